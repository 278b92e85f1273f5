"""What the bench scripts take and record: each check here was a bug found by probing
(an output over an input, a plot suffix matplotlib refuses, a saved row without a key
the table reads, heads that do not divide, the chunk recorded as asked rather than as
run, a per-token figure of one sequence of the batch, a symbolic link written through,
a device without its GPU's name, a default output relative to the folder run from)."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import pathlib
import re

import pytest

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"
GD_ROW = {"impl": "chunkscan", "T": 16, "seconds": 0.5, "kib_per_token": 2.0}
ATT_ROW = {"impl": "chunkscan", "T": 16, "ms": 5.0, "kib_per_token": 2.0}


@pytest.fixture
def no_measuring(monkeypatch):
    """The measuring processes fail the test: a check must stop the script first."""
    from chunkscan.commands import measure

    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: pytest.fail("measured"))


def refused(module, argv, capsys) -> str:
    """``module.main(argv)``'s last line on stderr, where it stops with exit status 2."""
    with pytest.raises(SystemExit) as exc:
        module.main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


def test_outputs_over_the_saved_file_are_refused(bench, tmp_path, capsys, no_measuring):
    """``gated_delta.py --from-json F --md F`` (or ``--json F``, ``--png F``) wrote over F
    with exit status 0, as did ``attention.py --from-json F --json F`` (its table and plot
    beside F) and ``--from-json X.md --json X.json`` (its table over F)."""
    saved = json.dumps({"title": "t", "rows": [GD_ROW]})
    for option, name in (("--md", "saved.json"), ("--png", "saved.png")):
        path = tmp_path / name
        path.write_text(saved)
        outputs = {"--json": "", "--md": "", "--png": "", option: str(path)}
        argv = ["--from-json", str(path), *(x for kv in outputs.items() for x in kv)]
        err = refused(bench("gated_delta"), argv, capsys)
        assert f"argument {option}: '{path}' is also an input of this run" in err, err
        assert path.read_text() == saved
    rows = json.dumps([ATT_ROW])
    path = tmp_path / "a.md"
    path.write_text(rows)
    err = refused(bench("attention"), ["--from-json", str(path), "--json",
                                       str(tmp_path / "a.json")], capsys)  # fmt: skip
    assert f"'{path}' is also an input of this run" in err, err
    assert path.read_text() == rows
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.md", "saved.json", "saved.png"]
    # --json naming the file read: refused for a committed result (its table and plot
    # are committed beside it), ...
    results = pathlib.Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu"
    for script, option, name in (("gated_delta", "--from-json", "gdn_t1024_cpu.json"),
                                 ("attention", "--from-json", "attention_cpu.json"),
                                 ("lora", "--replot", "lora_cpu_attn.json")):  # fmt: skip
        committed = str(results / name)
        err = refused(bench(script), [option, committed, "--json", committed], capsys)
        assert f"'{committed}' is also an input of this run" in err, err


def test_the_last_run_replots_in_place(bench, tmp_path):
    """... but one's own last run outside bench/results/ replots in place, as before the
    input check (which had refused ``--from-json bench-out/gated_delta.json`` with the
    default ``--json``; found by review): its table and plot beside it, the file read
    left as it was."""
    path = tmp_path / "gd.json"
    saved = json.dumps({"meta": {}, "title": "t", "rows": [GD_ROW]})
    path.write_text(saved)
    md = tmp_path / "gd.md"
    bench("gated_delta").main(["--from-json", str(path), "--json", str(path), "--md", str(md),
                               "--png", ""])  # fmt: skip
    assert path.read_text() == saved and "chunkscan" in md.read_text()


def test_in_place_no_other_output_may_name_the_file_read(bench, tmp_path, capsys):
    """``--from-json F --json F --md F`` outside bench/results/: --json is not written
    again, so the input check was dropped, and --md replaced F's rows with the table,
    exit 0 (found by probing, session 49). Refused now; --md elsewhere runs (above)."""
    path = tmp_path / "gd.json"
    saved = json.dumps({"meta": {}, "title": "t", "rows": [GD_ROW]})
    path.write_text(saved)
    argv = ["--from-json", str(path), "--json", str(path), "--md", str(path), "--png", ""]
    err = refused(bench("gated_delta"), argv, capsys)
    assert f"argument --md: '{path}' is also an input of this run" in err, err
    assert path.read_text() == saved


def test_a_saved_file_rebuilds_elsewhere(bench, tmp_path, monkeypatch):
    """The negative control: the table of a saved file goes to another path, a row
    without ``chunk_run`` (written before it) or an error row's values included."""
    path = tmp_path / "saved.json"
    rows = [GD_ROW, {"impl": "mlx_lm", "T": 16, "error": "skipped"}]
    path.write_text(json.dumps({"title": "t", "rows": rows}))
    bench("gated_delta").main(["--from-json", str(path), "--json", "", "--png", "",
                               "--md", str(tmp_path / "out.md")])  # fmt: skip
    assert "| chunkscan | 16 | 0.500 | 2.0 |" in (tmp_path / "out.md").read_text()
    attention = bench("attention")
    monkeypatch.setattr(attention, "plot", lambda *a: None)
    path.write_text(json.dumps([ATT_ROW, {"impl": "mlx_fast", "T": 16, "error": "x"}]))
    (tmp_path / "o.json").write_text("[]")  # another run's rows: replaced, not left beside
    assert attention.main(["--from-json", str(path), "--json", str(tmp_path / "o.json")]) == 0
    assert "| chunkscan | 16 | 5.0 | 2.0 |" in (tmp_path / "o.md").read_text()
    assert json.loads((tmp_path / "o.json").read_text()) == json.loads(path.read_text())


def test_the_plot_suffix_is_checked_before_measuring(bench, tmp_path, capsys, no_measuring):
    """``gated_delta.py --png x.pgn`` failed with matplotlib's ValueError after the
    measuring; a path without a suffix was written as ``x.png``."""
    for name, why in (("x.pgn", "ends in .pgn"), ("x", "has no suffix")):
        argv = ["--T", "16", "--impls", "chunkscan", "--json", "", "--md", "",
                "--png", str(tmp_path / name)]  # fmt: skip
        err = refused(bench("gated_delta"), argv, capsys)
        assert f"argument --png: '{tmp_path / name}' {why}, which matplotlib" in err, err
        assert ".png" in err and ".pdf" in err
    common = bench("_common")
    parser = argparse.ArgumentParser(prog="x")
    for name in ("a.png", "a.pdf", "a.SVG", "a.jpeg", "a.eps"):  # taken (eps: review)
        common.check_outputs(parser, {"--png": tmp_path / name}, plots=("--png",))
    common.check_outputs(parser, {"--json": tmp_path / "a.pgn"})  # only where asked


SAVED_ROWS = [
    ("gated_delta", {"rows": [{"x": 1}], "title": "t"}, "row 0 has no key 'impl'"),
    ("gated_delta", {"rows": [GD_ROW, {"impl": "a", "T": 1}], "title": "t"},
     "row 1 has no key 'seconds'"),
    ("gated_delta", {"rows": [GD_ROW, 3], "title": "t"}, "row 1 is not an object"),
    ("gated_delta", {"rows": {"impl": "a"}, "title": "t"}, "its rows are not a list"),
    ("attention", [{"x": 1}], "row 0 has no key 'impl'"),
    ("attention", [ATT_ROW, {"impl": "a", "T": 1, "ms": 1.0}], "row 1 has no key 'kib_per_token'"),
]  # fmt: skip


@pytest.mark.parametrize("script,saved,message", SAVED_ROWS)
def test_saved_rows_need_the_keys_the_table_reads(script, saved, message, bench, tmp_path,
                                                  capsys):  # fmt: skip
    """A saved file of the right shape whose rows lack a key the table or plot reads:
    one line naming the file, the row and the key (a KeyError before)."""
    path = tmp_path / "saved.json"
    path.write_text(json.dumps(saved))
    out = ["--json", str(tmp_path / "out" / "o.json")]
    if script == "gated_delta":
        out += ["--md", "", "--png", ""]
    err = refused(bench(script), ["--from-json", str(path), *out], capsys)
    assert f"error: argument --from-json: '{path}': {message}" in err, err
    assert not (tmp_path / "out" / "o.md").exists()


def _committed(kind: str) -> list[pathlib.Path]:
    """The committed outputs of ``gated_delta.py`` (``{"title", "rows", ...}``) or of
    ``attention.py`` (a list of rows with ``impl``)."""
    found = []
    for path in sorted((BENCH / "results").rglob("*.json")):
        data = json.loads(path.read_text())
        if kind == "gated_delta" and isinstance(data, dict) and {"title", "rows"} <= set(data):
            found.append(path)
        elif kind == "attention" and isinstance(data, list) and data and "impl" in data[0]:
            found.append(path)
    return found


def test_the_committed_results_still_rebuild(bench, tmp_path, monkeypatch):
    """Every committed output of the two scripts passes the row checks and rebuilds its
    table (none has ``chunk_run`` or ``tokens``, written since); the attention results
    all have B = 1, so per token of the batch (B x T) is what they read."""
    gated, attention = _committed("gated_delta"), _committed("attention")
    assert len(gated) >= 20 and len(attention) >= 7  # 22 and 7 at this writing
    for path in gated:  # the plots drawn too (two raised a TypeError there; review)
        md, png = tmp_path / f"{path.stem}.md", tmp_path / f"{path.stem}.png"
        bench("gated_delta").main(["--from-json", str(path), "--json", "", "--png", str(png),
                                   "--md", str(md)])  # fmt: skip
        assert md.read_text().count("\n| ") == len(json.loads(path.read_text())["rows"]) + 1
        assert png.exists() or importlib.util.find_spec("matplotlib") is None
    module = bench("attention")
    monkeypatch.setattr(module, "plot", lambda *a: None)
    for path in attention:
        rows = json.loads(path.read_text())
        assert {r["B"] for r in rows} == {1}, path
        assert not any("--B" in r.get("meta", {}).get("argv", []) for r in rows), path
        assert module.main(["--from-json", str(path), "--json",
                            str(tmp_path / f"{path.stem}.json")]) == 0  # fmt: skip


HEADS = [
    (["--Hq", "3", "--Hkv", "2"], "argument --Hq: 3 is not a multiple of --Hkv 2"),
    (["--Hq", "3"], "argument --Hq: 3 is not a multiple of --Hkv 2 (--shape cpu-small's)"),
    (["--Hkv", "3"], "argument --Hkv: --Hq 4 (--shape cpu-small's) is not a multiple of 3"),
    (["--shape", "qwen3-next", "--Hkv", "3"], "--Hq 16 (--shape qwen3-next's)"),
]


@pytest.mark.parametrize("argv,message", HEADS)
def test_attention_heads_must_divide(argv, message, bench, tmp_path, capsys, no_measuring):
    """``attention.py --Hq 3 --Hkv 2`` gave one error row per implementation and exit
    status 0; as ``first_call.py`` and ``gdn_phases.py`` it now stops at parse time."""
    argv = [*argv, "--T", "16", "--json", str(tmp_path / "a.json")]
    err = refused(bench("attention"), argv, capsys)
    assert message in err, err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("mib", ["0.0000001", "1e-300"])
def test_attention_scratch_below_a_byte_is_refused(mib, bench, tmp_path, capsys, no_measuring):
    """``attention.py --scratch-mib 0.0000001`` set a scratch of 0 bytes: every chunkscan
    row failed and the run exited 0 (found by probing). It stops at parse time now; one
    byte's worth is taken."""
    argv = ["--T", "16", "--scratch-mib", mib, "--json", str(tmp_path / "a.json")]
    err = refused(bench("attention"), argv, capsys)
    assert "argument --scratch-mib: must be at least one byte" in err and mib in err, err
    assert not list(tmp_path.iterdir())
    assert bench("attention").scratch_mib_arg(str(1 / 2**20)) == 1 / 2**20


def test_attention_kib_per_token_counts_the_batch(bench):
    """``kib_per_token`` divided the peak by T, so ``--B 4`` read about 4x the B = 1
    figure: it is per token of the whole batch (``tokens`` = B x T)."""
    attention = bench("attention")
    row = attention.measure("chunkscan_portable", T=16, B=2, Hq=2, Hkv=1, D=8,
                            dtype="float32", repeats=1)  # fmt: skip
    assert row["peak_bytes"] > 0
    assert row["kib_per_token"] == pytest.approx(row["peak_bytes"] / 1024 / 32)
    assert row["tokens"] == 32
    assert "B x T" in attention.build_parser().format_help()


CHUNKS = [  # impl, T, chunk asked, gate, chunk run
    ("chunkscan", 16, 32, "head", 16),  # cut to T
    ("chunkscan", 16, None, "head", 16),  # the default (32 on the CPU), cut to T
    ("chunkscan", 64, 32, "head", 32),  # as asked
    ("chunkscan", 64, 12, "channel", 16),  # whole sub-chunks of 8
    ("scan", 16, 32, "head", 16),  # scan cuts it to T too
    ("mlx_fast", 16, 32, "head", None),  # not chunked
]


@pytest.mark.parametrize("impl,T,asked,gate,ran", CHUNKS)
def test_gated_delta_rows_record_the_chunk_run(impl, T, asked, gate, ran, bench):
    """``gated_delta.py``'s rows said ``chunk_size: 32`` at T = 16, where the op ran at
    16: ``chunk_run`` is the chunk it ran at, ``chunk_size`` still the one asked for."""
    gated_delta = bench("gated_delta")
    row = gated_delta.measure(impl, T, dtype="float32", repeats=1, chunk_size=asked, Hk=1,
                              Hv=1, Dk=8, Dv=8, gate=gate)  # fmt: skip
    assert row["chunk_run"] == ran
    assert row["chunk_size"] == gated_delta._chunk_used(impl, asked)


@pytest.mark.parametrize("T,asked,gate,ran", [(8, 16, "head", 8), (20, 12, "channel", 16)])
def test_first_call_rows_record_the_chunk_run(T, asked, gate, ran, bench):
    """``first_call.py --T 8 --C 16`` recorded ``C: 16`` alone, where the op ran at 8
    (found by probing): ``chunk_run`` is the chunk it ran at."""
    row = bench("first_call").measure("fwd", 1, T, 1, 1, 8, asked, gate)
    assert row["chunk_run"] == ran


def test_lora_patched_rows_record_the_chunk_run(bench, monkeypatch):
    """``lora.py``'s rows held the chunk asked (``None``: the op's default) alone; the
    patched rows record the one the op ran at for their T, the stub rows none (they run
    no op)."""
    import mlx_lm.models.qwen3_next as qwen3_next

    from chunkscan.commands.demo_model import tiny_config

    # measure() swaps the recurrence in this process: restored however the test ends
    monkeypatch.setattr(qwen3_next, "gated_delta_update", qwen3_next.gated_delta_update)
    lora = bench("lora")
    config = {"hidden_size": 32, "intermediate_size": 32, "vocab_size": 16}
    row = lora.measure("patched", 8, chunk_size=16, repeats=1, config=config)
    assert (row["chunk_size"], row["chunk_run"]) == (16, 8)
    assert "chunk_run" not in lora.measure("stub", 8, chunk_size=16, repeats=1, config=config)
    default = lora._chunk_run(tiny_config(), 1, 4096, None, "float32")
    from chunkscan.ops.gated_delta import chunk

    assert default == chunk.default_chunk_size(None, 128, 128)


def test_gdn_vs_fla_prints_the_chunk_run(bench):
    """``gdn_vs_fla.py``'s line printed the ``C=`` asked (128 at T = 64, where the op
    ran at 64; found by probing): the chunk run, and the one asked where they differ."""
    line = bench("gdn_vs_fla")._line
    row = {"impl": "chunkscan", "T": 64, "chunk_size": 128, "chunk_run": 64, "ms": 1.0,
           "kib_per_token": 2.0}  # fmt: skip
    assert "C=  64 (asked 128) " in line(row)
    assert "C= 128 eager" in line(dict(row, T=256, chunk_run=128))
    assert "C=  64 eager" in line({"impl": "fla", "T": 64, "chunk_size": 64, "error": "x"})


def test_memory_breakdown_prints_the_chunk_the_kernels_ran_at(bench, tmp_path, capsys):
    """At ``--T 20`` the header said ``C=64`` where the kernels ran ``C=32``."""
    out = tmp_path / "mb.json"
    assert bench("memory_breakdown").main(["--T", "20", "--json", str(out)]) == 0
    meta = json.loads(out.read_text())["meta"]
    assert (meta["chunk_size"], meta["chunk_run"], meta["groups"]) == (64, 32, 1)
    assert capsys.readouterr().out.startswith("T=20 C=32 (--chunk-size 64 cut to T")


def test_stepwise_chunk_records_the_chunk_scan_runs(bench, monkeypatch, tmp_path, capsys):
    """``stepwise_chunk.py --T 8 --chunk 100`` recorded ``chunk: 100``: scan runs one
    chunk of 8 (the measuring process faked)."""
    stepwise_chunk = bench("stepwise_chunk")
    ran = []
    monkeypatch.setattr(stepwise_chunk, "run_isolated",
                        lambda target, cfg, **k: ran.append(cfg) or {"seconds": 1.0,
                                                                     "rss_mib": 1.0})  # fmt: skip
    out = tmp_path / "s.json"
    argv = ["--T", "8", "16", "--chunk", "10", "--H", "1", "--D", "2", "--json", str(out)]
    assert stepwise_chunk.main(argv) == 0
    assert [r["chunk"] for r in json.loads(out.read_text())["rows"]] == [8, 10]
    assert [c["chunk"] for c in ran] == [8, 10]
    assert "| 8 | 8 | 1.00 |" in capsys.readouterr().out


def test_growth_gates_tells_gates_and_chunks_apart(bench, tmp_path, capsys):
    """``--gates 0.05 0.1`` printed both as ``+0.1``; ``--chunk-sizes 16 64`` at T = 16
    gave two identical rows labelled 16 and 64: ``chunk_run`` records 16 for both, and
    the table says so."""
    growth_gates = bench("growth_gates")
    out = tmp_path / "g.json"
    argv = ["--gates", "0.05", "0.1", "--chunk-sizes", "16", "64", "--T", "16", "--D", "2",
            "--json", str(out)]  # fmt: skip
    assert growth_gates.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()[2:]
    assert [line.split(" | ")[1] for line in lines] == ["+0.05"] * 3 + ["+0.1"] * 3
    assert [line.split(" | ")[4] for line in lines[:3]] == ["naive", "chunk 16",
                                                           "chunk 64 (ran 16)"]  # fmt: skip
    rows = json.loads(out.read_text())["rows"]
    assert [r["chunk_run"] for r in rows] == [None, 16, 16] * 2
    argv = ["--channel", "--gates", "0", "--chunk-sizes", "12", "--T", "32", "--D", "2",
            "--json", str(out)]  # fmt: skip
    assert growth_gates.main(argv) == 0
    assert [r["chunk_run"] for r in json.loads(out.read_text())["rows"]] == [None, 16]
    assert "| +0.0 |" in capsys.readouterr().out  # one decimal reads as before


def test_check_outputs_refuses_a_symbolic_link(bench, tmp_path, capsys, no_measuring):
    """An output path that is a symbolic link (or a file written beside it, or a
    dangling link) was written through into the file it named."""
    common = bench("_common")
    parser = argparse.ArgumentParser(prog="x")
    target = tmp_path / "target.json"
    target.write_text("kept")
    (tmp_path / "link.json").symlink_to(target)
    (tmp_path / "dangling.json").symlink_to(tmp_path / "nowhere.json")
    (tmp_path / "b.md").symlink_to(target)
    for paths, beside, name in (({"--json": tmp_path / "link.json"}, (), "link.json"),
                                ({"--json": tmp_path / "dangling.json"}, (), "dangling.json"),
                                ({"--json": tmp_path / "b.json"}, (".md",), "b.md")):  # fmt: skip
        with pytest.raises(SystemExit):
            common.check_outputs(parser, paths, beside=beside)
        err = capsys.readouterr().err.splitlines()[-1]
        assert f"'{tmp_path / name}' is a symbolic link to a file: remove it or pass" in err
    common.check_outputs(parser, {"--json": tmp_path / "c.json"}, beside=(".md",))  # no link
    # a link to what is not a file (/dev/stdout: a link to /proc/self/fd/1) is written to
    # as before (found by review)
    (tmp_path / "out.json").symlink_to("/dev/null")
    common.check_outputs(parser, {"--json": tmp_path / "out.json"})
    link = str(tmp_path / "link.json")
    err = refused(bench("gated_delta"), ["--T", "16", "--impls", "chunkscan", "--json", link,
                                         "--md", "", "--png", ""], capsys)  # fmt: skip
    assert "argument --json: " in err and "is a symbolic link" in err
    assert target.read_text() == "kept" and not (tmp_path / "nowhere.json").exists()


def test_scan_time_records_the_device_as_the_others_do(bench, monkeypatch, tmp_path):
    """``scan_time.py`` recorded ``provenance()``'s device, without the GPU's name that
    ``_common.meta()`` gives the other scripts' files (``provenance()`` records it now,
    for ``chunkscan repro`` too)."""
    from chunkscan.commands import measure

    monkeypatch.setattr(measure, "device", lambda: "gpu (A FAKE GPU), x86_64, 2 cpus")
    out = tmp_path / "scan_time.json"
    argv = ["--T", "8", "--H", "1", "--D", "2", "--chunk", "4", "--rounds", "1",
            "--grads", "state", "--modes", "cs.scan", "--json", str(out)]  # fmt: skip
    assert bench("scan_time").main(argv) == 0
    meta = json.loads(out.read_text())["meta"]
    assert meta["device"] == "gpu (A FAKE GPU), x86_64, 2 cpus"
    assert (meta["H"], meta["D"], meta["chunk"], meta["rounds"], meta["compiled"]) == (
        1, 2, 4, 1, False
    )  # fmt: skip


def test_meta_names_the_scripts_checkout_where_it_is_not_chunkscans(bench, monkeypatch):
    """``_common.meta()`` records ``scripts_commit`` where the benchmark scripts' checkout
    differs from the chunkscan measured (a clone's edited script run with another
    checkout's chunkscan recorded that one's clean commit; found by probing), and
    nothing more where they are one."""
    from chunkscan.commands import measure

    common = bench("_common")
    monkeypatch.delenv("CHUNKSCAN_COMMIT", raising=False)
    monkeypatch.setattr(measure, "device", lambda: "cpu")
    same = common.meta()
    assert same["commit"] == measure.git_commit(measure.__file__)
    if common._checkout(common.__file__) == common._checkout(common.chunkscan_src()):
        assert "scripts_commit" not in same
    scripts = common.__file__

    def commits(path):
        return "a" * 40 + "+dirty" if path == str(pathlib.Path(scripts).resolve()) else "b" * 40

    monkeypatch.setattr(measure, "git_commit", commits)
    monkeypatch.setattr(common, "_CODE_AT_START", None)  # (read as now)
    assert common.meta()["scripts_commit"] == f"{'a' * 40}+dirty ({common.ROOT})"
    assert common.meta()["commit"] == "b" * 40


def test_meta_records_the_commit_read_as_the_script_started(bench, monkeypatch, capsys):
    """``_common.meta()``, called after measuring, recorded the commit read then: a
    commit made while a CPU run measured was credited with every row (noted in sessions
    51 and 52). It records the one read as the script started (``_common``'s import), and
    the other as ``git_commit_after`` where they differ, saying so on stderr."""
    from chunkscan.commands import measure

    common = bench("_common")
    monkeypatch.delenv("CHUNKSCAN_COMMIT", raising=False)
    monkeypatch.setattr(measure, "device", lambda: "cpu")
    assert common._CODE_AT_START == measure.code_commit()  # read at the import
    assert "git_commit_after" not in common.meta()
    monkeypatch.setattr(common, "_CODE_AT_START", "1" * 40)
    monkeypatch.setattr(measure, "git_commit", lambda path: "2" * 40)
    got = common.meta()
    assert (got["commit"], got["git_commit_after"]) == ("1" * 40, "2" * 40)
    assert f"the checkout changed during the run ({'1' * 40} before, {'2' * 40} after)" in (
        capsys.readouterr().err
    )


def test_meta_names_the_scripts_checkout_with_chunkscan_commit_set(bench, monkeypatch):
    """With ``CHUNKSCAN_COMMIT`` set (a copied ``src/`` measured, as
    bench/results/README.md describes) ``scripts_commit`` was never recorded (found by
    probing): it is where the scripts' commit or state is not the one named, or their
    checkout is not chunkscan's; not where they agree, nor where git does not know the
    scripts (the device's tree)."""
    from chunkscan.commands import measure

    common = bench("_common")
    monkeypatch.setattr(measure, "device", lambda: "cpu")
    monkeypatch.setattr(common, "_checkout", lambda path: "/checkout")  # one checkout
    scripts = "a" * 40
    monkeypatch.setattr(measure, "git_commit", lambda path: scripts)
    monkeypatch.setattr(common, "_CODE_AT_START", None)  # (read as now)
    monkeypatch.setenv("CHUNKSCAN_COMMIT", "f25e49f")
    assert common.meta()["scripts_commit"] == f"{'a' * 40} ({common.ROOT})"
    assert common.meta()["commit"] == "f25e49f"
    monkeypatch.setenv("CHUNKSCAN_COMMIT", "aaaaaaa")  # the scripts' commit, short
    assert "scripts_commit" not in common.meta()
    scripts = "a" * 40 + "+dirty"  # the scripts' checkout changed since
    assert common.meta()["scripts_commit"] == f"{scripts} ({common.ROOT})"
    monkeypatch.setattr(common, "_checkout", lambda path: path if "src" in path else "/x")
    scripts = "a" * 40  # the same commit, but chunkscan imported from elsewhere
    assert "scripts_commit" in common.meta()
    scripts = "unknown"  # no git metadata (the device): nothing known, nothing recorded
    assert "scripts_commit" not in common.meta()


def test_meta_records_the_argv_main_parsed(bench, monkeypatch, tmp_path):
    """A script's ``main(argv)`` called in-process (by a test, by another script)
    recorded the caller's ``sys.argv`` as ``meta.argv`` (found by probing): it records
    ``["python", "bench/<script>.py", *argv]``, and ``lora.py``'s ``meta.commands`` the
    same command."""
    monkeypatch.setattr("sys.argv", ["the-caller", "--its-own", "options"])
    argv = ["--T", "16", "--gates", "0.5", "--chunk-sizes", "8", "--json",
            str(tmp_path / "gg.json")]  # fmt: skip
    assert bench("growth_gates").main(argv) == 0
    meta = json.loads((tmp_path / "gg.json").read_text())["meta"]
    assert meta["argv"] == ["python", "bench/growth_gates.py", *argv]
    import mlx_lm.models.qwen3_next as qwen3_next

    # lora's stub swaps the recurrence in this process (its measure runs here): restored
    monkeypatch.setattr(qwen3_next, "gated_delta_update", qwen3_next.gated_delta_update)
    from chunkscan.commands import measure

    lora = bench("lora")
    monkeypatch.setattr(measure, "run_isolated", lambda target, cfg, **k: lora.measure(**{
        k: v for k, v in cfg.items() if k != "repeats"}, repeats=1))  # fmt: skip
    argv = ["--T", "8", "--modes", "stub", "--repeats", "1", "--json", str(tmp_path / "l.json")]
    assert lora.main(argv) == 0
    meta = json.loads((tmp_path / "l.json").read_text())["meta"]
    assert meta["argv"] == ["python", "bench/lora.py", *argv]
    assert meta["commands"] == [" ".join(meta["argv"])]
    # and every script passes its own: meta(__file__, argv), run_side_by_side(...,
    # __file__, argv), never sys.argv
    import ast

    for path in sorted(BENCH.glob("*.py")):
        text = path.read_text()
        assert '"argv": sys.argv' not in text, path.name
        if path.name == "_common.py":
            continue
        for call in ast.walk(ast.parse(text)):
            name = getattr(getattr(call, "func", None), "id", None)
            if name in ("meta", "provenance", "run_side_by_side"):
                given = [getattr(a, "id", None) for a in call.args][-2:]
                assert given == ["__file__", "argv"], (path.name, call.lineno)


def test_cuda_scripts_write_under_the_checkouts_bench_out(bench):
    """``state_pass.py`` and ``tc_probe.py`` wrote to ``bench-out/`` of the folder run
    from; the others (and now they) to the checkout's (``_common.OUT``)."""
    out = bench("_common").OUT
    assert bench("state_pass").build_parser().parse_args([]).out == str(out / "state_pass.json")
    assert bench("tc_probe").build_parser().parse_args([]).out == str(out / "tc_probe.npz")
    assert out.is_absolute() and out.name == "bench-out"


def test_list_options_take_each_value_once(bench):
    """A value given twice in a list option counts once, in the order first given: a
    repeated impl was measured twice and its ratios taken against the last copy
    (``--impls mlx_lm chunkscan mlx_lm`` showed mlx_lm "1.71x" faster than itself; found
    by probing). Every list option of the benchmarks takes ``_common.Once``."""
    common = bench("_common")
    args = (
        bench("gated_delta")
        .build_parser()
        .parse_args(["--impls", "mlx_lm", "chunkscan", "mlx_lm", "--T", "64", "16", "64"])
    )
    assert (args.impls, args.T) == (["mlx_lm", "chunkscan"], [64, 16])
    args = bench("rwkv7").build_parser().parse_args(["--impls", "chunkscan", "chunkscan"])
    assert args.impls == ["chunkscan"]
    for script in sorted((pathlib.Path(common.__file__).parent).glob("*.py")):
        text = script.read_text()
        lists = re.findall(r'nargs="[+*]"(?!`)', text)  # (not the docstring's)
        assert len(lists) == len(re.findall(r'nargs="[+*]",\s*action=Once', text)), script.name


def test_the_plot_draws_a_line_per_save_mode(bench, tmp_path, monkeypatch):
    """``plot_time_and_memory`` draws one line per impl and save mode (``gated_delta.py
    --save chunks groups`` drew both modes as one zigzag "chunkscan" line; found by
    probing), each through its own points."""
    pyplot = pytest.importorskip("matplotlib.pyplot")
    drawn = {}

    class Axes:
        def plot(self, xs, ys, style, label, **kw):
            drawn.setdefault(label, []).append((list(xs), list(ys)))

        def __getattr__(self, name):  # the axes' other settings
            return lambda *a, **k: None

    class Figure(Axes):
        pass

    monkeypatch.setattr(pyplot, "subplots", lambda *a, **k: (Figure(), (Axes(), Axes())))
    monkeypatch.setattr(pyplot, "close", lambda fig: None)
    rows = [{"impl": "chunkscan", "T": T, "save": save, "s": s, "kib_per_token": 1.0}
            for T in (16, 32) for save, s in (("chunks", 1.0), ("groups", 2.0))]  # fmt: skip
    rows.append({"impl": "mlx_lm", "T": 16, "s": 3.0, "kib_per_token": 9.0})
    bench("_common").plot_time_and_memory(rows, tmp_path / "p.png", "t", ("chunkscan", "mlx_lm"),
                                          "s", "s")  # fmt: skip
    assert drawn["chunkscan (save=chunks)"][0] == ([16, 32], [1.0, 1.0])
    assert drawn["chunkscan (save=groups)"][0] == ([16, 32], [2.0, 2.0])
    assert drawn["mlx_lm"][0] == ([16], [3.0])
    # attention.py's several --scratch-mib values: a line each (one zigzag before;
    # found by review, session 47)
    drawn.clear()
    rows = [{"impl": "chunkscan", "T": T, "scratch_mib": m, "s": m, "kib_per_token": 1.0}
            for T in (16, 32) for m in (1.0, 32.0)]  # fmt: skip
    bench("_common").plot_time_and_memory(rows, tmp_path / "p.png", "t", ("chunkscan",), "s", "s")
    assert drawn["chunkscan (1 MiB scratch)"][0] == ([16, 32], [1.0, 1.0])
    assert drawn["chunkscan (32 MiB scratch)"][0] == ([16, 32], [32.0, 32.0])


def test_result_files_are_strict_json_and_read_back(bench, tmp_path):
    """A non-finite figure (``growth_gates``' NaN where nothing is finite) is written as
    its name, not a bare ``NaN`` that strict parsers refuse, and ``read_saved`` gives the
    float back: the negative control is ``json.dumps``' own output, which the strict
    reading refuses."""
    common = bench("_common")
    rows = [{"impl": "chunkscan", "err": float("nan"), "hi": float("inf"), "lo": -math.inf,
             "name": "nan-free", "ok": 1.5}]  # fmt: skip
    path = tmp_path / "r.json"
    common.write_json(path, {"argv": ["--json", "nan"]}, rows)

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    with pytest.raises(ValueError, match="not strict JSON"):
        json.loads(json.dumps({"rows": rows}), parse_constant=refuse)
    saved = json.loads(path.read_text(), parse_constant=refuse)
    assert saved["rows"][0] == dict(rows[0], err="nan", hi="inf", lo="-inf")
    data = common.read_saved(argparse.ArgumentParser(), "--from-json", str(path), keys=("rows",))
    back = data["rows"][0]
    assert math.isnan(back.pop("err"))
    assert back == {k: v for k, v in rows[0].items() if k != "err"}
    # only the rows' values: an argv naming a file "nan" stays a string (review)
    assert data["meta"]["argv"] == ["--json", "nan"]


@pytest.mark.parametrize("script", ["gated_delta", "mamba2", "linear_attention"])
def test_a_run_that_measured_nothing_exits_1(script, bench, tmp_path, monkeypatch, capsys):
    """Every configuration failed (timed out, crashed): the scripts exited 0, so a batch
    of runs could not tell (found by probing, session 49). Now 1, said on stderr; with one
    row measured beside a failed one (a result: the baseline out of memory) still 0."""
    from chunkscan.commands import measure

    rows = iter([{"error": "timed out after 0.001 s"}] * 2)
    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: dict(next(rows)))
    argv = ["--T", "16", "--json", str(tmp_path / "r.json"), "--md", str(tmp_path / "r.md")]
    argv += ["--png", ""] if script == "gated_delta" else []
    argv += ["--impls", "chunkscan", "mlx_lm"] if script != "linear_attention" else [
        "--impls", "chunkscan", "mlx_lm_loop"]  # fmt: skip
    assert bench(script).main(argv) == 1
    assert "every configuration failed" in capsys.readouterr().err
    measured = {"seconds": 1.0, "kib_per_token": 1.0, "peak_mib": 1.0, "peak_bytes": 1}
    rows = iter([{"error": "out of memory"}, measured])
    assert bench(script).main(argv) == 0


def test_openblas_is_checked_before_anything(bench, tmp_path, capsys, no_measuring):
    """``--openblas`` naming no file came at the first measurement (exit 1, the output
    folder made), and a file that is not a library was preloaded in name only: the
    loader dropped it and the run said "OpenBLAS preloaded" (found by probing, session
    49). Both refused with exit 2 before any output; a real library passes the check."""
    out = tmp_path / "out"
    fake = tmp_path / "fake.so"
    fake.write_text("not a library")
    argv = ["--T", "16", "--json", str(out / "r.json"), "--png", "", "--md", ""]
    for value, message in ((str(tmp_path / "none.so"), "no such file"),
                           (str(fake), "is not a shared library")):  # fmt: skip
        err = refused(bench("gated_delta"), [*argv, "--openblas", value], capsys)
        assert f"argument --openblas {value}" in err and message in err, err
    assert not out.exists()
    elf = tmp_path / "libelf.so"  # the negative control: a file with an ELF header passes
    elf.write_bytes(b"\x7fELF" + bytes(60))
    assert bench("gated_delta")._find_openblas(str(elf)) == str(elf.resolve())
