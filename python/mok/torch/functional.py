"""``moe_experts``: the functional form of the mok layer, and the EP-group resolution the modules share."""

from __future__ import annotations

import dataclasses
import functools

import torch
from torch import Tensor

import mok
from mok.config import KEEP_ACTIVATIONS, KEEP_ROUTING_ONLY
from mok.errors import invalid_argument

from . import _ops
from ._spec import LayerSpec, make_spec

_CONFIG_FIELDS = [f.name for f in dataclasses.fields(mok.Config)]
LOCAL = "local"  # ep_group value: this process alone, even when torch.distributed is initialised


def resolve_ep_group(ep_group) -> tuple[str, int]:
    """(group name, EP size) of an ``ep_group`` argument: None -> the world group when torch.distributed is
    initialised, else this process alone; mok.torch.LOCAL -> this process alone; a ProcessGroup -> it."""
    if isinstance(ep_group, str):
        if ep_group != LOCAL:
            raise invalid_argument("ep_group", "None, mok.torch.LOCAL or a torch.distributed ProcessGroup",
                                   repr(ep_group))
        return "", 1
    import torch.distributed as dist

    initialised = dist.is_available() and dist.is_initialized()
    if ep_group is None:
        if not initialised:
            return "", 1
        ep_group = dist.group.WORLD
    elif not initialised:
        raise invalid_argument("ep_group", "None or mok.torch.LOCAL (torch.distributed is not initialised)",
                               type(ep_group).__name__)
    size = dist.get_world_size(ep_group)
    if size == 1:
        return "", 1
    backend = dist.get_backend(ep_group)
    if backend != "nccl" and "nccl" not in str(backend):
        raise invalid_argument("ep_group", "a group with the NCCL backend (mok's unique id travels through it)",
                               f"backend {backend!r}")
    return ep_group.group_name, size


@functools.lru_cache(maxsize=256)
def _cached_spec(hidden, intermediate, shared, experts, topk, ep, group, config) -> LayerSpec:
    return make_spec(hidden, intermediate, shared, experts, topk, ep, group, config)


def layer_spec(hidden: int, intermediate: int, num_experts: int, topk: int, shared_intermediate: int = 0,
               ep_group=None, config: mok.Config | None = None) -> str:
    """The spec string of a layer (validated): pass it as ``moe_experts(..., spec=...)`` to skip working it out
    on every call (and under torch.compile, where the work would be traced)."""
    group, ep = resolve_ep_group(ep_group)
    return _cached_spec(hidden, intermediate, shared_intermediate, num_experts, topk, ep, group,
                        config or mok.Config()).key()


def apply(spec: str, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, weights: list, recompute: bool) -> Tensor:
    """The op call behind every entry point. weights: gate, up (None: gate is fused), down, shared gate/up/down."""
    H = x.shape[-1]
    if not x.is_contiguous():
        raise invalid_argument("x", "a contiguous bf16 tensor [..., H] (call .contiguous())",
                               f"strides {tuple(x.stride())}")
    x2 = x.reshape(-1, H)
    K = topk_idx.shape[-1]
    idx2 = topk_idx.reshape(-1, K) if topk_idx.is_contiguous() else topk_idx
    tw2 = topk_weights.reshape(-1, topk_weights.shape[-1]) if topk_weights.is_contiguous() else topk_weights
    needs_grad = torch.is_grad_enabled() and (
        x.requires_grad or topk_weights.requires_grad or any(w is not None and w.requires_grad for w in weights))
    if needs_grad:
        keep = KEEP_ROUTING_ONLY if recompute else KEEP_ACTIVATIONS
        main_grads = [getattr(w, "main_grad", None) if w is not None else None for w in weights]
        policy = 0
        for i, w in enumerate(weights):
            if main_grads[i] is not None and hasattr(w, "grad_added_to_main_grad"):
                zero = getattr(w, "zero_out_wgrad", False)
                policy |= (_ops.POLICY_ZERO_DUMMY if zero else _ops.POLICY_DUMMY) << (2 * i)
    else:
        keep, main_grads, policy = _ops.KEEP_NONE, [None] * 6, 0
    y, _ = torch.ops.mok.moe_forward(x2, idx2, tw2, *weights, *main_grads, spec, keep, policy)
    return y.view(x.shape)


def moe_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor | None = None,
                shared_w1: Tensor | None = None, shared_w2: Tensor | None = None, shared_w3: Tensor | None = None, *,
                num_experts: int | None = None, ep_group=None, config: mok.Config | None = None,
                recompute: bool = False, spec: str | None = None) -> Tensor:
    """y = shared(x) + sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]) with mok's fused kernels.

    x [..., H] bf16 (contiguous); topk_idx [..., K] int32/int64 global expert ids, distinct per token;
    topk_weights [..., K] float32. Weights in torchtitan's layout, this rank's E_local experts: w1 (gate) and
    w3 (up) [E_local, I, H], w2 (down) [E_local, H, I]; w3 None: w1 is Hugging Face's fused gate_up_proj
    [E_local, 2I, H]. Shared expert: shared_w1/shared_w3 [I_sh, H], shared_w2 [H, I_sh]. num_experts: E over
    the EP group (default E_local * its size). recompute: keep only the routing table; the backward
    recomputes the activations (the same bits). Parameters with a ``main_grad`` get their weight gradients
    added into it in fp32 (docs/python.md, "Gradients").
    """
    I = w1.shape[1] if w3 is not None else w1.shape[1] // 2
    shared = shared_w1.shape[0] if shared_w1 is not None else 0
    if spec is None:
        fields = None if config is None else tuple(getattr(config, n) for n in _CONFIG_FIELDS)
        spec = _spec_key(x.shape[-1], I, shared, num_experts or 0, topk_idx.shape[-1], w1.shape[0], ep_group, fields)
    return apply(spec, x, topk_idx, topk_weights, [w1, w3, w2, shared_w1, shared_w3, shared_w2], recompute)


@torch.compiler.assume_constant_result
def _spec_key(hidden, intermediate, shared, num_experts, topk, local_experts, ep_group, config_fields) -> str:
    """moe_experts' spec. torch.compile calls it while tracing and keeps the string as a constant (the
    validation inside calls libmok, which dynamo cannot trace)."""
    group, ep = resolve_ep_group(ep_group)
    config = mok.Config(**dict(zip(_CONFIG_FIELDS, config_fields))) if config_fields is not None else mok.Config()
    return _cached_spec(hidden, intermediate, shared, num_experts or local_experts * ep, topk, ep, group, config).key()
