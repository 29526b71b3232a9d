"""mok.torch with precision "fp8" (block-scaled FP8 expert GEMMs, docs/fp8.md) on a Hopper GPU: forward and
backward run and stay within the FP8 recipe's distance of the bf16 layer, repeat bit for bit, and the layer's FP8
weight copies are re-quantized exactly when a weight changes (docs/python.md, "FP8"): after an optimizer step or an
in-place write, not when nothing changed, not twice for one step, and inside a replayed CUDA graph of the whole step.
Skips without a GPU (conftest.py says why)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
import mok.torch  # noqa: E402
from mok.torch import _runtime  # noqa: E402
from reference import relnorm  # noqa: E402
from test_gpu import (E, H, I, K, S, T, assert_bitwise, check_compile_fullgraph_matches_eager, dy_like,  # noqa: E402
                      fwd_bwd, make_layer, names_of)
from test_gpu import _release_at_end, _sync_checks  # noqa: E402, F401  (its autouse fixtures apply here too)

pytestmark = pytest.mark.gpu

# The FP8 reference layer is 0.065-0.075 from the bf16 one on every output and gradient (docs/fp8.md, "The reference
# layer in FP8"); a GEMM of the GPU may differ from the reference within its own tolerance on top of that.
FP8_VS_BF16 = 0.1
FP8 = mok.Config(precision="fp8")
LR = 1e-3  # the optimizer steps' learning rate: the weights move, y stays finite


def updates() -> int:
    """FP8 re-quantizations so far (mok_fp8_weights_update calls of this process)."""
    return _runtime.fp8_update_count


def copies_of(m) -> list[_runtime.Fp8Weights]:
    """The FP8 weight copies of layer m on every workspace (found by its weights' addresses)."""
    ptrs = tuple(p.data_ptr() for p in (m.w1, m.w2, m.w3))
    return [e for ws in _runtime.workspaces() for k, e in ws.fp8_weights.items() if k[:3] == ptrs]


def bits(t):
    """t's bits (bitwise comparison: torch.equal says False for two NaNs of the same bits)."""
    return t.detach().contiguous().view(torch.int16 if t.element_size() == 2 else torch.int32)


def forward(m, x, idx, w):
    with torch.no_grad():
        return m(x, idx, w)


def test_fp8_forward_backward_close_to_bf16():
    bf16, x, idx, w, _ = make_layer()
    fp8, *_ = make_layer(config=FP8)  # the same weights (same seed)
    dy = dy_like(x)
    a, b = fwd_bwd(fp8, x, idx, w, dy), fwd_bwd(bf16, x, idx, w, dy)
    for k in a:
        assert torch.isfinite(a[k]).all(), f"{k}: not finite"
        r = relnorm(a[k], b[k])
        print(f"fp8 vs bf16 {k}: {r:.4f}")
        assert 0 < r < FP8_VS_BF16, f"{k}: relative norm {r:.3e} from the bf16 layer (expected ~0.06, below 0.1)"


@pytest.mark.parametrize("weight_grads", [True, False])
def test_fp8_bitwise_repeat(weight_grads):
    m, x, idx, w, _ = make_layer(config=mok.Config(precision="fp8", fp8_weight_grads=weight_grads))
    dy = dy_like(x)
    first = fwd_bwd(m, x, idx, w, dy)
    assert_bitwise(first, fwd_bwd(m, x, idx, w, dy), "repeat")
    again, *_ = make_layer(config=mok.Config(precision="fp8", fp8_weight_grads=weight_grads))  # fresh copies
    assert_bitwise(first, fwd_bwd(again, x, idx, w, dy), "a second layer of the same weights")


def test_fp8_recompute_gives_the_same_bits():
    m, x, idx, w, _ = make_layer(config=FP8)
    r, *_ = make_layer(config=FP8, recompute=True)
    dy = dy_like(x)
    assert_bitwise(fwd_bwd(m, x, idx, w, dy), fwd_bwd(r, x, idx, w, dy), "recompute=True")


def test_weight_copies_are_quantized_once_per_change():
    m, x, idx, w, _ = make_layer(config=FP8)
    n = updates()
    y0 = forward(m, x, idx, w)
    assert updates() == n + 1  # new copies
    stats = mok.torch.memory_stats()
    assert stats["fp8_weight_copies"] >= 1 and stats["fp8_weight_bytes"] >= mok.fp8_weights_bytes(
        mok.LayerShape(tokens=T, hidden=H, intermediate=I, experts=E, topk=K, shared_intermediate=S))
    assert torch.equal(forward(m, x, idx, w), y0) and updates() == n + 1  # unchanged weights: no update
    fwd_bwd(m, x, idx, w, dy_like(x))
    assert updates() == n + 1  # forward and backward read the same copies
    with torch.no_grad():
        m.w1.add_(0.01 * torch.randn_like(m.w1))
    y1 = forward(m, x, idx, w)
    assert updates() == n + 2 and not torch.equal(y1, y0)  # re-quantized after the in-place write
    fresh, *_ = make_layer(config=FP8)
    with torch.no_grad():
        for name in names_of(m):
            getattr(fresh, name).copy_(getattr(m, name))
    assert torch.equal(forward(fresh, x, idx, w), y1)  # and to the same copies as new weights give


def test_optimizer_step_requantizes_once():
    m, x, idx, w, _ = make_layer(config=FP8)
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    dy = dy_like(x)
    before = fwd_bwd(m, x, idx, w, dy)
    opt.step()
    n = updates()
    after = fwd_bwd(m, x, idx, w, dy)
    assert updates() == n + 1  # the step's forward re-quantized, its backward did not
    assert not torch.equal(after["y"], before["y"])


def test_copies_of_freed_layers_are_dropped():
    """A program that builds and drops FP8 layers keeps copies only for the live ones (each costs about its bf16
    weights' bytes): a new layer's first call drops the copies whose weights were freed."""
    m, x, idx, w, _ = make_layer(config=FP8)
    forward(m, x, idx, w)
    before = mok.torch.memory_stats()["fp8_weight_copies"]
    hold = []  # the freed weights' blocks, taken so that each next layer lands at new addresses (new keys)
    for seed in (21, 22, 23):
        dropped, *_ = make_layer(config=FP8, seed=seed)
        forward(dropped, x, idx, w)
        shapes = [p.shape for p in dropped.parameters()]
        del dropped
        hold += [torch.empty(shape, dtype=torch.bfloat16, device=x.device) for shape in shapes]
    last, *_ = make_layer(config=FP8, seed=24)
    forward(last, x, idx, w)
    assert mok.torch.memory_stats()["fp8_weight_copies"] <= before + 1  # m's and last's (and none of the three)
    assert torch.equal(forward(m, x, idx, w), forward(m, x, idx, w))


def test_writes_torch_does_not_see_need_mark_fp8_weights_stale():
    """``param.data`` has its own version counter: such writes reach the copies after mark_fp8_weights_stale()."""
    m, x, idx, w, _ = make_layer(config=FP8)
    y0 = forward(m, x, idx, w)
    m.w2.data.mul_(2.0)
    assert torch.equal(forward(m, x, idx, w), y0)  # the documented limit: the old copies
    mok.torch.mark_fp8_weights_stale()
    n = updates()
    y1 = forward(m, x, idx, w)
    assert updates() == n + 1 and not torch.equal(y1, y0)


def test_compile_fullgraph_matches_eager_bitwise():
    check_compile_fullgraph_matches_eager(FP8)


def test_cuda_graph_of_the_whole_step_requantizes_on_replay():
    """A captured step (forward, backward, SGD) replayed against the same steps run eagerly on a copy: the same bits
    every step, which needs each replay to re-quantize the weights its previous replay's optimizer changed."""
    graphed, x, idx, w, _ = make_layer(config=FP8)
    dy = dy_like(x)
    # (lr 0.5 took the weights far enough in one step that y overflowed: NaN on both sides)
    opt = torch.optim.SGD(graphed.parameters(), lr=LR)
    sw = w.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: the workspace and the FP8 copies exist before the capture
        for _ in range(2):
            opt.zero_grad(set_to_none=True)
            graphed(x, idx, sw).backward(dy)
            opt.step()
    torch.cuda.current_stream().wait_stream(side)
    eager, *_ = make_layer(config=FP8)
    with torch.no_grad():
        for n in names_of(graphed):
            getattr(eager, n).copy_(getattr(graphed, n))
    eager_opt = torch.optim.SGD(eager.parameters(), lr=LR)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        sy = graphed(x, idx, sw)
        sy.backward(dy)
        opt.step()
    for step in range(3):
        graph.replay()
        torch.cuda.synchronize()
        mok.torch.check()
        eager_opt.zero_grad(set_to_none=True)
        y = eager(x, idx, w.clone().requires_grad_())
        assert torch.isfinite(y).all(), f"step {step}: the eager y is not finite (the comparison would mean nothing)"
        if not torch.equal(bits(sy), bits(y)):
            # Which side is stale: the eager layer's weights (those the replay read) re-quantized once more.
            same_copies = [torch.equal(a.memory, b.memory) for a in copies_of(graphed) for b in copies_of(eager)]
            mok.torch.mark_fp8_weights_stale()
            again = forward(eager, x, idx, w)
            pytest.fail(f"step {step}: y of the replay differs from eager (relative norm {relnorm(sy, y.detach()):.3e}); "
                        f"the two layers' FP8 weight copies are equal: {same_copies}; the eager layer re-quantized gives "
                        f"its own y again: {torch.equal(again, y.detach())}, the replay's: {torch.equal(again, sy)}")
        y.backward(dy)
        eager_opt.step()
        for n in names_of(graphed):
            assert torch.equal(bits(getattr(graphed, n)), bits(getattr(eager, n))), f"step {step}: {n} after the step differs"
    # eager calls after replays re-quantize (mok cannot see what a replay did to the weights)
    n = updates()
    assert torch.equal(bits(forward(graphed, x, idx, w)), bits(forward(eager, x, idx, w))) and updates() >= n + 1


@pytest.mark.parametrize("mode", ["eager", "compile", "graph", "compile+graph"])
def test_toy_model_trains_in_fp8(mode):
    import toy_model

    first = toy_model.train(mode, 8, "cuda", precision="fp8")
    assert first == toy_model.train(mode, 8, "cuda", precision="fp8"), f"{mode}: two runs differ"
    assert all(v == v for v in first) and first[-1] < first[0], f"{mode}: {first}"
