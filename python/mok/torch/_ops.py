"""The custom ops ``mok::moe_forward`` and ``mok::moe_backward`` (torch.library), their fake
(meta) implementations for torch.compile, and the autograd formula that ties them together.

Weight slots, in this order everywhere: gate, up, down, shared gate, shared up, shared down
(torchtitan's w1, w3, w2 and the shared expert's). ``w_up`` None means ``w_gate`` is Hugging
Face's fused gate_up_proj [E, 2I, H]. ``mg_*`` are the parameters' fp32 ``main_grad`` buffers
(Megatron): inputs the forward ignores and the backward adds the weight gradients into.
"""


from typing import Optional, Tuple

import torch
from torch import Tensor

from mok.errors import invalid_argument

from . import _reference, _runtime
from ._checks import check_forward_args, check_grad_buffers, check_routing_values, check_tensor, describe
from ._spec import LayerSpec, parse_spec

KEEP_NONE = -1  # forward without a context: nothing will be differentiated
GRAD_NAMES = ["grad_gate", "grad_up", "grad_down", "grad_shared_gate", "grad_shared_up", "grad_shared_down"]

# grad_policy: 2 bits per weight slot i (bits 2i, 2i+1), read when the slot has a main_grad:
# 0 -> the backward returns no .grad for it; 1 -> a dummy .grad (left unset) and, in eager mode,
# param.grad_added_to_main_grad = True (Megatron's convention); 2 -> a zero dummy .grad, likewise.
POLICY_NONE, POLICY_DUMMY, POLICY_ZERO_DUMMY = 0, 1, 2


def _spec(spec: str) -> LayerSpec:
    return parse_spec(spec)


def _context_bytes(s: LayerSpec, x: Tensor, keep: int):
    if keep < 0 or x.device.type != "cuda":
        return 0
    T = x.shape[0]
    if not isinstance(T, int):  # a symbolic T (dynamic shapes): the size is known when the op runs
        return torch.library.get_ctx().new_dynamic_size()
    if T == 0:
        return 0
    import mok

    return mok.context_bytes(s.shape(s.workspace_tokens(T)), s.config, keep)


def _cpu_only_local(s: LayerSpec, x: Tensor) -> None:
    """The CPU path's limits: EP 1."""
    if s.ep != 1:
        raise invalid_argument("x", f"a CUDA tensor (the layer's EP group has {s.ep} ranks; the CPU path is EP 1)",
                               describe(x))


def _cpu_fp8(s: LayerSpec):
    """The CPU path's FP8 argument: None in bf16, else whether the weight gradients are FP8 too."""
    return bool(s.config.fp8_weight_grads) if s.fp8 else None


@torch.library.custom_op("mok::moe_forward", mutates_args=())
def moe_forward(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w_gate: Tensor, w_up: Optional[Tensor],
                w_down: Tensor, shared_gate: Optional[Tensor], shared_up: Optional[Tensor],
                shared_down: Optional[Tensor], mg_gate: Optional[Tensor], mg_up: Optional[Tensor],
                mg_down: Optional[Tensor], mg_shared_gate: Optional[Tensor], mg_shared_up: Optional[Tensor],
                mg_shared_down: Optional[Tensor], spec: str, keep: int, grad_policy: int) -> Tuple[Tensor, Tensor]:
    """y [T, H] and the forward's context (uint8; empty when keep < 0 or on the CPU)."""
    s = _spec(spec)
    weights = [w_gate, w_up, w_down, shared_gate, shared_up, shared_down]
    check_forward_args(s, x, topk_idx, topk_weights, *weights)
    if x.device.type == "cuda":
        return _runtime.forward(s, x, topk_idx, topk_weights, weights, keep)
    if x.device.type == "cpu":
        _cpu_only_local(s, x)
        check_routing_values(s, topk_idx, topk_weights)
        y = _reference.forward(x, topk_idx, topk_weights, *weights, s.intermediate, fp8=_cpu_fp8(s) is not None)
        return y, x.new_empty(0, dtype=torch.uint8)
    raise invalid_argument("x", "a CUDA tensor (or a CPU one: the reference path)", describe(x))


@moe_forward.register_fake
def _moe_forward_fake(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, mg_gate,
                      mg_up, mg_down, mg_shared_gate, mg_shared_up, mg_shared_down, spec, keep, grad_policy):
    s = _spec(spec)
    check_forward_args(s, x, topk_idx, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down)
    return torch.empty_like(x), x.new_empty(_context_bytes(s, x, keep), dtype=torch.uint8)


@torch.library.custom_op("mok::moe_backward", mutates_args=tuple(GRAD_NAMES))
def moe_backward(ctx: Tensor, x: Tensor, topk_idx: Tensor, topk_weights: Tensor, dy: Tensor, w_gate: Tensor,
                 w_up: Optional[Tensor], w_down: Tensor, shared_gate: Optional[Tensor], shared_up: Optional[Tensor],
                 shared_down: Optional[Tensor], grad_gate: Tensor, grad_up: Optional[Tensor], grad_down: Tensor,
                 grad_shared_gate: Optional[Tensor], grad_shared_up: Optional[Tensor],
                 grad_shared_down: Optional[Tensor], spec: str, accumulate: int) -> Tuple[Tensor, Tensor]:
    """dx [T, H] bf16 and d topk_weights [T, K] fp32; the weight gradients go into the grad_* buffers: added
    (accumulate = 1, fp32 buffers: main_grad += dW) or written (accumulate = 0, bf16)."""
    s = _spec(spec)
    weights = [w_gate, w_up, w_down, shared_gate, shared_up, shared_down]
    buffers = [grad_gate, grad_up, grad_down, grad_shared_gate, grad_shared_up, grad_shared_down]
    _check_backward_args(s, ctx, x, topk_idx, topk_weights, dy, weights, buffers, bool(accumulate))
    if x.device.type == "cuda":
        return _runtime.backward(s, ctx, x, topk_weights, dy, weights, buffers, bool(accumulate))
    _cpu_only_local(s, x)
    dx, dtw, grads = _reference.backward(x, topk_idx, topk_weights, dy, *weights, s.intermediate, fp8=_cpu_fp8(s))
    for b, g in zip(buffers, grads):
        if b is not None:
            if accumulate:
                b.add_(g)
            else:
                b.copy_(g)
    return dx, dtw


@moe_backward.register_fake
def _moe_backward_fake(ctx, x, topk_idx, topk_weights, dy, w_gate, w_up, w_down, shared_gate, shared_up, shared_down,
                       grad_gate, grad_up, grad_down, grad_shared_gate, grad_shared_up, grad_shared_down, spec,
                       accumulate):
    s = _spec(spec)
    weights = [w_gate, w_up, w_down, shared_gate, shared_up, shared_down]
    buffers = [grad_gate, grad_up, grad_down, grad_shared_gate, grad_shared_up, grad_shared_down]
    _check_backward_args(s, ctx, x, topk_idx, topk_weights, dy, weights, buffers, bool(accumulate))
    return torch.empty_like(x), x.new_empty((x.shape[0], s.topk), dtype=torch.float32)


def _check_backward_args(s, ctx, x, topk_idx, topk_weights, dy, weights, buffers, accumulate):
    check_forward_args(s, x, topk_idx, topk_weights, *weights)
    check_tensor(dy, "dy", tuple(x.shape), f"[T={x.shape[0]}, H={s.hidden}]", (torch.bfloat16,), x.device, "bf16")
    if not isinstance(ctx, Tensor) or ctx.dtype != torch.uint8 or ctx.dim() != 1 or ctx.device != x.device:
        raise invalid_argument("ctx", f"the uint8 context tensor of a mok forward on {x.device}",
                               describe(ctx) if isinstance(ctx, Tensor) else type(ctx).__name__)
    check_grad_buffers(s, weights, buffers, accumulate, GRAD_NAMES)


# ---- autograd ----------------------------------------------------------------------------------------------

_dummies: dict[tuple, Tensor] = {}


def _dummy_grad(w: Tensor, zero: bool) -> Tensor:
    """A cached stand-in .grad for a weight whose gradient went into main_grad (as Transformer Engine does)."""
    key = (tuple(w.shape), w.dtype, w.device, zero)
    d = _dummies.get(key)
    if d is None:
        d = _dummies[key] = torch.zeros_like(w) if zero else torch.empty_like(w)
    return d


def _setup_context(ctx, inputs, output):
    x, topk_idx, topk_weights = inputs[0:3]
    weights, main_grads = list(inputs[3:9]), list(inputs[9:15])
    spec, keep, grad_policy = inputs[15:18]
    ctx.spec, ctx.grad_policy = spec, grad_policy
    # Eager calls pass the Parameters themselves; under torch.compile these are traced stand-ins.
    ctx.params = [w if isinstance(w, torch.nn.Parameter) else None for w in weights]
    ctx.save_for_backward(output[1], x, topk_idx, topk_weights, *weights, *main_grads)


def _backward(ctx, dy, dctx):
    saved = ctx.saved_tensors
    context, x, topk_idx, topk_weights = saved[0:4]
    weights, main_grads = list(saved[4:10]), list(saved[10:16])
    accumulate = any(m is not None for m in main_grads)
    buffers = []
    for w, m in zip(weights, main_grads):
        if w is None:
            buffers.append(None)
        elif accumulate:
            buffers.append(m if m is not None else torch.zeros(w.shape, dtype=torch.float32, device=w.device))
        else:
            buffers.append(_runtime.empty_unfilled(w.shape, dtype=w.dtype, device=w.device))  # mok writes all
    dx, dtw = torch.ops.mok.moe_backward(context, x, topk_idx, topk_weights, dy.contiguous(), *weights, *buffers,
                                         ctx.spec, int(accumulate))
    grads = []
    for i, (w, m, b) in enumerate(zip(weights, main_grads, buffers)):
        if w is None:
            grads.append(None)
        elif m is None:
            grads.append(b.to(w.dtype) if accumulate else b)
        else:
            grads.append(_main_grad_result(ctx, i, w))
    return (dx, None, dtw, *grads) + (None,) * 9


def _main_grad_result(ctx, i: int, w: Tensor):
    policy = (ctx.grad_policy >> (2 * i)) & 3
    if policy == POLICY_NONE:
        return None
    param = ctx.params[i]
    if param is None:  # traced (torch.compile): no Python side effects; a zero .grad is harmless to add
        return torch.zeros_like(w)
    param.grad_added_to_main_grad = True
    return _dummy_grad(w, zero=policy == POLICY_ZERO_DUMMY)


torch.library.register_autograd("mok::moe_forward", _backward, setup_context=_setup_context)
