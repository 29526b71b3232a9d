"""An independent PyTorch implementation of the mok layer, for the tests.

Written from docs/numerics.md, not from mok's code: fp32 math with autograd, the forward's bf16
rounding points (g, u, h, each expert's output, the shared expert's output, y), every token's
expert weights gathered per top-k slot (no grouping by expert). Gradients come from
torch.autograd, not from hand-written formulas, so they check mok's backward independently;
they differ from mok's by rounding only (mok also rounds dg, du, hs and dx to bf16), which the
relative-norm tolerance of docs/numerics.md covers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

TOLERANCE = 1e-2  # docs/numerics.md: ||out - ref|| / ||ref|| below 1e-2 (typically ~3e-3)


def _bf(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.bfloat16).to(torch.float32)


def _swiglu_expert(v, w_gate, w_up, w_down):
    """v [T, H]; weights per token [T, I, H] / [T, H, I] (gathered) or shared [I, H] / [H, I]."""
    if w_gate.dim() == 3:
        g = _bf(torch.einsum("th,tih->ti", v, w_gate))
        u = _bf(torch.einsum("th,tih->ti", v, w_up))
        h = _bf(F.silu(g) * u)
        return _bf(torch.einsum("ti,thi->th", h, w_down))
    g = _bf(v @ w_gate.t())
    u = _bf(v @ w_up.t())
    h = _bf(F.silu(g) * u)
    return _bf(h @ w_down.t())


def layer(x, topk_idx, topk_weights, w1, w2, w3, shared_w1=None, shared_w2=None, shared_w3=None):
    """y [T, H] (fp32 holding bf16 values). All arguments fp32 (or castable); weights hold every expert:
    w1, w3 [E, I, H], w2 [E, H, I]; topk_idx [T, K] expert ids."""
    x, w = x.float(), topk_weights.float()
    w1, w2, w3 = w1.float(), w2.float(), w3.float()
    y = torch.zeros_like(x)
    if shared_w1 is not None:
        y = _swiglu_expert(x, shared_w1.float(), shared_w3.float(), shared_w2.float())
    for k in range(topk_idx.shape[1]):
        e = topk_idx[:, k].long()
        y = y + w[:, k : k + 1] * _swiglu_expert(x, w1[e], w3[e], w2[e])
    return _bf(y)


def split_gate_up(gate_up: torch.Tensor):
    """Hugging Face's fused [E, 2I, H] -> (gate, up) [E, I, H] each."""
    i = gate_up.shape[1] // 2
    return gate_up[:, :i], gate_up[:, i:]


def layer_and_grads(x, topk_idx, topk_weights, dy, weights: dict):
    """(y, {name: gradient}) of ``layer`` for the upstream gradient dy; weights maps w1, w2, w3 and, when
    present, shared_w1, shared_w2, shared_w3 (or gate_up_proj and down_proj) to tensors."""
    leaves = {"x": x.detach().float().requires_grad_(), "topk_weights": topk_weights.detach().float().requires_grad_()}
    for name, t in weights.items():
        leaves[name] = t.detach().float().requires_grad_()
    if "gate_up_proj" in leaves:
        w1, w3 = split_gate_up(leaves["gate_up_proj"])
        w2 = leaves["down_proj"]
        y = layer(leaves["x"], topk_idx, leaves["topk_weights"], w1, w2, w3)
    else:
        y = layer(leaves["x"], topk_idx, leaves["topk_weights"], leaves["w1"], leaves["w2"], leaves["w3"],
                  leaves.get("shared_w1"), leaves.get("shared_w2"), leaves.get("shared_w3"))
    names = list(leaves)
    grads = torch.autograd.grad(y, [leaves[n] for n in names], dy.float())
    return y.detach(), dict(zip(names, grads))


def relnorm(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (inf when out has a NaN or ref is zero and out is not)."""
    out, ref = out.detach().double().cpu(), ref.detach().double().cpu()
    if torch.isnan(out).any():
        return float("inf")
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else (0.0 if diff == 0 else float("inf"))


def assert_close(out, ref, what: str, tol: float = TOLERANCE) -> None:
    r = relnorm(out, ref)
    assert r < tol, f"{what}: relative norm {r:.3e} >= {tol:.0e}"


def random_routing(tokens: int, experts: int, topk: int, generator: torch.Generator) -> torch.Tensor:
    """[T, K] int32 distinct expert ids per token."""
    scores = torch.rand(tokens, experts, generator=generator)
    return scores.topk(topk, dim=1).indices.to(torch.int32)


def random_problem(tokens, hidden, intermediate, experts, topk, shared=0, seed=0, scale=1.0):
    """bf16 inputs of a layer on the CPU: x, topk_idx, topk_weights (softmax-like, fp32) and weights."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, std):
        return (torch.randn(*shape, generator=g) * std).to(torch.bfloat16)

    x = rnd(tokens, hidden, std=scale)
    idx = random_routing(tokens, experts, topk, g)
    w = torch.rand(tokens, topk, generator=g) + 0.1
    w = (w / w.sum(dim=1, keepdim=True)).float()
    weights = {"w1": rnd(experts, intermediate, hidden, std=hidden ** -0.5),
               "w2": rnd(experts, hidden, intermediate, std=intermediate ** -0.5),
               "w3": rnd(experts, intermediate, hidden, std=hidden ** -0.5)}
    if shared:
        weights.update({"shared_w1": rnd(shared, hidden, std=hidden ** -0.5),
                        "shared_w2": rnd(hidden, shared, std=shared ** -0.5),
                        "shared_w3": rnd(shared, hidden, std=hidden ** -0.5)})
    return x, idx, w, weights
