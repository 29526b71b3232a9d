"""mok.torch.plain_fp8 (the plain EP layer with FP8 rowwise expert GEMMs, torchao's recipe) and the torch_fp8
engine of python -m mok.bench.

On the CPU: the arguments, the availability check and its error, the quantization against a direct computation,
and the whole layer (EP 1 and EP 2 over gloo) with torch._scaled_grouped_mm / torch._scaled_mm replaced by an
emulation that first runs torch's own checks of those ops (their meta functions: dtypes, shapes, strides, scale
shapes) plus the kernels' checks that the meta functions leave out (dimensions multiples of 16, non-empty
16-row groups in the 2d x 2d GEMM), then computes sum_k (a * scale_a) (b * scale_b) per group in fp32 as the
CUTLASS kernels do (scale pointers per group as torch's prepare_grouped_gemm_data sets them). The real kernels
run in the GPU tests, which skip without a Hopper GPU."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
from mok import bench  # noqa: E402
from mok.torch import plain, plain_fp8  # noqa: E402
from procs import run_ranks  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
H, I, E, K, S, T = 128, 64, 8, 2, 64, 40
E4M3 = torch.float8_e4m3fn

_REAL_SCALED_GROUPED_MM = getattr(torch, "_scaled_grouped_mm", None)
_REAL_SCALED_MM = torch._scaled_mm


def rel(a, b) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm())


def routing(T, E, K, seed, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(T, E, generator=g).topk(K, dim=1).indices.to(torch.int32)
    tw = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return idx.to(device), tw.to(device)


def weights(E_local, shared, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)

    def randn(*size, std):
        return (torch.randn(*size, generator=g) * std).to(torch.bfloat16).to(device).requires_grad_(True)

    w = {"w1": randn(E_local, I, H, std=H ** -0.5), "w2": randn(E_local, H, I, std=I ** -0.5),
         "w3": randn(E_local, I, H, std=H ** -0.5)}
    if shared:
        w.update(shared_w1=randn(shared, H, std=H ** -0.5), shared_w2=randn(H, shared, std=shared ** -0.5),
                 shared_w3=randn(shared, H, std=H ** -0.5))
    return w


def step(fn, x, idx, tw, dy, w, **kw):
    """y, dx, d topk_weights and every weight gradient of one forward and backward."""
    x = x.detach().clone().requires_grad_(True)
    tw = tw.detach().clone().requires_grad_(True)
    for t in w.values():
        t.grad = None
    y = fn(x, idx, tw, w["w1"], w["w2"], w["w3"], w.get("shared_w1"), w.get("shared_w2"), w.get("shared_w3"), **kw)
    y.backward(dy)
    return y.detach(), x.grad, tw.grad, {k: t.grad for k, t in w.items()}


# ---- the CPU emulation of torch's FP8 GEMMs --------------------------------------------------------------------

def _meta(t):
    return None if t is None else t.to("meta")


def emulated_scaled_grouped_mm(a, b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                               use_fast_accum=False):
    """torch._scaled_grouped_mm's rowwise 2d x 3d and 2d x 2d cases on the CPU, after torch's checks."""
    _REAL_SCALED_GROUPED_MM(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), offs=_meta(offs), bias=bias,
                            scale_result=scale_result, out_dtype=out_dtype, use_fast_accum=use_fast_accum)
    # GroupedBlas.cpp's checks beyond the meta function
    assert a.size(-1) % 16 == 0 and b.size(-2) % 16 == 0 and b.size(-1) % 16 == 0, (a.shape, b.shape)
    assert out_dtype in (None, torch.bfloat16)
    ends = offs.tolist()
    starts = [0] + ends[:-1]
    assert len(ends) < 1024
    A, B = a.float(), b.float()
    if a.dim() == 2 and b.dim() == 3:  # groups along a's rows; scale_a per row, scale_b [G, N]
        assert len(ends) == b.shape[0] and ends[-1] <= a.shape[0]
        out = torch.zeros(a.shape[0], b.shape[-1])
        for g, (s, e) in enumerate(zip(starts, ends)):
            out[s:e] = (A[s:e] * scale_a[s:e, None]) @ (B[g] * scale_b[g][None, :])
    elif a.dim() == 2 and b.dim() == 2:  # groups along the reduction; scale_a [G * M], scale_b [G * N]
        G, M, N = len(ends), a.shape[0], b.shape[1]
        sa, sb = scale_a.view(G, M), scale_b.view(G, N)
        out = torch.empty(G, M, N)
        for g, (s, e) in enumerate(zip(starts, ends)):
            # the kernel asserts a non-empty group whose byte size keeps 16-byte alignment
            assert e - s > 0 and (e - s) % 16 == 0, (g, s, e)
            out[g] = (A[:, s:e] * sa[g][:, None]) @ (B[s:e] * sb[g][None, :])
    else:
        raise AssertionError("the layer uses the 2d x 3d and 2d x 2d cases only")
    return out.to(torch.bfloat16)


def emulated_scaled_mm(a, b, scale_a, scale_b, bias=None, scale_result=None, out_dtype=None, use_fast_accum=False):
    """torch._scaled_mm rowwise on the CPU, with the CUDA path's layout and size checks."""
    _REAL_SCALED_MM(_meta(a), _meta(b), _meta(scale_a), _meta(scale_b), out_dtype=out_dtype,
                    use_fast_accum=use_fast_accum)
    assert a.dtype == E4M3 and b.dtype == E4M3
    assert a.stride(1) == 1 and a.stride(0) >= a.size(1), "a must be row-major"
    assert b.stride(0) == 1 and b.stride(1) >= b.size(0), "b must be column-major"
    assert a.size(1) % 16 == 0 and b.size(0) % 16 == 0 and b.size(1) % 16 == 0, (a.shape, b.shape)
    assert scale_a.shape == (a.size(0), 1) and scale_b.shape == (1, b.size(1))
    assert scale_a.is_contiguous() and scale_b.is_contiguous() and scale_a.dtype == scale_b.dtype == torch.float32
    return ((a.float() * scale_a) @ (b.float() * scale_b)).to(out_dtype or torch.bfloat16)


def install_emulation(setattr_):
    setattr_(torch, "_scaled_grouped_mm", emulated_scaled_grouped_mm)
    setattr_(torch, "_scaled_mm", emulated_scaled_mm)
    setattr_(plain_fp8, "fp8_grouped_mm_available", lambda device: True)


needs_scaled_grouped_mm = pytest.mark.skipif(_REAL_SCALED_GROUPED_MM is None,
                                             reason="this torch has no torch._scaled_grouped_mm")


@pytest.fixture
def emulated(monkeypatch):
    install_emulation(monkeypatch.setattr)


# ---- arguments, availability ----------------------------------------------------------------------------------

def test_engines_argument():
    assert bench.parse_args(["--device", "cpu"]).engines == ["mok", "torch"]  # the default is unchanged
    a = bench.parse_args(["--device", "cpu", "--engines", "mok,torch,torch_fp8"])
    assert a.engines == ["mok", "torch", "torch_fp8"]
    assert bench.parse_args(["--device", "cpu", "--engines", "torch_fp8"]).engines == ["torch_fp8"]


@pytest.mark.parametrize("bad", ["torch_fp4", "fp8", "mok,torch,torch-fp8"])
def test_unknown_engine_is_refused(bad, capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--device", "cpu", "--engines", bad])
    assert "unknown engine" in capsys.readouterr().err


def test_fp8_is_unavailable_on_the_cpu():
    assert plain_fp8.fp8_grouped_mm_available(torch.device("cpu")) is False
    assert plain_fp8.fp8_grouped_mm_available("cpu") is False


def test_the_layer_on_the_cpu_says_what_it_needs():
    w = weights(E, 0)
    x = torch.randn(T, H).to(torch.bfloat16)
    idx, tw = routing(T, E, K, seed=1)
    with pytest.raises(RuntimeError, match=r"torch._scaled_grouped_mm .* compute capability 9.0 \(Hopper\)"):
        plain_fp8.plain_moe_experts_fp8(x, idx, tw, w["w1"], w["w2"], w["w3"])


# ---- quantization ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dim", [-1, -2, 0])
def test_quantize_rowwise_against_a_direct_computation(dim):
    g = torch.Generator().manual_seed(5)
    t = (torch.randn(3, 48, 32, generator=g) * torch.logspace(-3, 3, 32)).to(torch.bfloat16)
    t[1, 5] = 0  # zero rows along dim -1
    t[:, :, 7] = 0  # zero rows along dims -2 and 0
    q, scale = plain_fp8.quantize_rowwise(t, dim=dim)
    assert q.dtype == E4M3 and q.shape == t.shape and scale.dtype == torch.float32
    amax = t.float().abs().amax(dim=dim, keepdim=True)
    want_scale = torch.clamp(amax, min=1e-12) / 448.0
    assert torch.equal(scale, want_scale)
    assert torch.isfinite(scale).all() and (scale > 0).all()
    want_q = (t.float() / want_scale).clamp(-448, 448).to(E4M3)
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    # every row's largest element lands on +-448, nothing overflows to NaN, zero rows stay zero
    qf = q.float()
    assert not torch.isnan(qf).any()
    nonzero = amax.squeeze(dim) > 0
    assert torch.equal(qf.abs().amax(dim=dim)[nonzero], torch.full_like(qf.abs().amax(dim=dim)[nonzero], 448.0))
    assert (qf.abs().amax(dim=dim)[~nonzero] == 0).all()
    # dequantized, within e4m3's half ulp (2^-4 relative) of the input
    err = (qf * scale - t.float()).abs()
    assert (err <= t.float().abs() * 2 ** -4 + scale * 2 ** -9).all()


@pytest.mark.parametrize("dim", [-1, -2, 0])
def test_quantization_in_pieces_gives_the_same_bits(monkeypatch, dim):
    """Large tensors are quantized in pieces of CHUNK elements (bounded fp32 temporaries): the same codes."""
    g = torch.Generator().manual_seed(9)
    t = torch.randn(4, 48, 40, generator=g).to(torch.bfloat16)
    t2 = t[1].contiguous()
    row_group = torch.repeat_interleave(torch.arange(3), torch.tensor([16, 0, 32]))
    whole = plain_fp8.quantize_rowwise(t, dim=dim), plain_fp8._quantize_group_columns(t2, row_group, 3)
    monkeypatch.setattr(plain_fp8, "CHUNK", 100)
    pieces = plain_fp8.quantize_rowwise(t, dim=dim), plain_fp8._quantize_group_columns(t2, row_group, 3)
    for (qa, sa), (qb, sb) in zip(whole, pieces):
        assert torch.equal(sa, sb) and qa.stride() == qb.stride()
        assert torch.equal(qa.view(torch.uint8), qb.view(torch.uint8))
    tt = t.transpose(-2, -1)  # a non-contiguous input keeps its layout
    qa, _ = plain_fp8.quantize_rowwise(tt, dim=dim)
    assert qa.stride() == tt.stride()


def test_the_cast_saturates():
    v = torch.tensor([[1000.0, -1e30, 448.0, 464.0, 447.0, float("inf")]])
    assert plain_fp8._to_e4m3(v.clone()).float().tolist() == [[448.0, -448.0, 448.0, 448.0, 448.0, 448.0]]
    assert torch.isnan(v.to(E4M3).float()).any()  # the plain cast does not saturate: why the layer clamps


def test_group_column_scales_run_along_each_groups_tokens():
    g = torch.Generator().manual_seed(6)
    sizes = [16, 48, 16, 32]  # group 2: padding only (an expert without tokens)
    t = torch.randn(sum(sizes), 24, generator=g).to(torch.bfloat16)
    t[64:80] = 0
    row_group = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    q, scale = plain_fp8._quantize_group_columns(t, row_group, 4)
    assert q.dtype == E4M3 and scale.shape == (4, 24)
    start = 0
    for gi, n in enumerate(sizes):
        rows = t[start:start + n].float()
        want = torch.clamp(rows.abs().amax(dim=0), min=1e-12) / 448
        assert torch.equal(scale[gi], want), gi
        want_q = (rows / want).clamp(-448, 448).to(E4M3)
        assert torch.equal(q[start:start + n].view(torch.uint8), want_q.view(torch.uint8)), gi
        start += n
    assert torch.isfinite(scale).all() and (q[64:80].float() == 0).all()


def test_fused_quantizers_give_the_eager_bits():
    """The torch.compile'd quantizers the layer uses on a GPU (FUSED_QUANTIZATION), compiled here for the CPU: the
    eager quantizers' codes and scales bit for bit, contiguous whatever the input's strides (transposed views: the
    copy fused into the cast), the group-column codes transposed."""
    g = torch.Generator().manual_seed(12)
    w = (torch.randn(3, 48, 64, generator=g) * torch.logspace(-3, 3, 64)).to(torch.bfloat16)
    w[1, 5] = 0
    rowwise = plain_fp8._compiled_fn(plain_fp8._rowwise_direct)
    for t in (w, w.transpose(-2, -1), w[0], w[0].t()):
        q, scale = rowwise(t, -1)
        want_q, want_scale = plain_fp8.quantize_rowwise(t.contiguous(), -1)
        assert q.is_contiguous() and q.shape == t.shape
        assert torch.equal(scale, want_scale)
        assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8))
    sizes = [16, 48, 16, 32]
    t = torch.randn(sum(sizes), 40, generator=g).to(torch.bfloat16)
    t[64:80] = 0  # group 2: padding only
    row_group = torch.repeat_interleave(torch.arange(4), torch.tensor(sizes))
    qt, scale = plain_fp8._compiled_fn(plain_fp8._group_columns_t_direct)(t, row_group, 4)
    want_q, want_scale = plain_fp8._quantize_group_columns(t, row_group, 4)
    assert qt.is_contiguous() and qt.shape == (40, sum(sizes))
    assert torch.equal(scale, want_scale)
    assert torch.equal(qt.view(torch.uint8), want_q.t().contiguous().view(torch.uint8))


def test_dimensions_that_the_fp8_kernels_cannot_take_are_refused(emulated):
    x = torch.randn(T, 120).to(torch.bfloat16)
    idx, tw = routing(T, E, K, seed=1)
    w = {"w1": torch.zeros(E, I, 120, dtype=torch.bfloat16), "w2": torch.zeros(E, 120, I, dtype=torch.bfloat16),
         "w3": torch.zeros(E, I, 120, dtype=torch.bfloat16)}
    with pytest.raises(mok.MokInvalidArgument, match="hidden: expected a multiple of 16"):
        plain_fp8.plain_moe_experts_fp8(x, idx, tw, w["w1"], w["w2"], w["w3"])
    w = weights(E, 0)
    with pytest.raises(mok.MokInvalidArgument, match="align"):
        plain_fp8.plain_moe_experts_fp8(torch.randn(T, H).to(torch.bfloat16), idx, tw, w["w1"], w["w2"], w["w3"],
                                        align=8)


# ---- the layer on the emulated GEMMs --------------------------------------------------------------------------

@needs_scaled_grouped_mm
@pytest.mark.parametrize("shared", [S, 0])
def test_emulated_layer_is_the_bf16_layer_to_fp8_precision(emulated, shared):
    """Every operand, layout and scale as the real kernels take them (the checks above), and the values of the
    bf16 layer to FP8 precision: y, dx, d topk_weights and each weight gradient (relative norms of a few %)."""
    w = weights(E, shared, seed=2)
    x = torch.randn(T, H).to(torch.bfloat16)
    idx, tw = routing(T, E, K, seed=3)
    dy = torch.randn(T, H).to(torch.bfloat16)
    got = step(plain_fp8.plain_moe_experts_fp8, x, idx, tw, dy, w)
    want = step(plain.plain_moe_experts, x, idx, tw, dy, w, impl="loop")
    for name, a, b in (("y", got[0], want[0]), ("dx", got[1], want[1]), ("d topk_w", got[2], want[2])):
        assert torch.isfinite(a.float()).all() and a.dtype == b.dtype, name
        assert 1e-3 < rel(a, b) < 0.1, (name, rel(a, b))  # FP8 changes the values, by a few per cent
    assert got[3].keys() == want[3].keys()
    for n in want[3]:
        a = got[3][n]
        assert a.dtype == torch.bfloat16 and torch.isfinite(a.float()).all(), n
        assert rel(a, want[3][n]) < 0.1, (n, rel(a, want[3][n]))


@needs_scaled_grouped_mm
def test_emulated_layer_with_experts_without_tokens(emulated):
    """Experts 2..7 get no rows: their groups are 16 zero rows each, and their gradients exactly zero."""
    w = weights(E, S, seed=4)
    x = torch.randn(6, H).to(torch.bfloat16)
    idx = torch.tensor([[0, 1]] * 6)
    tw = torch.full((6, 2), 0.5)
    y, dx, dtw, grads = step(plain_fp8.plain_moe_experts_fp8, x, idx, tw, torch.randn(6, H).to(torch.bfloat16), w)
    assert y.shape == x.shape and torch.isfinite(y.float()).all() and torch.isfinite(dx.float()).all()
    for k in ("w1", "w2", "w3"):
        assert torch.isfinite(grads[k].float()).all(), k
        assert grads[k][2:].abs().sum() == 0 and grads[k][:2].abs().sum() > 0, k
    ref = step(plain.plain_moe_experts, x, idx, tw, torch.randn(6, H).to(torch.bfloat16), w, impl="loop")
    assert rel(y, ref[0]) < 0.1


_EP_WORKER = r"""
import sys, torch, torch.distributed as dist
sys.path[:0] = [sys.argv[5], sys.argv[7]]
import test_plain_fp8 as t
from mok.torch import plain_fp8
t.install_emulation(setattr)
rank, world, init, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]


def step():
    full = torch.load(sys.argv[6])
    el, n = full["w1"].shape[0] // world, full["x"].shape[0] // world
    mine = {k: full[k][rank * el:(rank + 1) * el].clone().requires_grad_(True) for k in ("w1", "w2", "w3")}
    shared = {k: full[k].clone().requires_grad_(True) for k in ("shared_w1", "shared_w2", "shared_w3")}
    rows = slice(rank * n, (rank + 1) * n)
    x = full["x"][rows].clone().requires_grad_(True)
    tw = full["tw"][rows].clone().requires_grad_(True)
    y = plain_fp8.plain_moe_experts_fp8(x, full["idx"][rows], tw, mine["w1"], mine["w2"], mine["w3"],
                                        shared["shared_w1"], shared["shared_w2"], shared["shared_w3"])
    y.backward(full["dy"][rows])
    torch.save({"y": y.detach(), "dx": x.grad, "dtw": tw.grad,
                **{k: v.grad for k, v in {**mine, **shared}.items()}}, out)


dist.init_process_group("gloo", init_method="file://" + init, rank=rank, world_size=world)
step()
dist.barrier()
dist.destroy_process_group()
"""


@needs_scaled_grouped_mm
def test_emulated_layer_expert_parallel_over_two_gloo_ranks(tmp_path, emulated):
    """EP 2 (plain.py's all-to-all over gloo, each rank half the experts and half the tokens) gives EP 1's values:
    the same rows reach each expert, so the same rowwise and per-group scales, summed in another order."""
    world, T2 = 2, 48
    w = weights(E, S, seed=7)
    x = torch.randn(T2, H).to(torch.bfloat16)
    idx, tw = routing(T2, E, K, seed=8)
    dy = torch.randn(T2, H).to(torch.bfloat16)
    y, dx, dtw, grads = step(plain_fp8.plain_moe_experts_fp8, x, idx, tw, dy, w, ep_group=mok.torch.LOCAL)
    problem = tmp_path / "problem.pt"
    torch.save({"x": x, "idx": idx, "tw": tw, "dy": dy, **{k: t.detach() for k, t in w.items()}}, problem)
    run_ranks([[sys.executable, "-c", _EP_WORKER, str(r), str(world), str(tmp_path / "store"),
                str(tmp_path / f"out{r}.pt"), str(ROOT / "python"), str(problem), str(Path(__file__).parent)]
               for r in range(world)], timeout=180, what="gloo EP workers (FP8 layer, emulated GEMMs)")
    outs = [torch.load(tmp_path / f"out{r}.pt") for r in range(world)]
    el, n = E // world, T2 // world
    for r, o in enumerate(outs):
        rows = slice(r * n, (r + 1) * n)
        assert rel(o["y"], y[rows]) < 1e-2 and rel(o["dx"], dx[rows]) < 1e-2 and rel(o["dtw"], dtw[rows]) < 1e-2
        for k in ("w1", "w2", "w3"):
            assert rel(o[k], grads[k][r * el:(r + 1) * el]) < 1e-2, k
    for k in ("shared_w1", "shared_w2", "shared_w3"):  # partial sums over each rank's tokens
        assert rel(outs[0][k].float() + outs[1][k].float(), grads[k]) < 5e-2, k


# ---- python -m mok.bench --------------------------------------------------------------------------------------

def test_render_table_with_the_fp8_engine():
    m = {"mok_fwd_ms": 2.0, "torch_fwd_ms": 5.0, "torch_fp8_fwd_ms": 4.0, "mok_fwd_tflops": 400.0,
         "torch_fwd_tflops": 160.0, "torch_fp8_fwd_tflops": 200.0, "fwd_speedup": 2.5, "mok_vs_torch_fp8_fwd": 2.0,
         "cublas_dense_tflops": 800.0, "cublas_dense_fp8_tflops": 1400.0, "y_rel_norm": 1e-3, "dx_rel_norm": 2e-3,
         "dtw_rel_norm": 3e-3, "dw_rel_norm": 4e-3, "fp8_vs_bf16_y_rel_norm": 3.1e-2,
         "fp8_vs_bf16_dx_rel_norm": 3.2e-2, "fp8_vs_bf16_dtw_rel_norm": 3.3e-2, "fp8_vs_bf16_dw_rel_norm": 3.4e-2}
    text = bench.render_table([{"shape": "dsv3", "ep": 1, "torch_impl": "grouped_mm", "metrics": m,
                                "dense_fp8_scaling": "blockwise"}], passes=["fwd"])
    head, _, row = text.splitlines()[:3]
    assert "fp8 ms" in head and "vs fp8" in head and len(head) <= 110
    assert row.startswith("dsv3     fwd") and "4.000" in row and row.endswith("2.00x") and "2.50x" in row
    assert "fp8: |y_fp8 - y_torch|/|y_torch| = 3.10e-02" in text and "3.40e-02" in text
    assert "dense fp8 matmul (blockwise scales): 1400 TFLOP/s" in text
    # without the engine the table is as before
    plain_text = bench.render_table([{"shape": "dsv3", "ep": 1, "torch_impl": "grouped_mm",
                                      "metrics": {k: v for k, v in m.items() if "fp8" not in k}}], passes=["fwd"])
    assert "fp8" not in plain_text


def test_bench_reports_the_fp8_engine_failing_on_the_cpu(tmp_path, capsys):
    rc = bench.main(["--device", "cpu", "--engines", "torch,torch_fp8", "--iters", "1", "--warmup", "0",
                     "--json", str(tmp_path / "r.json")])
    assert rc == 1  # an engine failed; the other still ran
    (entry,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert "compute capability 9.0" in entry["errors"]["torch_fp8"] and entry["metrics"]["torch_step_ms"] > 0
    assert not any(k.startswith("torch_fp8_") or k.startswith("fp8_vs") for k in entry["metrics"])
    assert "torch_fp8 failed: RuntimeError" in capsys.readouterr().out


@needs_scaled_grouped_mm
def test_bench_runs_the_fp8_engine_on_the_emulated_gemms(tmp_path, capsys, monkeypatch):
    install_emulation(monkeypatch.setattr)
    rc = bench.main(["--device", "cpu", "--engines", "torch,torch_fp8", "--iters", "1", "--warmup", "0",
                     "--json", str(tmp_path / "r.json")])
    assert rc == 0
    (entry,) = json.loads((tmp_path / "r.json").read_text())["results"]
    m = entry["metrics"]
    for p in bench.PASSES:
        assert m[f"torch_fp8_{p}_ms"] > 0 and m[f"torch_fp8_{p}_tflops"] > 0, p
        assert f"mok_vs_torch_fp8_{p}" not in m  # mok did not run
    for k in ("y", "dx", "dtw", "dw"):
        assert 0 < m[f"fp8_vs_bf16_{k}_rel_norm"] < 0.1, k
    assert "cublas_dense_fp8_tflops" not in m and "dense_fp8_scaling" not in entry  # a GPU figure only
    assert "fp8: |y_fp8 - y_torch|" in capsys.readouterr().out


# ---- on a Hopper GPU ------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch._scaled_grouped_mm)")


def _require_gpu_fp8():
    if not plain_fp8.fp8_grouped_mm_available(torch.device("cuda")):
        pytest.skip("needs torch._scaled_grouped_mm on a GPU of compute capability 9.0 (sm_90)")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("shared", [256, 0])
def test_fp8_layer_against_the_bf16_layer_on_the_gpu(shared):
    _require_gpu_fp8()
    dev = torch.device("cuda")
    Hg, Ig, Eg, Kg, Tg = 512, 256, 16, 4, 1000
    g = torch.Generator(device=dev).manual_seed(0)

    def randn(*size, std=1.0):
        return (torch.randn(*size, device=dev, generator=g) * std).to(torch.bfloat16).requires_grad_(True)

    w = {"w1": randn(Eg, Ig, Hg, std=Hg ** -0.5), "w2": randn(Eg, Hg, Ig, std=Ig ** -0.5),
         "w3": randn(Eg, Ig, Hg, std=Hg ** -0.5)}
    if shared:
        w.update(shared_w1=randn(shared, Hg, std=Hg ** -0.5), shared_w2=randn(Hg, shared, std=shared ** -0.5),
                 shared_w3=randn(shared, Hg, std=Hg ** -0.5))
    x = torch.randn(Tg, Hg, device=dev, generator=g).to(torch.bfloat16)
    idx = torch.rand(Tg, Eg, device=dev, generator=g).topk(Kg, dim=1).indices.to(torch.int32)
    tw = torch.softmax(torch.randn(Tg, Kg, device=dev, generator=g), dim=1)
    dy = torch.randn(Tg, Hg, device=dev, generator=g).to(torch.bfloat16)
    got = step(plain_fp8.plain_moe_experts_fp8, x, idx, tw, dy, w)
    want = step(plain.plain_moe_experts, x, idx, tw, dy, w, impl="grouped_mm")
    for name, a, b in (("y", got[0], want[0]), ("dx", got[1], want[1]), ("d topk_w", got[2], want[2])):
        assert torch.isfinite(a.float()).all(), name
        assert rel(a, b) < 0.1, (name, rel(a, b))
    for n in want[3]:
        a = got[3][n]
        assert a.dtype == torch.bfloat16 and torch.isfinite(a.float()).all(), n
        assert rel(a, want[3][n]) < 0.1, (n, rel(a, want[3][n]))


@pytest.mark.gpu
@needs_cuda
def test_fp8_layer_with_experts_without_tokens_on_the_gpu():
    _require_gpu_fp8()
    dev = torch.device("cuda")
    w = weights(E, S, device=dev, seed=4)
    x = torch.randn(6, H).to(torch.bfloat16).to(dev)
    idx = torch.tensor([[0, 1]] * 6, device=dev)
    tw = torch.full((6, 2), 0.5, device=dev)
    dy = torch.randn(6, H).to(torch.bfloat16).to(dev)
    y, dx, dtw, grads = step(plain_fp8.plain_moe_experts_fp8, x, idx, tw, dy, w)
    ref = step(plain.plain_moe_experts, x, idx, tw, dy, w, impl="grouped_mm")
    assert torch.isfinite(y.float()).all() and torch.isfinite(dx.float()).all() and rel(y, ref[0]) < 0.1
    for k in ("w1", "w2", "w3"):
        assert torch.isfinite(grads[k].float()).all(), k
        assert grads[k][2:].abs().sum() == 0 and grads[k][:2].abs().sum() > 0, k
        assert rel(grads[k][:2], ref[3][k][:2]) < 0.1, k


@pytest.mark.gpu
@needs_cuda
def test_bench_with_the_fp8_engine_on_the_gpu(tmp_path):
    _require_gpu_fp8()
    rc = bench.main(["--hidden", "1024", "--intermediate", "512", "--experts", "16", "--topk", "4", "--shared", "512",
                     "--tokens", "4096", "--iters", "3", "--warmup", "1", "--engines", "mok,torch,torch_fp8",
                     "--json", str(tmp_path / "r.json")])
    assert rc == 0
    (entry,) = json.loads((tmp_path / "r.json").read_text())["results"]
    m = entry["metrics"]
    assert m["y_rel_norm"] < 2e-2 and m["dx_rel_norm"] < 2e-2  # mok against bf16, as before
    for k in ("y", "dx", "dtw", "dw"):
        assert 0 < m[f"fp8_vs_bf16_{k}_rel_norm"] < 0.1, k
    for p in bench.PASSES:
        assert m[f"torch_fp8_{p}_ms"] > 0 and m[f"mok_vs_torch_fp8_{p}"] > 0, p
    assert m["cublas_dense_fp8_tflops"] > 0 and entry["dense_fp8_scaling"] in ("blockwise", "rowwise")
