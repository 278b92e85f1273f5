"""Fixtures for every test. Shared helpers live in ``helpers.py`` (this file's folder
is on ``sys.path``, so test modules ``from helpers import ...``)."""

import mlx.core as mx
import pytest


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)
