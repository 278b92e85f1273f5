"""The docs' Python blocks are Python: each ```python block of README.md and docs/*.md
(not docs/history/, which keeps old code as it was) compiles. Four op docs once wrote
their signatures as calls with defaults (``f(q, g=None, *, ...)``), which no reader can
paste (found by a docs review, session 51); the blocks' use of the API is checked by
the tests of each op, not here."""

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def _blocks():
    for path in DOCS:
        for i, match in enumerate(BLOCK.finditer(path.read_text())):
            yield pytest.param(match.group(1), id=f"{path.relative_to(ROOT)}[{i}]")


BLOCKS = list(_blocks())


def test_the_docs_have_python_blocks():
    assert len(BLOCKS) >= 8  # the README's and every op doc's


@pytest.mark.parametrize("source", BLOCKS)
def test_python_block_compiles(source):
    compile(source, "<doc block>", "exec")
