"""What the loaded libmok implements and which NCCL it runs on."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

from . import _lib

__all__ = ["EngineInfo", "engine_info", "library_path", "nccl_versions", "nccl_version_string"]

library_path = _lib.library_path


@dataclass(frozen=True)
class EngineInfo:
    """mok::engine_info() plus where the library and its NCCL come from."""

    version: str
    gpu_schedule: bool
    gpu_forward: bool
    gpu_backward: bool
    description: str
    library: str
    nccl_runtime: int  # ncclGetVersion() of the loaded libnccl, e.g. 22809 for 2.28.9
    nccl_headers: int  # NCCL_VERSION_CODE mok was compiled with
    nccl_library: str | None  # the loaded libnccl file, when it can be told

    def __str__(self) -> str:
        nccl = (f"NCCL headers {nccl_version_string(self.nccl_headers)}, loaded {nccl_version_string(self.nccl_runtime)}"
                f" ({self.nccl_library or 'path unknown'})")
        if self.nccl_runtime != self.nccl_headers:
            nccl += "  MISMATCH: workspaces refuse to start (docs/python.md, 'NCCL')"
        return (f"mok {self.version} ({self.library})\n"
                f"engine: schedule={'gpu' if self.gpu_schedule else 'no'} forward={'gpu' if self.gpu_forward else 'no'} "
                f"backward={'gpu' if self.gpu_backward else 'no'}\n{self.description}\n{nccl}")


def nccl_version_string(code: int) -> str:
    """"2.28.9" from an NCCL_VERSION_CODE-style integer (major*10000 + minor*100 + patch)."""
    if code >= 10000:
        return f"{code // 10000}.{(code % 10000) // 100}.{code % 100}"
    return f"{code // 1000}.{(code % 1000) // 100}.{code % 100}"


def nccl_versions() -> tuple[int, int]:
    """(runtime, headers): the loaded libnccl's version and the one mok was compiled against."""
    runtime, headers = ctypes.c_int32(), ctypes.c_int32()
    _lib.call("mok_nccl_versions", ctypes.byref(runtime), ctypes.byref(headers))
    return int(runtime.value), int(headers.value)


def engine_info() -> EngineInfo:
    l = _lib.lib()
    s, f, b = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
    desc = ctypes.c_char_p()
    _lib.call("mok_engine_info", ctypes.byref(s), ctypes.byref(f), ctypes.byref(b), ctypes.byref(desc))
    runtime, headers = nccl_versions()
    return EngineInfo(
        version=l.mok_version().decode(),
        gpu_schedule=bool(s.value),
        gpu_forward=bool(f.value),
        gpu_backward=bool(b.value),
        description=(desc.value or b"").decode(),
        library=_lib.library_path(),
        nccl_runtime=runtime,
        nccl_headers=headers,
        nccl_library=_lib.loaded_library("libnccl.so"),
    )
