"""Argument checks of the mok ops: metadata (dtype, device, shape, layout) and, for the CPU path,
the values (expert ids, router weights).

Metadata checks run in the real and in the fake implementations, so a wrong call fails when it
is traced (torch.compile) as well as when it runs. On the GPU the value checks are libmok's own:
the schedule and the forward flag a bad expert id, a duplicate expert or a non-finite router
weight in the workspace's device error record, and ``mok_workspace_check`` turns the record
into a MokInvalidArgument (docs/python.md, "Errors").
"""

from __future__ import annotations

import torch

from mok.errors import invalid_argument

from ._spec import LayerSpec

INDEX_DTYPES = (torch.int32, torch.int64)


def describe(t: torch.Tensor) -> str:
    """'float32 [8, 256] on cuda:0' (plus the strides when the tensor is not contiguous)."""
    dtype = str(t.dtype).replace("torch.", "")
    text = f"{dtype} {list(t.shape)} on {t.device}"
    if not t.is_contiguous():
        text += f" with strides {tuple(t.stride())} (not contiguous)"
    return text


def check_tensor(t, name: str, shape: tuple, dims: str, dtypes, device: torch.device | None,
                 dtype_text: str) -> None:
    """``t`` must be a contiguous tensor of one of ``dtypes``, shape ``shape`` (ints, None = any), on ``device``."""
    if not isinstance(t, torch.Tensor):
        raise invalid_argument(name, f"a tensor {dims}", type(t).__name__)
    expected = f"a contiguous {dtype_text} tensor {dims}" + (f" on {device}" if device is not None else "")
    if t.dtype not in dtypes:
        raise invalid_argument(name, expected, describe(t))
    if device is not None and t.device != device:
        raise invalid_argument(name, expected, describe(t))
    if t.dim() != len(shape) or any(s is not None and t.shape[i] != s for i, s in enumerate(shape)):
        raise invalid_argument(name, expected, describe(t))
    if not t.is_contiguous():
        raise invalid_argument(name, expected + " (call .contiguous())", describe(t))


def check_forward_args(spec: LayerSpec, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up,
                       shared_down) -> None:
    """Dtypes, devices, shapes and layouts of a forward's tensors (w_up None: w_gate is the fused [E, 2I, H])."""
    H, I, S, E, K = spec.hidden, spec.intermediate, spec.shared_intermediate, spec.local_experts, spec.topk
    bf16 = (torch.bfloat16,)
    check_tensor(x, "x", (None, H), f"[T, H={H}]", bf16, None, "bf16")
    T = x.shape[0]
    dev = x.device
    check_tensor(topk_idx, "topk_idx", (T, K), f"[T={T}, K={K}]", INDEX_DTYPES, dev, "int32 or int64")
    check_tensor(topk_weights, "topk_weights", (T, K), f"[T={T}, K={K}]", (torch.float32,), dev, "float32")
    if w_up is None:
        check_tensor(w_gate, "gate_up_proj", (E, 2 * I, H), f"[E_local={E}, 2*I={2 * I}, H={H}]", bf16, dev, "bf16")
    else:
        check_tensor(w_gate, "w1", (E, I, H), f"[E_local={E}, I={I}, H={H}]", bf16, dev, "bf16")
        check_tensor(w_up, "w3", (E, I, H), f"[E_local={E}, I={I}, H={H}]", bf16, dev, "bf16")
    check_tensor(w_down, "w2", (E, H, I), f"[E_local={E}, H={H}, I={I}]", bf16, dev, "bf16")
    shared = (shared_gate, shared_up, shared_down)
    if S > 0:
        for t, name, shape, dims in ((shared_gate, "shared_w1", (S, H), f"[I_shared={S}, H={H}]"),
                                     (shared_up, "shared_w3", (S, H), f"[I_shared={S}, H={H}]"),
                                     (shared_down, "shared_w2", (H, S), f"[H={H}, I_shared={S}]")):
            if t is None:
                raise invalid_argument(name, f"a bf16 tensor {dims} (shared_intermediate = {S})", "None")
            check_tensor(t, name, shape, dims, bf16, dev, "bf16")
    elif any(t is not None for t in shared):
        raise invalid_argument("shared_w1/w2/w3", "None (the layer has no shared expert: shared_intermediate = 0)",
                               "tensors")


def check_grad_buffers(spec: LayerSpec, weights: list, buffers: list, accumulate: bool, names: list[str]) -> None:
    """Weight-gradient buffers: each like its weight, float32 (accumulate) or bf16 (write)."""
    dtype = torch.float32 if accumulate else torch.bfloat16
    text = "float32" if accumulate else "bf16"
    for w, g, name in zip(weights, buffers, names):
        if w is None:
            if g is not None:
                raise invalid_argument(name, "None (its weight is None)", describe(g))
            continue
        dims = str(list(w.shape))
        if g is None:
            raise invalid_argument(name, f"a {text} tensor {dims}", "None")
        check_tensor(g, name, tuple(w.shape), dims, (dtype,), w.device, text)


def check_routing_values(spec: LayerSpec, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
    """Expert ids in [0, E), distinct within a token, finite router weights (the CPU path; libmok checks on the GPU)."""
    E = spec.experts
    idx = topk_idx.to(torch.int64)
    bad = (idx < 0) | (idx >= E)
    if bool(bad.any()):
        t, k = (int(v) for v in bad.nonzero()[0])
        raise invalid_argument(f"topk_idx[token {t}, k {k}]", f"an expert id in [0, {E})", int(idx[t, k]))
    if idx.shape[1] > 1:
        same = idx.unsqueeze(2) == idx.unsqueeze(1)  # [T, K, K]
        earlier = torch.ones(idx.shape[1], idx.shape[1], dtype=torch.bool, device=idx.device).tril(-1)
        dup = (same & earlier).any(dim=2)
        if bool(dup.any()):
            t, k = (int(v) for v in dup.nonzero()[0])
            raise invalid_argument(f"topk_idx[token {t}, k {k}]",
                                   f"distinct experts within one token (expert {int(idx[t, k])} already appears at an "
                                   "earlier k)", int(idx[t, k]))
    finite = torch.isfinite(topk_weights)
    if not bool(finite.all()):
        t, k = (int(v) for v in (~finite).nonzero()[0])
        raise invalid_argument(f"topk_weights[token {t}, k {k}]", "a finite router weight", float(topk_weights[t, k]))
