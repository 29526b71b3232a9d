"""The GPU side of mok.torch: NCCL communicators, the workspace cache, each forward's context, the FP8
weight copies, and the error-check policy (docs/python.md).

Nothing here is traced by torch.compile: it runs inside the real (CUDA) implementations of the
custom ops, on real tensors, every time a compiled graph calls them.
"""

from __future__ import annotations

import collections
import ctypes
import os
import threading

import torch

import mok
from mok import _lib
from mok._info import nccl_version_string
from mok.config import KEEP_ACTIVATIONS
from mok.errors import MokError, MokNcclError, MokTimeout, invalid_argument

from ._spec import LayerSpec

_lock = threading.RLock()

# ---- error checks ------------------------------------------------------------------------------------

_CHECK_MODES = ("sync", "off")
_checks = os.environ.get("MOK_TORCH_CHECKS", "sync")
if _checks not in _CHECK_MODES:
    raise invalid_argument("MOK_TORCH_CHECKS", "'sync' or 'off'", repr(_checks))


def set_checks(mode: str) -> None:
    """'sync' (default): after every mok call that is not being captured into a CUDA graph, wait for it and
    raise its device-side errors (bad expert id, duplicate expert, non-finite router weight, capacity
    overflow, timeout) as MokError, and check that T is equal on every EP rank. 'off': no waits; call
    mok.torch.check() yourself (after a step, after a graph replay). Errors are never silent either way:
    the outputs of a failed call are NaN and the error stays recorded until the next check."""
    global _checks
    if mode not in _CHECK_MODES:
        raise invalid_argument("mode", "'sync' or 'off'", repr(mode))
    _checks = mode


def get_checks() -> str:
    return _checks


def capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _checking() -> bool:
    return _checks == "sync" and not capturing()


# ---- NCCL communicators --------------------------------------------------------------------------------

def resolve_group(name: str):
    """The torch.distributed ProcessGroup named ``name`` ("" = none: this process alone)."""
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def check_nccl_versions() -> None:
    """The loaded libnccl must be the version mok's headers describe (its device-API structs come from them)."""
    runtime, headers = mok.nccl_versions()
    if runtime == headers:
        return
    path = _lib.loaded_library("libnccl.so") or "an unknown file"
    torch_nccl = ""
    try:
        v = torch.cuda.nccl.version()
        torch_nccl = f"; torch {torch.__version__} was built with NCCL {'.'.join(str(p) for p in v)}"
    except Exception:  # noqa: BLE001 - informational only
        pass
    raise MokNcclError(
        f"NCCL: mok was compiled against NCCL {nccl_version_string(headers)} headers, but this process loaded "
        f"libnccl {nccl_version_string(runtime)} ({path}){torch_nccl}. mok's device-API path needs them equal. Either "
        f"load a libnccl {nccl_version_string(headers)} first (LD_LIBRARY_PATH=<its folder>, or "
        f"MOK_NCCL_LIBRARY=<file> before importing torch), or rebuild mok against the NCCL that torch loads "
        f"(cmake -DMOK_NCCL_DIR=<site-packages>/nvidia/nccl, then pip install . again)")


class Comm:
    """An NCCL communicator of mok's own over one EP group on one device."""

    def __init__(self, group: str, device: int):
        self.group, self.device = group, device
        pg = resolve_group(group)
        if pg is None:
            self.rank, self.size = 0, 1
        else:
            import torch.distributed as dist

            self.rank, self.size = dist.get_rank(pg), dist.get_world_size(pg)
        check_nccl_versions()  # every rank raises alike before any collective
        uid = ctypes.create_string_buffer(_lib.NCCL_UNIQUE_ID_BYTES)
        if self.rank == 0:
            _lib.call("mok_nccl_unique_id", uid)
        if pg is not None:
            import torch.distributed as dist

            box = [uid.raw if self.rank == 0 else None]
            dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg,
                                       device=torch.device("cuda", device))
            if not isinstance(box[0], bytes) or len(box[0]) != _lib.NCCL_UNIQUE_ID_BYTES:
                raise MokNcclError(f"ep_group {group!r}: the NCCL unique id from EP rank 0 did not arrive intact")
            ctypes.memmove(uid, box[0], _lib.NCCL_UNIQUE_ID_BYTES)
        handle = ctypes.c_void_p()
        _lib.call("mok_nccl_comm_init", uid, self.size, self.rank, device, ctypes.byref(handle))
        self.handle = handle

    def destroy(self) -> None:
        if self.handle:
            _lib.call("mok_nccl_comm_destroy", self.handle)
            self.handle = ctypes.c_void_p()


_comms: dict[tuple[str, int], Comm] = {}


def comm_for(group: str, device: int) -> Comm:
    key = (group, device)
    with _lock:
        c = _comms.get(key)
        if c is None:
            c = Comm(group, device)
            _comms[key] = c
        return c


# ---- workspaces ----------------------------------------------------------------------------------------

class Workspace:
    """One mok workspace: shared by every layer of one spec on one device, sized for ``tokens`` per call."""

    def __init__(self, spec: LayerSpec, tokens: int, device: int):
        self.spec, self.tokens, self.device = spec, tokens, device
        self.comm = comm_for(spec.group, device)
        if self.comm.size != spec.ep:
            raise invalid_argument("ep_group", f"a group of {spec.ep} ranks (the layer's EP size)", self.comm.size)
        self.shape = spec.shape(tokens)
        handle = ctypes.c_void_p()
        _lib.call("mok_workspace_create", ctypes.byref(self.shape.to_c()), ctypes.byref(spec.config.to_c()),
                  self.comm.handle, device, ctypes.byref(handle))
        self.handle = handle
        self._context_bytes: dict[int, int] = {}
        self._fp8_bytes: int | None = None
        # FP8 specs: each layer's weight copies on this workspace, keyed on its weights' addresses
        self.fp8_weights: dict[tuple, Fp8Weights] = {}

    def device_bytes(self) -> int:
        out = ctypes.c_uint64()
        _lib.call("mok_workspace_bytes", self.handle, ctypes.byref(out))
        return int(out.value)

    def context_bytes(self, keep: int) -> int:
        n = self._context_bytes.get(keep)
        if n is None:
            n = self._context_bytes[keep] = mok.context_bytes(self.shape, self.spec.config, keep)
        return n

    def fp8_weights_bytes(self) -> int:
        if self._fp8_bytes is None:
            self._fp8_bytes = mok.fp8_weights_bytes(self.shape)
        return self._fp8_bytes

    def check(self) -> None:
        """Waits for the workspace's last stream and raises its device-side error, if any."""
        try:
            _lib.call("mok_workspace_check", self.handle)
        except MokTimeout:
            _evict(self)  # a timed-out workspace must be recreated (docs/python.md, "Errors")
            raise

    def destroy(self) -> None:
        with _lock:
            copies = list(self.fp8_weights.values())
            self.fp8_weights.clear()
        for c in copies:  # they belong to the workspace: gone before it
            c.destroy()
        if self.handle:
            _lib.call("mok_workspace_destroy", self.handle)
            self.handle = ctypes.c_void_p()


_workspaces: dict[tuple[str, int, int], Workspace] = {}


def _evict(ws: Workspace) -> None:
    with _lock:
        for k, v in list(_workspaces.items()):
            if v is ws:
                del _workspaces[k]


def workspace_for(spec: LayerSpec, tokens: int, device: int) -> Workspace:
    ws_tokens = spec.workspace_tokens(tokens)
    if tokens > ws_tokens:
        raise invalid_argument("x", f"at most Config.max_tokens = {ws_tokens} tokens per call", f"T = {tokens}")
    key = (spec.key(), device, ws_tokens)
    with _lock:
        ws = _workspaces.get(key)
        if ws is None:
            if capturing():
                raise MokError(
                    f"mok: no workspace yet for this layer at T <= {ws_tokens} on cuda:{device}, and one cannot be "
                    "created while a CUDA graph is being captured (it allocates and synchronises). Run the step once "
                    "before capturing it (the usual warm-up), or set Config.max_tokens")
            ws = Workspace(spec, ws_tokens, device)
            _workspaces[key] = ws
        return ws


def workspaces() -> list[Workspace]:
    with _lock:
        return list(_workspaces.values())


# ---- contexts: one per forward that a backward will consume ---------------------------------------------

_MAX_PENDING = 4096  # forwards whose backward has not run yet; beyond it the oldest are forgotten
_contexts: collections.OrderedDict[tuple[int, int], tuple[Workspace, ctypes.c_void_p]] = collections.OrderedDict()


def _destroy_context(handle: ctypes.c_void_p) -> None:
    _lib.call("mok_context_destroy", handle)


def register_context(ws: Workspace, memory: torch.Tensor, keep: int) -> ctypes.c_void_p:
    """A mok context over ``memory`` (a torch-allocated uint8 tensor), found again by its address."""
    handle = ctypes.c_void_p()
    _lib.call("mok_context_create_in", ws.handle, ctypes.c_void_p(memory.data_ptr()), memory.numel(), keep,
              ctypes.byref(handle))
    key = (ws.device, memory.data_ptr())
    with _lock:
        stale = _contexts.pop(key, None)  # its memory was freed (no backward came) and now holds this one
        _contexts[key] = (ws, handle)
        old = [_contexts.popitem(last=False)[1] for _ in range(len(_contexts) - _MAX_PENDING)]
    for _, h in ([stale] if stale else []) + old:
        _destroy_context(h)
    return handle


def take_context(memory: torch.Tensor) -> tuple[Workspace, ctypes.c_void_p]:
    """The workspace and context of the forward that filled ``memory``; the caller destroys the context."""
    key = (memory.device.index, memory.data_ptr())
    with _lock:
        entry = _contexts.pop(key, None)
    if entry is None:
        raise invalid_argument(
            "ctx", "the context of a mok forward that no backward consumed yet",
            "an unknown or consumed context (a second backward through the same graph needs retain_graph-free "
            f"recomputation: mok consumes a forward's context; or more than {_MAX_PENDING} forwards were pending, "
            "or mok.torch.release() ran in between)")
    return entry


def drop_context(memory: torch.Tensor) -> None:
    try:
        _, handle = take_context(memory)
    except MokError:
        return
    _destroy_context(handle)


# ---- FP8 weight copies: one per layer of an FP8 spec and workspace ------------------------------------------

fp8_update_count = 0  # mok_fp8_weights_update calls made by this process (enqueued or captured): for tests, logs


class Fp8Weights:
    """One layer's FP8 weight copies (mok_fp8_weights_t) over a torch uint8 tensor, and the state of the weights
    they were last quantized from (docs/python.md, "FP8")."""

    def __init__(self, ws: Workspace, device: torch.device):
        n = ws.fp8_weights_bytes()
        self.memory = empty_unfilled(n, dtype=torch.uint8, device=device)  # the update writes every byte
        if self.memory.data_ptr() % 256:  # torch's caching allocator hands out 512-byte aligned blocks
            raise MokError(f"mok: the FP8 weight copies need 256-byte aligned memory; torch gave "
                           f"0x{self.memory.data_ptr():x}")
        handle = ctypes.c_void_p()
        _lib.call("mok_fp8_weights_create_in", ws.handle, ctypes.c_void_p(self.memory.data_ptr()), n,
                  ctypes.byref(handle))
        self.handle = handle
        self.versions: tuple | None = None  # the weights' _version at the last eager update; None: quantize next use
        self.storages: tuple = ()  # weak references to the storages they were quantized from (_same_storages)
        self.captured = False  # a captured graph quantizes into these copies on replay

    def destroy(self) -> None:
        if self.handle:
            _lib.call("mok_fp8_weights_destroy", self.handle)
            self.handle = ctypes.c_void_p()


def _version(t: torch.Tensor | None):
    """t's version counter; an inference tensor has none: a value equal to nothing, so it is quantized every call."""
    if t is None:
        return -1
    return object() if t.is_inference() else t._version


def _storage_refs(weights: list) -> tuple:
    """Weak references to the weights' storages: they tell a live weight from a new tensor that the allocator
    placed at a freed weight's address (same pointer, same version counter 0, other values)."""
    from torch.multiprocessing.reductions import StorageWeakRef
    return tuple(None if t is None else StorageWeakRef(t.untyped_storage()) for t in weights)


def _weights_freed(refs: tuple) -> bool:
    """True when a weight that copies were quantized from has been freed (its storage is gone)."""
    return any(ref is not None and ref.expired() for ref in refs)


def _same_storages(refs: tuple, weights: list) -> bool:
    """True when every weight still lives in the storage its copies were quantized from."""
    if len(refs) != len(weights):
        return False
    for ref, t in zip(refs, weights):
        if (ref is None) != (t is None):
            return False
        if t is not None and (ref.expired() or ref.cdata != t.untyped_storage()._cdata):
            return False
    return True


def _pop_stale_copies(workspaces, ws, ptrs: tuple) -> list:
    """Before a new set of copies for weights at ``ptrs`` on ``ws``: removes and returns the sets of layers whose
    weights were freed (their memory may hold this layer's now), on every workspace (a layer called at several
    token counts has a set on each), so that a program that builds and drops FP8 layers does not keep a weights'
    worth of copies for each; and on ``ws`` a set keyed on the same gate address, that address's previous layer
    in any case. (Workspaces: anything with an ``fp8_weights`` dict of entries with ``storages``.)"""
    stale = []
    for other in workspaces:
        keys = [k for k, e in other.fp8_weights.items()
                if (other is ws and k[0] == ptrs[0]) or _weights_freed(e.storages)]
        stale += [other.fp8_weights.pop(k) for k in keys]
    return stale


def fp8_weights_for(ws: Workspace, weights: list, w: _lib.ExpertWeightsC, stream: ctypes.c_void_p,
                    forward: bool) -> ctypes.c_void_p:
    """The handle of the layer's FP8 copies on ``ws``, current for ``weights`` once ``stream`` gets there.

    Eager calls quantize when the copies are new or a weight's address, storage or version counter (``_version``,
    bumped by every in-place write torch sees: optimizer steps, copy_, load_state_dict) moved since the last
    quantization. The storage check catches a new layer whose weights the caching allocator put where a freed
    layer's were: the same addresses and version counters (0), other values.
    A forward being captured into a CUDA graph always enqueues the quantization (stream-ordered before the pass):
    the replays then re-quantize whatever the weights hold by then, since a replayed optimizer step moves no
    version counter; for the same reason every eager forward re-quantizes copies that a graph also writes. A
    backward quantizes only when its forward did not leave the copies current."""
    global fp8_update_count
    ptrs = tuple(_ptr(t) for t in weights)
    versions = tuple(_version(t) for t in weights)
    capture = capturing()
    stale = []
    with _lock:
        entry = ws.fp8_weights.get(ptrs)
        if entry is None:
            if capture:
                raise MokError(
                    "mok: no FP8 weight copies yet for this layer's weights, and none are made while a CUDA graph is "
                    "being captured. Run the step once before capturing it (the usual warm-up)")
            stale = _pop_stale_copies(_workspaces.values(), ws, ptrs)
            entry = ws.fp8_weights[ptrs] = Fp8Weights(ws, torch.device("cuda", ws.device))
    for old in stale:
        old.destroy()
    changed = entry.versions != versions or not _same_storages(entry.storages, weights)
    if capture:
        update = forward or (not entry.captured and changed)
    else:
        update = changed or (forward and entry.captured)
    if update:
        _lib.call("mok_fp8_weights_update", entry.handle, ctypes.byref(w), stream)
        fp8_update_count += 1
        if capture:
            entry.captured, entry.versions = True, None  # not run yet: the first eager call after it quantizes
        else:
            entry.versions = versions
        entry.storages = _storage_refs(weights)
    return entry.handle


def mark_fp8_weights_stale() -> None:
    """The next call of every FP8 layer re-quantizes its weights. Needed only after a weight changed in a way
    torch's version counter does not see: writes through ``param.data``, or by a library into the parameter's
    memory (docs/python.md, "FP8")."""
    with _lock:
        for ws in _workspaces.values():
            for entry in ws.fp8_weights.values():
                entry.versions = None


# ---- checks across ranks ---------------------------------------------------------------------------------

def check_tokens_across_ranks(spec: LayerSpec, tokens: int, device: int) -> None:
    """In 'sync' mode with EP > 1: T must be equal on every rank (one small all-gather)."""
    if spec.ep == 1 or not _checking():
        return
    import torch.distributed as dist

    pg = resolve_group(spec.group)
    mine = torch.tensor([tokens], dtype=torch.int64, device=torch.device("cuda", device))
    every = torch.empty(spec.ep, dtype=torch.int64, device=mine.device)
    dist.all_gather_into_tensor(every, mine, group=pg)
    values = every.tolist()
    if any(v != tokens for v in values):
        raise invalid_argument("x", f"the same number of tokens on every rank of the EP group (T per EP rank: {values})",
                               f"T = {tokens} on EP rank {dist.get_rank(pg)}")


# ---- the C structs of one call ---------------------------------------------------------------------------

def _ptr(t: torch.Tensor | None) -> int | None:
    return t.data_ptr() if t is not None else None


def _set_experts(c, spec: LayerSpec, gate, up, down, shared_gate, shared_up, shared_down, fused: bool):
    """The six pointers of an ExpertWeightsC / WeightGradsC. fused: `gate` is Hugging Face's
    [E, 2I, H] (gate rows, then up rows, per expert; `up` unused), reached through expert strides."""
    if fused:
        ih = spec.intermediate * spec.hidden
        c.gate = gate.data_ptr()
        c.up = gate.data_ptr() + ih * gate.element_size()
        c.gate_expert_stride = c.up_expert_stride = 2 * ih
    else:
        c.gate, c.up = gate.data_ptr(), up.data_ptr()
    c.down = down.data_ptr()
    c.shared_gate, c.shared_up, c.shared_down = _ptr(shared_gate), _ptr(shared_up), _ptr(shared_down)
    return c


def weights_c(spec: LayerSpec, w_gate, w_up, w_down, shared_gate, shared_up, shared_down) -> _lib.ExpertWeightsC:
    """w_up None: w_gate is Hugging Face's fused [E, 2I, H] (gate rows, then up rows, per expert)."""
    return _set_experts(_lib.ExpertWeightsC(), spec, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                        fused=w_up is None)


def grads_c(spec: LayerSpec, buffers: list, accumulate: bool, fused: bool) -> _lib.WeightGradsC:
    g = _lib.WeightGradsC()
    g.accumulate_fp32 = 1 if accumulate else 0
    return _set_experts(g, spec, *buffers, fused=fused)


def _stream(device: torch.device) -> ctypes.c_void_p:
    return ctypes.c_void_p(torch.cuda.current_stream(device).cuda_stream)


# ---- the ops' CUDA implementations -----------------------------------------------------------------------

def empty_unfilled(*size, **kwargs) -> torch.Tensor:
    """torch.empty that mok's kernels overwrite entirely (outputs, contexts, gradient buffers; poisoned with NaN
    on an error): not filled even under ``torch.use_deterministic_algorithms(True)``, whose default fill of
    every new tensor would add a memset per call (dsv3's bf16 weight gradients: 22.5 GB per backward)."""
    det = torch.utils.deterministic
    if not (torch.are_deterministic_algorithms_enabled() and det.fill_uninitialized_memory):
        return torch.empty(*size, **kwargs)
    det.fill_uninitialized_memory = False
    try:
        return torch.empty(*size, **kwargs)
    finally:
        det.fill_uninitialized_memory = True


def forward(spec: LayerSpec, x, topk_idx, topk_weights, weights: list, keep: int) -> tuple[torch.Tensor, torch.Tensor]:
    """schedule + forward on the current stream; keep < 0: no context (nothing to differentiate)."""
    T, dev = x.shape[0], x.device
    if T == 0:
        return torch.empty_like(x), torch.empty(0, dtype=torch.uint8, device=dev)
    check_tokens_across_ranks(spec, T, dev.index)
    ws = workspace_for(spec, T, dev.index)
    stream = _stream(dev)
    idx = topk_idx if topk_idx.dtype == torch.int32 else topk_idx.to(torch.int32)
    _lib.call("mok_schedule", ws.handle, ctypes.c_void_p(idx.data_ptr()), T, stream)
    y = empty_unfilled(x.shape, dtype=x.dtype, device=dev)
    if keep < 0:
        ctx, handle = torch.empty(0, dtype=torch.uint8, device=dev), None
    else:
        ctx = empty_unfilled(ws.context_bytes(keep), dtype=torch.uint8, device=dev)
        handle = register_context(ws, ctx, keep)
    w = weights_c(spec, *weights)
    try:
        if spec.fp8:
            w.fp8 = fp8_weights_for(ws, weights, w, stream, forward=True)
        _lib.call("mok_forward", ws.handle, handle, ctypes.c_void_p(x.data_ptr()),
                  ctypes.c_void_p(topk_weights.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.byref(w),
                  1 if keep == KEEP_ACTIVATIONS else 0, stream)
        if _checking():
            ws.check()
    except BaseException:
        if handle is not None:
            drop_context(ctx)
        raise
    return y, ctx


def backward(spec: LayerSpec, ctx, x, topk_weights, dy, weights: list, buffers: list,
             accumulate: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """dx, d topk_w; the weight gradients into ``buffers`` (added in fp32, or written in bf16)."""
    T, dev = x.shape[0], x.device
    dtw = empty_unfilled(T, spec.topk, dtype=torch.float32, device=dev)
    if T == 0:
        if not accumulate:
            for b in buffers:
                if b is not None:
                    b.zero_()
        return torch.empty_like(x), dtw
    ws, handle = take_context(ctx)
    dx = empty_unfilled(x.shape, dtype=x.dtype, device=dev)
    w = weights_c(spec, *weights)
    g = grads_c(spec, buffers, accumulate, fused=weights[1] is None)
    stream = _stream(dev)
    try:
        if spec.fp8:  # the dgrad GEMMs read the transposed copies; a recompute (keep 1) the forward ones
            w.fp8 = fp8_weights_for(ws, weights, w, stream, forward=False)
        _lib.call("mok_backward", ws.handle, handle, ctypes.c_void_p(x.data_ptr()),
                  ctypes.c_void_p(topk_weights.data_ptr()), ctypes.c_void_p(dy.data_ptr()),
                  ctypes.c_void_p(dx.data_ptr()), ctypes.c_void_p(dtw.data_ptr()), ctypes.byref(w), ctypes.byref(g), 0,
                  stream)
    finally:
        _destroy_context(handle)
    if _checking():
        ws.check()
    return dx, dtw


# ---- public helpers ---------------------------------------------------------------------------------------

def check() -> None:
    """Synchronises the devices of mok's workspaces and raises the first device-side error recorded since the
    last check (not while capturing). The device-wide sync covers work a CUDA-graph replay put on any stream."""
    if capturing():
        raise MokError("mok.torch.check() synchronises: call it after the CUDA graph's replay, not inside its capture")
    spaces = workspaces()
    for device in sorted({ws.device for ws in spaces}):
        torch.cuda.synchronize(device)
    for ws in spaces:
        ws.check()


def release() -> None:
    """Frees every workspace, pending context and communicator of this process (collective over each EP group:
    call it on every rank). Layers keep working: the next forward makes new ones."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with _lock:
        handles = [h for _, h in _contexts.values()]
        _contexts.clear()
        spaces = list(_workspaces.values())
        _workspaces.clear()
        comms = list(_comms.values())
        _comms.clear()
    for h in handles:
        _destroy_context(h)
    for ws in spaces:
        ws.destroy()
    for c in comms:
        c.destroy()


def memory_stats() -> dict:
    """Device bytes of mok's workspaces, the number of pending contexts, and the FP8 layers' weight copies (their
    number and bytes; torch allocated them, so torch.cuda.memory_allocated counts them too): for logs and tests."""
    spaces = workspaces()
    with _lock:
        copies = [c for ws in spaces for c in ws.fp8_weights.values()]
    return {"workspaces": len(spaces), "workspace_bytes": sum(ws.device_bytes() for ws in spaces),
            "pending_contexts": len(_contexts), "fp8_weight_copies": len(copies),
            "fp8_weight_bytes": sum(c.memory.numel() for c in copies)}
