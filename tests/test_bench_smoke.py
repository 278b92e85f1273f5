"""The benchmarks that reach into the ops' internals still run (tiny shapes, CPU)."""

from __future__ import annotations

import argparse
import json
import math
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
PROVENANCE = {"argv", "commit", "date", "device", "versions"}  # bench/_common.py's meta()


@pytest.mark.parametrize("gate", ["head", "channel"])
def test_gdn_phases_runs(gate, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    import gdn_phases

    from chunkscan.ops.gated_delta import chunk

    monkeypatch.setattr(chunk, "_COMPILE_GROUPS", chunk._COMPILE_GROUPS)  # the bench sets it
    out = tmp_path / "phases.json"
    argv = ["--T", "100", "--Hk", "1", "--Hv", "2", "--D", "8", "--chunk-size", "16",
            "--group-chunks", "3", "--repeats", "1", "--gate", gate,
            "--json", str(out)]  # fmt: skip
    assert gdn_phases.main(argv) == 0
    row = json.loads(out.read_text())["rows"][0]
    assert (row["chunks"], row["group_chunks"], row["groups"]) == (7, 3, 3)
    assert len(row["phase_ms_per_group"]) == 7
    assert all(ms > 0 for ms in row["phase_ms_per_group"].values())
    sys.modules.pop("gdn_phases", None)


def test_ncu_op_runs_and_its_summary_reads_ncu_csv(tmp_path, monkeypatch, capsys):
    """``bench/ncu_op.py`` runs the op off CUDA (nothing to bracket), and
    ``bench/ncu_summary.py`` turns a raw CSV of ncu's layout (its units row, thousands
    separators, hashed kernel names, ``==PROF==`` lines) into one line per kernel name,
    in microseconds and KiB; a unit it does not know is an error, not a silent 1x."""
    monkeypatch.syspath_prepend(str(BENCH))
    import ncu_op
    import ncu_summary

    for harness in ("cotangents", "loss"):
        assert ncu_op.main(["--impl", "chunkscan-portable", "--T", "40", "--C", "16",
                            "--warmup", "0", "--harness", harness]) == 0  # fmt: skip
        assert "ran (no CUDA PyTorch" in capsys.readouterr().out
    stall = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"
    head = ["ID", "Kernel Name", "Grid Size", "Block Size", "gpu__time_duration.sum",
            "launch__shared_mem_per_block_dynamic", stall.format("barrier"),
            stall.format("long_scoreboard")]  # fmt: skip
    units = ["", "", "", "", "ns", "byte/block", "ratio", "ratio"]  # ncu 2025.3.1's
    rows = [["0", "chunkscan_gdn_prepare_0123456789abcdef(float *)", "(64, 32, 1)",
             "(256, 1, 1)", "1,200,500", "102,400", "3.5", "1.25"],
            ["1", "chunkscan_gdn_prepare_fedcba9876543210(float *)", "(64, 32, 1)",
             "(256, 1, 1)", "800,000", "102,400", "2", "4"],
            ["2", "copy_kernel", "(8, 1, 1)", "(128, 1, 1)", "10", "0", "", ""]]  # fmt: skip
    lines = ["==PROF== Connected to process 1\n"]
    lines += [",".join(f'"{c}"' for c in r) + "\n" for r in [head, units, *rows]]
    path = tmp_path / "raw.csv"
    path.write_text("".join(lines))
    out = tmp_path / "rows.json"
    assert ncu_summary.main([str(path), "--by-name", "--json", str(out)]) == 0
    prepare, copy = json.loads(out.read_text())["rows"]
    assert prepare["kernel"] == "chunkscan_gdn_prepare" and prepare["launches"] == 2
    assert prepare["us"] == pytest.approx(2000.5)
    assert prepare["stalls"] == {"barrier": 3.5, "long_scoreboard": 1.25}  # the longest's
    assert prepare["smem_kib"] == pytest.approx(100)
    assert copy["kernel"] == "copy_kernel" and copy["stalls"] == {}
    assert copy["us"] == pytest.approx(0.01)
    capsys.readouterr()
    assert ncu_summary.main([str(path), "--top", "1"]) == 0  # the longest launch only
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[2].startswith("chunkscan_gdn_prepare")
    assert "1200.5" in printed[2]
    with pytest.raises(ValueError, match="unknown unit 'furlong'"):
        ncu_summary.scaled(1.0, "furlong")
    # The JSON carries the run's provenance (it held argv alone, sys.argv's even when
    # main was called with its own) and the file read.
    meta = json.loads(out.read_text())["meta"]
    assert meta["input"] == str(path) and {"commit", "date", "versions"} <= set(meta)
    # Another page, an empty file, a .gz that is not gzip: a message and exit status 1
    # (the source page printed "23534 kernels, 0.00 ms in all" with exit status 0, the
    # others were tracebacks; found by probing).
    src = BENCH / "results/h200/ncu/ncu_src_cuda_sass_16k_89268cd.csv.gz"
    (tmp_path / "empty.csv").write_text("")
    (tmp_path / "text.csv.gz").write_text("not gzip")
    for bad in (src, tmp_path / "empty.csv", tmp_path / "text.csv.gz"):
        capsys.readouterr()
        assert ncu_summary.main([str(bad)]) == 1
        assert "no kernel rows with gpu__time_duration.sum" in capsys.readouterr().err
    for name in ("ncu_op", "ncu_summary"):
        sys.modules.pop(name, None)


def test_ncu_summary_reads_the_committed_gzipped_csv(capsys, monkeypatch):
    """``bench/ncu_summary.py`` reads a committed ``.csv.gz`` as it is and gives the
    figures ``docs/history/benchmarks-sessions-3-29.md`` quotes for it (run 50, session
    15's ``state_grads``: base d4a7d2e against c4ad00f, 19.17 / 17.89 ms in all)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import ncu_summary

    ncu = BENCH / "results" / "h200" / "ncu"
    expected = {"base_d4a7d2e": (19.17, 4691.2, 152.25), "c4ad00f": (17.89, 3626.1, 104.25)}
    for tag, (total_ms, us, smem_kib) in expected.items():
        raw, units = ncu_summary.read_rows(str(ncu / f"ncu_chunkscan_16k_sol_{tag}.csv.gz"))
        rows = ncu_summary.by_name([ncu_summary.summarise(r, units) for r in raw])
        assert sum(r["us"] for r in rows) / 1e3 == pytest.approx(total_ms, abs=0.005)
        (state_grads,) = [r for r in rows if r["kernel"] == "chunkscan_gdn_state_grads_tf32_tc"]
        assert state_grads["us"] == pytest.approx(us, abs=0.05)
        assert state_grads["smem_kib"] == pytest.approx(smem_kib)
    assert ncu_summary.main([str(ncu / "ncu_chunkscan_16k_sol_c4ad00f.csv.gz"), "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith("110 kernels, 17.89 ms in all")
    # one row per name keeps its longest launch's columns: from the third launch on the
    # longest was compared with the running sum, so an earlier launch's stayed (probing)
    rows = [{"kernel": "k", "us": us, "regs": regs} for us, regs in
            ((12.0, 1), (10.0, 2), (13.0, 3), (11.0, 4), (5.0, 5))]  # fmt: skip
    (merged,) = ncu_summary.by_name(rows)
    assert merged["us"] == 51.0 and merged["launches"] == 5 and merged["regs"] == 3
    sys.modules.pop("ncu_summary", None)


def test_lora_table_counts_the_batch_in_the_patched_minus_stub_column(bench):
    """``(patched-stub) MiB/tok`` divided by T alone, a batch's times the MiB/tok columns
    beside it (which divide by batch x T; found by probing)."""
    lora = bench("lora")
    rows = [dict(mode=m, T=16, batch=2, peak_mib=peak, mib_per_token=peak / 32,
                 seconds_per_step=1.0, first_step_seconds=1.0)
            for m, peak in (("patched", 10.0), ("stub", 6.0))]  # fmt: skip
    table = lora._table(rows, ["patched", "stub"], [16])
    assert "| 0.1250 |" in table, table  # (10 - 6) / (2 x 16)


def test_lora_plot_takes_two_rows_of_one_t(bench, tmp_path):
    """Two rows of one mode and T (``--merge`` of another setup, or ``--T 64 64``): the
    plot compared the row dicts and raised after the measuring, leaving the earlier
    plot beside the new results (found by probing, session 40)."""
    pytest.importorskip("matplotlib")
    lora = bench("lora")
    row = dict(mode="stub", T=16, peak_mib=8.0, mib_per_token=0.5, seconds_per_step=1.0,
               first_step_seconds=1.0)  # fmt: skip
    path = tmp_path / "plot.png"
    lora._plot([row, dict(row, batch=2, peak_mib=9.0)], ["stub"], path, "cpu")
    assert path.is_file()


def test_lora_plot_pairs_rows_of_one_setup_only(bench, tmp_path, monkeypatch):
    """The plot's share panel set a batch-3 patched row against a batch-1 stub row, and
    its other panels drew every setup of a mode as one line (found by probing, session
    48): a line per mode and setup, each share from its own setup's stub."""
    pytest.importorskip("matplotlib")
    import matplotlib.axes

    drawn = []
    real = matplotlib.axes.Axes.plot
    monkeypatch.setattr(matplotlib.axes.Axes, "plot",
                        lambda ax, x, y, *a, **k: drawn.append((k.get("label"), list(y)))
                        or real(ax, x, y, *a, **k))  # fmt: skip
    lora = bench("lora")

    def row(mode, batch, peak):
        return dict(mode=mode, T=16, batch=batch, peak_mib=peak, mib_per_token=peak / 16,
                    seconds_per_step=1.0, first_step_seconds=1.0)  # fmt: skip

    rows = [row("stub", 1, 6.0), row("patched", 3, 15.0), row("stub", 3, 12.0)]
    lora._plot(rows, ["patched", "stub"], tmp_path / "plot.png", "cpu")
    shares = {label: y for label, y in drawn if label.endswith(" - stub")}
    assert shares == {"patched (batch 3) - stub": [(15.0 - 12.0) / (16 * 3)]}, drawn
    labels = {label for label, _ in drawn}
    assert {"stub (batch 1)", "stub (batch 3)", "patched (batch 3)"} <= labels, labels


def test_lora_table_pairs_rows_of_one_setup_only(bench, monkeypatch):
    """``--merge`` keeps rows of other runs: a batch-4 patched row was set against a
    batch-1 stub row of another commit (patched/stub 5.4; found by probing). Rows pair
    within one batch, dtype, memory limit, model and commit; the T column names what
    tells the setups apart. And a step time is the median: with two steps the mean of
    both, where the slower was reported (found by probing)."""
    lora = bench("lora")
    row = dict(T=16, peak_mib=8.0, mib_per_token=0.5, seconds_per_step=1.0,
               first_step_seconds=1.0, dtype="float32")  # fmt: skip
    rows = [dict(row, mode="stub", batch=1, commit="a"),
            dict(row, mode="patched", batch=4, commit="b", peak_mib=40.0),
            dict(row, mode="stub", batch=4, commit="b", peak_mib=20.0)]  # fmt: skip
    lines = lora._table(rows, ["patched", "stub"], [16]).splitlines()[2:]
    assert len(lines) == 2, lines
    assert lines[0].startswith("| 16 (batch 1, commit a) | not run |")
    assert lines[1].startswith("| 16 (batch 4, commit b) | 40 |")
    assert "| 2.000 |" in lines[1] and "| 2.000 |" not in lines[0]  # 40 / 20, not 40 / 8
    # The step time, in a real (stub) step with the clock faked: two steps of 1 s and
    # 3 s give 2 s.
    import mlx_lm.models.qwen3_next as qwen3_next

    # measure() stubs the recurrence in this process: restored however the test ends
    # (the stub left behind broke every later mlx-lm test of the run)
    monkeypatch.setattr(qwen3_next, "gated_delta_update", qwen3_next.gated_delta_update)
    stock = qwen3_next.gated_delta_update
    ticks = iter([0.0, 5.0, 10.0, 11.0, 20.0, 23.0])
    monkeypatch.setattr(lora.time, "perf_counter", lambda: next(ticks))
    row = lora.measure("stub", 16, repeats=2)
    assert qwen3_next.gated_delta_update is stock
    assert row["seconds_per_step"] == 2.0 and row["step_seconds"] == [1.0, 3.0]


def test_ncu_source_summary_reads_the_source_page(tmp_path, monkeypatch, capsys):
    """``bench/ncu_source_summary.py`` splits each launch's warp-stall samples of ncu's
    source page (SASS) by stall reason and by opcode, predicates skipped, and lists the
    instructions with the most samples."""
    monkeypatch.syspath_prepend(str(BENCH))
    import ncu_source_summary

    head = ["Address", "Source", "Warp Stall Sampling (All Samples)", "stall_long_sb",
            "stall_wait", "stall_long_sb (Not Issued)"]  # fmt: skip
    rows = [["0x10", "      LDG.E.128 R8, desc[UR12][R32.64]", "6", "6", "0", "6"],
            ["0x20", "@!P0  HMMA.1684.F32.TF32 R4, R8, R10, R4", "3", "0", "3", "0"],
            ["0x30", "      LDG.E.U8 R6, desc[UR12][R6.64]", "1", "1", "0", "1"]]  # fmt: skip
    text = '"Kernel Name","k_0123",\n' + "".join(
        ",".join(f'"{c}"' for c in r) + "\n" for r in [head, *rows]
    )
    path = tmp_path / "src.csv"
    path.write_text(text)
    assert ncu_source_summary.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "k_0123: 10 samples, 3 instructions"
    assert out[1] == "  by stall reason: long_sb 70%, wait 30%"
    assert out[2] == "  by opcode: LDG 70.0%, HMMA 30.0%"
    assert out[3].startswith("   60.0%  LDG.E.128") and out[4].startswith("   30.0%  @!P0  HMMA")
    assert len(out) == 5
    # a .gz that is not gzip, a file that is not UTF-8: one line, exit 1 (tracebacks
    # before; found by probing, session 49)
    (tmp_path / "not.csv.gz").write_text("hello")
    (tmp_path / "bytes.csv").write_bytes(b"\xff\xfe\x00bad")
    import gzip

    packed = bytearray(gzip.compress(b"a,b\n" * 200))
    packed[12:20] = b"\xff" * 8  # a good header, corrupt data (zlib.error; review)
    (tmp_path / "corrupt.csv.gz").write_bytes(bytes(packed))
    for name in ("not.csv.gz", "bytes.csv", "corrupt.csv.gz"):
        assert ncu_source_summary.main([str(tmp_path / name)]) == 1
        assert "cannot read it" in capsys.readouterr().err
    sys.modules.pop("ncu_source_summary", None)


def test_op_count_reads_the_graph(tmp_path, monkeypatch):
    """``bench/op_count.py`` builds the portable fwd+bwd graph and counts it: more
    launches for two groups than for one, and the per-chunk addmm of each pass."""
    monkeypatch.syspath_prepend(str(BENCH))
    import op_count

    from chunkscan.ops.gated_delta import _passes, chunk

    # The bench sets both for its process: put them back for the tests after this one.
    monkeypatch.setattr(chunk, "_GROUP_BYTES", chunk._GROUP_BYTES)
    monkeypatch.setattr(_passes, "portable_state_pass", _passes.portable_state_pass)
    out = tmp_path / "ops.json"
    assert op_count.main(["--T", "256", "512", "--C", "128", "--group-mib", "80",
                          "--json", str(out)]) == 0  # fmt: skip
    one, two = json.loads(out.read_text())["rows"]
    assert (one["groups"], two["groups"]) == (1, 2) and two["launches"] > one["launches"]
    assert one["by_kind"]["AddMM"] == 2 * 2  # two chunks, forward and reverse pass
    sys.modules.pop("op_count", None)


def test_graph_build_times_the_fused_paths_graph(monkeypatch, capsys, tmp_path):
    """``bench/graph_build.py`` builds the fused path's fwd+bwd graph with faked kernels
    (a small T): every fused kernel is launched, and the build's times are printed and
    written (``--json``)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import graph_build

    from chunkscan import _backend
    from chunkscan.ops.gated_delta import _chunk_cuda, _passes, chunk

    # The bench fakes these for its process: put them back for the tests after this one.
    for module, name in ((_backend, "RUNNER"), (chunk, "_fused"), (chunk, "_GROUP_BYTES"),
                         (_passes, "use_kernels")):  # fmt: skip
        monkeypatch.setattr(module, name, getattr(module, name))
    launched = set()
    real = _chunk_cuda._launch
    monkeypatch.setattr(
        _chunk_cuda, "_launch", lambda w, *a, **k: launched.add(w) or real(w, *a, **k)
    )
    out = tmp_path / "build.json"
    assert graph_build.main(["--T", "256", "--repeats", "3", "--json", str(out)]) == 0
    assert "T=256: graph build median" in capsys.readouterr().out
    assert launched == set(_chunk_cuda._KERNELS)
    # --json: the row printed, with the run's provenance (none written before)
    written = json.loads(out.read_text())
    assert PROVENANCE <= set(written["meta"])
    (row,) = written["rows"]
    assert (row["T"], row["real"], row["repeats"], len(row["build_ms"])) == (256, False, 3, 3)
    assert row["median_ms"] == row["build_ms"][1] and row["min_ms"] == row["build_ms"][0]
    sys.modules.pop("graph_build", None)


def test_gpu_gaps_summarises_kernel_intervals(monkeypatch):
    """``bench/gpu_gaps.py``'s summary (the run itself needs CUDA PyTorch): overlapping
    kernels count once in the busy time, idle stretches are the gaps."""
    monkeypatch.syspath_prepend(str(BENCH))
    import gpu_gaps

    span, busy, gaps = gpu_gaps.summarise([(0.0, 10.0), (5.0, 12.0), (8.0, 9.0), (40.0, 50.0)])
    assert (span, busy, gaps) == (50.0, 22.0, [28.0])
    assert gpu_gaps.summarise([(3.0, 4.0)]) == (1.0, 1.0, [])


def test_ncu_source_summary_reads_the_cuda_sass_page(tmp_path, monkeypatch, capsys):
    """The ``--print-source cuda,sass`` page (kernels with line information): samples per
    CUDA source line, the SASS rows under a line not counted again."""
    monkeypatch.syspath_prepend(str(BENCH))
    import ncu_source_summary

    rows = [
        ["File Path", "/tmp/c/src/k_01.cu"],
        ["Function Name", "k_01"],
        ["Line No", "Source", "Address", "Source", "Warp Stall Sampling (All Samples)"],
        ["12", "  acc = fmaf(a, b, acc);", "-", "-", "30"],
        ["", "", "0x10", "  FFMA R1, R2, R3, R1", "30"],
        ["7", "  x = ld4(p);", "-", "-", "10"],
        ["", "", "0x20", "  LDS.128 R4, [R8]", "10"],
        ["9", "  // a comment", "-", "-", "0"],
    ]
    path = tmp_path / "src.csv"
    path.write_text("".join(",".join(f'"{c}"' for c in r) + "\n" for r in rows))
    assert ncu_source_summary.main([str(path), "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "k_01: 40 samples, 3 source lines"
    assert out[1].startswith("   75.0%  L12") and out[1].endswith("acc = fmaf(a, b, acc);")
    assert out[2].startswith("   25.0%  L7")
    assert len(out) == 3
    # A line of inline asm, which Nsight Compute writes with its quotes unescaped: the
    # csv module misread the row and its samples counted as 0, as did its bank
    # conflicts (the committed pages' cp.async and mma lines; found by probing).
    asm = '"10","asm volatile("cp.async [%0], 16;\\n" ::"r"(d) : "memory");","-","-","60"\n'
    path.write_text(path.read_text() + asm)
    assert ncu_source_summary.main([str(path), "--top", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "k_01: 100 samples, 4 source lines"
    assert out[1].startswith("   60.0%  L10") and 'asm volatile("cp.async' in out[1]
    sys.modules.pop("ncu_source_summary", None)


def test_the_two_harnesses_give_the_same_gradients(monkeypatch):
    """The two harnesses of ``bench/gdn_vs_fla.py`` (``gated_delta.make_step``) differ
    only in what they time: the gradients given the outputs' cotangents ``w``, ``w_s``
    equal the loss's gradients (bf16 inputs, as in the benchmark: the loss's cotangent
    of ``o`` is ``w`` cast back to bf16 exactly). Negative control: other cotangents
    give other gradients."""
    monkeypatch.syspath_prepend(str(BENCH))
    import mlx.core as mx
    from gated_delta import _inputs, make_step

    import chunkscan

    xs, w, w_s = _inputs(40, 1, 2, 4, 16, 8, "bfloat16", 0)

    def op(q, k, v, g, beta, h0):
        return chunkscan.gated_delta_rule(
            q, k, v, g, beta, initial_state=h0, chunk_size=16, kernels=False
        )

    (o, final), given = make_step(op, w, w_s, "cotangents")(*xs)
    loss, of_loss = make_step(op, w, w_s, "loss")(*xs)
    assert o.shape == w.shape and final.shape == w_s.shape and loss.ndim == 0
    for a, b in zip(given, of_loss):
        assert a.dtype == b.dtype and mx.array_equal(a, b).item()
    _, other = make_step(op, 2 * w, w_s, "cotangents")(*xs)
    assert not mx.array_equal(other[2], given[2]).item()  # dv doubles


def saved_rows(path: pathlib.Path) -> list[dict]:
    """The rows of a result file, its ``"nan"`` / ``"inf"`` strings (strict JSON) floats."""
    from chunkscan.commands.measure import from_strict_json

    return from_strict_json(json.loads(path.read_text()))["rows"]


def test_growth_gates_measures_what_the_docstring_says(tmp_path, monkeypatch):
    """``bench/growth_gates.py`` (the figures of ``gated_delta_rule``'s docstring on
    positive gates) runs, and its headline holds: at +0.6 per token (T = 64) a chunk of
    8 is as accurate as the float32 loop (measured 2.7e-6 and 4.0e-6; bound 4x), one of
    64 is not (1.1e-4), and at +1.2 chunks of 64 give NaN gradients where the loop's
    are finite."""
    monkeypatch.syspath_prepend(str(BENCH))
    import growth_gates

    out = tmp_path / "growth.json"
    argv = ["--gates", "0.6", "1.2", "--chunk-sizes", "8", "64", "--T", "64", "--json", str(out)]
    assert growth_gates.main(argv) == 0
    rows = {(r["gate"], r["impl"]): r for r in saved_rows(out)}

    def worst(r):
        return max(r[n] for n in growth_gates.NAMES)

    assert worst(rows[0.6, "chunk 8"]) <= 1.6e-5 and worst(rows[0.6, "naive"]) <= 1.6e-5
    assert worst(rows[0.6, "chunk 64"]) > 4e-5
    assert rows[1.2, "naive"]["non_finite_grads"] == rows[1.2, "chunk 8"]["non_finite_grads"] == 0
    assert rows[1.2, "chunk 64"]["non_finite_grads"] > 0
    # per key channel (docs/gated_delta.md): values close, gradients overflow the same way
    argv = ["--channel", "--gates", "1.2", "--chunk-sizes", "8", "64", "--T", "64"]
    assert growth_gates.main([*argv, "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in saved_rows(out)}
    assert all(r["channel"] for r in rows.values())
    assert max(rows["chunk 64"][n] for n in ("o", "final")) <= 8e-6  # measured 1.3e-6
    assert rows["naive"]["non_finite_grads"] == rows["chunk 8"]["non_finite_grads"] == 0
    assert rows["chunk 64"]["non_finite_grads"] > 0
    # o and the final state not finite (T = 128, +1.2 per token): NaN, counted; they
    # read 0.0, the error of their finite part (found by probing, session 40)
    argv = ["--gates", "1.2", "--chunk-sizes", "64", "--T", "128", "--json", str(out)]
    assert growth_gates.main(argv) == 0
    for r in saved_rows(out):
        assert math.isnan(r["o"]) and math.isnan(r["final"]), r
        assert r["non_finite_final"] > 0 and r["non_finite_o"] > 0
    sys.modules.pop("growth_gates", None)


def test_lora_replot_writes_beside_json_not_beside_the_file_read(tmp_path, monkeypatch):
    """``bench/lora.py --replot`` rewrote the table and plot beside the JSON it read, so
    replotting a committed result overwrote it (found by probing); they now go beside
    ``--json`` (default bench-out/)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import lora

    source = tmp_path / "committed" / "lora_cpu.json"
    source.parent.mkdir()
    committed = BENCH / "results" / "cpu" / "lora_cpu_attn_a28bad4.json"
    source.write_text(committed.read_text())
    out = tmp_path / "out" / "replot.json"
    out.parent.mkdir()
    out.write_text('{"meta": {}, "rows": []}')  # another run's: replaced, not left beside
    assert lora.main(["--replot", str(source), "--json", str(out)]) == 0  # (found by probing)
    assert out.with_suffix(".md").is_file()
    assert json.loads(out.read_text()) == json.loads(committed.read_text())
    assert sorted(p.name for p in source.parent.iterdir()) == ["lora_cpu.json"]


# One number out of range per script and option kind: each failed only after measuring
# (a traceback, or error rows and exit status 0) before (found by probing).
BAD_NUMBERS = [
    ("attention", ["--T", "0"], "--T"),
    ("attention", ["--T", "6_4"], "--T"),  # int() read 64 (found by probing)
    ("attention", ["--repeats", "0"], "--repeats"),
    ("attention", ["--chunk-size", "-16"], "--chunk-size"),
    ("attention", ["--timeout", "0"], "--timeout"),
    ("attention_kernels", ["--repeats", "0"], "--repeats"),
    ("first_call", ["--T", "-1"], "--T"),
    ("fla_gdn", ["--T", "0"], "--T"),
    ("fla_gdn", ["--warmup", "-1"], "--warmup"),
    ("gated_delta", ["--repeats", "0"], "--repeats"),
    ("gated_delta", ["--chunk-size", "0"], "--chunk-size"),
    ("gated_delta", ["--gate", "channel", "--impls", "mlx_fast"], "--impls"),  # exit 1
    ("gdn_fused_kernels", ["--tokens", "0"], "--tokens"),
    ("gdn_fused_kernels", ["--tokens", "32", "--C", "64"], "--tokens"),  # no chunk
    ("gdn_phases", ["--chunk-size", "-4"], "--chunk-size"),
    ("gdn_phases", ["--group-chunks", "0"], "--group-chunks"),
    ("gdn_vs_fla", ["--T", "0"], "--T"),
    ("gdn_vs_fla", ["--chunk-sizes", "-64"], "--chunk-sizes"),
    ("gdn_vs_fla", ["--budget", "-1"], "--budget"),
    ("gpu_gaps", ["--T", "0"], "--T"),
    ("graph_build", ["--repeats", "0"], "--repeats"),
    ("growth_gates", ["--chunk-sizes", "8", "0"], "--chunk-sizes"),
    ("growth_gates", ["--gates", "nan"], "--gates"),  # rows of NaN, exit status 0
    ("growth_gates", ["--state-std", "-1"], "--state-std"),
    ("gdn_phases", ["--Hk", "2", "--Hv", "3"], "--Hv"),  # a traceback
    ("first_call", ["--Hk", "2", "--Hv", "3"], "--Hv"),  # an error row, exit status 0
    ("launch_cost", ["--launches", "0"], "--launches"),
    ("linear_attention", ["--T", "0"], "--T"),
    ("linear_attention", ["--chunk-size", "0"], "--chunk-size"),
    ("lora", ["--T", "0"], "--T"),
    ("lora", ["--repeats", "0"], "--repeats"),
    ("lora", ["--modes", "patchd"], "--modes"),  # an error row per T before
    ("memory_breakdown", ["--chunk-size", "0"], "--chunk-size"),
    ("ncu_op", ["--T", "0"], "--T"),
    ("ncu_summary", [__file__, "--top", "-1"], "--top"),  # an input that exists
    ("ncu_source_summary", [__file__, "--top", "-1"], "--top"),
    ("op_count", ["--C", "0"], "--C"),
    ("scan_time", ["--rounds", "0"], "--rounds"),
    ("state_pass", ["--runs", "0"], "--runs"),
    ("stepwise_chunk", ["--T", "0"], "--T"),
    ("stepwise_chunk", ["--chunk", "-1"], "--chunk"),
    ("tc_probe", ["--n", "0"], "--n"),
]


@pytest.mark.parametrize("script,argv,option", BAD_NUMBERS)
def test_bad_numbers_fail_at_parse_time(script, argv, option, bench, tmp_path, capsys):
    """A count, size or time out of range fails before anything runs, as argparse fails
    (exit status 2, one line naming the option), with nothing written."""
    with pytest.raises(SystemExit) as exc:
        bench(script).main([*argv])
    assert exc.value.code == 2
    assert f": error: argument {option}: " in capsys.readouterr().err.splitlines()[-1]


def test_number_types_name_the_rule(bench):
    """``_common``'s argparse types: what they take and the message they give."""
    common = bench("_common")
    assert common.positive_int("3") == 3 and common.non_negative_int("0") == 0
    assert common.positive_float("0.5") == 0.5 and common.non_negative_float("0") == 0.0
    for convert, text in ((common.positive_int, "0"), (common.positive_int, "-2"),
                          (common.positive_int, "1.5"), (common.non_negative_int, "-1"),
                          (common.positive_float, "0"), (common.non_negative_float, "nan"),
                          (common.non_negative_float, "-0.1"), (common.positive_float, "inf"),
                          (common.non_negative_float, "inf")):  # fmt: skip
        with pytest.raises(argparse.ArgumentTypeError, match=f"but got '{text}'"):
            convert(text)


# Each output option of each script, given a folder: it failed only when writing, after
# the measuring (found by probing); the small sizes keep a regression short.
BAD_OUTPUTS = [
    ("attention", ["--T", "16"], "--json"),
    ("attention_kernels", ["--T", "16", "--repeats", "1"], "--json"),
    ("first_call", ["--T", "16", "--modes", "fwd"], "--json"),
    ("fla_gdn", ["--T", "16"], "--json"),
    ("gated_delta", ["--T", "16", "--impls", "chunkscan"], "--json"),
    ("gated_delta", ["--T", "16", "--impls", "chunkscan"], "--md"),
    ("gated_delta", ["--T", "16", "--impls", "chunkscan"], "--png"),
    ("gdn_fused_kernels", ["--tokens", "64", "--repeats", "1"], "--json"),
    ("gdn_phases", ["--T", "32", "--D", "8", "--repeats", "1"], "--json"),
    ("gdn_vs_fla", ["--T", "16", "--impls", "chunkscan-portable"], "--json"),
    ("gpu_gaps", ["--T", "16"], "--json"),
    ("graph_build", ["--T", "64", "--repeats", "1"], "--json"),
    ("growth_gates", ["--T", "16", "--gates", "0", "--chunk-sizes", "8"], "--json"),
    ("launch_cost", ["--launches", "1", "--repeats", "1"], "--json"),
    ("linear_attention", ["--T", "16", "--impls", "chunkscan"], "--json"),
    ("linear_attention", ["--T", "16", "--impls", "chunkscan"], "--md"),
    ("lora", ["--T", "16", "--modes", "stub"], "--json"),
    ("memory_breakdown", ["--T", "64"], "--json"),
    ("op_count", ["--T", "128", "--C", "64"], "--json"),
    ("scan_time", ["--T", "8", "--H", "1", "--D", "2", "--rounds", "1"], "--json"),
    ("state_pass", ["--n", "2", "--runs", "1"], "--out"),
    ("stepwise_chunk", ["--T", "8"], "--json"),
    ("tc_probe", ["--n", "1"], "--out"),
]


@pytest.mark.parametrize("script,argv,option", BAD_OUTPUTS)
def test_outputs_are_checked_before_measuring(script, argv, option, bench, tmp_path, capsys,
                                              monkeypatch):  # fmt: skip
    """An output path that is a folder fails at once (exit status 2, one line naming the
    option), before any measuring."""
    folder = tmp_path / "a_folder"
    folder.mkdir()
    module = bench(script)
    for m in (module, bench("_common")):  # the CUDA-only scripts check CUDA first
        if hasattr(m, "stop_without_cuda"):
            monkeypatch.setattr(m, "stop_without_cuda", lambda *a, **k: False)
    from chunkscan.ops.gated_delta import _passes

    monkeypatch.setattr(_passes, "use_kernels", lambda *a, **k: True)  # state_pass asks too
    with pytest.raises(SystemExit) as exc:
        module.main([*argv, option, str(folder)])
    assert exc.value.code == 2
    assert f"error: argument {option}: '{folder}' is a directory" in capsys.readouterr().err
    # a folder that does not exist yet, written with its slash: a file of its name was
    # written (found by probing, session 48)
    new = f"{tmp_path / 'new_folder'}/"
    with pytest.raises(SystemExit) as exc:
        module.main([*argv, option, new])
    assert exc.value.code == 2
    assert f"error: argument {option}: '{new}' names a folder" in capsys.readouterr().err
    assert not (tmp_path / "new_folder").exists()


def test_check_outputs_makes_the_folder_and_refuses_a_file_in_its_place(bench, tmp_path):
    """A missing parent folder is made (as ``write_json`` makes it); a file in a folder's
    place, or a folder where a file is written beside the output (``.md``, ``.png``), is
    refused at once."""
    common = bench("_common")
    parser = argparse.ArgumentParser(prog="x")
    common.check_outputs(parser, {"--json": tmp_path / "new" / "deeper" / "a.json", "--md": None})
    assert (tmp_path / "new" / "deeper").is_dir()
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit):
        common.check_outputs(parser, {"--json": tmp_path / "file" / "sub" / "a.json"})
    (tmp_path / "a.png").mkdir()
    with pytest.raises(SystemExit):
        common.check_outputs(parser, {"--json": tmp_path / "a.json"}, beside=(".md", ".png"))
    common.check_outputs(parser, {"--json": tmp_path / "a.json"}, beside=(".md",))
    # '' is refused where the script always writes (IsADirectoryError after measuring),
    # taken where it switches the output off; '.' with beside= (with_suffix raised)
    with pytest.raises(SystemExit):
        common.check_outputs(parser, {"--json": ""})
    common.check_outputs(parser, {"--json": ""}, optional=("--json",))
    with pytest.raises(SystemExit):
        common.check_outputs(parser, {"--json": "."}, beside=(".md", ".png"))


# Each input a script reads back: a missing, unreadable or foreign file gave a
# traceback; lora.py --merge read its --json only after measuring (found by probing).
BAD_INPUTS = [
    ("attention", ["--from-json"], "[1, 2]", "is not a list of rows"),
    ("gated_delta", ["--from-json"], "[]", "is not an object with keys rows, title"),
    ("lora", ["--replot"], '{"rows": []}', "is not an object with keys meta, rows"),
    ("lora", ["--T", "16", "--modes", "stub", "--merge", "--json"], "{", "is not JSON"),
    # another script's file: a KeyError (after measuring, for --merge; found by probing)
    (
        "lora",
        ["--replot"],
        '{"meta": {}, "rows": [{"impl": "x", "T": 16}]}',
        "row 0 has no key 'mode'",
    ),
    (
        "lora",
        ["--T", "16", "--modes", "stub", "--merge", "--json"],
        '{"meta": {}, "rows": [{"impl": "x", "T": 16}]}',
        "row 0 has no key 'mode'",
    ),
    ("ncu_summary", [], None, None),
    ("ncu_source_summary", [], None, None),
]


@pytest.mark.parametrize("script,argv,text,message", BAD_INPUTS)
def test_inputs_read_back_are_checked_first(script, argv, text, message, bench, tmp_path,
                                            capsys, monkeypatch):  # fmt: skip
    """Missing, a folder, or (for the JSON ones) not JSON / not the script's own shape:
    one line naming the option, exit status 2, before anything is measured."""
    from chunkscan.commands import measure

    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: pytest.fail("measured"))
    module = bench(script)
    option = argv[-1] if argv else "csv"
    merge = "--merge" in argv  # a missing --json is a new one there, a folder check_outputs'
    out = [] if merge else ["--json", str(tmp_path / "out" / "o.json")]
    cases = [] if merge else [(tmp_path / "missing.json", "no such file"), (tmp_path, "directory")]
    if text is not None:
        (tmp_path / "bad.json").write_text(text)
        cases.append((tmp_path / "bad.json", message))
    for path, expected in cases:
        if script.startswith("ncu"):
            call = [str(path)]
        else:
            call = [*argv, str(path), *out]
        with pytest.raises(SystemExit) as exc:
            module.main(call)
        assert exc.value.code == 2
        err = capsys.readouterr().err.splitlines()[-1]
        assert f"error: argument {option}: " in err and expected in err, err
    assert not (tmp_path / "out" / "o.md").exists()


def test_lora_config_must_name_model_fields(bench, capsys, monkeypatch):
    """``bench/lora.py --config``: a JSON object whose keys are fields of the model's
    ``ModelArgs``. A misspelt key was dropped by mlx-lm's ``from_dict`` (the default
    model measured), a list failed after measuring (found by probing)."""
    from chunkscan.commands import measure

    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: pytest.fail("measured"))
    lora = bench("lora")
    for config, expected in (('[1]', "must be a JSON object"), ("x", "not JSON"),
                             ('{"hidden_sizee": 4}', "'hidden_sizee' not fields of mlx_lm"),
                             ('{"model_type": "nope"}', "model_type 'nope' is not supp"),
                             # the stub and titles are Qwen3-Next's: other models measured
                             # wrong ratios under their names (found by probing)
                             ('{"model_type": "qwen3_5"}', "model_type 'qwen3_5' is not supp"),
                             ('{"model_type": "llama"}', "'llama' is not supported")):  # fmt: skip
        with pytest.raises(SystemExit) as exc:
            lora.main(["--T", "16", "--config", config])
        assert exc.value.code == 2
        assert expected in capsys.readouterr().err.splitlines()[-1]
    # the negative control: a real field passes the check (and would measure)
    with pytest.raises(pytest.fail.Exception, match="measured"):
        lora.main(["--T", "16", "--modes", "stub", "--config",
                   '{"hidden_size": 128, "model_type": "qwen3_next"}',
                   "--json", str(pathlib.Path(lora.ROOT) / "bench-out" / "t.json")])  # fmt: skip


def test_two_outputs_in_one_file_are_refused(bench, tmp_path, capsys):
    """``--json P --md P``, ``--json X.md`` (its table goes to X.md) and ``ncu_summary.py
    IN --json IN`` each wrote one output over another, exit status 0 (found by probing)."""
    cases = (
        ("gated_delta", ["--T", "16", "--json", str(tmp_path / "s.out"), "--md",
                         str(tmp_path / "s.out"), "--png", ""], "is also written for --json"),
        ("attention", ["--T", "16", "--json", str(tmp_path / "a.md")], "ends in .md"),
        ("ncu_summary", [__file__, "--json", __file__], "is also an input of this run"),
    )  # fmt: skip
    for script, argv, message in cases:
        with pytest.raises(SystemExit) as exc:
            bench(script).main(argv)
        assert exc.value.code == 2
        assert message in capsys.readouterr().err.splitlines()[-1], script
    assert not list(tmp_path.iterdir())


# The CUDA-only scripts (and options) on a machine without CUDA: one line, exit status 2,
# where most gave a traceback (found by probing; state_pass and tc_probe did this already).
NO_CUDA = [
    ("attention_kernels", ["--T", "16", "--json"], "[attention_kernels] needs MLX with a CUDA"),
    ("gdn_fused_kernels", ["--tokens", "64", "--json"], "[gdn_fused_kernels] needs MLX with"),
    ("gpu_gaps", ["--T", "16", "--json"], "[gpu_gaps] needs MLX with a CUDA GPU"),
    ("launch_cost", ["--launches", "1", "--json"], "[launch_cost] needs MLX with a CUDA GPU"),
    ("graph_build", ["--real", "--T", "64", "--json"], "[graph_build --real] needs MLX with"),
    ("ncu_op", ["--impl", "fla", "--T", "16"], "[ncu_op --impl fla] needs PyTorch with CUDA"),
    ("state_pass", ["--n", "2", "--out"], "[state_pass bench] needs MLX with a CUDA GPU"),
    ("tc_probe", ["--n", "1", "--out"], "[tc_probe] needs MLX with a CUDA GPU"),
]


@pytest.mark.parametrize("script,argv,line", NO_CUDA)
def test_cuda_only_scripts_say_so_without_cuda(script, argv, line, bench, monkeypatch, tmp_path,
                                               capsys):  # fmt: skip
    """Without CUDA (MLX's CUDA back-end and PyTorch made unavailable here, so this holds
    on a GPU machine too) the script prints one line and returns 2, writing nothing."""
    import mlx.core as mx

    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch: ImportError
    out = tmp_path / "new_folder" / "out.json"
    if argv[-1].startswith("--"):
        argv = [*argv, str(out)]
    assert bench(script).main(argv) == 2
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1 and printed[0].startswith(line)
    assert not out.parent.exists()  # not even the output's folder (it was made first)


def test_fla_scripts_say_so_without_pytorch_or_fla(bench, monkeypatch, tmp_path, capsys):
    """``bench/fla_gdn.py`` without PyTorch: one line and exit status 2 (a traceback
    before); ``bench/gdn_vs_fla.py`` with fla in ``--impls`` but fla or PyTorch missing:
    a parse error (one error row per T before)."""
    monkeypatch.setitem(sys.modules, "torch", None)
    out = tmp_path / "fla.json"
    assert bench("fla_gdn").main(["--T", "16", "--json", str(out)]) == 2
    assert capsys.readouterr().err.strip() == (
        "[bench.fla_gdn] fla's kernels need PyTorch with a CUDA GPU; PyTorch is not installed."
    )
    assert not out.exists()
    monkeypatch.setitem(sys.modules, "fla", None)
    with pytest.raises(SystemExit) as exc:
        bench("gdn_vs_fla").main(["--T", "16", "--json", str(out)])
    assert exc.value.code == 2
    assert "error: argument --impls: fla needs PyTorch and fla" in capsys.readouterr().err
    assert not out.exists()
    common = bench("_common")
    assert common.cuda_missing("x", mlx=False, torch=True) == (
        "[x] needs PyTorch with CUDA; PyTorch is not installed."
    )


def test_gdn_vs_fla_times_fla_with_the_repeats_asked(bench, monkeypatch, tmp_path):
    """fla's rows timed fla_gdn's default of 10 runs whatever ``--repeats`` said (run
    94's three-repeat JSONs; found by probing). The measuring process is faked, and
    fla's presence (the test reads the wiring, not the machine)."""
    import importlib.util

    import chunkscan.commands.measure as measure

    gdn_vs_fla = bench("gdn_vs_fla")
    ran = []

    def run_isolated(target, cfg, **kw):
        ran.append((target, cfg))
        return {"error": "faked"}

    monkeypatch.setattr(measure, "run_isolated", run_isolated)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda m, *a: object() if m in ("torch", "fla") else find_spec(m, *a),
    )
    out = tmp_path / "rows.json"
    argv = ["--T", "16", "--impls", "fla", "--repeats", "3", "--json", str(out)]
    assert gdn_vs_fla.main(argv) == 1  # every row the fake's error: nothing measured
    assert ran == [("gdn_vs_fla:measure_fla", {"T": 16, "harness": "cotangents", "repeats": 3})]
    # a repeated T is measured once (it ran twice, its ratios taken against the other
    # run's reference row; found by probing, session 40)
    ran.clear()
    assert gdn_vs_fla.main([*argv[:2], "16", *argv[2:]]) == 1
    assert len(ran) == 1, ran


def test_stepwise_chunk_writes_its_rows_with_provenance(bench, monkeypatch, tmp_path):
    """``bench/stepwise_chunk.py --json``: the table's rows (a failed configuration's
    error too) and the run's provenance; it wrote no JSON before. The measuring process
    is faked (the test reads the wiring, not the machine)."""
    stepwise_chunk = bench("stepwise_chunk")
    ran = []

    def fake_run(target, cfg, timeout, env):
        ran.append((target, cfg))
        if cfg["T"] == 30:
            return {"error": "timed out"}
        return {"seconds": 0.5, "rss_mib": 12.0}

    monkeypatch.setattr(stepwise_chunk, "run_isolated", fake_run)
    out = tmp_path / "sub" / "stepwise.json"
    argv = ["--T", "20", "30", "--chunk", "4", "--H", "1", "--D", "2", "--json", str(out)]
    assert stepwise_chunk.main(argv) == 0
    data = json.loads(out.read_text())
    assert PROVENANCE <= set(data["meta"])
    cfg = {"chunk": 4, "H": 1, "D": 2, "op": "stepwise", "forward": False}
    assert data["rows"] == [
        {"T": 20, **cfg, "seconds": 0.5, "rss_mib": 12.0},
        {"T": 30, **cfg, "error": "timed out"},
    ]
    assert [t for t, _ in ran] == ["stepwise_chunk:measure"] * 2
    default = pathlib.Path(stepwise_chunk.OUT) / "stepwise_chunk.json"
    assert default.parent.name == "bench-out"


def test_launch_cost_writes_its_rows_with_provenance(bench, monkeypatch, tmp_path, capsys):
    """``bench/launch_cost.py --json`` (CUDA only; here with MLX's ``add`` alone on the
    CPU, the CUDA check skipped): one row per kind, the figures printed."""
    launch_cost = bench("launch_cost")
    monkeypatch.setattr(launch_cost, "stop_without_cuda", lambda *a, **k: False)
    monkeypatch.setattr(launch_cost, "kinds", lambda pads: [("mlx add", lambda x: x + 1.0)])
    out = tmp_path / "launch.json"
    assert launch_cost.main(["--launches", "3", "--repeats", "1", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert PROVENANCE <= set(data["meta"]) and "op_binaries" not in data["meta"]
    (row,) = data["rows"]
    assert (row["kind"], row["launches"], row["repeats"]) == ("mlx add", 3, 1)
    line = capsys.readouterr().out.splitlines()[-1]
    assert line == f"{'mlx add':>22}  {row['build_us_per_launch']:15.1f}  " + (
        f"{row['eval_us_per_launch']:14.1f}"
    )


def test_gpu_gaps_writes_its_rows_and_prints_as_before(bench, monkeypatch, tmp_path, capsys):
    """``bench/gpu_gaps.py --json`` (CUDA and PyTorch only; here the profiled call is
    faked): one row per mode with the figures of the line printed, which reads as it
    did before the rows were written."""
    gpu_gaps = bench("gpu_gaps")
    ks = [(0.0, 10.0), (5.0, 12.0), (40.0, 50.0)]  # microseconds
    by_name = {"a": [10.0, 10.0], "b": [7.0]}
    fake = gpu_gaps.summary_row("eager", [0.003, 0.001, 0.002], [0.0005] * 3, 0.004, ks, -1000.0,
                                by_name, 1)  # fmt: skip
    assert fake["top"] == [{"kernel": "a", "ms": 0.02, "launches": 2}]
    gpu_gaps.print_row(fake)
    assert capsys.readouterr().out.splitlines() == [
        "eager: wall 2.00 ms (graph built in 0.50; profiled 4.00, first kernel 1.00 ms in), "
        "3 kernels, span 0.05 ms, busy 0.02 ms, gaps 0.03 ms (1 over 20 us: 0.03 ms, largest "
        "0.03 ms)",
        "       0.020 ms     2x  a",
    ]
    monkeypatch.setattr(gpu_gaps, "stop_without_cuda", lambda *a, **k: False)
    monkeypatch.setattr(gpu_gaps, "profile_mode", lambda label, *a: dict(fake, mode=label))
    out = tmp_path / "gaps.json"
    assert gpu_gaps.main(["--T", "16", "--json", str(out)]) == 0
    data = json.loads(out.read_text())
    assert PROVENANCE <= set(data["meta"])
    assert [(r["mode"], r["T"], r["harness"]) for r in data["rows"]] == [
        ("eager", 16, "cotangents"), ("compiled", 16, "cotangents")
    ]  # fmt: skip
    assert gpu_gaps.build_parser().parse_args([]).json.endswith("bench-out/gpu_gaps.json")


def test_memory_breakdown_counts_every_kernel_output(monkeypatch, capsys, tmp_path):
    """``bench/memory_breakdown.py`` (faked kernels): one row per launch and output, the
    printed total their sum, and the rows the outputs' shapes say, per token at the
    Qwen3-Next shape with C = 64 (Hv = 32, Dk = Dv = 128, float32): the states entering
    the chunks 32 KiB (32 * 128 * 128 * 4 / 64 bytes), ``w`` 16 (32 * 128 * 4)."""
    monkeypatch.syspath_prepend(str(BENCH))
    import memory_breakdown

    from chunkscan import _backend
    from chunkscan.ops.gated_delta import _passes, chunk

    before = {(m, name): getattr(m, name) for m, name in (
        (_backend, "RUNNER"), (_backend, "_LIMITS"), (_backend, "_CAPABILITY"),
        (chunk, "_fused"), (chunk, "_GROUP_BYTES"), (_passes, "use_kernels"))}  # fmt: skip
    out = tmp_path / "mb.json"
    assert memory_breakdown.main(["--T", "512", "--json", str(out)]) == 0
    # the fakes are undone: they had stayed, and the op returned zeros afterwards (probing)
    for (m, name), value in before.items():
        assert getattr(m, name) is value, name
    written = json.loads(out.read_text())
    rows, meta = written["rows"], written["meta"]
    assert PROVENANCE <= set(meta) and meta["groups"] == 1 and meta["save_states"] == "chunks"
    total = sum(r["kib_per_token"] for r in rows)
    assert abs(total - meta["total_kib_per_token"]) < 1e-9
    assert f"(total {total:.1f})" in capsys.readouterr().out
    by = {(r["launch"], r["output"]): r["kib_per_token"] for r in rows}
    states = [kib for (_, name), kib in by.items() if name == "states per chunk"]
    assert states == [32.0, 32.0]  # the forward's entering states, the backward's cotangents
    assert [kib for (_, name), kib in by.items() if name == "w"] == [16.0]
    assert len({r["launch"] for r in rows}) == max(r["launch"] for r in rows) + 1
    # a C the fused kernels do not take runs the batched ops, which it does not count
    # (C = 128 read 34.2 KiB/token, the state pass alone)
    with pytest.raises(SystemExit) as stop:
        memory_breakdown.main(["--chunk-size", "128", "--json", str(out)])
    assert stop.value.code == 2


def test_a_copy_of_bench_finds_the_test_helpers_of_its_chunkscan(tmp_path, monkeypatch):
    """``memory_breakdown.py`` and ``graph_build.py`` fake the kernels with
    ``tests/helpers.py``, which they looked for beside themselves only: a copy of
    ``bench/`` stopped at ``No module named 'helpers'`` (found by probing). Now the
    checkout whose chunkscan is imported is asked first."""
    import importlib.util

    copy = tmp_path / "elsewhere" / "bench"
    copy.mkdir(parents=True)
    (copy / "_common.py").write_text((BENCH / "_common.py").read_text())
    assert not (tmp_path / "elsewhere" / "tests").exists()  # where they looked before
    spec = importlib.util.spec_from_file_location("copied_common", copy / "_common.py")
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "helpers", raising=False)  # restored afterwards
    helpers = common.import_test_helpers()
    checkout = pathlib.Path(common.chunkscan_src()).parent
    assert pathlib.Path(helpers.__file__).resolve() == (checkout / "tests" / "helpers.py").resolve()
    assert callable(helpers.fake_fused_kernels)


def test_ncu_source_summary_says_when_the_page_is_another(bench, capsys):
    """A SpeedOfLight CSV given where the source page belongs printed nothing, exit
    status 0 (found by probing): now one line and exit status 1."""
    summary = bench("ncu_source_summary")
    sol = BENCH / "results" / "h200" / "ncu" / "ncu_chunkscan_16k_sol_3454e77.csv.gz"
    assert summary.main([str(sol)]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and "no launch or source line found" in captured.err


def test_linear_attention_bench_measures_the_three_forms(bench):
    """``bench/linear_attention.py``'s three implementations of one Lightning-attention
    layer run and report (tiny shape, in this process)."""
    module = bench("linear_attention")
    for impl in module.IMPLS:
        row = module.measure(impl, T=24, dtype="float32", repeats=1, chunk_size=8, H=2, D=8)
        assert row["impl"] == impl and row["seconds"] > 0 and row["peak_bytes"] > 0
        # the chunk the op ran at, and none for mlx-lm's (every row said the default;
        # found by probing, session 48)
        ran = (8, 8) if impl == "chunkscan" else (None, None)
        assert (row["chunk_size"], row["chunk_run"]) == ran, row
    row = module.measure("chunkscan", T=6, dtype="float32", repeats=1, chunk_size=8, H=2, D=8)
    assert (row["chunk_size"], row["chunk_run"]) == (8, 6), row
    assert module.slopes(4) == [-(2**-2.0), -(2**-4.0), -(2**-6.0), -(2**-8.0)]


def test_attention_bench_measures_both_paths(bench):
    """``bench/attention.py``'s ``measure`` runs in this process for the short-call
    path and the blocks (it failed every chunkscan row on an H100 once ``_use_fast``'s
    signature changed, run 128: no test called it in-process)."""
    module = bench("attention")
    for fast_max_scores, blocks in ((None, 0), (0, 1)):
        row = module.measure("chunkscan", T=16, Hq=2, Hkv=1, D=8, dtype="float32",
                             fast_max_scores=fast_max_scores, repeats=1)  # fmt: skip
        assert row["ms"] > 0 and row["blocks"] == blocks, row


def test_mamba2_bench_measures_both_forms(bench):
    """``bench/mamba2.py``'s two forms of one Mamba2 SSD layer run and report (tiny
    shape, in this process); the chunkscan form goes through the seam (its measure
    asserts the routed call), and a shape whose heads are no multiple of the groups is
    refused by the parser."""
    import chunkscan.mlx_lm as cmlx

    module = bench("mamba2")
    try:
        for impl in module.IMPLS:
            cmlx.routed_calls.clear()
            row = module.measure(impl, T=40, dtype="float32", repeats=1, heads=4, head_dim=8,
                                 state=8, groups=2)  # fmt: skip
            assert row["impl"] == impl and row["seconds"] > 0 and row["peak_bytes"] > 0
    finally:
        while cmlx._stack:  # measure() patches for the rest of its (own) process
            cmlx._stack[-1].undo()
    with pytest.raises(SystemExit):
        module.main(["--heads", "6", "--groups", "4", "--json", "", "--md", ""])


def test_routed_row_records_the_chunk_run(bench):
    """``routed_row`` records ``chunk_run``, the chunk the op ran at: ``T`` where that
    is shorter than the chunk asked for (the rows said 64 at T = 16; found by probing);
    the table shows it."""
    import mlx.core as mx

    common = bench("_common")
    rows = [common.routed_row("chunkscan", T, lambda: mx.zeros(1), None, 1, {"chunk_size": 64})
            for T in (16, 128)]  # fmt: skip
    assert [r["chunk_run"] for r in rows] == [16, 64]
    assert "| chunkscan | 16 | 16 |" in common.side_by_side_table(rows, "mlx_lm")
    assert "chunk_run" not in common.routed_row("mlx_lm", 16, lambda: mx.zeros(1), None, 1, {})


def _layer_bench_rows(module, op_chunk, **shape):
    """Both impls of a side-by-side layer bench (mamba, rwkv7, rg_lru) at a chunk of 4,
    in this process: their rows, each checked (measured, the chunk recorded), and that
    the op ran at that chunk (its module's ``scan`` recorded; after the seam's probes, at
    the default chunk). ``op_chunk`` is the op's ``chunk`` module; its ``scan`` and
    ``default_chunk_size`` and the patch the measure applies are put back after."""
    import chunkscan.mlx_lm as cmlx

    default, scan = op_chunk.default_chunk_size, op_chunk.scan
    ran = []

    def recording(*args, **kwargs):
        ran.append(kwargs["chunk_size"])
        return scan(*args, **kwargs)

    op_chunk.scan = recording  # the chunk the op runs at
    try:
        for impl in module.IMPLS:
            cmlx.routed_calls.clear()
            row = module.measure(impl, dtype="float32", repeats=1, chunk_size=4, **shape)
            assert row["impl"] == impl and row["seconds"] > 0 and row["peak_bytes"] > 0
            assert row["chunk_size"] == (4 if impl == "chunkscan" else None)
            assert row.get("chunk_run") == (4 if impl == "chunkscan" else None)
        assert ran[-3:] == [4, 4, 4]
    finally:
        op_chunk.default_chunk_size, op_chunk.scan = default, scan
        while cmlx._stack:  # measure() patches for the rest of its (own) process
            cmlx._stack[-1].undo()


def test_mamba_bench_measures_both_forms(bench):
    """``bench/mamba.py``'s two forms of one Mamba layer run and report (tiny shape, in
    this process); the chunkscan form goes through the seam (its measure asserts the
    routed call) with the chunk asked for."""
    from chunkscan.ops.selective_scan import chunk as s6

    _layer_bench_rows(bench("mamba"), s6, T=24, hidden=16, channels=32, state=4, dt_rank=2)


def test_rwkv7_bench_measures_both_forms(bench):
    """``bench/rwkv7.py``'s two forms of one RWKV-7 time-mixing layer run and report
    (tiny shape, in this process); the chunkscan form goes through the seam (its
    measure asserts the routed call) with the chunk asked for."""
    from chunkscan.ops.dplr_delta import chunk as dplr

    _layer_bench_rows(bench("rwkv7"), dplr, T=20, hidden=16, head_dim=8)


def test_rg_lru_bench_measures_both_forms(bench):
    """``bench/rg_lru.py``'s two forms of one RecurrentGemma recurrent block run and
    report (tiny shape, in this process); the chunkscan form goes through the seam (its
    measure asserts the routed call) with the chunk asked for; a width that is no
    multiple of the heads is refused by the parser."""
    from chunkscan.ops.diagonal import chunk as diagonal

    module = bench("rg_lru")
    _layer_bench_rows(module, diagonal, T=20, width=16, heads=2)
    with pytest.raises(SystemExit):
        module.main(["--width", "10", "--heads", "4", "--json", "", "--md", ""])


def test_dplr_delta_bench_measures_both_forms(bench):
    """``bench/dplr_delta.py``'s two forms of RWKV-7's recurrence run and report (tiny
    shape, in this process), the chunkscan form at the chunk asked for."""
    module = bench("dplr_delta")
    for impl in module.IMPLS:
        for compiled in (False, True):
            row = module.measure(impl, T=12, dtype="float32", repeats=1, heads=2, head_dim=4,
                                 chunk_size=4, compiled=compiled)  # fmt: skip
            assert row["impl"] == impl and row["seconds"] > 0 and row["peak_bytes"] > 0
            assert row["chunk_size"] == (4 if impl == "chunkscan" else None)
            assert row["compiled"] is compiled


def test_side_by_side_children_import_the_bench_helpers(bench, tmp_path):
    """``run_side_by_side``'s fresh processes find ``bench/_common.py`` (the targets
    import ``routed_row`` from it; with the checkout's root alone on their path every
    row was an ImportError, found before commit): a whole tiny run, its rows measured."""
    module = bench("dplr_delta")
    out = tmp_path / "rows.json"
    module.main(["--T", "8", "--heads", "2", "--head-dim", "4", "--repeats", "1",
                 "--json", str(out), "--md", ""])  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["impl"] for r in rows] == ["mlx_lm", "chunkscan"]
    assert all("error" not in r and r["seconds"] > 0 for r in rows), rows
