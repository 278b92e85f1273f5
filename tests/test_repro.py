"""chunkscan repro: the command runs end to end and writes its table, JSON and plot."""

import json
import subprocess
import sys

from chunkscan import repro


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
    assert len(data["rows"]) == 20
    assert all("peak_mib" in r and r["max_grad_diff"] == 0.0 for r in data["rows"])
    assert (out / "repro.png").stat().st_size > 10_000


def test_table_marks_failures_and_missing_cells():
    rows = [
        {"mode": "cs.scan", "grads": "qkv", "T": 8, "peak_mib": 1.0, "seconds": 0.5},
        {"mode": "plain", "grads": "qkv", "T": 16, "error": "exit -9: killed (out of memory?)"},
    ]
    table = repro.format_table(rows, [8, 16])
    assert "| qkv | plain | - | fail | - | fail | n/a |" in table
    assert "| qkv | cs.scan | 1.0 | - | 0.50 | - | n/a |" in table
