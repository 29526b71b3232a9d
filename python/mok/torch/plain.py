"""``PlainMoE``: the same layer as ``mok.torch.MoE`` in plain PyTorch, as users write an EP MoE today.

The reference that ``examples/train_lm.py --engine torch`` and ``python -m mok.bench`` compare mok
against (docs/training.md, "The plain PyTorch layer"). One forward over an EP group of W ranks:

1. sort this rank's (token, k) slots by global expert (stable: token order within an expert);
2. exchange the per-expert counts (``all_to_all_single``, one host sync for the split sizes);
3. ``all_to_all_single`` the sorted rows: each rank receives its experts' rows, grouped by source rank;
4. permute them expert-major, each local expert's group padded to a multiple of ``align`` rows
   (at least ``align``: no empty groups);
5. SwiGLU experts: three ``torch._grouped_mm`` calls (bf16 in and out, fp32 accumulation), or a
   loop over experts where ``_grouped_mm`` is unavailable (the CPU);
6. undo the permutation, ``all_to_all_single`` back, undo the sort;
7. y = shared(x) + sum_k w[t, k] * slot[t, k], summed in fp32 in the order k = 0..K-1, rounded once.

The permutations are autograd functions whose backward is the inverse gather (no scatter-add, so
the backward is deterministic and as fast as the forward). Parameters are named and shaped as in
``mok.torch.MoE`` (torchtitan's ``GroupedExperts``): the two layers load each other's state dicts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mok.errors import invalid_argument

from .modules import ExpertParameters

__all__ = ["PlainMoE", "plain_moe_experts", "grouped_mm_available", "IMPLS"]

IMPLS = ("auto", "grouped_mm", "loop")


def grouped_mm_available(device: torch.device) -> bool:
    """True when ``torch._grouped_mm`` (forward and backward) can run bf16 on ``device``: a CUDA GPU of
    compute capability 9.0 or newer (its CUTLASS kernels; the CPU has a forward but no backward)."""
    if not hasattr(torch, "_grouped_mm") or device.type != "cuda":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def _resolve_group(group):
    """(ProcessGroup or None, size, rank): None -> the world group when torch.distributed is initialised,
    "local" (mok.torch.LOCAL) -> this process alone."""
    import torch.distributed as dist

    if isinstance(group, str):
        if group != "local":
            raise invalid_argument("ep_group", "None, mok.torch.LOCAL or a torch.distributed ProcessGroup",
                                   repr(group))
        return None, 1, 0
    if group is None:
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1, 0
        group = dist.group.WORLD
    size = dist.get_world_size(group)
    return (group if size > 1 else None), size, dist.get_rank(group)


class _GatherRows(torch.autograd.Function):
    """y = src[index] for an injective index; the backward puts the rows back (no accumulation needed)."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor) -> Tensor:
        ctx.save_for_backward(index)
        ctx.rows = src.shape[0]
        return src.index_select(0, index)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        out = grad.new_zeros((ctx.rows, *grad.shape[1:]))
        return out.index_copy_(0, index, grad.contiguous()), None


class _DispatchRows(torch.autograd.Function):
    """y[i] = x[order[i] // K]: token t's row once per (t, k) slot, in the slots' sorted order. The backward
    puts each slot's gradient back in (t, k) order and sums over k (in the order k = 0..K-1)."""

    @staticmethod
    def forward(ctx, x: Tensor, order: Tensor, topk: int) -> Tensor:
        ctx.save_for_backward(order)
        ctx.topk = topk
        return x.index_select(0, order // topk)

    @staticmethod
    def backward(ctx, grad: Tensor):
        (order,) = ctx.saved_tensors
        T, K = order.shape[0] // ctx.topk, ctx.topk
        slots = grad.new_empty((T * K, *grad.shape[1:])).index_copy_(0, order, grad.contiguous())
        return slots.view(T, K, *grad.shape[1:]).sum(dim=1), None, None


class _ScatterRows(torch.autograd.Function):
    """y = zeros(rows); y[index] = src for an injective index (the other rows stay zero: padding)."""

    @staticmethod
    def forward(ctx, src: Tensor, index: Tensor, rows: int) -> Tensor:
        ctx.save_for_backward(index)
        out = src.new_zeros((rows, *src.shape[1:]))
        return out.index_copy_(0, index, src.contiguous())

    @staticmethod
    def backward(ctx, grad: Tensor):
        (index,) = ctx.saved_tensors
        return grad.index_select(0, index), None, None


class _AllToAll(torch.autograd.Function):
    """all_to_all_single over rows; the backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx, x: Tensor, out_splits: list, in_splits: list, group) -> Tensor:
        import torch.distributed as dist

        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        import torch.distributed as dist

        out_splits, in_splits = ctx.splits
        # The graph (kept by whoever holds the output) must not keep the group alive after its last use: a
        # group that outlives destroy_process_group keeps gloo's worker threads running into interpreter
        # finalization, where a worker that drops a Python-owned tensor takes the GIL and is ended by
        # pthread_exit inside a noexcept frame ("terminate called without an active exception").
        group, ctx.group = ctx.group, None
        dx = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(dx, grad.contiguous(), in_splits, out_splits, group=group)
        return dx, None, None, None


def _swiglu(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor) -> Tensor:
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def _experts_grouped_mm(buf: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, offs: Tensor) -> Tensor:
    g = torch._grouped_mm(buf, w1.transpose(-2, -1), offs=offs)
    u = torch._grouped_mm(buf, w3.transpose(-2, -1), offs=offs)
    return torch._grouped_mm(F.silu(g) * u, w2.transpose(-2, -1), offs=offs)


def _experts_loop(buf: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, sizes: list) -> Tensor:
    outs = [_swiglu(xe, w1[e], w3[e], w2[e]) if xe.shape[0] else xe.new_empty((0, w2.shape[1]))
            for e, xe in enumerate(torch.split(buf, sizes))]
    return torch.cat(outs)


def plain_moe_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                      shared_w1: Tensor | None = None, shared_w2: Tensor | None = None,
                      shared_w3: Tensor | None = None, *, ep_group=None, impl: str = "auto",
                      align: int = 16) -> Tensor:
    """y = shared(x) + sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]) in plain PyTorch.

    The arguments are ``mok.torch.moe_experts``'s (torchtitan layout: w1/w3 [E_local, I, H], w2 [E_local, H, I],
    this rank's experts; shared_w1/w3 [I_sh, H], shared_w2 [H, I_sh]). ep_group: None (the world group when
    torch.distributed is initialised), mok.torch.LOCAL or a ProcessGroup (any backend with all_to_all).
    impl: "grouped_mm" (torch._grouped_mm), "loop" (one matmul chain per expert) or "auto" (grouped_mm where
    ``grouped_mm_available``). align: rows each expert's group is padded to (grouped_mm only).
    """
    if impl not in IMPLS:
        raise invalid_argument("impl", f"one of {IMPLS}", repr(impl))
    if impl == "auto":
        impl = "grouped_mm" if grouped_mm_available(x.device) else "loop"
    if impl == "grouped_mm":
        def experts(buf: Tensor, sizes: list) -> Tensor:
            offs = torch.tensor(sizes, dtype=torch.int32, device=buf.device).cumsum(0, dtype=torch.int32)
            return _experts_grouped_mm(buf, w1, w3, w2, offs)
    else:
        def experts(buf: Tensor, sizes: list) -> Tensor:
            return _experts_loop(buf, w1, w3, w2, sizes)
    shared = None if shared_w1 is None else (lambda x2: _swiglu(x2, shared_w1, shared_w3, shared_w2))
    return route_through_experts(x, topk_idx, topk_weights, w1.shape[0], ep_group,
                                 align if impl == "grouped_mm" else None, experts, shared)


def route_through_experts(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, E_local: int, ep_group,
                          align: int | None, experts, shared) -> Tensor:
    """The plain layer's data path around its expert GEMMs (shared by the bf16 and the FP8 plain layers).

    Sorts the (token, k) slots by expert, exchanges the counts (one host sync) and the rows over ``ep_group``,
    builds the expert-major buffer (each expert's rows padded with zero rows to a multiple of ``align``, at least
    ``align``; unpadded when ``align`` is None), calls ``experts(buf, sizes)`` -> the rows' outputs, takes them
    back to (token, k) order and combines in fp32 with ``shared(x2)`` (or None) added; one rounding at the end.
    """
    group, ep, _ = _resolve_group(ep_group)
    lead, H = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, H)
    T, K = x2.shape[0], topk_idx.shape[-1]
    E = E_local * ep
    dev = x.device

    # 1. (token, k) slots sorted by global expert; the rows travel in this order.
    flat = topk_idx.reshape(T * K).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=E)
    send = _DispatchRows.apply(x2, order, K)

    # 2. counts per (source rank, local expert): one host sync for the split sizes.
    if group is not None:
        import torch.distributed as dist

        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        host = torch.cat([counts, recv_counts]).tolist()
        send_splits = [sum(host[r * E_local:(r + 1) * E_local]) for r in range(ep)]
        recv_matrix = [host[E + r * E_local:E + (r + 1) * E_local] for r in range(ep)]
        recv_splits = [sum(row) for row in recv_matrix]
        C = recv_counts.view(ep, E_local)
        # 3. dispatch
        recv = _AllToAll.apply(send, recv_splits, send_splits, group)
    else:
        recv_matrix = [counts.tolist()]
        C = counts.view(1, E_local)
        recv = send

    # 4. expert-major order, groups padded to `align` rows (or unpadded).
    per_expert = [sum(recv_matrix[r][j] for r in range(ep)) for j in range(E_local)]
    if align is not None:
        sizes = [max(align, -(-n // align) * align) for n in per_expert]
    else:
        sizes = per_expert
    starts = torch.tensor([0] + sizes[:-1], dtype=torch.int64, device=dev).cumsum(0)  # [E_local]
    # received rows are (source rank, local expert)-major; within expert j, source r starts after sources < r
    dest_start = (starts.unsqueeze(0) + C.cumsum(0) - C).reshape(-1)  # [ep * E_local]
    recv_start = C.reshape(-1).cumsum(0) - C.reshape(-1)
    n_recv = recv.shape[0]
    seg = torch.repeat_interleave(torch.arange(ep * E_local, device=dev), C.reshape(-1), output_size=n_recv)
    dest = dest_start[seg] + torch.arange(n_recv, device=dev) - recv_start[seg]
    rows = sum(sizes)
    moved = align is not None or ep > 1
    buf = _ScatterRows.apply(recv, dest, rows) if moved else recv

    # 5. experts
    out = experts(buf, sizes)

    # 6. back to the source ranks, back to (token, k) order
    back = _GatherRows.apply(out, dest) if moved else out
    if group is not None:
        back = _AllToAll.apply(back, send_splits, recv_splits, group)
    slots = _ScatterRows.apply(back, order, T * K).view(T, K, H)

    # 7. combine in fp32, k = 0..K-1, plus the shared expert; one rounding to bf16
    y = (slots.float() * topk_weights.reshape(T, K, 1).float()).sum(dim=1)
    if shared is not None:
        y = y + shared(x2).float()
    return y.to(x.dtype).view(*lead, H)


class PlainMoE(ExpertParameters):
    """``mok.torch.MoE``'s layer in plain PyTorch (same constructor, parameters and forward).

    ``forward(x, topk_idx, topk_weights)``; parameters ``w1``, ``w3`` [E_local, I, H], ``w2`` [E_local, H, I]
    and with ``shared_intermediate > 0`` ``shared_w1``, ``shared_w3`` [I_sh, H], ``shared_w2`` [H, I_sh]; rank
    r of the EP group holds experts [r * E_local, (r + 1) * E_local). impl: see ``plain_moe_experts``.
    """

    def __init__(self, hidden: int, intermediate: int, num_experts: int, topk: int, shared_intermediate: int = 0,
                 ep_group=None, dtype: torch.dtype = torch.bfloat16, *, device=None, init_std: float = 0.02,
                 impl: str = "auto"):
        super().__init__()
        if impl not in IMPLS:
            raise invalid_argument("impl", f"one of {IMPLS}", repr(impl))
        _, ep, _ = _resolve_group(ep_group)
        if num_experts % ep:
            raise invalid_argument("num_experts", f"a multiple of the EP group's size ({ep})", num_experts)
        if not 1 <= topk <= num_experts:
            raise invalid_argument("topk", f"1 <= topk <= num_experts ({num_experts})", topk)
        self.ep_group, self.impl = ep_group, impl
        self._make_experts(hidden, intermediate, num_experts, topk, shared_intermediate, ep, dtype, device, init_std)

    def forward(self, x: Tensor, topk_idx: Tensor, topk_weights: Tensor) -> Tensor:
        return plain_moe_experts(x, topk_idx, topk_weights, self.w1, self.w2, self.w3, self.shared_w1,
                                 self.shared_w2, self.shared_w3, ep_group=self.ep_group, impl=self.impl)

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, intermediate={self.intermediate}, num_experts={self.num_experts} "
                f"(local {self.local_experts}), topk={self.topk}, shared_intermediate={self.shared_intermediate}, "
                f"ep={self.ep}, impl={self.impl}")
