"""The examples of docs/python.md and python/README.md marked "# example (CPU)" run as written."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "docs" / "python.md", ROOT / "python" / "README.md"]


def examples():
    found = []
    for doc in DOCS:
        for i, block in enumerate(re.findall(r"```python\n(.*?)```", doc.read_text(), re.S)):
            if block.startswith("# example (CPU)"):
                found.append(pytest.param(block, id=f"{doc.name}-{i}"))
    return found


def test_there_are_examples():
    assert examples()


@pytest.mark.parametrize("code", examples())
def test_example_runs(code):
    exec(compile(code, "<docs example>", "exec"), {})
