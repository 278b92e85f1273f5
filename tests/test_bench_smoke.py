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
