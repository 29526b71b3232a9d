"""``plain_moe_experts_fp8``: the plain PyTorch EP layer with FP8 expert GEMMs, as torchao trains MoEs on Hopper.

A baseline for ``python -m mok.bench --engines ...,torch_fp8``: the layer of ``mok.torch.plain`` (same arguments,
weight layout, routing, EP exchange, padding and combine) whose expert GEMMs run in FP8 the way torchao's float8
MoE training does (``torchao.prototype.moe_training``, ``_Float8GroupedMM``, the FP8_ROWWISE recipe): every
GEMM of forward and backward quantizes both operands to e4m3 with rowwise fp32 scales right before it and calls
``torch._scaled_grouped_mm`` (CUTLASS, sm_90), bf16 out. Everything else is bf16 as in ``plain_moe_experts``.

Per expert GEMM y = x @ W^T (x [M, K] the expert-major rows, W [G, N, K] torchtitan's layout: G1 is w1/w3
[E, I, H], G2 is w2 [E, H, I]); "rowwise along D" means one scale per row of the operand as the GEMM reads it,
taken over D, the GEMM's reduction dimension:

- forward, 2d x 3d:  x_q [M, K] row-major, scales [M] (along K);  W_q viewed [G, K, N] column-major (W's own
  memory), scales [G, N] (along K, per expert and output feature).
- dgrad, dx = dy @ W, 2d x 3d:  dy_q [M, N] row-major, scales [M] (along N);  W^T made contiguous [G, K, N] and
  quantized along N, viewed [G, N, K] column-major, scales [G, K] (per expert and input feature).
- wgrad, dW_g = dy_g^T @ x_g, 2d x 2d, the groups along the reduction (token) dimension: dy^T_q [N, M]
  row-major with scales [G * N] (per expert group g and feature n, over the group's tokens), x_q [M, K]
  column-major with scales [G * K] (likewise). This is what torchao does on Hopper
  (``triton_fp8_per_group_colwise_scales``): the token dimension is the reduction, so each expert group gets its
  own column scales over its rows; the output [G, N, K] is dW in W's layout.

The shared expert's three GEMMs use ``torch._scaled_mm`` (cuBLAS / CUTLASS) with the same rowwise recipe: forward
along K, dgrad along N, wgrad along the tokens (T padded with zero rows to a multiple of 16, which the kernel
needs and which add nothing).

Quantization (``quantize_rowwise``): amax = max |v| over the reduction dimension, scale = max(amax, 1e-12) / 448
(fp32; the floor keeps all-zero rows, the padding among them, finite), q = e4m3(clamp(v / scale, -448, 448))
(a saturating cast: torch's plain cast would give NaN beyond 448). The GEMM's epilogue multiplies by both
scales. On a GPU each quantization is one function compiled by ``torch.compile`` (``FUSED_QUANTIZATION``):
Triton kernels that read the bf16 operand once for its amax and once for the codes, transposing on the way
where the GEMM wants the other layout, as torchao's fused Triton casts do (the eager version, kept for the CPU
and as the definition, makes fp32 temporaries and transposed bf16 copies: on dsv3 its quantization took most
of a 438 ms step, 2026-12-07). Both give the same bits (a CPU test compares them). Difference from torchao, on
purpose: torchao rounds scales down to a power of two (this layer keeps the exact amax / 448).
Like torchao the kernels run with ``use_fast_accum=True`` (Hopper's FP8 accumulation without the periodic
promotion to fp32; ``fast_accum=False`` promotes).

Constraints of ``torch._scaled_grouped_mm`` honoured here (torch's GroupedBlas.cpp / ScaledGroupMM.cu):
e4m3 operands, fp32 scales, bf16 output; the left operand row-major and the right one column-major; H, I
(and I_shared) multiples of 16; ``offs`` the int32 cumulative group ends; fewer than 1024 groups; in the
2d x 2d wgrad every group non-empty and a multiple of 16 rows. So each expert's group is padded with zero rows
to a multiple of 16, at least 16 (torchtitan aligns token groups to 16 rows for torchao's FP8 recipe the same
way; ``plain_moe_experts`` already pads to ``align`` = 16): an expert without tokens is a group of 16 zero
rows, whose gradient is exactly zero.

Needs a CUDA GPU where torch's rowwise FP8 grouped GEMM runs: compute capability 9.0, Hopper
(``fp8_grouped_mm_available``; torch's op also admits 10.x, but its rowwise kernel is CUTLASS's sm_90 one);
elsewhere calling the layer raises a RuntimeError saying so.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mok.errors import invalid_argument

from .plain import route_through_experts

__all__ = ["plain_moe_experts_fp8", "fp8_grouped_mm_available", "quantize_rowwise", "E4M3_MAX", "AMAX_FLOOR"]

E4M3_MAX = 448.0     # largest finite torch.float8_e4m3fn
AMAX_FLOOR = 1e-12   # amax is clamped to at least this (torchao's EPS) before it becomes a scale
GROUP_ROWS = 16      # the grouped GEMM's row granularity (16-byte TMA alignment of e4m3 rows)
MAX_GROUPS = 1023    # torch's CUTLASS grouped GEMM takes fewer than 1024 groups
CHUNK = 1 << 26      # elements per fp32 quantization temporary (256 MB; dsv3's w1 whole would be 15 GB)


def fp8_grouped_mm_available(device) -> bool:
    """True when ``torch._scaled_grouped_mm`` runs FP8 rowwise on ``device``: a CUDA GPU of compute capability 9.0
    (the rowwise grouped kernel is CUTLASS's sm_90 warp-specialized one) and a torch that has the op."""
    device = torch.device(device)
    if device.type != "cuda" or not hasattr(torch, "_scaled_grouped_mm") or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) == (9, 0)


def _require_fp8(device: torch.device) -> None:
    if fp8_grouped_mm_available(device):
        return
    if device.type == "cuda" and torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(device)
        got = f"{device} is sm_{major}{minor}"
        if not hasattr(torch, "_scaled_grouped_mm"):
            got += f" and torch {torch.__version__} has no torch._scaled_grouped_mm"
    else:
        got = f"the tensors are on {device}"
    raise RuntimeError("plain_moe_experts_fp8 needs torch._scaled_grouped_mm (FP8 e4m3, rowwise scales) on a CUDA "
                       f"GPU of compute capability 9.0 (Hopper), but {got}")


# ---- quantization --------------------------------------------------------------------------------------------

def _to_e4m3(v: Tensor) -> Tensor:
    """Saturating cast of an fp32 temporary (clamped in place) to e4m3."""
    return v.clamp_(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def _amax_to_scale(amax: Tensor) -> Tensor:
    return amax.float().clamp(min=AMAX_FLOOR) / E4M3_MAX


def _chunks(n: int, row_elems: int):
    """(start, length) pieces of n rows of row_elems elements each, about CHUNK elements a piece."""
    step = max(1, CHUNK // max(1, row_elems))
    return [(s, min(step, n - s)) for s in range(0, n, step)]


def quantize_rowwise(t: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """(q, scale) with t ~= q * scale: scale = max(amax, 1e-12) / 448 with amax = max |t| along ``dim`` (fp32,
    kept as a size-1 dimension), q = e4m3(clamp(t / scale, -448, 448)) in t's layout."""
    lo, hi = torch.aminmax(t, dim=dim, keepdim=True)  # no |t| temporary
    scale = _amax_to_scale(torch.maximum(hi, lo.neg()))
    if t.numel() <= CHUNK or t.dim() < 2:
        return _to_e4m3(torch.div(t, scale)), scale
    q = torch.empty_like(t, dtype=torch.float8_e4m3fn)  # t's strides
    c = 1 if dim % t.dim() == 0 else 0  # pieces along a dimension the scales do not reduce
    for s, n in _chunks(t.shape[c], t.numel() // t.shape[c]):
        q.narrow(c, s, n).copy_(_to_e4m3(torch.div(t.narrow(c, s, n), scale.narrow(c, s, n))))
    return q, scale


def _quantize_group_columns(t: Tensor, row_group: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """Per (expert group, column) scales over the group's rows of t [M, C] (rows in groups of multiples of 16;
    row_group[m] is row m's group): (q [M, C] row-major e4m3, scale [groups, C] fp32)."""
    M, C = t.shape
    lo, hi = torch.aminmax(t.view(M // GROUP_ROWS, GROUP_ROWS, C), dim=1)  # per 16-row block
    block_amax = torch.maximum(hi, lo.neg()).float()
    block_group = row_group[::GROUP_ROWS].unsqueeze(1).expand(-1, C)
    amax = block_amax.new_zeros(groups, C).scatter_reduce_(0, block_group, block_amax, "amax")
    scale = _amax_to_scale(amax)
    q = torch.empty_like(t, dtype=torch.float8_e4m3fn)
    for s, n in _chunks(M, C):
        piece = scale.index_select(0, row_group[s:s + n])  # fp32, overwritten by t / scale
        q[s:s + n] = _to_e4m3(torch.div(t[s:s + n], piece, out=piece))
    return q, scale


# ---- fused quantization (torch.compile) ---------------------------------------------------------------------

FUSED_QUANTIZATION = True  # CUDA tensors: the compiled quantizers below; False: the eager ones (to time them)
_compiled: dict = {}


def _rowwise_direct(t: Tensor, dim: int) -> tuple[Tensor, Tensor]:
    """quantize_rowwise's values in one expression for torch.compile: q contiguous in t's shape, whatever t's strides
    (a transposed view comes out transposed in memory: the copy fused into the cast)."""
    amax = t.abs().amax(dim=dim, keepdim=True).float()
    scale = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    q = (t.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).contiguous()
    return q, scale


def _group_columns_t_direct(t: Tensor, row_group: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """_quantize_group_columns' values, the codes transposed: (q^T [C, M] contiguous, scale [groups, C])."""
    M, C = t.shape
    block_amax = t.view(M // GROUP_ROWS, GROUP_ROWS, C).abs().amax(dim=1).float()
    block_group = row_group[::GROUP_ROWS].unsqueeze(1).expand(-1, C)
    amax = block_amax.new_zeros(groups, C).scatter_reduce_(0, block_group, block_amax, "amax")
    scale = amax.clamp(min=AMAX_FLOOR) / E4M3_MAX
    q = (t.float() / scale[row_group]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.t().contiguous(), scale


def _compiled_fn(fn):
    if fn not in _compiled:
        _compiled[fn] = torch.compile(fn, dynamic=True)
    return _compiled[fn]


def _fused(t: Tensor) -> bool:
    return FUSED_QUANTIZATION and t.is_cuda


def _rowwise(t: Tensor, dim: int = -1) -> tuple[Tensor, Tensor]:
    """(q contiguous in t's shape, scale) of any view t: the compiled quantizer on a GPU, else the eager one."""
    if _fused(t):
        return _compiled_fn(_rowwise_direct)(t, dim)
    return quantize_rowwise(t.contiguous(), dim)


def _group_columns_t(t: Tensor, row_group: Tensor, groups: int) -> tuple[Tensor, Tensor]:
    """(q^T [C, M] contiguous, scale [groups, C]) of t [M, C] in expert row groups (the wgrad operands)."""
    if _fused(t):
        return _compiled_fn(_group_columns_t_direct)(t, row_group, groups)
    q, scale = _quantize_group_columns(t, row_group, groups)
    return q.t().contiguous(), scale


# ---- the GEMMs -----------------------------------------------------------------------------------------------

def _grouped_mm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, offs: Tensor, fast_accum: bool) -> Tensor:
    return torch._scaled_grouped_mm(a, b, sa, sb, offs=offs, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


class _GroupedLinearFp8(torch.autograd.Function):
    """y[rows of g] = x[rows of g] @ w[g]^T for x [M, K] in expert groups (ends ``offs``, multiples of 16 rows),
    w [G, N, K]; forward, dgrad and wgrad as FP8 rowwise ``torch._scaled_grouped_mm`` (module docstring)."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, offs: Tensor, row_group: Tensor, fast_accum: bool) -> Tensor:
        x = x.contiguous()
        xq, xs = _rowwise(x)                            # [M, K], [M, 1]: along K
        wq, ws = _rowwise(w)                            # [G, N, K], [G, N, 1]: along K
        ctx.save_for_backward(x, w, offs, row_group)
        ctx.fast_accum = fast_accum
        # [M, K] row-major @ [G, K, N] column-major -> [M, N]
        return _grouped_mm(xq, wq.transpose(-2, -1), xs.squeeze(-1), ws.squeeze(-1), offs, fast_accum)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w, offs, row_group = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq, dys = _rowwise(dy)                                             # [M, N], [M, 1]: along N
            wtq, wts = _rowwise(w.transpose(-2, -1))                            # [G, K, N], [G, K, 1]: along N
            # [M, N] row-major @ [G, N, K] column-major -> [M, K]
            dx = _grouped_mm(dyq, wtq.transpose(-2, -1), dys.squeeze(-1), wts.squeeze(-1), offs,
                             ctx.fast_accum).to(x.dtype)
        if ctx.needs_input_grad[1]:
            G = w.shape[0]
            dyqt, dys = _group_columns_t(dy, row_group, G)                      # [N, M], [G, N]: group's tokens
            xqt, xs = _group_columns_t(x, row_group, G)                         # [K, M], [G, K]: group's tokens
            # [N, M] row-major @ [M, K] column-major, K-groups along M -> [G, N, K]
            dw = _grouped_mm(dyqt, xqt.t(), dys.reshape(-1), xs.reshape(-1), offs, ctx.fast_accum).to(w.dtype)
        return dx, dw, None, None, None


def _dense_mm(a: Tensor, b: Tensor, sa: Tensor, sb: Tensor, fast_accum: bool) -> Tensor:
    """a [M, K] row-major e4m3, scales sa [M, 1]; b [K, N] column-major e4m3, scales sb [1, N]."""
    return torch._scaled_mm(a, b, sa, sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum)


class _LinearFp8(torch.autograd.Function):
    """y = x @ w^T for x [T, K], w [N, K] (the shared expert), each GEMM an FP8 rowwise ``torch._scaled_mm``."""

    @staticmethod
    def forward(ctx, x: Tensor, w: Tensor, fast_accum: bool) -> Tensor:
        x = x.contiguous()
        xq, xs = _rowwise(x)                            # [T, K], [T, 1]
        wq, ws = _rowwise(w)                            # [N, K], [N, 1]
        ctx.save_for_backward(x, w)
        ctx.fast_accum = fast_accum
        return _dense_mm(xq, wq.t(), xs, ws.view(1, -1), fast_accum)

    @staticmethod
    def backward(ctx, dy: Tensor):
        x, w = ctx.saved_tensors
        dy = dy.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dyq, dys = _rowwise(dy)                                 # [T, N], [T, 1]: along N
            wtq, wts = _rowwise(w.t())                              # [K, N], [K, 1]: along N
            dx = _dense_mm(dyq, wtq.t(), dys, wts.view(1, -1), ctx.fast_accum).to(x.dtype)
        if ctx.needs_input_grad[1]:
            pad = -x.shape[0] % GROUP_ROWS                          # the reduction (token) dim: a multiple of 16
            dyt = F.pad(dy, (0, 0, 0, pad)).t()                     # [N, T'] (a view)
            xt = F.pad(x, (0, 0, 0, pad)).t()                       # [K, T']
            dytq, dyts = _rowwise(dyt)                              # along the tokens, per output feature
            xtq, xts = _rowwise(xt)                                 # along the tokens, per input feature
            dw = _dense_mm(dytq, xtq.t(), dyts, xts.view(1, -1), ctx.fast_accum).to(w.dtype)
        return dx, dw, None


def _swiglu_fp8(x: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, fast_accum: bool) -> Tensor:
    h = F.silu(_LinearFp8.apply(x, w1, fast_accum)) * _LinearFp8.apply(x, w3, fast_accum)
    return _LinearFp8.apply(h, w2, fast_accum)


def _experts_fp8(buf: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, offs: Tensor, row_group: Tensor,
                 fast_accum: bool) -> Tensor:
    g = _GroupedLinearFp8.apply(buf, w1, offs, row_group, fast_accum)
    u = _GroupedLinearFp8.apply(buf, w3, offs, row_group, fast_accum)
    return _GroupedLinearFp8.apply(F.silu(g) * u, w2, offs, row_group, fast_accum)


# ---- the layer -----------------------------------------------------------------------------------------------

def _check_dims(H: int, w1: Tensor, w2: Tensor, w3: Tensor, shared_w1, align: int) -> None:
    E_local, I = w1.shape[0], w1.shape[1]
    if H % 16:
        raise invalid_argument("hidden", "a multiple of 16 (torch._scaled_grouped_mm)", H)
    if I % 16:
        raise invalid_argument("intermediate", "a multiple of 16 (torch._scaled_grouped_mm)", I)
    if tuple(w1.shape) != (E_local, I, H) or tuple(w3.shape) != (E_local, I, H) or tuple(w2.shape) != (E_local, H, I):
        raise invalid_argument("w1/w2/w3", f"[E_local, I, H] / [E_local, H, I] with H = {H}",
                               f"{tuple(w1.shape)} / {tuple(w2.shape)} / {tuple(w3.shape)}")
    if not 1 <= E_local <= MAX_GROUPS:
        raise invalid_argument("w1", f"1 to {MAX_GROUPS} local experts (torch._scaled_grouped_mm groups)", E_local)
    if shared_w1 is not None and shared_w1.shape[0] % 16:
        raise invalid_argument("shared_intermediate", "a multiple of 16 (torch._scaled_mm)", shared_w1.shape[0])
    if align < GROUP_ROWS or align % GROUP_ROWS:
        raise invalid_argument("align", f"a positive multiple of {GROUP_ROWS}", align)


def plain_moe_experts_fp8(x: Tensor, topk_idx: Tensor, topk_weights: Tensor, w1: Tensor, w2: Tensor, w3: Tensor,
                          shared_w1: Tensor | None = None, shared_w2: Tensor | None = None,
                          shared_w3: Tensor | None = None, *, ep_group=None, align: int = 16,
                          fast_accum: bool = True) -> Tensor:
    """y = shared(x) + sum_k topk_weights[t, k] * expert_{topk_idx[t, k]}(x[t]), the expert GEMMs in FP8.

    ``plain_moe_experts``' arguments and results (torchtitan layout: w1/w3 [E_local, I, H], w2 [E_local, H, I];
    shared_w1/w3 [I_sh, H], shared_w2 [H, I_sh]; ep_group None, mok.torch.LOCAL or a ProcessGroup) with its
    ``impl="grouped_mm"`` data path: the same sort, count exchange, all-to-all, expert-major buffer padded to
    ``align`` rows per expert (here a multiple of 16), reverse path and fp32 combine: ``plain.route_through_experts``.
    Only the GEMMs differ: FP8 e4m3 with rowwise scales through ``torch._scaled_grouped_mm`` (routed
    experts) and ``torch._scaled_mm`` (shared expert), bf16 out (module docstring). fast_accum: the kernels'
    ``use_fast_accum`` (torchao's choice, True). H, I and I_sh must be multiples of 16.
    """
    _require_fp8(x.device)
    H = x.shape[-1]
    _check_dims(H, w1, w2, w3, shared_w1, align)
    E_local = w1.shape[0]

    def experts(buf: Tensor, sizes: list) -> Tensor:
        sizes_t = torch.tensor(sizes, dtype=torch.int32, device=buf.device)
        offs = sizes_t.cumsum(0, dtype=torch.int32)
        row_group = torch.repeat_interleave(torch.arange(E_local, device=buf.device), sizes_t,
                                            output_size=buf.shape[0])
        return _experts_fp8(buf, w1, w3, w2, offs, row_group, fast_accum)

    shared = None if shared_w1 is None else (
        lambda x2: _swiglu_fp8(x2, shared_w1, shared_w3, shared_w2, fast_accum))
    return route_through_experts(x, topk_idx, topk_weights, E_local, ep_group, align, experts, shared)
