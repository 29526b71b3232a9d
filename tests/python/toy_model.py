"""A 4-layer toy model with mok MoE blocks, trained eagerly, under torch.compile(fullgraph=True), as a
captured CUDA graph of the whole step, and both; each run twice from the same seed.

    PYTHONPATH=python python3 tests/python/toy_model.py --device cuda     # prints every run's losses
    PYTHONPATH=python python3 tests/python/toy_model.py --device cpu --steps 4 --modes eager,compile

Exit status 0 when every mode's two runs give bitwise-identical losses, every mode's losses fall, and
every mode agrees with the eager run within docs/numerics.md's tolerance. The tests import train().
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "python"))
import mok.torch  # noqa: E402

MODES = ("eager", "compile", "graph", "compile+graph")


@dataclass
class ToySize:
    tokens: int = 256
    hidden: int = 256
    intermediate: int = 128
    experts: int = 8
    topk: int = 2
    shared: int = 128
    layers: int = 4


CPU_SIZE = ToySize(tokens=64, hidden=128, intermediate=64, experts=4, topk=2, shared=64, layers=4)


class Block(nn.Module):
    """Pre-norm residual MoE block: h + MoE(norm(h)) with a softmax top-k router."""

    def __init__(self, s: ToySize, precision: str = "bf16"):
        super().__init__()
        self.norm = nn.RMSNorm(s.hidden)
        self.router = mok.torch.TopKRouter(s.hidden, s.experts, s.topk, aux_loss_coeff=0.01)
        self.moe = mok.torch.MoE(s.hidden, s.intermediate, s.experts, s.topk, s.shared, init_std=0.1,
                                 precision=precision)

    def forward(self, h):
        x = self.norm(h.float()).to(torch.bfloat16)
        idx, w = self.router(x)
        return h + self.moe(x, idx, w)


class ToyModel(nn.Module):
    def __init__(self, s: ToySize, precision: str = "bf16"):
        super().__init__()
        self.blocks = nn.ModuleList(Block(s, precision) for _ in range(s.layers))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def make_data(s: ToySize, batches: int, device, seed: int = 1234):
    g = torch.Generator().manual_seed(seed)
    proj = torch.randn(s.hidden, s.hidden, generator=g) / s.hidden ** 0.5
    data = []
    for _ in range(batches):
        x = torch.randn(s.tokens, s.hidden, generator=g)
        data.append((x.to(torch.bfloat16).to(device), torch.tanh(x @ proj).to(device)))
    return data


def _loss(model, x, target):
    return ((model(x).float() - target) ** 2).mean()


def train(mode: str, steps: int, device="cuda", size: ToySize | None = None, seed: int = 0, lr: float = 0.5,
          batches: int = 2, precision: str = "bf16") -> list[float]:
    """The losses of ``steps`` SGD steps of a fresh model (``seed``) in ``mode`` (one of MODES); ``precision``: the
    MoE layers' (mok.PRECISIONS, or "fp8")."""
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    size = size or ToySize()
    torch.manual_seed(seed)
    model = ToyModel(size, precision).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    data = make_data(size, batches, device)
    fwd = torch.compile(model, fullgraph=True) if "compile" in mode else model
    losses = []
    if "graph" not in mode:
        for i in range(steps):
            x, t = data[i % batches]
            opt.zero_grad(set_to_none=True)
            loss = _loss(fwd, x, t)
            loss.backward()
            opt.step()
            losses.append(loss.detach())
        return [float(v) for v in losses]
    # CUDA graph of the whole step (forward, backward, optimizer), after 3 warm-up steps on a side stream
    static_x, static_t = data[0][0].clone(), data[0][1].clone()
    warm = 3
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(min(warm, steps)):
            static_x.copy_(data[i % batches][0])
            static_t.copy_(data[i % batches][1])
            opt.zero_grad(set_to_none=True)
            loss = _loss(fwd, static_x, static_t)
            loss.backward()
            opt.step()
            losses.append(loss.detach().clone())
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        static_loss = _loss(fwd, static_x, static_t)
        static_loss.backward()
        opt.step()
    for i in range(warm, steps):
        static_x.copy_(data[i % batches][0])
        static_t.copy_(data[i % batches][1])
        graph.replay()
        losses.append(static_loss.detach().clone())
    mok.torch.check()  # device-side errors of the replays, now that they are done
    return [float(v) for v in losses]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--precision", default="bf16", help="the MoE layers': bf16 or fp8")
    a = p.parse_args(argv)
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ.setdefault(k, v)
    size = ToySize() if a.device.startswith("cuda") else CPU_SIZE
    modes = a.modes.split(",")
    ok = True
    results = {}
    for mode in modes:
        runs = [train(mode, a.steps, a.device, size, precision=a.precision) for _ in range(2)]
        results[mode] = runs[0]
        same = runs[0] == runs[1]
        falls = runs[0][-1] < runs[0][0]
        ok &= same and falls
        for r, losses in enumerate(runs):
            print(f"{mode:14s} run {r + 1}: " + " ".join(f"{v:.6f}" for v in losses))
        print(f"{mode:14s} bitwise identical: {'yes' if same else 'NO'}; loss falls: {'yes' if falls else 'NO'}")
    if "eager" in results:
        for mode, losses in results.items():
            if mode == "eager":
                continue
            # Inductor rounds the non-mok parts (norms, attention) differently from eager: the first
            # step's loss agrees to ~2e-4 (H200, 2026-12-03), and training lets the two trajectories
            # drift apart (~1.3e-2 after 20 steps), so the first step is held to 1e-3, every step to 3e-2.
            first = abs(losses[0] - results["eager"][0]) / abs(results["eager"][0])
            worst = max(abs(a - b) / abs(b) for a, b in zip(losses, results["eager"]))
            exact = losses == results["eager"]
            ok &= first < 1e-3 and worst < 3e-2
            print(f"{mode:14s} vs eager: first step {first:.2e}, max relative difference {worst:.2e}"
                  f"{' (bitwise equal)' if exact else ''}")
    print("toy model: " + ("PASSED" if ok else "FAILED"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
