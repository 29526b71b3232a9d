"""The CPU path of the mok ops: the layer of docs/numerics.md in plain torch, one process (EP 1).

It lets models that use mok run, trace and train without a GPU (the CPU test suite runs the
ops, opcheck, torch.compile and a toy model on it), and it is slow: a loop over experts in fp32.
It rounds to bf16 at the contract's points (g, u, h, the expert outputs, y, dg, du, hs, dx);
the order of fp32 sums inside a dot product is torch's, which the contract leaves free. The
backward recomputes g and u from x (so the CPU context holds nothing).
"""

from __future__ import annotations

import torch


def _bf(t: torch.Tensor) -> torch.Tensor:
    """bf16 rounding of an fp32 tensor, kept in fp32."""
    return t.to(torch.bfloat16).float()


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


def _mlp_forward(xr, wg, wu):
    g = _bf(xr @ wg.float().t())
    u = _bf(xr @ wu.float().t())
    h = _bf(torch.nn.functional.silu(g) * u)
    return g, u, h


def forward(x, topk_idx, topk_weights, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, intermediate):
    """y [T, H] bf16."""
    T, K = topk_idx.shape
    xf = x.float()
    wg_all, wu_all = _split(w_gate, w_up, intermediate)
    slots = torch.zeros(T, K, x.shape[1], dtype=torch.float32)
    for e, t, k in _routed_rows(topk_idx, w_down.shape[0]):
        _, _, h = _mlp_forward(xf[t], wg_all[e], wu_all[e])
        slots[t, k] = _bf(h @ w_down[e].float().t())
    if shared_gate is not None:
        _, _, h = _mlp_forward(xf, shared_gate, shared_up)
        acc = _bf(h @ shared_down.float().t())
    else:
        acc = torch.zeros(T, x.shape[1], dtype=torch.float32)
    w = topk_weights.float()
    for k in range(K):  # fixed order k = 0..K-1
        acc = acc + w[:, k : k + 1] * slots[:, k]
    return acc.to(torch.bfloat16)


def _mlp_backward(xr, dyr, w, wg, wu, wd):
    """One expert's rows: (dx_r, d topk_w per row or None, dWg, dWu, dWd) in fp32; w is [rows, 1] or None."""
    g, u, h = _mlp_forward(xr, wg, wu)
    dhr = dyr @ wd.float()  # [rows, I]: the transpose of the down projection
    dtw = (dhr * h).sum(dim=1) if w is not None else None
    dh = dhr * w if w is not None else dhr
    s = torch.sigmoid(g)
    dg = _bf(dh * u * s * (1 + g * (1 - s)))
    du = _bf(dh * g * s)
    dx_r = _bf(dg @ wg.float() + du @ wu.float())
    hs = _bf(h * w) if w is not None else h
    return dx_r, dtw, dg.t() @ xr, du.t() @ xr, dyr.t() @ hs


def backward(x, topk_idx, topk_weights, dy, w_gate, w_up, w_down, shared_gate, shared_up, shared_down, intermediate):
    """(dx bf16, d topk_w fp32, [dW_gate, dW_up, dW_down, dS_gate, dS_up, dS_down] fp32; the shared ones None
    without a shared expert; with the fused layout dW_gate is [E, 2I, H] and dW_up None)."""
    T, K = topk_idx.shape
    xf, dyf = x.float(), dy.float()
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
                                                         w_down[e])
        dtw[t, k] = dt
        dx_slots[t, k] = dx_r
    shared = [None, None, None]
    if shared_gate is not None:
        acc, _, *shared = _mlp_backward(xf, dyf, None, shared_gate, shared_up, shared_down)
    else:
        acc = torch.zeros(T, x.shape[1], dtype=torch.float32)
    for k in range(K):
        acc = acc + dx_slots[:, k]
    if w_up is None:
        grads = [torch.cat([dwg, dwu], dim=1), None, dwd]
    else:
        grads = [dwg, dwu, dwd]
    return acc.to(torch.bfloat16), dtw, grads + shared
