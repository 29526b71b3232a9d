"""mok: a deterministic fused mixture-of-experts layer for training (C++/CUDA, Hopper).

``import mok`` loads libmok through its C API (ctypes; no torch needed): the config and shape
types, their validation, engine information and the error classes. The PyTorch layer is
``mok.torch`` (docs/python.md).

    >>> import mok
    >>> mok.validate(mok.LayerShape(tokens=4096, hidden=2048, intermediate=768, experts=128, topk=8))
"""

from __future__ import annotations

from ._info import EngineInfo, engine_info, library_path, nccl_versions
from .config import (
    KEEP_ACTIVATIONS,
    KEEP_DEFERRED_WGRAD,
    KEEP_ROUTING_ONLY,
    PRECISIONS,
    Config,
    LayerShape,
    context_bytes,
    fp8_weights_bytes,
    validate,
)
from .errors import (
    MokCapacityOverflow,
    MokCudaError,
    MokError,
    MokInternalError,
    MokInvalidArgument,
    MokNcclError,
    MokNotImplemented,
    MokTimeout,
)

__version__ = "0.1.0"

__all__ = [
    "Config",
    "LayerShape",
    "validate",
    "context_bytes",
    "KEEP_ACTIVATIONS",
    "KEEP_ROUTING_ONLY",
    "KEEP_DEFERRED_WGRAD",
    "PRECISIONS",
    "fp8_weights_bytes",
    "EngineInfo",
    "engine_info",
    "library_path",
    "nccl_versions",
    "library_version",
    "MokError",
    "MokInvalidArgument",
    "MokCapacityOverflow",
    "MokNotImplemented",
    "MokCudaError",
    "MokNcclError",
    "MokTimeout",
    "MokInternalError",
    "__version__",
]


def library_version() -> str:
    """The version libmok reports (mok_version); equal to ``mok.__version__`` for a matching build."""
    from . import _lib

    return _lib.lib().mok_version().decode()
