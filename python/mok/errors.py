"""mok's exceptions: one class per C API status (include/mok/c_api.h, mok_status_t).

Every failure mok reports is a :class:`MokError` (a ``RuntimeError``); argument errors are
also ``ValueError`` s (:class:`MokInvalidArgument`), unfinished entry points also
``NotImplementedError`` s and wait timeouts also ``TimeoutError`` s, so callers can catch
them the way they would catch Python's own. The message names the argument and what was
expected, as the C++ library writes it (``"<argument>: expected <what>, got <value>"``).
"""

from __future__ import annotations

__all__ = [
    "MokError",
    "MokInvalidArgument",
    "MokCapacityOverflow",
    "MokNotImplemented",
    "MokCudaError",
    "MokNcclError",
    "MokTimeout",
    "MokInternalError",
    "error_for_status",
    "invalid_argument",
]

# mok_status_t values (include/mok/c_api.h).
OK = 0
INVALID_ARGUMENT = 1
CAPACITY_OVERFLOW = 2
NOT_IMPLEMENTED = 3
CUDA_ERROR = 4
NCCL_ERROR = 5
TIMEOUT = 6
INTERNAL = 7


class MokError(RuntimeError):
    """A failure reported by mok. ``status`` is the C API's mok_status_t value."""

    status: int = INTERNAL

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        if status is not None:
            self.status = status


class MokInvalidArgument(MokError, ValueError):
    """A shape, dtype, device, knob, pointer or routing input is wrong (MOK_INVALID_ARGUMENT)."""

    status = INVALID_ARGUMENT


class MokCapacityOverflow(MokError):
    """More routed rows landed on a rank than Config.capacity allows (MOK_CAPACITY_OVERFLOW)."""

    status = CAPACITY_OVERFLOW


class MokNotImplemented(MokError, NotImplementedError):
    """The entry point exists but this engine does not implement it yet (MOK_NOT_IMPLEMENTED)."""

    status = NOT_IMPLEMENTED


class MokCudaError(MokError):
    """A CUDA runtime call failed (MOK_CUDA_ERROR)."""

    status = CUDA_ERROR


class MokNcclError(MokError):
    """An NCCL call failed, or the loaded NCCL does not match mok's headers (MOK_NCCL_ERROR)."""

    status = NCCL_ERROR


class MokTimeout(MokError, TimeoutError):
    """An in-kernel wait exceeded Config.wait_timeout_s: a peer died or ranks diverged (MOK_TIMEOUT)."""

    status = TIMEOUT


class MokInternalError(MokError):
    """A bug in mok (MOK_INTERNAL)."""

    status = INTERNAL


_BY_STATUS = {
    INVALID_ARGUMENT: MokInvalidArgument,
    CAPACITY_OVERFLOW: MokCapacityOverflow,
    NOT_IMPLEMENTED: MokNotImplemented,
    CUDA_ERROR: MokCudaError,
    NCCL_ERROR: MokNcclError,
    TIMEOUT: MokTimeout,
    INTERNAL: MokInternalError,
}


def error_for_status(status: int, message: str) -> MokError:
    """The exception for a non-zero mok_status_t, carrying ``message``."""
    cls = _BY_STATUS.get(status, MokInternalError)
    return cls(message, status if status in _BY_STATUS else INTERNAL)


def invalid_argument(argument: str, expected: str, got: object) -> MokInvalidArgument:
    """A MokInvalidArgument worded like the C++ library's: "<argument>: expected <expected>, got <got>"."""
    return MokInvalidArgument(f"{argument}: expected {expected}, got {got}")
