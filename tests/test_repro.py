"""chunkscan repro: the command runs end to end and writes its table, JSON and plot."""

import json
import math
import os
import pathlib
import re
import subprocess
import sys
import time

import mlx.core as mx
import numpy as np
import pytest

from chunkscan.commands import measure, reporter, repro


def test_repro_command_end_to_end(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        "-m",
        "chunkscan",
        "repro",
        "--T",
        "32",
        "64",
        "--H",
        "2",
        "--D",
        "16",
        "--chunk",
        "8",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| qkv | cs.scan |" in proc.stdout and "[20/20]" in proc.stdout
    data = json.loads((out / "repro.json").read_text())
    assert len(data["rows"]) == 20 and all("peak_mib" in r for r in data["rows"])
    # Every non-plain row (T <= --check-max-T) was compared with plain autograd; the
    # plain rows are the reference and carry no difference. Measured: 0.0 on the CPU
    # (the same float32 operations in the same order); 1e-6 is ~10 float32 epsilons.
    compared = [r for r in data["rows"] if r["mode"] != "plain"]
    assert len(compared) == 16
    assert all(r["max_grad_diff"] <= 1e-6 for r in compared), compared
    plain = [r for r in data["rows"] if r["mode"] == "plain"]
    assert all(r["reference"] and "max_grad_diff" not in r for r in plain)
    assert "| (reference) |" in proc.stdout and data["meta"]["modes"] == list(repro.MODES)
    pytest.importorskip("matplotlib", reason="the PNG needs the bench extra")
    assert (out / "repro.png").stat().st_size > 10_000


def test_gradient_comparison_can_fail(tmp_path):
    """measure() really compares: a wrong saved reference shows as a large difference."""
    config = dict(grads="qkv", T=16, H=1, D=8, chunk=4, ref_dir=str(tmp_path))
    assert repro.measure("plain", **config)["reference"]  # saves the reference
    assert repro.measure("cs.scan", **config)["max_grad_diff"] <= 1e-6
    (path,) = tmp_path.glob("*.npz")
    saved = mx.load(str(path))
    mx.savez(str(path), *[1.5 * saved[f"arr_{i}"] for i in range(len(saved))])
    assert repro.measure("cs.scan", **config)["max_grad_diff"] >= 0.3  # |1 - 1/1.5|


def test_table_marks_failures_and_missing_cells():
    rows = [
        {"mode": "cs.scan", "grads": "qkv", "T": 8, "peak_mib": 1.0, "seconds": 0.5},
        {"mode": "plain", "grads": "qkv", "T": 16, "error": "exit -9: killed (out of memory?)"},
    ]
    table = repro.format_table(rows, [8, 16])
    assert "| qkv | plain | - | fail | - | fail | n/a |" in table
    # measured, never compared (a T above --check-max-T): said so (it read "n/a")
    assert "| qkv | cs.scan | 1.0 | - | 0.50 | - | not compared (T above --check-max-T) |" in table


@pytest.fixture
def no_measuring(monkeypatch):
    def never(*a, **k):
        raise AssertionError("a configuration was measured")

    monkeypatch.setattr(measure, "run_isolated", never)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--T", "0"], "argument --T: must be a positive integer below 2**31 but got 0"),
        (["--T", "64", "-5"], "argument --T: must be a positive integer below 2**31 but got -5"),
        (["--chunk", "0"], "argument --chunk: must be a positive integer but got 0"),
        (["--repeats", "0"], "argument --repeats: must be a positive integer but got 0"),
        (["--H", "0"], "argument --H: must be a positive integer below 2**31 but got 0"),
        (["--D", "two"], "argument --D: must be a positive integer below 2**31 but got 'two'"),
        (["--check-max-T", "-1"], "argument --check-max-T: must be an integer >= 0 but got -1"),
        (
            ["--timeout", "0"],
            "argument --timeout: must be a positive number of seconds up to 2000000 but got 0.0",
        ),
        (
            ["--timeout", "inf"],
            "argument --timeout: must be a positive number of seconds up to 2000000 but got inf",
        ),
        # past subprocess's limit: an OverflowError at the first configuration (probing)
        (
            ["--timeout", "1e9"],
            "argument --timeout: must be a positive number of seconds up to "
            "2000000 but got 1000000000.0",
        ),
        # past MLX's 32-bit shapes: every configuration failed (probing)
        (
            ["--T", str(2**31)],
            f"argument --T: must be a positive integer below 2**31 but got {2**31}",
        ),
        (
            ["--D", "3000000000"],
            "argument --D: must be a positive integer below 2**31 but got 3000000000",
        ),
        # int() reads these as 50 and 3 (found by probing)
        (["--T", "5_0"], "argument --T: must be a positive integer below 2**31 but got '5_0'"),
        (
            ["--T", "\u0663"],
            "argument --T: must be a positive integer below 2**31 but got '\u0663'",
        ),
    ],
    ids=[
        "T0",
        "T-neg",
        "chunk0",
        "repeats0",
        "H0",
        "D-text",
        "check-neg",
        "timeout0",
        "inf",
        "timeout-overflow",
        "T-32-bit",
        "D-32-bit",
        "underscore",
        "arabic-indic",
    ],  # fmt: skip
)
def test_bad_arguments_fail_before_measuring(argv, message, tmp_path, capsys, no_measuring):
    with pytest.raises(SystemExit) as info:
        repro.main(argv + ["--out", str(tmp_path)])
    assert info.value.code == 2
    assert f"chunkscan repro: error: {message}" in capsys.readouterr().err


def test_unwritable_out_fails_before_measuring(tmp_path, capsys, no_measuring):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as info:
        repro.main(["--T", "8", "--out", str(blocker / "out")])
    assert info.value.code == 2
    assert (
        f"chunkscan repro: error: argument --out: cannot write to '{blocker / 'out'}' "
        "(NotADirectoryError: Not a directory)"
    ) in capsys.readouterr().err


def test_an_out_that_is_a_file_says_out_names_a_folder(tmp_path, capsys, no_measuring):
    """``--out afile`` said only "FileExistsError: File exists" (found by probing)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    with pytest.raises(SystemExit) as info:
        repro.main(["--T", "8", "--out", str(afile)])
    assert info.value.code == 2
    assert f"{afile} is not a folder; --out names the folder the report goes into" in (
        capsys.readouterr().err
    )


def test_a_checkout_changed_during_the_run_is_recorded(tmp_path, monkeypatch, capsys):
    """The commit is read before the configurations run, and again after: where they
    differ the JSON keeps both and the run says so (it read the commit after the run,
    naming code that measured none of the rows before a commit made meanwhile; found
    by probing, session 51)."""
    ran = []  # a commit made while the configurations run

    def measured(*args, **kwargs):
        ran.append(1)
        return {"peak_mib": 1.0, "seconds": 0.1}

    monkeypatch.setattr(measure, "git_commit", lambda path: "2222222" if ran else "1111111")
    monkeypatch.delenv("CHUNKSCAN_COMMIT", raising=False)
    monkeypatch.setattr(measure, "run_isolated", measured)
    argv = ["--T", "8", "--modes", "cs.scan", "--grads", "state", "--no-plot"]
    assert repro.main(argv + ["--out", str(tmp_path)]) == 0
    meta = json.loads((tmp_path / "repro.json").read_text())["meta"]
    assert (meta["commit"], meta["git_commit_after"]) == ("1111111", "2222222")
    assert "the checkout changed during the run (1111111 before, 2222222 after)" in (
        capsys.readouterr().err
    )


def test_out_under_the_home_folder_is_expanded(tmp_path, monkeypatch, capsys):
    """``--out '~/x'`` made a folder named ``~`` in the working folder (found by
    probing); it is the home folder's ``x``."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: {"peak_mib": 1.0,
                                                                 "seconds": 0.1})  # fmt: skip
    assert repro.main(["--T", "8", "--modes", "cs.scan", "--no-plot", "--out", "~/x"]) == 0
    assert (tmp_path / "home" / "x" / "repro.json").is_file() and not (tmp_path / "~").exists()


@pytest.mark.parametrize("name", repro.OUTPUTS)
def test_an_output_that_is_a_folder_fails_before_measuring(name, tmp_path, capsys,
                                                          no_measuring):  # fmt: skip
    """A folder where the JSON or the plot goes failed only after every configuration
    had been measured, losing them (found by probing)."""
    (tmp_path / name).mkdir()
    with pytest.raises(SystemExit) as info:
        repro.main(["--T", "8", "--out", str(tmp_path)])
    assert info.value.code == 2
    assert f"{tmp_path / name} is not a file; remove it or pass another --out" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize("name", repro.OUTPUTS)
def test_an_output_that_is_a_link_fails_before_measuring(name, tmp_path, capsys,
                                                        no_measuring):  # fmt: skip
    """A link where the JSON goes was written through, into the file it named, and one
    where the plot goes was replaced (found by probing): refused, leaving the file the
    link names as it was."""
    victim = tmp_path / "victim.txt"
    victim.write_text("mine")
    out = tmp_path / "out"
    out.mkdir()
    (out / name).symlink_to(victim)
    with pytest.raises(SystemExit) as info:
        repro.main(["--T", "8", "--out", str(out)])
    assert info.value.code == 2
    assert f"{out / name} is a symbolic link; remove it or pass another --out" in (
        capsys.readouterr().err
    )
    assert victim.read_text() == "mine"


def test_no_stale_plot_beside_a_new_json(tmp_path, monkeypatch, capsys):
    """``--no-plot`` (or a run that measured nothing) left an earlier run's plot beside
    the new JSON (found by probing); an empty plot was drawn where nothing was measured."""
    argv = ["--T", "8", "--modes", "cs.scan", "--grads", "state", "--out", str(tmp_path)]
    png = tmp_path / "repro.png"
    png.write_text("an earlier run's plot")
    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: {"error": "exit 1: failed"})
    assert repro.main(argv) == 1
    assert not png.exists()
    assert "nothing was measured: no plot" in capsys.readouterr().err
    png.write_text("an earlier run's plot")
    monkeypatch.setattr(measure, "run_isolated",
                        lambda *a, **k: {"peak_mib": 1.0, "seconds": 0.1})  # fmt: skip
    assert repro.main(argv + ["--no-plot"]) == 0
    assert not png.exists() and (tmp_path / "repro.json").is_file()


def test_exit_status_is_1_when_a_configuration_fails(tmp_path, capsys, monkeypatch):
    def fake(target, config, **kw):
        if config["mode"] == "plain":
            return {"error": "exit -9: killed (out of memory?)"}
        return {"peak_mib": 1.0, "seconds": 0.1, "max_grad_diff": 0.0}

    monkeypatch.setattr(measure, "run_isolated", fake)
    argv = ["--T", "8", "--modes", "plain", "cs.scan", "--grads", "state", "--no-plot"]
    assert repro.main(argv + ["--out", str(tmp_path)]) == 1
    err = capsys.readouterr().err
    assert (
        "chunkscan repro: 1 of 2 configurations and 0 reference runs failed:\n"
        "  state plain T=8: exit -9: killed (out of memory?)"
    ) in err
    data = json.loads((tmp_path / "repro.json").read_text())
    assert len(data["rows"]) == 2
    assert (data["meta"]["modes"], data["meta"]["grads"]) == (["plain", "cs.scan"], ["state"])
    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: fake(None, {"mode": "x"}))
    assert repro.main(argv + ["--out", str(tmp_path)]) == 0
    # a gradient NaN or off plain autograd's fails the run too (exit 0 before; found by
    # probing); one within GRAD_TOLERANCE does not
    for diff, status in ((math.nan, 1), (0.5, 1), (repro.GRAD_TOLERANCE, 0)):
        row = {"peak_mib": 1.0, "seconds": 0.1, "max_grad_diff": diff}
        monkeypatch.setattr(measure, "run_isolated", lambda *a, row=row, **k: dict(row))
        capsys.readouterr()
        assert repro.main(argv + ["--out", str(tmp_path)]) == status, diff
        if status:
            assert "off plain autograd's" in capsys.readouterr().err
        # strict JSON: a NaN difference is written as "nan", not a bare NaN
        saved = json.loads((tmp_path / "repro.json").read_text(), parse_constant=_refuse)
        assert saved["rows"][0]["max_grad_diff"] == (diff if diff == diff else "nan")


def _refuse(name):
    raise ValueError(f"not strict JSON: {name}")


def test_a_nan_gradient_error_shows_as_nan():
    """Python's ``max`` drops a NaN that does not come first: a NaN in one gradient (dk
    of three) read as 0.0 in the table, and exit 0 (found by probing)."""
    assert math.isnan(repro.worst([0.0, math.nan, 0.0]))
    assert repro.worst([1e-7, 3e-7]) == 3e-7
    rows = [
        {"mode": "cs.scan", "grads": "qkv", "T": 8, "peak_mib": 1.0, "seconds": 0.5,
         "max_grad_diff": 0.0},
        {"mode": "cs.scan", "grads": "qkv", "T": 16, "peak_mib": 2.0, "seconds": 0.5,
         "max_grad_diff": math.nan},
    ]  # fmt: skip
    assert repro.format_table(rows, [8, 16]).endswith("| nan |")


def test_a_failed_reference_keeps_the_row(tmp_path):
    """Where plain autograd failed (out of memory, what the report shows) the other
    modes recomputed it in their own process after measuring, and a crash there lost
    their row ("fail"; found by probing). Now the row keeps its figures and says that
    there was no reference."""
    config = dict(grads="qkv", T=16, H=1, D=8, chunk=4, ref_dir=str(tmp_path))
    row = repro.measure("cs.scan", **config)  # no saved reference in ref_dir
    assert row["check"] == "no reference: plain autograd failed" and row["peak_mib"] > 0
    assert "max_grad_diff" not in row
    row.update(mode="cs.scan", grads="qkv", T=16)
    assert repro.format_table([row], [16]).endswith("| no reference |")
    # beside a T that was checked, the worst difference says which T it does not cover
    # (it read as covering every T; found by probing)
    checked = dict(row, T=8, max_grad_diff=0.0)
    del checked["check"]
    table = repro.format_table([checked, row], [8, 16])
    assert table.endswith("| 0.0e+00 (not checked at T=16: no reference) |"), table
    # a T above --check-max-T, measured and not compared: said as well (found by
    # probing: the README's command's table read as covering T = 4096)
    beyond = {k: v for k, v in row.items() if k != "check"}
    table = repro.format_table([checked, beyond], [8, 16])
    assert table.endswith("| 0.0e+00 (not compared at T=16: --check-max-T) |"), table
    # none compared (--check-max-T 0): it said "n/a", no reason (probing, session 40)
    table = repro.format_table([beyond], [16])
    assert table.endswith("| not compared (T above --check-max-T) |"), table


def test_an_interrupted_run_leaves_no_reference_folder(tmp_path, monkeypatch):
    """Ctrl-C while measuring left ``$TMPDIR/chunkscan-repro-*`` behind, with the plain
    gradients kept for the comparison (found by probing)."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))

    def interrupted(target, config, **kw):
        assert os.path.isdir(config["ref_dir"])
        raise KeyboardInterrupt

    monkeypatch.setattr(repro._measure, "run_isolated", interrupted)
    with pytest.raises(KeyboardInterrupt):
        repro.main(["--T", "8", "--out", str(tmp_path / "out")])
    assert not [p for p in os.listdir(tmp_path) if p.startswith("chunkscan-repro-")]
    # through the chunkscan command: status 130 and a line, not a traceback (probing)
    from chunkscan.commands import cli

    assert cli.main(["repro", "--T", "8", "--out", str(tmp_path / "out")]) == 130
    assert not [p for p in os.listdir(tmp_path) if p.startswith("chunkscan-repro-")]
    import signal

    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # restored after the command


def test_a_terminated_run_leaves_no_reference_folder(tmp_path):
    """SIGTERM (``timeout``'s signal) ended the process at once, leaving
    ``$TMPDIR/chunkscan-repro-*`` (found by probing); now it exits 143 through the same
    cleanup as Ctrl-C. Negative control: with SIGTERM's default action restored in the
    command's process, the folder stays."""
    import signal

    def run(default_action: bool) -> tuple[int, list[str]]:
        tmp = tmp_path / ("default" if default_action else "handled")
        tmp.mkdir()
        prelude = ("import signal, chunkscan.commands.cli as c; "
                   "c._exit_on_sigterm = lambda: False; " if default_action else
                   "import chunkscan.commands.cli as c; ")  # fmt: skip
        code = prelude + "import sys; sys.exit(c.main(sys.argv[1:]))"
        argv = ["repro", "--T", "64", "128", "--H", "1", "--D", "8", "--no-plot",
                "--out", str(tmp / "out")]  # fmt: skip
        env = dict(os.environ, TMPDIR=str(tmp))
        proc = subprocess.Popen([sys.executable, "-c", code, *argv], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not any(
            p.startswith("chunkscan-repro-") for p in os.listdir(tmp)
        ):
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
        return code, [p for p in os.listdir(tmp) if p.startswith("chunkscan-repro-")]

    assert run(default_action=False) == (143, [])
    code, left = run(default_action=True)
    assert code == -signal.SIGTERM and left


def test_references_run_apart_where_plain_is_not_a_mode(tmp_path, monkeypatch, capsys):
    """Without plain among the modes, one reference run per (gradients, T) up to
    --check-max-T, in a process of its own and with no row; repeated list entries run
    once."""
    calls = []

    def fake(target, config, **kw):
        calls.append(config)
        if config.get("reference_only"):
            return {"reference": True}
        return {"peak_mib": 1.0, "seconds": 0.1, "max_grad_diff": 0.0}

    monkeypatch.setattr(measure, "run_isolated", fake)
    argv = ["--T", "8", "8", "64", "--check-max-T", "32", "--modes", "cs.scan", "cs.scan",
            "--grads", "state", "--no-plot", "--out", str(tmp_path)]  # fmt: skip
    assert repro.main(argv) == 0
    refs = [c for c in calls if c.get("reference_only")]
    assert [(c["mode"], c["T"]) for c in refs] == [("plain", 8)]
    assert calls.index(refs[0]) == 0 and len(calls) == 3  # the reference, then T = 8, 64
    data = json.loads((tmp_path / "repro.json").read_text())
    assert [r["T"] for r in data["rows"]] == [8, 64] and data["meta"]["modes"] == ["cs.scan"]
    # A failed reference run fails the command (before, each row recomputed it, and a
    # crash there failed that row): exit 1, named (found by probing).
    calls.clear()

    def reference_fails(target, config, **kw):
        return {"error": "exit 3: "} if config.get("reference_only") else fake(target, config)

    monkeypatch.setattr(measure, "run_isolated", reference_fails)
    assert repro.main(argv) == 1
    assert "  state plain autograd (reference) T=8: exit 3: " in capsys.readouterr().err


def test_provenance_names_no_commit_of_another_repository(tmp_path, monkeypatch):
    """A copy of the package inside someone else's git repository (an install into
    their project) recorded that repository's commit (found by probing). It records
    only a commit of a repository that tracks the package's files; here this tree's."""
    import shutil

    import chunkscan

    monkeypatch.delenv("CHUNKSCAN_COMMIT", raising=False)
    ours = measure.provenance()["commit"]
    repo = tmp_path / "project"
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=x"]
    try:
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        subprocess.run(git + ["commit", "-q", "--allow-empty", "-m", "theirs"], check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git here")
    shutil.copytree(pathlib.Path(chunkscan.__file__).parent, repo / "site" / "chunkscan")
    code = "import chunkscan.commands.measure as m; print(m.provenance()['commit'])"
    env = {k: v for k, v in os.environ.items() if k != "CHUNKSCAN_COMMIT"}
    env["PYTHONPATH"] = str(repo / "site")
    copied = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                            text=True, check=True).stdout.strip()  # fmt: skip
    assert copied == "unknown"
    if ours != "unknown":  # this tree is a git checkout: its commit
        here = pathlib.Path(chunkscan.__file__).parent
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=here
        ).stdout.strip()
        assert ours.startswith(head)


def test_provenance_dirty_means_the_code_not_committed_outputs(tmp_path):
    """A rewritten (or new) result under ``bench/results/`` leaves the commit clean; a
    changed source, or an untracked script, marks it ``+dirty``. (Each run of a batch
    rewrote its own committed file, so every later command recorded ``+dirty``: 14 CPU
    results did.)"""
    import shutil

    import chunkscan

    repo = tmp_path / "repo"
    git = ["git", "-C", str(repo), "-c", "user.email=a@b", "-c", "user.name=x"]
    shutil.copytree(pathlib.Path(chunkscan.__file__).parent, repo / "src" / "chunkscan",
                    ignore=shutil.ignore_patterns("__pycache__"))  # fmt: skip
    result = repo / "bench" / "results" / "r.json"
    result.parent.mkdir(parents=True)
    result.write_text("{}")
    (repo / ".gitignore").write_text("__pycache__/\n")
    try:
        subprocess.run(["git", "init", "-q", str(repo)], check=True)
        subprocess.run(git + ["add", "-A"], check=True)
        subprocess.run(git + ["commit", "-q", "-m", "x"], check=True)
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("no git here")
    code = "import chunkscan.commands.measure as m; print(m.provenance()['commit'])"
    env = {k: v for k, v in os.environ.items() if k != "CHUNKSCAN_COMMIT"}
    env["PYTHONPATH"] = str(repo / "src")

    def commit():
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()  # fmt: skip

    result.write_text('{"rows": []}')
    assert len(commit()) == 40  # clean: the output is not the code
    script = result.parent / "run.sh"  # a run script there is code
    script.write_text("echo 1\n")
    subprocess.run(git + ["add", "-A"], check=True)
    subprocess.run(git + ["commit", "-q", "-m", "y"], check=True)
    script.write_text("echo 2\n")
    assert commit().endswith("+dirty")
    subprocess.run(git + ["checkout", "-q", "--", str(script)], check=True)
    assert len(commit()) == 40
    (result.parent / "new.json").write_text("{}")  # a new output: not the code either
    assert len(commit()) == 40
    mine = repo / "bench" / "mine.py"  # a script no commit holds (recorded clean before;
    mine.write_text("pass\n")  # found by probing)
    assert commit().endswith("+dirty")
    mine.unlink()
    with open(repo / "src" / "chunkscan" / "split.py", "a") as f:
        f.write("# changed\n")
    assert commit().endswith("+dirty")


def test_a_process_ended_by_a_signal_names_it():
    """A configuration that crashed (a segfault) gave ``exit -11:`` and no reason."""
    import signal

    from helpers import run_target

    assert run_target("die_by_signal", {"number": int(signal.SIGSEGV)}) == {
        "error": "exit -11: killed by SIGSEGV"
    }
    assert run_target("die_by_signal", {"number": int(signal.SIGKILL)}) == {
        "error": "exit -9: killed (out of memory?)"
    }


def test_reporter_refuses_an_unknown_mode_or_gradient():
    """``bench/scan_time.py --modes foo`` timed ``cs.checkpoint``'s loop under the name
    foo, and any grads name but "state" the q, k, v gradients (found by probing)."""
    s0, q, k, v = reporter.make_inputs(4, 1, 2)
    with pytest.raises(ValueError, match=re.escape("mode must be one of plain, mx.checkpoint")):
        reporter.forward("cs.scna", s0, q, k, v, 2, state_only=False)
    with pytest.raises(ValueError, match=re.escape("grads must be one of state, qkv but got")):
        reporter.gradient_fn("cs.scan", "q", 2, compiled=False)


def test_reporter_recurrence_is_the_issues():
    """The reporter's recurrence against the issue's formula in NumPy (every test used
    ``reporter.step`` as its own reference: a changed decay, sign or key scale passed;
    mutation audit): ``s = 0.95 s + (v - s k) k^T``, ``y = s q``."""
    s0, q, k, v = reporter.make_inputs(6, 2, 4, seed=3)
    s, y = reporter.forward("plain", s0, q, k, v, 2, state_only=False)
    S = np.array(s0, dtype=np.float64)
    Q, K, V = (np.array(a, dtype=np.float64) for a in (q, k, v))
    ys = []
    for t in range(6):
        S = 0.95 * S
        S = S + np.einsum("hi,hj->hij", V[t] - np.einsum("hij,hj->hi", S, K[t]), K[t])
        ys.append(np.einsum("hij,hj->hi", S, Q[t]))
    assert np.allclose(np.array(s), S, rtol=1e-5, atol=1e-6)
    assert np.allclose(np.array(y), np.stack(ys), rtol=1e-5, atol=1e-6)
    ks = np.array(mx.random.normal((6, 2, 4), key=mx.random.split(mx.random.key(3), 4)[2]))
    assert np.allclose(np.array(k), 0.05 * ks)  # k scaled by 0.05, as documented


def test_reporter_modes_use_the_checkpoint_they_name(monkeypatch):
    """``cs.checkpoint`` and ``cs.checkpoint+split`` wrap chunkscan's checkpoint, and
    only ``mx.checkpoint`` MLX's (a swap would print MLX's peak as chunkscan's)."""
    calls = []
    real = mx.checkpoint
    monkeypatch.setattr(mx, "checkpoint", lambda f: calls.append(f) or real(f))
    s0, q, k, v = reporter.make_inputs(4, 1, 2)
    for mode in ("cs.checkpoint", "cs.checkpoint+split", "cs.scan", "plain"):
        reporter.forward(mode, s0, q, k, v, 2, state_only=False)
    assert calls == []
    reporter.forward("mx.checkpoint", s0, q, k, v, 2, state_only=False)
    assert len(calls) == 1


def test_peak_above_active_measures_the_call_alone():
    """The peak of a small call after a large one is the small call's (without the reset
    it read the earlier call's peak; mutation audit)."""
    _, big = measure.peak_above_active(lambda: mx.zeros((64, 1 << 20)) + 1)
    _, small = measure.peak_above_active(lambda: mx.zeros((64, 1 << 10)) + 1)
    assert big >= 64 * (1 << 20) * 4 and 0 < small < big / 100


def test_provenance_keeps_gits_commit_beside_a_disagreeing_override(monkeypatch):
    """``CHUNKSCAN_COMMIT`` names the code of a tree copied without git; left set in a
    checkout it named other code than ran (noted in session 46). Where git knows the
    tree and names another commit or state, ``git_commit`` records git's too."""
    monkeypatch.setattr(measure, "git_commit", lambda path: "a" * 40 + "+dirty")
    for given, kept in (("b" * 7, True), ("a" * 7, True), ("a" * 7 + "+dirty", False),
                        ("a" * 40 + "+dirty", False)):  # fmt: skip
        monkeypatch.setenv("CHUNKSCAN_COMMIT", given)
        meta = measure.provenance()
        assert meta["commit"] == given
        assert meta.get("git_commit") == ("a" * 40 + "+dirty" if kept else None), given
    monkeypatch.setattr(measure, "git_commit", lambda path: "unknown")  # no git: no key
    assert "git_commit" not in measure.provenance()
    monkeypatch.delenv("CHUNKSCAN_COMMIT")
    assert "git_commit" not in measure.provenance()


def test_provenance_records_the_settings_and_threads(monkeypatch):
    """The ``MLX_*`` and ``CHUNKSCAN_*`` variables set, and the threads the products
    use, not the cap (dropping MLX_* or recording MAX_THREADS passed; mutation audit)."""
    from chunkscan.ops import _cpu_threads

    monkeypatch.setenv("MLX_ENABLE_TF32", "0")
    monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", "1")
    meta = measure.provenance()
    assert meta["env"]["MLX_ENABLE_TF32"] == "0" and meta["env"]["CHUNKSCAN_CPU_THREADS"] == "1"
    assert meta["cpu_threads"] == 1 != _cpu_threads.MAX_THREADS
    # a value refused is recorded as such: provenance is written after measuring, and
    # it raised there, losing every result (found by probing)
    for bad in ("abc", "0"):
        monkeypatch.setenv("CHUNKSCAN_CPU_THREADS", bad)
        meta = measure.provenance()
        assert meta["cpu_threads"].startswith("refused: [chunkscan]"), meta["cpu_threads"]
        assert meta["env"]["CHUNKSCAN_CPU_THREADS"] == bad


def test_the_demo_model_is_the_same_in_every_process():
    """``build_model(config, seed)`` seeds MLX itself: the same weights whatever the
    random state before (without the seed two processes differed; mutation audit)."""
    from mlx.utils import tree_flatten

    from chunkscan.commands import demo_model

    config = demo_model.tiny_config()
    mx.random.seed(1)
    a = dict(tree_flatten(demo_model.build_model(config, seed=0).parameters()))
    mx.random.seed(2)
    b = dict(tree_flatten(demo_model.build_model(config, seed=0).parameters()))
    assert a.keys() == b.keys() and all(mx.array_equal(a[k], b[k]).item() for k in a)


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_measuring_processes_ignore_modules_in_the_working_folder(tmp_path, monkeypatch):
    """``python -m`` put the working folder first on the measuring process's path: a
    ``statistics.py`` there failed every configuration of ``chunkscan repro`` (found by
    probing). The negative control runs the same with ``PYTHONSAFEPATH`` cleared."""
    (tmp_path / "statistics.py").write_text("raise ImportError('a module of the user')\n")
    monkeypatch.chdir(tmp_path)
    config = dict(grads="qkv", T=8, H=1, D=4, chunk=4, check_max_T=0)
    row = measure.run_isolated("chunkscan.commands.repro:measure", dict(config, mode="cs.scan"))
    assert "error" not in row and row["peak_mib"] >= 0, row
    row = measure.run_isolated("chunkscan.commands.repro:measure", dict(config, mode="cs.scan"),
                               env={"PYTHONSAFEPATH": ""})  # fmt: skip
    assert "a module of the user" in row.get("error", ""), row


def test_device_names_a_gpu_only_when_mlx_runs_on_it(tmp_path, monkeypatch):
    """``provenance()``'s device line names the GPU (``nvidia-smi``) where MLX runs on
    one (``chunkscan repro`` recorded no name), not on a CPU run of a machine that has
    one (found by review; a stub ``nvidia-smi`` stands for it here)."""
    stub = tmp_path / "nvidia-smi"
    stub.write_text("#!/bin/sh\necho 'A FAKE GPU'\n")
    stub.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.cpu))
    assert "A FAKE GPU" not in measure.device()
    assert measure.provenance()["device"].startswith("Device(cpu")
    monkeypatch.setattr(mx, "default_device", lambda: mx.Device(mx.gpu))
    assert measure.device().startswith("Device(gpu, 0) (A FAKE GPU)")


def test_measuring_processes_import_the_callers_copy_of_chunkscan(tmp_path):
    """A run of another checkout's ``src`` (``PYTHONPATH=<copy>/src``) recorded that copy's
    commit while every measuring process imported the installed copy (found by probing,
    session 48). The caller's folder now comes first; the control: a process started
    as before (the caller's environment alone) imports the installed one."""
    import shutil

    copy = tmp_path / "copy" / "src"
    shutil.copytree(pathlib.Path(measure.__file__).parents[1], copy / "chunkscan")
    (tmp_path / "where.py").write_text(
        "import chunkscan\n\ndef where():\n    return {'file': chunkscan.__file__}\n"
    )
    script = (
        "import json, sys, chunkscan\n"
        "from chunkscan.commands import measure\n"
        f"print(json.dumps(measure.run_isolated('where:where', {{}}, env={{'PYTHONPATH': "
        f"{str(tmp_path)!r}}})))\n"
    )
    env = dict(os.environ, PYTHONPATH=str(copy), PYTHONSAFEPATH="1")
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout  # fmt: skip
    assert json.loads(out.splitlines()[-1])["file"].startswith(str(copy)), out
    control = subprocess.run(
        [sys.executable, "-c", "import chunkscan; print(chunkscan.__file__)"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path), PYTHONSAFEPATH="1"),
        capture_output=True, text=True, timeout=120, check=True,
    ).stdout  # fmt: skip
    assert not control.strip().startswith(str(copy)), control


def test_a_closed_stdout_does_not_stop_the_run(tmp_path):
    """``chunkscan repro | head -1``: the progress line after the reader left raised
    ``BrokenPipeError``, and the configurations measured were lost, no ``repro.json``
    (found by probing, session 49). Now stdout goes to ``os.devnull`` and the run ends
    as usual. Negative control: ``repro._say`` as a plain print, without the command's
    stdout guard, raises again."""

    def run(plain_print: bool) -> tuple[int, bool, str]:
        out = tmp_path / ("plain" if plain_print else "said") / "out"
        prelude = ("import contextlib, chunkscan.commands.repro as r; r._say = lambda t: "
                   "print(t, flush=True); r.guarded_stdout = contextlib.nullcontext; "
                   if plain_print else "")  # fmt: skip
        code = prelude + "import sys, chunkscan.commands.cli as c; sys.exit(c.main(sys.argv[1:]))"
        argv = ["repro", "--T", "4", "--H", "1", "--D", "2", "--modes", "cs.scan", "--grads",
                "qkv", "--no-plot", "--out", str(out)]  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)  # fmt: skip
        proc.stdout.readline()  # the banner, then the reader leaves
        proc.stdout.close()
        err = proc.stderr.read()
        return proc.wait(timeout=120), (out / "repro.json").is_file(), err

    assert run(plain_print=False)[:2] == (0, True)
    code, written, err = run(plain_print=True)
    assert code != 0 and not written and "BrokenPipeError" in err


@pytest.mark.parametrize("mode", ["mx.checkpoint", "cs.checkpoint"])
def test_a_chunk_past_32_bit_slices_runs_the_slicing_modes(mode):
    """``--chunk 2147483648`` ran cs.scan and split's mode and failed the slicing ones
    (``Slice indices must be 32-bit integers``; found by probing, session 49): their
    slices now end within T. The values are the plain loop's."""
    q, k, v = (mx.random.normal((5, 1, 2), key=mx.random.key(i)) for i in range(3))
    s0 = mx.zeros((1, 2, 2))
    s, y = reporter.forward(mode, s0, q, k, v, 2**31, state_only=False)
    s_ref, y_ref = reporter.forward("plain", s0, q, k, v, 2**31, state_only=False)
    assert mx.array_equal(s, s_ref).item() and mx.array_equal(y, y_ref).item()
