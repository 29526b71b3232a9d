"""pytest set-up for mok's Python tests (tests/python).

Run from the repository root: ``PYTHONPATH=python python3 -m pytest -q tests/python`` (./dev.sh test
does, with the torch that scripts/setup.sh installed into .deps/torch). libmok is found as
python/mok/_lib.py says (MOK_LIBRARY, the installed package, or build/). GPU tests are marked
``gpu`` and skip, saying why, without a CUDA GPU of compute capability 9.0 (Hopper).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "python") not in sys.path:
    sys.path.insert(0, str(ROOT / "python"))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # reference.py, toy_model.py

# NVLink multicast stays off in every GPU run (it can take a shared host's GPUs down).
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)


def gpu_skip_reason() -> str | None:
    """None when the GPU tests can run here, else why not."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible (torch.cuda.is_available() is False)"
    major, minor = torch.cuda.get_device_capability(0)
    if major != 9:
        return f"mok's kernels are built for Hopper (sm_90a); GPU 0 is sm_{major}{minor}"
    return None


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a Hopper GPU (skips with the reason otherwise)")


def pytest_collection_modifyitems(config, items):
    reason = None
    for item in items:
        if "gpu" in item.keywords:
            if reason is None:
                reason = gpu_skip_reason() or ""
            if reason:
                item.add_marker(pytest.mark.skip(reason=f"GPU test: {reason}"))


@pytest.fixture
def mok_torch():
    pytest.importorskip("torch")
    import mok.torch

    return mok.torch
