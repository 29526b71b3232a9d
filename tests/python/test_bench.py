"""mok.torch.plain (the plain PyTorch EP layer) against mok.torch's CPU path, its EP dispatch over two gloo
processes, its permutation autograd functions, and python -m mok.bench on the CPU (arguments, table, record).
The GPU parts (grouped_mm, NCCL, the timed shapes) skip without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mok.torch  # noqa: E402
from mok import bench  # noqa: E402
from mok.torch import plain  # noqa: E402
from procs import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
H, I, E, K, S, T = 128, 64, 4, 2, 64, 40


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def routing(T, E, K, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32)
    tw = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return idx, tw


def step(layer, x, idx, tw, dy):
    x = x.detach().clone().requires_grad_(True)
    tw = tw.detach().clone().requires_grad_(True)
    layer.zero_grad(set_to_none=True)
    y = layer(x, idx, tw)
    y.backward(dy)
    return y, x.grad, tw.grad, {n: p.grad for n, p in layer.named_parameters()}


@pytest.mark.parametrize("shared", [S, 0])
def test_plain_layer_matches_mok_cpu_path(shared):
    torch.manual_seed(0)
    ref = mok.torch.MoE(H, I, E, K, shared, init_std=0.1)
    layer = plain.PlainMoE(H, I, E, K, shared, init_std=0.1)
    layer.load_state_dict(ref.state_dict())  # the same parameter names and shapes
    x = torch.randn(T, H).to(torch.bfloat16)
    idx, tw = routing(T, E, K, seed=1)
    dy = torch.randn(T, H).to(torch.bfloat16)
    got, want = step(layer, x, idx, tw, dy), step(ref, x, idx, tw, dy)
    for name, a, b in (("y", got[0], want[0]), ("dx", got[1], want[1]), ("d topk_w", got[2], want[2])):
        assert rel(a, b) < 2e-2, name
    assert got[3].keys() == want[3].keys()
    for n in want[3]:
        assert got[3][n].dtype == torch.bfloat16 and rel(got[3][n], want[3][n]) < 2e-2, n


def test_plain_layer_handles_unused_experts_and_int64_ids():
    layer = plain.PlainMoE(H, I, 8, 2, 0, init_std=0.1)
    x = torch.randn(6, H).to(torch.bfloat16).requires_grad_(True)
    idx = torch.tensor([[0, 1]] * 6, dtype=torch.int64)  # experts 2..7 get no rows
    y = layer(x, idx, torch.full((6, 2), 0.5))
    y.float().sum().backward()
    assert y.shape == x.shape and layer.w1.grad is not None
    assert layer.w1.grad[2:].abs().sum() == 0 and layer.w1.grad[:2].abs().sum() > 0


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_grouped_mm_forward_equals_the_loop_on_cpu():
    # torch._grouped_mm has a CPU forward (no backward): the padded, expert-major buffer gives the loop's values.
    layer = plain.PlainMoE(H, I, E, K, S, init_std=0.1)
    x = torch.randn(T, H).to(torch.bfloat16)
    idx, tw = routing(T, E, K, seed=2)
    args = (x, idx, tw, layer.w1, layer.w2, layer.w3, layer.shared_w1, layer.shared_w2, layer.shared_w3)
    with torch.no_grad():
        a = plain.plain_moe_experts(*args, impl="grouped_mm")
        b = plain.plain_moe_experts(*args, impl="loop")
    assert rel(a, b) < 1e-2


def test_permutation_functions_have_exact_gradients():
    src = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    index = torch.tensor([4, 0, 6, 2])
    assert torch.autograd.gradcheck(lambda s: plain._GatherRows.apply(s, index), (src,))
    part = src[:4].detach().requires_grad_(True)
    assert torch.autograd.gradcheck(lambda s: plain._ScatterRows.apply(s, index, 9), (part,))
    order = torch.tensor([3, 0, 5, 1, 4, 2])  # T = 3 tokens, K = 2
    x = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: plain._DispatchRows.apply(s, order, 2), (x,))


def test_invalid_impl_is_an_argument_error():
    with pytest.raises(mok.MokInvalidArgument, match="impl"):
        plain.PlainMoE(H, I, E, K, impl="cutlass")


def test_autograd_graph_does_not_keep_the_ep_group_alive(tmp_path):
    """A graph that outlives destroy_process_group (a module-level output, say) must not keep the group: a live
    gloo group runs its worker threads into interpreter finalization, where one that drops a Python-owned
    tensor aborts the process (test_plain_layer_expert_parallel_over_two_gloo_ranks' workers say how)."""
    import gc
    import weakref

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        group = weakref.ref(dist.group.WORLD)
        x = torch.randn(6, 4, requires_grad=True)
        y = plain._AllToAll.apply(x, [6], [6], dist.group.WORLD)  # the layer's exchange, over a group of one
        y.square().sum().backward()
        assert torch.equal(y, x) and torch.equal(x.grad, 2 * x.detach())
    finally:
        dist.destroy_process_group()
    gc.collect()
    assert y.grad_fn is not None  # the graph is alive ...
    assert group() is None, "the autograd graph of y keeps the process group alive"  # ... the group is not


_EP_WORKER = r"""
import gc, sys, weakref, torch, torch.distributed as dist
sys.path.insert(0, sys.argv[5])
from mok.torch.plain import plain_moe_experts
rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]


def step():  # every tensor and autograd graph of the step dies when it returns
    full = torch.load(sys.argv[6])
    el, t = full["w1"].shape[0] // world, full["x"].shape[0] // world
    mine = {k: full[k][rank * el:(rank + 1) * el].clone().requires_grad_(True) for k in ("w1", "w2", "w3")}
    shared = {k: full[k].clone().requires_grad_(True) for k in ("shared_w1", "shared_w2", "shared_w3")}
    rows = slice(rank * t, (rank + 1) * t)
    x = full["x"][rows].clone().requires_grad_(True)
    tw = full["tw"][rows].clone().requires_grad_(True)
    y = plain_moe_experts(x, full["idx"][rows], tw, mine["w1"], mine["w2"], mine["w3"], shared["shared_w1"],
                          shared["shared_w2"], shared["shared_w3"], impl="loop")
    y.backward(full["dy"][rows])
    grads = {k: v.grad for k, v in {**mine, **shared}.items()}
    torch.save({"y": y.detach(), "dx": x.grad, "dtw": tw.grad, **grads}, out)


dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
step()
dist.barrier()  # both ranks done with their collectives before either closes its connections
group = weakref.ref(dist.group.WORLD)
dist.destroy_process_group()
gc.collect()
# The group, and with it gloo's worker threads, must be gone while Python is alive: a gloo thread that drops
# the last reference to a Python-owned tensor during interpreter finalization takes the GIL there, Python
# ends the thread with pthread_exit inside a noexcept frame, and the process aborts ("terminate called
# without an active exception"). Anything that keeps the group alive past destroy_process_group fails here.
assert group() is None, "the gloo process group outlived destroy_process_group"
"""


def test_plain_layer_expert_parallel_over_two_gloo_ranks(tmp_path):
    """EP 2 (all_to_all_single over gloo, each rank half the experts and half the tokens) gives EP 1's values."""
    world, E2, T2 = 2, 8, 48
    torch.manual_seed(3)
    layer = plain.PlainMoE(H, I, E2, K, S, init_std=0.1, ep_group=mok.torch.LOCAL)
    x = torch.randn(T2, H).to(torch.bfloat16)
    idx, tw = routing(T2, E2, K, seed=4)
    dy = torch.randn(T2, H).to(torch.bfloat16)
    y, dx, dtw, grads = step(layer, x, idx, tw, dy)
    problem = tmp_path / "problem.pt"
    torch.save({"x": x, "idx": idx, "tw": tw, "dy": dy, **{n: p.detach() for n, p in layer.named_parameters()}},
               problem)
    run_ranks([[sys.executable, "-c", _EP_WORKER, str(r), str(world), str(tmp_path / "store"),
                str(tmp_path / f"out{r}.pt"), str(ROOT / "python"), str(problem)] for r in range(world)],
              timeout=120, what="gloo EP workers")
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    el, t = E2 // world, T2 // world
    for r, o in enumerate(outs):
        rows = slice(r * t, (r + 1) * t)
        assert rel(o["y"], y[rows]) < 1e-3 and rel(o["dx"], dx[rows]) < 1e-3 and rel(o["dtw"], dtw[rows]) < 1e-3
        for k in ("w1", "w2", "w3"):  # this rank's experts: the gradient over every rank's tokens
            assert rel(o[k], grads[k][r * el:(r + 1) * el]) < 1e-3, k
    for k in ("shared_w1", "shared_w2", "shared_w3"):  # partial sums: the caller all-reduces them
        assert rel(outs[0][k].float() + outs[1][k].float(), grads[k]) < 1e-2, k


# ---- python -m mok.bench -----------------------------------------------------------------------------------

def test_flops_formula():
    s = bench.SHAPES["dsv3"]
    fwd = 2 * 8192 * 8 * 3 * 7168 * 2048 + 2 * 8192 * 3 * 7168 * 2048
    assert s.flops("fwd") == fwd and s.flops("bwd") == 2 * fwd and s.flops("step") == 3 * fwd
    assert bench.SHAPES["qwen3"].flops("fwd") == 2 * 16384 * 8 * 3 * 2048 * 768


def test_parse_args_shapes_and_errors():
    a = bench.parse_args(["--device", "cpu", "--hidden", "128", "--intermediate", "64", "--experts", "4", "--topk",
                          "2", "--tokens", "64"])
    assert [s.name for s in a.shape_list] == ["custom"] and a.shape_list[0].shared == 0
    a = bench.parse_args(["--device", "cpu", "--shapes", "tiny,qwen3", "--passes", "fwd"])
    assert [s.name for s in a.shape_list] == ["tiny", "qwen3"] and a.passes == ["fwd"]
    assert [s.name for s in bench.parse_args(["--device", "cpu"]).shape_list] == ["tiny"]
    for bad in (["--shapes", "nope"], ["--hidden", "128"], ["--passes", "fwd,sideways"], ["--engines", "jax"]):
        with pytest.raises(SystemExit):
            bench.parse_args(["--device", "cpu", *bad])


def test_an_invalid_shape_is_refused_before_anything_runs(capsys):
    rc = bench.main(["--device", "cpu", "--hidden", "100", "--intermediate", "64", "--experts", "4", "--topk", "2",
                     "--tokens", "64"])
    assert rc == 2 and "LayerShape.hidden: expected a positive multiple of 64, got 100" in capsys.readouterr().err


def test_render_table():
    m = {"mok_fwd_ms": 2.0, "torch_fwd_ms": 5.0, "mok_fwd_tflops": 400.0, "torch_fwd_tflops": 160.0,
         "fwd_speedup": 2.5, "cublas_dense_tflops": 800.0, "y_rel_norm": 1e-3, "dx_rel_norm": 2e-3,
         "dtw_rel_norm": 3e-3, "dw_rel_norm": 4e-3}
    text = bench.render_table([{"shape": "dsv3", "ep": 1, "torch_impl": "grouped_mm", "metrics": m},
                               {"shape": "qwen3", "error": "out of memory: ..."}], passes=["fwd"])
    row = next(line for line in text.splitlines() if line.startswith("dsv3     fwd"))
    assert "2.000" in row and "5.000" in row and "0.500" in row and "0.200" in row and "2.50x" in row
    assert "qwen3    error: out of memory" in text and "1.00e-03" in text and "800 TFLOP/s" in text


def test_bench_runs_on_the_cpu(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("MOK_COMMIT", "test")
    rc = bench.main(["--device", "cpu", "--iters", "2", "--warmup", "1", "--results-dir", str(tmp_path),
                     "--json", str(tmp_path / "full.json")])
    assert rc == 0
    text = capsys.readouterr().out
    assert "tiny     step" in text and "sanity:" in text
    (record,) = list(tmp_path.glob("*-torch_step-test.json"))
    rec = json.loads(record.read_text())
    (entry,) = rec["results"]
    assert entry["bench"] == "torch_step" and entry["shape"] == "tiny" and entry["torch_impl"] == "loop"
    for k in ("mok_fwd_ms", "mok_bwd_ms", "mok_step_ms", "torch_fwd_ms", "torch_bwd_ms", "torch_step_ms",
              "cublas_dense_tflops"):
        assert entry["metrics"][k] > 0, k
    assert entry["metrics"]["y_rel_norm"] < 2e-2 and entry["metrics"]["dw_rel_norm"] < 2e-2


def test_python_dash_m_mok_bench_help():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "mok.bench", "--help"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and "--results-dir" in out.stdout and "dsv3" in out.stdout


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (mok's kernels, torch._grouped_mm)")
def test_bench_small_shape_on_the_gpu(tmp_path):
    rc = bench.main(["--hidden", "1024", "--intermediate", "512", "--experts", "16", "--topk", "4", "--shared", "512",
                     "--tokens", "4096", "--iters", "3", "--warmup", "1", "--json", str(tmp_path / "r.json")])
    assert rc == 0
    (entry,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert entry["metrics"]["y_rel_norm"] < 2e-2 and entry["metrics"]["dx_rel_norm"] < 2e-2


def test_render_table_with_the_fp8_engines():
    m = {"mok_step_ms": 4.0, "mok_fp8_step_ms": 2.5, "torch_fp8_step_ms": 5.0, "mok_fp8_vs_mok_step": 1.6,
         "mok_fp8_vs_torch_fp8_step": 2.0, "cublas_dense_tflops": 800.0, "mok_fp8_vs_bf16_y_rel_norm": 0.06,
         "mok_fp8_vs_bf16_dx_rel_norm": 0.065, "mok_fp8_vs_bf16_dtw_rel_norm": 0.06, "mok_fp8_vs_bf16_dw_rel_norm": 0.07}
    text = bench.render_table([{"shape": "dsv3", "ep": 1, "torch_impl": "grouped_mm", "metrics": m}], passes=["step"])
    head, row = text.splitlines()[0], next(line for line in text.splitlines() if line.startswith("dsv3     step"))
    assert "mok8 ms" in head and "8/bf16" in head and "8/fp8" in head
    assert "2.500" in row and "1.60x" in row and "2.00x" in row
    assert "mok fp8: |y_fp8 - y_mok|/|y_mok| = 6.00e-02" in text
    assert bench.parse_args(["--device", "cpu", "--engines", "mok,mok_fp8"]).engines == ["mok", "mok_fp8"]
    m.update({"mok_fp8_w16_step_ms": 2.0})
    text = bench.render_table([{"shape": "dsv3", "ep": 1, "torch_impl": "grouped_mm", "metrics": m}], passes=["step"])
    assert "mok fp8 with bf16 weight-gradient GEMMs (mok_fp8_w16): step 2.000 ms; its step over mok_fp8's 1.25x" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (mok's FP8 kernels)")
def test_bench_fp8_engine_on_the_gpu(tmp_path):
    rc = bench.main(["--hidden", "1024", "--intermediate", "512", "--experts", "16", "--topk", "4", "--shared", "512",
                     "--tokens", "4096", "--iters", "3", "--warmup", "1", "--engines", "mok,mok_fp8,mok_fp8_w16",
                     "--json", str(tmp_path / "r.json")])
    assert rc == 0
    (entry,) = json.loads((tmp_path / "r.json").read_text())["results"]
    m, rec = entry["metrics"], entry["fp8_record"]
    assert 0.01 < m["mok_fp8_vs_bf16_y_rel_norm"] < 0.1 and m["mok_fp8_vs_bf16_dw_rel_norm"] < 0.1
    assert rec["precision"] == "fp8_block" and rec["ep"] == 1 and entry["precision"] == "bf16"
    for k in ("fwd_ms", "bwd_ms", "step_ms", "bf16_fwd_ms", "bf16_bwd_ms", "bf16_step_ms", "dense_bf16_tflops",
              "dense_fp8_tflops", "w16_fwd_ms", "w16_bwd_ms", "w16_step_ms"):
        assert rec[k] > 0, k
    assert 0.01 < m["mok_fp8_w16_vs_bf16_y_rel_norm"] < 0.1 and m["mok_fp8_w16_vs_bf16_dw_rel_norm"] < 0.1
