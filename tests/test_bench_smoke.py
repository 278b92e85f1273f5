"""The benchmarks that reach into the ops' internals still run (tiny shapes, CPU)."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


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
    sys.modules.pop("ncu_summary", None)


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


def test_graph_build_times_the_fused_paths_graph(monkeypatch, capsys):
    """``bench/graph_build.py`` builds the fused path's fwd+bwd graph with faked kernels
    (a small T): every fused kernel is launched, and the build's times are printed."""
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
    assert graph_build.main(["--T", "256", "--repeats", "3"]) == 0
    assert "T=256: graph build median" in capsys.readouterr().out
    assert launched == set(_chunk_cuda._KERNELS)
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
    rows = {(r["gate"], r["impl"]): r for r in json.loads(out.read_text())["rows"]}

    def worst(r):
        return max(r[n] for n in growth_gates.NAMES)

    assert worst(rows[0.6, "chunk 8"]) <= 1.6e-5 and worst(rows[0.6, "naive"]) <= 1.6e-5
    assert worst(rows[0.6, "chunk 64"]) > 4e-5
    assert rows[1.2, "naive"]["non_finite_grads"] == rows[1.2, "chunk 8"]["non_finite_grads"] == 0
    assert rows[1.2, "chunk 64"]["non_finite_grads"] > 0
    # per key channel (docs/gated_delta.md): values close, gradients overflow the same way
    argv = ["--channel", "--gates", "1.2", "--chunk-sizes", "8", "64", "--T", "64"]
    assert growth_gates.main([*argv, "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())["rows"]}
    assert all(r["channel"] for r in rows.values())
    assert max(rows["chunk 64"][n] for n in ("o", "final")) <= 8e-6  # measured 1.3e-6
    assert rows["naive"]["non_finite_grads"] == rows["chunk 8"]["non_finite_grads"] == 0
    assert rows["chunk 64"]["non_finite_grads"] > 0
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
    assert lora.main(["--replot", str(source), "--json", str(out)]) == 0
    assert out.with_suffix(".md").is_file()
    assert sorted(p.name for p in source.parent.iterdir()) == ["lora_cpu.json"]
