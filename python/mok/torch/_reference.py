"""The CPU path of the mok ops: the layer of docs/numerics.md in plain torch, one process (EP 1).

It lets models that use mok run, trace and train without a GPU (the CPU test suite runs the
ops, opcheck, torch.compile and a toy model on it), and it is slow: a loop over experts in fp32.
It rounds to bf16 at the contract's points (g, u, h, the expert outputs, y, dg, du, hs, dx);
the order of fp32 sums inside a dot product is torch's, which the contract leaves free. The
backward recomputes g and u from x (so the CPU context holds nothing).
"""

from __future__ import annotations

import torch

from mok.errors import invalid_argument


def _bf(t: torch.Tensor) -> torch.Tensor:
    """bf16 rounding of an fp32 tensor, kept in fp32."""
    return t.to(torch.bfloat16).float()


_E4M3_MAX = 448.0


def _scale_exponent(amax: torch.Tensor) -> torch.Tensor:
    """ref::scale_exponent: the smallest k with amax <= 448 * 2^k, clamped to >= -126; 0 for amax == 0."""
    m, e = torch.frexp(amax)
    k = torch.where(m <= 0.875, e - 9, e - 8).clamp(min=-126)
    return torch.where(amax == 0, torch.zeros_like(k), k)


def _check_finite(v: torch.Tensor, name: str) -> None:
    """A non-finite value in a tensor FP8 quantizes is an error naming it (the first in row-major order)."""
    if not torch.isfinite(v).all():
        r, c = (~torch.isfinite(v)).nonzero()[0].tolist()
        raise invalid_argument(name, "finite values to quantize to fp8 (Config.precision fp8_block)",
                               f"a non-finite value at row {r}, column {c}")


def _quant_blocks(v: torch.Tensor, br: int, name: str):
    """(codes as fp32 values, scales per element) of an fp32 [rows, cols] tensor in blocks of br x 128: the
    dequantized tensor is codes * scales. Non-finite values are an error naming the tensor."""
    _check_finite(v, name)
    rows, cols = v.shape
    pr, pc = (-rows) % br, (-cols) % 128
    vp = torch.nn.functional.pad(v, (0, pc, 0, pr))
    blocks = vp.view((rows + pr) // br, br, (cols + pc) // 128, 128)
    k = _scale_exponent(blocks.abs().amax(dim=(1, 3), keepdim=True))
    codes = torch.ldexp(blocks, -k.float()).to(torch.float8_e4m3fn).float()  # exact scaling, RNE, |v| <= 448
    scales = torch.ldexp(torch.ones_like(k, dtype=torch.float32), k.float()).expand_as(blocks)
    unpad = lambda t: t.reshape(rows + pr, cols + pc)[:rows, :cols]  # noqa: E731
    return unpad(codes), unpad(scales)


def _q_rows(v, name):
    """1x128 blocks along the columns (activations, gradients)."""
    return _quant_blocks(v, 1, name)


def _q_weight(w, name):
    return _quant_blocks(w.float(), 128, name)


def _dot8(a, w, acc=None):
    """a @ w^T in the FP8 recipe: a, w are (codes, scales) over the same K; per 128-block fp32 sums, then
    acc += part * (sa * sw) block after block (each scale constant over a block's K), from acc (None: zeros)."""
    (ac, asc), (wc, wsc) = a, w
    K = ac.shape[1]
    if acc is None:
        acc = torch.zeros(ac.shape[0], wc.shape[0], dtype=torch.float32)
    for b0 in range(0, K, 128):
        part = ac[:, b0:b0 + 128] @ wc[:, b0:b0 + 128].t()
        acc = acc + part * (asc[:, b0:b0 + 1] * wsc[:, b0:b0 + 1].t())
    return acc


def _round_fp8(v, name):
    """The FP8 round trip of an activation the context keeps (1x128 along the columns), back in bf16."""
    c, sc = _q_rows(v, name)
    return _bf(c * sc)


def _split(w_gate: torch.Tensor, w_up: torch.Tensor | None, I: int) -> tuple[torch.Tensor, torch.Tensor]:
    if w_up is None:  # fused [E, 2I, H]: gate rows first, then up rows
        return w_gate[:, :I, :], w_gate[:, I:, :]
    return w_gate, w_up


def _routed_rows(topk_idx: torch.Tensor, experts: int):
    """For each expert with rows: (e, tokens, k slots) in ascending token order."""
    flat = topk_idx.to(torch.int64)
    for e in range(experts):
        t, k = (flat == e).nonzero(as_tuple=True)
        if t.numel():
            yield e, t, k


def _mlp_forward(xr, wg, wu, fp8=False):
    if fp8:
        xq = _q_rows(xr, "x")
        g, u = _bf(_dot8(xq, _q_weight(wg, "w_gate"))), _bf(_dot8(xq, _q_weight(wu, "w_up")))
    else:
        g = _bf(xr @ wg.float().t())
        u = _bf(xr @ wu.float().t())
    h = _bf(torch.nn.functional.silu(g) * u)
    return g, u, h


def _down(h, wd, fp8):
    """bf16(h @ W_down^T)."""
    return _bf(_dot8(_q_rows(h, "h"), _q_weight(wd, "w_down")) if fp8 else h @ wd.float().t())


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, intermediate,
            fp8=False):
    """y [T, H] bf16."""
    T, K = topk_idx.shape
    xf = x.float()
    if fp8:  # named by its own rows (the per-expert quantizations would name an expert's row)
        _check_finite(xf, "x")
    wg_all, wu_all = _split(w_gate, w_up, intermediate)
    slots = torch.zeros(T, K, x.shape[1], dtype=torch.float32)
    for e, t, k in _routed_rows(topk_idx, w_down.shape[0]):
        _, _, h = _mlp_forward(xf[t], wg_all[e], wu_all[e], fp8)
        slots[t, k] = _down(h, w_down[e], fp8)
    if shared_gate is not None:
        _, _, h = _mlp_forward(xf, shared_gate, shared_up, fp8)
        acc = _down(h, shared_down, fp8)
    else:
        acc = torch.zeros(T, x.shape[1], dtype=torch.float32)
    w = topk_weights.float()
    for k in range(K):  # fixed order k = 0..K-1
        acc = acc + w[:, k : k + 1] * slots[:, k]
    return acc.to(torch.bfloat16)


def _mlp_backward(xr, dyr, w, wg, wu, wd, fp8=None):
    """One expert's rows: (dx_r, d topk_w per row or None, dWg, dWu, dWd) in fp32; w is [rows, 1] or None.
    fp8: None (bf16), or whether the weight gradients are FP8 too (Config.fp8_weight_grads)."""
    g, u, h = _mlp_forward(xr, wg, wu, fp8 is not None)
    if fp8 is not None:  # the FP8 context keeps g, u in e4m3: every step below reads them after the round trip
        g, u = _round_fp8(g, "g"), _round_fp8(u, "u")
        h = _bf(torch.nn.functional.silu(g) * u)
        dhr = _dot8(_q_rows(dyr, "dy"), _q_weight(wd.float().t(), "w_down^T"))
    else:
        dhr = dyr @ wd.float()  # [rows, I]: the transpose of the down projection
    dtw = (dhr * h).sum(dim=1) if w is not None else None
    dh = dhr * w if w is not None else dhr
    s = torch.sigmoid(g)
    dg = _bf(dh * u * s * (1 + g * (1 - s)))
    du = _bf(dh * g * s)
    hs = _bf(h * w) if w is not None else h
    if fp8 is None:
        dx_r = _bf(dg @ wg.float() + du @ wu.float())
        return dx_r, dtw, dg.t() @ xr, du.t() @ xr, dyr.t() @ hs
    # dx: the gate half's blocks then the up half's in one accumulator (dot_fp8_from)
    dgq, duq = _q_rows(dg, "dg"), _q_rows(du, "du")
    wgt, wut = _q_weight(wg.float().t(), "w_gate^T"), _q_weight(wu.float().t(), "w_up^T")
    dx_r = _bf(_dot8(duq, wut, _dot8(dgq, wgt)))
    if not fp8:  # bf16 weight gradients over the same dg, du, hs
        return dx_r, dtw, dg.t() @ xr, du.t() @ xr, dyr.t() @ hs
    xq = _q_rows(xr.t().contiguous(), "x^T")  # the operands transposed, 1x128 along the tokens
    return (dx_r, dtw, _dot8(_q_rows(dg.t().contiguous(), "dg^T"), xq), _dot8(_q_rows(du.t().contiguous(), "du^T"), xq),
            _dot8(_q_rows(dyr.t().contiguous(), "dy^T"), _q_rows(hs.t().contiguous(), "hs^T")))


def backward(x, topk_idx, topk_weights, dy, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, intermediate,
             fp8=None):
    """(dx bf16, d topk_w fp32, [dW_gate, dW_up, dW_down, dS_gate, dS_up, dS_down] fp32; the shared ones None
    without a shared expert; with the fused layout dW_gate is [E, 2I, H] and dW_up None)."""
    T, K = topk_idx.shape
    xf, dyf = x.float(), dy.float()
    if fp8 is not None:
        _check_finite(xf, "x")
        _check_finite(dyf, "dy")
    wg_all, wu_all = _split(w_gate, w_up, intermediate)
    E = w_down.shape[0]
    dwg = torch.zeros(wg_all.shape, dtype=torch.float32)
    dwu = torch.zeros(wu_all.shape, dtype=torch.float32)
    dwd = torch.zeros(w_down.shape, dtype=torch.float32)
    dtw = torch.zeros(T, K, dtype=torch.float32)
    dx_slots = torch.zeros(T, K, x.shape[1], dtype=torch.float32)
    w = topk_weights.float()
    for e, t, k in _routed_rows(topk_idx, E):
        dx_r, dt, dwg[e], dwu[e], dwd[e] = _mlp_backward(xf[t], dyf[t], w[t, k].unsqueeze(1), wg_all[e], wu_all[e],
                                                         w_down[e], fp8)
        dtw[t, k] = dt
        dx_slots[t, k] = dx_r
    shared = [None, None, None]
    if shared_gate is not None:
        acc, _, *shared = _mlp_backward(xf, dyf, None, shared_gate, shared_up, shared_down, fp8)
    else:
        acc = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for k in range(K):
        acc = acc + dx_slots[:, k]
    if w_up is None:
        grads = [torch.cat([dwg, dwu], dim=1), None, dwd]
    else:
        grads = [dwg, dwu, dwd]
    return acc.to(torch.bfloat16), dtw, grads + shared
