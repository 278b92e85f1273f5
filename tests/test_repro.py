"""chunkscan repro: the command runs end to end and writes its table, JSON and plot."""

import json
import subprocess
import sys

import mlx.core as mx
import pytest

from chunkscan.commands import measure, repro


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
    assert "| qkv | cs.scan | 1.0 | - | 0.50 | - | n/a |" in table


@pytest.fixture
def no_measuring(monkeypatch):
    def never(*a, **k):
        raise AssertionError("a configuration was measured")

    monkeypatch.setattr(measure, "run_isolated", never)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--T", "0"], "argument --T: must be a positive integer but got 0"),
        (["--T", "64", "-5"], "argument --T: must be a positive integer but got -5"),
        (["--chunk", "0"], "argument --chunk: must be a positive integer but got 0"),
        (["--repeats", "0"], "argument --repeats: must be a positive integer but got 0"),
        (["--H", "0"], "argument --H: must be a positive integer but got 0"),
        (["--D", "two"], "argument --D: must be a positive integer but got 'two'"),
        (["--check-max-T", "-1"], "argument --check-max-T: must be an integer >= 0 but got -1"),
        (["--timeout", "0"], "argument --timeout: must be a positive number but got 0.0"),
    ],
    ids=["T0", "T-neg", "chunk0", "repeats0", "H0", "D-text", "check-neg", "timeout0"],
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
        "chunkscan repro: 1 of 2 configurations failed:\n"
        "  state plain T=8: exit -9: killed (out of memory?)"
    ) in err
    data = json.loads((tmp_path / "repro.json").read_text())
    assert len(data["rows"]) == 2
    assert (data["meta"]["modes"], data["meta"]["grads"]) == (["plain", "cs.scan"], ["state"])
    monkeypatch.setattr(measure, "run_isolated", lambda *a, **k: fake(None, {"mode": "x"}))
    assert repro.main(argv + ["--out", str(tmp_path)]) == 0
