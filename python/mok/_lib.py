"""Loading libmok and declaring the C API (include/mok/c_api.h) for ctypes.

Where libmok comes from, first match wins:

1. ``MOK_LIBRARY=/path/to/libmok.so`` (a development build, the GPU machine's prebuilt copy);
2. the copy installed with the package (``mok/lib/libmok.so``, put there by ``pip install .``);
3. a build tree of this checkout: ``$MOK_BUILD_DIR/src/host/libmok.so``, then ``build/src/host/libmok.so``
   (running from the source tree with ``PYTHONPATH=python``).

libmok needs ``libcudart.so.13`` and ``libnccl.so.2``. When the process has not loaded them yet,
the copies from NVIDIA's wheels on ``sys.path`` (``nvidia/cu13/lib``, ``nvidia/nccl/lib``: the
ones PyTorch loads) are loaded first, so that mok and torch share one NCCL whichever is
imported first; otherwise the dynamic loader's search applies (``LD_LIBRARY_PATH``, libmok's
run path). ``MOK_NCCL_LIBRARY`` names an NCCL explicitly.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
from pathlib import Path

from .errors import MokError, error_for_status

_PACKAGE_DIR = Path(__file__).resolve().parent
_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_lib_path: str | None = None


def _candidates() -> list[Path]:
    found = []
    env = os.environ.get("MOK_LIBRARY")
    if env:
        return [Path(env)]
    found.append(_PACKAGE_DIR / "lib" / "libmok.so")
    repo = _PACKAGE_DIR.parent.parent  # python/mok -> the checkout
    build_dir = os.environ.get("MOK_BUILD_DIR")
    if build_dir:
        b = Path(build_dir)
        found.append((b if b.is_absolute() else repo / b) / "src" / "host" / "libmok.so")
    found.append(repo / "build" / "src" / "host" / "libmok.so")
    return found


def _loaded_paths(fragment: str) -> list[str]:
    """Files whose name contains ``fragment`` that this process has mapped (Linux /proc/self/maps)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split(None, 5)[5].strip() for line in f if fragment in line and len(line.split(None, 5)) == 6}
    except OSError:
        return []
    return sorted(p for p in paths if os.path.basename(p).startswith(fragment))


def loaded_library(fragment: str) -> str | None:
    """The path of the loaded shared library whose file name starts with ``fragment``, if any."""
    paths = _loaded_paths(fragment)
    return paths[0] if paths else None


def _wheel_library(*parts: str) -> Path | None:
    for entry in sys.path:
        if not entry:
            continue
        p = Path(entry).joinpath(*parts)
        if p.is_file():
            return p
    return None


def _preload_dependencies() -> None:
    """Loads NCCL and the CUDA runtime from NVIDIA's wheels when the process has none yet."""
    wanted = [
        ("libcudart.so", None, [("nvidia", "cu13", "lib", "libcudart.so.13"),
                                 ("nvidia", "cuda_runtime", "lib", "libcudart.so.13")]),
        ("libnccl.so", os.environ.get("MOK_NCCL_LIBRARY"), [("nvidia", "nccl", "lib", "libnccl.so.2")]),
    ]
    for fragment, explicit, wheel_paths in wanted:
        if explicit:
            try:
                ctypes.CDLL(explicit, mode=ctypes.RTLD_GLOBAL)
            except OSError as e:
                raise MokError(f"MOK_NCCL_LIBRARY: expected a loadable libnccl.so.2, got {explicit!r} ({e})") from e
            continue
        if loaded_library(fragment):
            continue
        for parts in wheel_paths:
            p = _wheel_library(*parts)
            if p is not None:
                try:
                    ctypes.CDLL(str(p), mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue  # the loader's own search may still find one
                break


# ---- C types mirroring include/mok/c_api.h ---------------------------------------------------------

class LayerShapeC(ctypes.Structure):
    _fields_ = [("tokens", ctypes.c_int64), ("hidden", ctypes.c_int64), ("intermediate", ctypes.c_int64),
                ("shared_intermediate", ctypes.c_int64), ("experts", ctypes.c_int64),
                ("topk", ctypes.c_int32), ("ep", ctypes.c_int32)]


class ConfigC(ctypes.Structure):
    _fields_ = [("comm_sms_forward", ctypes.c_int32), ("comm_sms_backward", ctypes.c_int32),
                ("minibatch", ctypes.c_int64), ("macrobatch", ctypes.c_int64), ("capacity", ctypes.c_double),
                ("grid_sms", ctypes.c_int32), ("wait_timeout_s", ctypes.c_double),
                ("forward_engine", ctypes.c_int32), ("backward_engine", ctypes.c_int32),
                ("precision", ctypes.c_int32), ("fp8_weight_grads", ctypes.c_int32)]


class ExpertWeightsC(ctypes.Structure):
    _fields_ = [("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("shared_gate", ctypes.c_void_p), ("shared_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p),
                ("gate_expert_stride", ctypes.c_int64), ("up_expert_stride", ctypes.c_int64),
                ("down_expert_stride", ctypes.c_int64), ("fp8", ctypes.c_void_p)]


class WeightGradsC(ctypes.Structure):
    _fields_ = [("accumulate_fp32", ctypes.c_int32),
                ("gate", ctypes.c_void_p), ("up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("shared_gate", ctypes.c_void_p), ("shared_up", ctypes.c_void_p), ("shared_down", ctypes.c_void_p),
                ("gate_expert_stride", ctypes.c_int64), ("up_expert_stride", ctypes.c_int64),
                ("down_expert_stride", ctypes.c_int64)]


NCCL_UNIQUE_ID_BYTES = 128

_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_I64 = ctypes.c_int64
_PI32 = ctypes.POINTER(ctypes.c_int32)
_PU64 = ctypes.POINTER(ctypes.c_uint64)

# name -> argument types; every one returns mok_status_t (int) unless listed in _RESTYPES.
_SIGNATURES = {
    "mok_last_error": [],
    "mok_status_string": [ctypes.c_int],
    "mok_version": [],
    "mok_config_default": [ctypes.POINTER(ConfigC)],
    "mok_validate": [ctypes.POINTER(LayerShapeC), ctypes.POINTER(ConfigC)],
    "mok_workspace_create": [ctypes.POINTER(LayerShapeC), ctypes.POINTER(ConfigC), _P, _I32, ctypes.POINTER(_P)],
    "mok_workspace_destroy": [_P],
    "mok_workspace_check": [_P],
    "mok_workspace_bytes": [_P, _PU64],
    "mok_context_bytes": [ctypes.POINTER(LayerShapeC), ctypes.POINTER(ConfigC), _I32, _PU64],
    "mok_context_create": [_P, _P, _I32, ctypes.POINTER(_P)],
    "mok_context_create_in": [_P, _P, ctypes.c_uint64, _I32, ctypes.POINTER(_P)],
    "mok_context_destroy": [_P],
    "mok_fp8_weights_bytes": [ctypes.POINTER(LayerShapeC), _PU64],
    "mok_fp8_weights_create_in": [_P, _P, ctypes.c_uint64, ctypes.POINTER(_P)],
    "mok_fp8_weights_update": [_P, ctypes.POINTER(ExpertWeightsC), _P],
    "mok_fp8_weights_destroy": [_P],
    "mok_schedule": [_P, _P, _I64, _P],
    "mok_forward": [_P, _P, _P, _P, _P, ctypes.POINTER(ExpertWeightsC), _I32, _P],
    "mok_backward": [_P, _P, _P, _P, _P, _P, _P, ctypes.POINTER(ExpertWeightsC), ctypes.POINTER(WeightGradsC), _I32, _P],
    "mok_backward_weight_grads": [_P, _P, _P, _P, ctypes.POINTER(WeightGradsC), _P],
    "mok_recompute_forward_context": [_P, _P, _P, _P, ctypes.POINTER(ExpertWeightsC), _P],
    "mok_engine_info": [_PI32, _PI32, _PI32, ctypes.POINTER(ctypes.c_char_p)],
    "mok_nccl_unique_id": [_P],
    "mok_nccl_comm_init": [_P, _I32, _I32, _I32, ctypes.POINTER(_P)],
    "mok_nccl_comm_destroy": [_P],
    "mok_nccl_versions": [_PI32, _PI32],
}
_RESTYPES = {"mok_last_error": ctypes.c_char_p, "mok_status_string": ctypes.c_char_p, "mok_version": ctypes.c_char_p}


def _declare(lib: ctypes.CDLL, path: str) -> None:
    missing = []
    for name, argtypes in _SIGNATURES.items():
        try:
            fn = getattr(lib, name)
        except AttributeError:
            missing.append(name)
            continue
        fn.argtypes = argtypes
        fn.restype = _RESTYPES.get(name, ctypes.c_int)
    if missing:
        raise MokError(f"libmok at {path}: expected the C API of this package, missing {', '.join(missing)} "
                       "(an older libmok? rebuild it: ./dev.sh build, or pip install .)")


def lib() -> ctypes.CDLL:
    """The loaded libmok (loaded on first use)."""
    global _lib, _lib_path
    if _lib is not None:
        return _lib
    with _lock:
        if _lib is not None:
            return _lib
        tried = []
        for path in _candidates():
            tried.append(str(path))
            if not path.is_file():
                continue
            _preload_dependencies()
            try:
                handle = ctypes.CDLL(str(path))
            except OSError as e:
                raise MokError(f"libmok at {path} did not load: {e}. It needs libcudart.so.13 and libnccl.so.2: "
                               "install the CUDA 13 runtime and NCCL (pip install nvidia-nccl-cu13 "
                               "nvidia-cuda-runtime), or put their folders on LD_LIBRARY_PATH") from e
            _declare(handle, str(path))
            _lib, _lib_path = handle, str(path)
            return _lib
        hint = ("MOK_LIBRARY names a missing file" if os.environ.get("MOK_LIBRARY")
                else "build it (./dev.sh build), install the package (pip install .), or set MOK_LIBRARY=/path/libmok.so")
        raise MokError(f"libmok.so not found (looked at {', '.join(tried)}): {hint}")


def library_path() -> str:
    """Where the loaded libmok lives."""
    lib()
    assert _lib_path is not None
    return _lib_path


def last_error() -> str:
    text = lib().mok_last_error()
    return text.decode("utf-8", errors="replace") if text else ""


def call(name: str, *args) -> None:
    """Calls a mok_status_t function; a non-zero status raises the matching MokError."""
    status = getattr(lib(), name)(*args)
    if status != 0:
        message = last_error() or f"{name} failed"
        raise error_for_status(status, message)
