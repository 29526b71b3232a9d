"""``MoE`` (the routed and shared experts, torchtitan's parameter layout) and ``TopKRouter``."""

from __future__ import annotations

import contextlib
import dataclasses

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mok
from mok.config import precision_name
from mok.errors import invalid_argument

from .functional import apply, resolve_ep_group
from ._spec import make_spec


@torch.no_grad()
def init_trunc_normal_(p: Tensor, std: float) -> None:
    """trunc_normal_ drawn in fp32 and rounded once (drawn in bf16 directly its std comes out far too large)."""
    if p.device.type == "meta":
        return
    tmp = torch.empty(p.shape, dtype=torch.float32, device=p.device)
    nn.init.trunc_normal_(tmp, mean=0.0, std=std)
    p.copy_(tmp)


class ExpertParameters(nn.Module):
    """This EP rank's expert weights in torchtitan's ``GroupedExperts`` layout, shared by ``MoE`` and the plain
    PyTorch layer (``mok.torch.plain.PlainMoE``), so that the two load each other's state dicts: ``w1`` (gate)
    and ``w3`` (up) [E_local, I, H], ``w2`` (down) [E_local, H, I]; with ``shared_intermediate > 0`` also
    ``shared_w1``, ``shared_w3`` [I_sh, H] and ``shared_w2`` [H, I_sh]."""

    def _make_experts(self, hidden: int, intermediate: int, num_experts: int, topk: int, shared_intermediate: int,
                      ep: int, dtype: torch.dtype, device, init_std: float) -> None:
        self.hidden, self.intermediate, self.num_experts, self.topk = hidden, intermediate, num_experts, topk
        self.shared_intermediate, self.ep, self.init_std = shared_intermediate, ep, init_std
        el = num_experts // ep
        kw = {"dtype": dtype, "device": device}
        self.w1 = nn.Parameter(torch.empty(el, intermediate, hidden, **kw))
        self.w2 = nn.Parameter(torch.empty(el, hidden, intermediate, **kw))
        self.w3 = nn.Parameter(torch.empty(el, intermediate, hidden, **kw))
        if shared_intermediate > 0:
            self.shared_w1 = nn.Parameter(torch.empty(shared_intermediate, hidden, **kw))
            self.shared_w2 = nn.Parameter(torch.empty(hidden, shared_intermediate, **kw))
            self.shared_w3 = nn.Parameter(torch.empty(shared_intermediate, hidden, **kw))
        else:
            self.shared_w1 = self.shared_w2 = self.shared_w3 = None
        self.reset_parameters()

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    def reset_parameters(self) -> None:
        """Truncated normal (std ``init_std``), as torchtitan initialises its experts."""
        for p in self.parameters():
            init_trunc_normal_(p, self.init_std)


class MoE(ExpertParameters):
    """The experts of one MoE layer on mok's fused kernels.

    Parameters are this EP rank's experts, named and shaped as torchtitan's ``GroupedExperts`` (so its
    checkpoints load after renaming ``experts.w1`` -> ``w1`` etc.): ``w1`` (gate) and ``w3`` (up)
    [E_local, I, H], ``w2`` (down) [E_local, H, I]; with ``shared_intermediate > 0`` also ``shared_w1``,
    ``shared_w3`` [I_sh, H] and ``shared_w2`` [H, I_sh] (torchtitan's ``shared_experts.w1.weight`` ...).
    Rank r of the EP group holds experts [r * E_local, (r + 1) * E_local).

    ``forward(x, topk_idx, topk_weights)``: x [..., H] bf16, topk_idx [..., K] global expert ids (int32 or
    int64), topk_weights [..., K] float32; returns y shaped like x. Layers of the same sizes, config and
    group share one workspace; each forward keeps its own context until its backward (docs/python.md).

    ep_group: None (the world group when torch.distributed is initialised, else this GPU alone),
    ``mok.torch.LOCAL``, or a ProcessGroup (NCCL backend). recompute: keep only the routing table; the
    backward recomputes the activations (the same bits, less memory).

    precision: the expert GEMMs' arithmetic, "bf16" or "fp8_block" ("fp8" for short: DeepSeek-V3's
    block-scaled FP8, docs/fp8.md; parameters, inputs, outputs and gradients stay bf16 / fp32); None takes
    ``config.precision`` (default "bf16"). fp8_weight_grads: with FP8, the weight-gradient GEMMs in FP8
    (True, libmok's default) or bf16; None takes ``config.fp8_weight_grads``. Either may also be set in
    ``config``; set in both, they must agree. An FP8 layer keeps FP8 copies of its weights on the GPU,
    re-quantized when a weight changes (docs/python.md, "FP8").
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, shared_intermediate: int = 0,
                 ep_group=None, config: mok.Config | None = None, dtype: torch.dtype = torch.bfloat16, *,
                 device=None, recompute: bool = False, init_std: float = 0.02, precision: str | None = None,
                 fp8_weight_grads: bool | None = None):
        super().__init__()
        if dtype != torch.bfloat16:
            raise invalid_argument("dtype", "torch.bfloat16 (mok's experts compute in bf16)", dtype)
        group, ep = resolve_ep_group(ep_group)
        config = with_precision(config, precision, fp8_weight_grads)
        self.spec = make_spec(hidden, intermediate, shared_intermediate, num_experts, topk, ep, group, config)
        self._spec_key = self.spec.key()
        self.recompute = recompute
        self._make_experts(hidden, intermediate, num_experts, topk, shared_intermediate, ep, dtype, device, init_std)

    def forward(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Tensor:
        return apply(self._spec_key, x, topk_idx, topk_weights,
                     [self.w1, self.w3, self.w2, self.shared_w1, self.shared_w3, self.shared_w2], self.recompute)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts} "
                f"(local {self.local_experts}), topk={self.topk}, shared_intermediate={self.shared_intermediate}, "
                f"ep={self.ep}, recompute={self.recompute}, precision={self.spec.config.precision}")


def with_precision(config: mok.Config | None, precision: str | None, fp8_weight_grads: bool | None) -> mok.Config:
    """``config`` with the module arguments ``precision`` and ``fp8_weight_grads`` filled in (validated as
    mok.Config validates them). One set both here and in ``config`` must agree."""
    config = config or mok.Config()
    if precision is not None:
        precision = precision_name(precision, "precision")
    if fp8_weight_grads is not None and not isinstance(fp8_weight_grads, bool):
        raise invalid_argument("fp8_weight_grads", "None, True or False", repr(fp8_weight_grads))
    for name, value in (("precision", precision), ("fp8_weight_grads", fp8_weight_grads)):
        inside = getattr(config, name)
        if value is None:
            continue
        if inside is not None and inside != value:
            raise invalid_argument(name, f"None or config.{name} ({inside!r}): set in both, they must agree",
                                   repr(value))
        config = dataclasses.replace(config, **{name: value})
    return config


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on the router weights whose backward also feeds d(aux_loss) = 1: the load-balancing loss
    trains the router without the caller adding it to the loss (Megatron's MoEAuxLossAutoScaler idea)."""

    @staticmethod
    def forward(ctx, weights, aux_loss):
        ctx.save_for_backward(aux_loss)
        return weights.clone()

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.ones_like(aux_loss)


class TopKRouter(nn.Module):
    """Linear scores over the experts, softmax or sigmoid, top-k: ``topk_idx, topk_weights = router(x)``.

    ``gate.weight`` [E, H] (torchtitan's router layout), float32 by default; the scores are float32.
    route_norm (default: on for sigmoid, off for softmax) divides the chosen scores by their sum;
    route_scale multiplies them. aux_loss_coeff > 0 adds the load-balancing loss
    ``coeff * E * sum_e f_e * P_e`` (f_e: share of this rank's (token, k) choices that picked expert e,
    P_e: mean score of e) to the training gradient (see ``_AttachAuxLoss``); ``forward(x,
    return_aux_loss=True)`` returns it as a third value instead, for the caller to add.
    """

    def __init__(self, hidden: int, num_experts: int, topk: int, score_func: str = "softmax",
                 route_norm: bool | None = None, route_scale: float = 1.0, aux_loss_coeff: float = 0.0, *,
                 dtype: torch.dtype = torch.float32, device=None):
        super().__init__()
        if score_func not in ("softmax", "sigmoid"):
            raise invalid_argument("score_func", "'softmax' or 'sigmoid'", repr(score_func))
        if not 1 <= topk <= num_experts:
            raise invalid_argument("topk", f"1 <= topk <= num_experts ({num_experts})", topk)
        self.num_experts, self.topk, self.score_func = num_experts, topk, score_func
        self.route_norm = (score_func == "sigmoid") if route_norm is None else route_norm
        self.route_scale, self.aux_loss_coeff = route_scale, aux_loss_coeff
        self.gate = nn.Linear(hidden, num_experts, bias=False, dtype=dtype, device=device)

    def forward(self, x: Tensor, return_aux_loss: bool = False):
        lead = x.shape[:-1]
        x2 = x.reshape(-1, x.shape[-1])
        # Scores in the gate's dtype (fp32 by default) also under torch.autocast, which would run the
        # linear in bf16: routing decisions are sensitive to it.
        kind = x2.device.type
        with torch.autocast(device_type=kind, enabled=False) if kind in ("cuda", "cpu") else contextlib.nullcontext():
            logits = F.linear(x2.to(self.gate.weight.dtype), self.gate.weight).float()
        scores = torch.softmax(logits, dim=-1) if self.score_func == "softmax" else torch.sigmoid(logits)
        top, idx = torch.topk(scores, self.topk, dim=-1)
        if self.route_norm:
            top = top / (top.sum(dim=-1, keepdim=True) + 1e-20)
        if self.route_scale != 1.0:
            top = top * self.route_scale
        aux = None
        if self.aux_loss_coeff > 0 and (return_aux_loss or (self.training and torch.is_grad_enabled())):
            aux = self.aux_loss_coeff * self.load_balancing_loss(scores, idx)
            if not return_aux_loss:
                top = _AttachAuxLoss.apply(top, aux)
        idx = idx.to(torch.int32).reshape(*lead, self.topk)
        top = top.reshape(*lead, self.topk)
        if return_aux_loss:
            return idx, top, aux if aux is not None else scores.new_zeros(())
        return idx, top

    def load_balancing_loss(self, scores: Tensor, idx: Tensor) -> Tensor:
        """E * sum_e f_e * P_e over this rank's tokens (1 when perfectly balanced); integer counts, no atomics
        on floats, so it is deterministic."""
        E = self.num_experts
        counts = torch.zeros(E, dtype=torch.int64, device=idx.device).scatter_add_(
            0, idx.reshape(-1), torch.ones(idx.numel(), dtype=torch.int64, device=idx.device))
        f = counts.float() / max(idx.numel(), 1)
        p = scores.float().mean(dim=0)
        if self.score_func == "sigmoid":
            p = p / (p.sum() + 1e-20)
        return E * (f * p).sum()
