"""One rank of the 2-process test (test_gpu_distributed.py), started by torchrun:

    torchrun --nproc_per_node=2 tests/python/dist_worker.py

EP 2 over the world group: the NCCL unique id travels through torch.distributed. Checks y, dx,
d topk_weights and the weight gradients against the independent reference of the whole global batch,
that they are bitwise equal to EP 1 on one GPU (D3; shared-expert gradients are per-rank partial
sums, so only their sum is compared), and that a T different across ranks is a MokInvalidArgument on
every rank (no hang). Prints "dist worker rank R: OK" and exits 0 when all holds.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "python"))
sys.path.insert(0, str(HERE))
for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(k, v)

import mok  # noqa: E402
import mok.torch  # noqa: E402
from reference import assert_close, layer_and_grads, random_problem  # noqa: E402

H, I, E, K, S, T = 256, 128, 8, 2, 128, 128  # T per rank
NAMES = ("w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3")


def gather(t: torch.Tensor) -> torch.Tensor:
    out = [torch.empty_like(t) for _ in range(dist.get_world_size())]
    dist.all_gather(out, t.contiguous())
    return torch.cat(out)


def run_layer(m, x, idx, w, dy):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = m(xg, idx, wg)
    y.backward(dy)
    return y.detach(), xg.grad, wg.grad


def main() -> int:
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", local)
    x, idx, w, weights = random_problem(T * world, H, I, E, K, shared=S, seed=42)  # the global batch
    dy = (torch.randn(T * world, H, generator=torch.Generator().manual_seed(43))).to(torch.bfloat16)
    mine = slice(rank * T, (rank + 1) * T)
    el = E // world
    experts = slice(rank * el, (rank + 1) * el)

    ep = mok.torch.MoE(H, I, E, K, S).to(dev)  # ep_group None: the world group
    assert ep.ep == world and ep.w1.shape[0] == el
    with torch.no_grad():
        for n in NAMES:
            t = weights[n]
            getattr(ep, n).copy_(t[experts] if n in ("w1", "w2", "w3") else t)
    y, dx, dtw = run_layer(ep, x[mine].to(dev), idx[mine].to(dev), w[mine].to(dev), dy[mine].to(dev))
    y, dx, dtw = gather(y), gather(dx), gather(dtw)
    routed = {n: gather(getattr(ep, n).grad) for n in ("w1", "w2", "w3")}
    shared = {n: getattr(ep, n).grad.float() for n in ("shared_w1", "shared_w2", "shared_w3")}
    for t in shared.values():
        dist.all_reduce(t)

    # EP 1 on this GPU over the whole global batch: the same bits (D3)
    one = mok.torch.MoE(H, I, E, K, S, ep_group=mok.torch.LOCAL, config=mok.Config(max_tokens=T * world)).to(dev)
    with torch.no_grad():
        for n in NAMES:
            getattr(one, n).copy_(weights[n])
    y1, dx1, dtw1 = run_layer(one, x.to(dev), idx.to(dev), w.to(dev), dy.to(dev))
    failures = []
    for name, a, b in (("y", y, y1), ("dx", dx, dx1), ("d topk_weights", dtw, dtw1)):
        if not torch.equal(a, b):
            failures.append(f"{name}: EP {world} differs from EP 1")
    for n, g in routed.items():
        if not torch.equal(g, getattr(one, n).grad):
            failures.append(f"d {n}: EP {world} differs from EP 1")

    ref_y, ref = layer_and_grads(x.to(dev), idx.to(dev), w.to(dev), dy.to(dev), {n: t.to(dev) for n, t in weights.items()})
    try:
        assert_close(y, ref_y, "y")
        assert_close(dx, ref["x"], "dx")
        assert_close(dtw, ref["topk_weights"], "d topk_weights")
        for n, g in {**routed, **shared}.items():
            assert_close(g, ref[n], f"d {n}")
    except AssertionError as e:
        failures.append(str(e))

    # T different across ranks: every rank raises, nobody hangs
    tokens = T if rank == 0 else T - 1
    xs, idxs, ws = x[:tokens].to(dev), idx[:tokens].to(dev), w[:tokens].to(dev)
    try:
        with torch.no_grad():
            ep(xs, idxs, ws)
        failures.append("T different across ranks: no error")
    except mok.MokInvalidArgument as e:
        if "same number of tokens" not in str(e) and "token" not in str(e):
            failures.append(f"T different across ranks: unexpected message {e}")
    with torch.no_grad():  # and the layer still works
        y2 = ep(x[mine].to(dev), idx[mine].to(dev), w[mine].to(dev))
    if not torch.equal(gather(y2), y1):
        failures.append("after the T error: y differs")

    mok.torch.release()
    dist.destroy_process_group()
    for f in failures:
        print(f"dist worker rank {rank}: FAILED: {f}", flush=True)
    if not failures:
        print(f"dist worker rank {rank}: OK", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
