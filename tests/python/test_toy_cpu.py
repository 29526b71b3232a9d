"""The toy model (toy_model.py) on the CPU path: eager and torch.compile(fullgraph=True) each train with
bitwise-identical losses across two runs (the wiring the GPU acceptance run uses)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import toy_model  # noqa: E402


@pytest.mark.parametrize("mode", ["eager", "compile"])
def test_toy_model_on_cpu(mode):
    runs = [toy_model.train(mode, 4, "cpu", toy_model.CPU_SIZE) for _ in range(2)]
    assert runs[0] == runs[1]
    assert runs[0][-1] < runs[0][0]
