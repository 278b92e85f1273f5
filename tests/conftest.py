import collections
import io
import re

import mlx.core as mx
import pytest


def max_rel_diff(a: mx.array, b: mx.array) -> float:
    """max |a - b| / max |b| (0 when both are zero)."""
    scale = mx.abs(b).max().item()
    diff = mx.abs(a - b).max().item()
    return diff / scale if scale > 0 else diff


def assert_trees_close(got, ref, tol: float = 1e-5, name: str = "value"):
    from chunkscan import _tree

    g_leaves, g_def = _tree.flatten(got)
    r_leaves, r_def = _tree.flatten(ref)
    assert _tree.same_structure(g_def, r_def), f"{name}: structures differ"
    for path, a, b in zip(_tree.paths(r_def, name), g_leaves, r_leaves):
        assert a.shape == b.shape, f"{path}: shape {a.shape} != {b.shape}"
        err = max_rel_diff(a.astype(mx.float32), b.astype(mx.float32))
        assert err <= tol, f"{path}: max relative difference {err:.2e} > {tol:.0e}"


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


def max_outputs_of_one_primitive(arrays) -> int:
    """The most outputs any primitive in the graph of ``arrays`` has (from its DOT)."""
    buf = io.StringIO()
    mx.export_to_dot(buf, *arrays)
    # Primitive nodes have numeric ids; an edge "id -> "name"" is one of its outputs.
    counts = collections.Counter(re.findall(r'^(\d+) -> "', buf.getvalue(), re.M))
    return max(counts.values())
