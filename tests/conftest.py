"""Fixtures for every test. Shared helpers live in ``helpers.py`` (this file's folder
is on ``sys.path``, so test modules ``from helpers import ...``)."""

import importlib
import os
import pathlib
import sys

# Float32 matmuls in full precision on CUDA, as the device scripts run every test there
# (bench/h200_suite.sh, bench/device_run.sh): under MLX's default TF32 matmuls a loop
# and its scan round their products differently (scan's second derivative measured
# 5.0e-4 against its 1e-5 bound on the H200, run 95), which is TF32's error, not the
# code's. Set before MLX reads it (once, at its first matmul); a value the user set is
# kept. No effect on the CPU.
os.environ.setdefault("MLX_ENABLE_TF32", "0")

import mlx.core as mx  # noqa: E402
import pytest  # noqa: E402


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


@pytest.fixture
def bench(monkeypatch):
    """``bench("name")``: the bench script's module (``bench/`` on ``sys.path``), taken
    out of ``sys.modules`` again afterwards (the bench tests' files share it)."""
    monkeypatch.syspath_prepend(str(BENCH))
    loaded = []

    def load(name):
        loaded.append(name)
        return importlib.import_module(name)

    yield load
    for name in loaded:
        sys.modules.pop(name, None)
