"""Training features on the CPU path (the same autograd and compile wiring the GPU uses): main_grad,
micro-batch accumulation, checkpointing, recompute, interleaved layers, no-grad forwards, T = 0,
torch.compile(fullgraph=True), the router."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
import mok.torch  # noqa: E402
from reference import assert_close, layer_and_grads, random_problem  # noqa: E402

H, I, E, K, S, T = 128, 64, 4, 2, 64, 24
NAMES = ("w1", "w2", "w3", "shared_w1", "shared_w2", "shared_w3")


def make_layer(seed=0, recompute=False):
    x, idx, w, weights = random_problem(T, H, I, E, K, shared=S, seed=seed)
    m = mok.torch.MoE(H, I, E, K, S, recompute=recompute)
    with torch.no_grad():
        for n in NAMES:
            getattr(m, n).copy_(weights[n])
    return m, x, idx, w, weights


def grads_of(m):
    return {n: getattr(m, n).grad for n in NAMES}


def run(m, x, idx, w, dy):
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    m(xg, idx, wg).backward(dy)
    return xg.grad, wg.grad


def test_main_grad_accumulates_in_fp32():
    m, x, idx, w, weights = make_layer()
    dy = torch.randn(T, H).bfloat16()
    for n in NAMES:
        getattr(m, n).main_grad = torch.full(getattr(m, n).shape, 0.5)
    run(m, x, idx, w, dy)
    _, ref = layer_and_grads(x, idx, w, dy, weights)
    for n in NAMES:
        p = getattr(m, n)
        assert p.grad is None, f"{n}: no .grad when main_grad has no grad_added_to_main_grad flag"
        assert p.main_grad.dtype == torch.float32
        assert_close(p.main_grad - 0.5, ref[n], f"main_grad {n}")


def test_main_grad_megatron_convention():
    m, x, idx, w, _ = make_layer()
    dy = torch.randn(T, H).bfloat16()
    for n in NAMES:
        p = getattr(m, n)
        p.main_grad = torch.zeros(p.shape)
        p.grad_added_to_main_grad = False
    m.w2.zero_out_wgrad = True
    run(m, x, idx, w, dy)
    for n in NAMES:
        p = getattr(m, n)
        assert p.grad_added_to_main_grad is True
        assert p.grad is not None and p.grad.shape == p.shape  # the dummy Megatron's hooks expect
        assert p.main_grad.abs().sum() > 0
    assert torch.count_nonzero(m.w2.grad) == 0  # zero_out_wgrad: a zero dummy


def test_micro_batches_accumulate_bitwise():
    m, x, idx, w, _ = make_layer()
    x2, idx2, w2, _ = random_problem(T, H, I, E, K, shared=S, seed=9)[:4]
    dy1, dy2 = torch.randn(T, H).bfloat16(), torch.randn(T, H).bfloat16()
    run(m, x, idx, w, dy1)
    g1 = {n: g.clone() for n, g in grads_of(m).items()}
    m.zero_grad(set_to_none=True)
    run(m, x2, idx2, w2, dy2)
    g2 = {n: g.clone() for n, g in grads_of(m).items()}
    m.zero_grad(set_to_none=True)
    run(m, x, idx, w, dy1)
    run(m, x2, idx2, w2, dy2)
    for n in NAMES:
        assert torch.equal(getattr(m, n).grad, g1[n] + g2[n]), n
    # main_grad: (0 + dW1) + dW2 in fp32, one add per element and micro-batch
    def main_grads_after(*batches):
        for n in NAMES:
            p = getattr(m, n)
            p.grad = None
            p.main_grad = torch.zeros(p.shape)
        for b in batches:
            run(m, *b)
        return {n: getattr(m, n).main_grad.clone() for n in NAMES}

    first, second = main_grads_after((x, idx, w, dy1)), main_grads_after((x2, idx2, w2, dy2))
    both = main_grads_after((x, idx, w, dy1), (x2, idx2, w2, dy2))
    for n in NAMES:
        assert torch.equal(both[n], first[n] + second[n]), n


@pytest.mark.parametrize("reentrant", [False, True])
def test_checkpoint_gives_the_same_gradients(reentrant):
    m, x, idx, w, _ = make_layer()
    dy = torch.randn(T, H).bfloat16()
    dx, dw = run(m, x, idx, w, dy)
    plain = {n: g.clone() for n, g in grads_of(m).items()}
    m.zero_grad(set_to_none=True)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = torch.utils.checkpoint.checkpoint(m, xg, idx, wg, use_reentrant=reentrant)
    y.backward(dy)
    assert torch.equal(xg.grad, dx) and torch.equal(wg.grad, dw)
    for n in NAMES:
        assert torch.equal(getattr(m, n).grad, plain[n]), n


def test_recompute_gives_the_same_bits():
    a, x, idx, w, _ = make_layer(recompute=False)
    b, *_ = make_layer(recompute=True)
    dy = torch.randn(T, H).bfloat16()
    assert torch.equal(a(x, idx, w), b(x, idx, w))
    ra, rb = run(a, x, idx, w, dy), run(b, x, idx, w, dy)
    assert all(torch.equal(p, q) for p, q in zip(ra, rb))
    for n in NAMES:
        assert torch.equal(getattr(a, n).grad, getattr(b, n).grad), n


def test_two_layers_interleaved():
    l1, x, idx, w, _ = make_layer(seed=1)
    l2, *_ = make_layer(seed=2)
    dy = torch.randn(T, H).bfloat16()
    run(l1, x, idx, w, dy)
    run(l2, x, idx, w, dy)
    alone = [{n: g.clone() for n, g in grads_of(m).items()} for m in (l1, l2)]
    l1.zero_grad(set_to_none=True)
    l2.zero_grad(set_to_none=True)
    xg = x.clone().requires_grad_()
    y1, y2 = l1(xg, idx, w), l2(xg, idx, w)  # forward 1, forward 2, then one backward through both
    (y1.float() * dy.float()).sum().add((y2.float() * dy.float()).sum()).backward()
    for m, ref in zip((l1, l2), alone):
        for n in NAMES:
            assert torch.equal(getattr(m, n).grad, ref[n]), n


def test_leading_dims_and_no_grad():
    m, x, idx, w, _ = make_layer()
    y = m(x.view(2, T // 2, H), idx.view(2, T // 2, K), w.view(2, T // 2, K))
    assert y.shape == (2, T // 2, H)
    with torch.no_grad():
        y0 = m(x, idx, w)
    assert y0.grad_fn is None and torch.equal(y0, y.view(T, H))


def test_zero_tokens():
    m, *_ = make_layer()
    x = torch.empty(0, H, dtype=torch.bfloat16, requires_grad=True)
    y = m(x, torch.empty(0, K, dtype=torch.int32), torch.empty(0, K))
    assert y.shape == (0, H)
    y.sum().backward()
    assert x.grad.shape == (0, H) and torch.count_nonzero(m.w1.grad) == 0


def test_compile_fullgraph_matches_eager_bitwise():
    m, x, idx, w, _ = make_layer()
    dy = torch.randn(T, H).bfloat16()

    def step(xx, ww):
        return m(xx, idx, ww)

    eager = run(m, x, idx, w, dy)
    eager_grads = {n: g.clone() for n, g in grads_of(m).items()}
    m.zero_grad(set_to_none=True)
    compiled = torch.compile(step, fullgraph=True)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    compiled(xg, wg).backward(dy)
    assert torch.equal(xg.grad, eager[0]) and torch.equal(wg.grad, eager[1])
    for n in NAMES:
        assert torch.equal(getattr(m, n).grad, eager_grads[n]), n


def test_compile_with_main_grad_and_functional_api():
    m, x, idx, w, weights = make_layer()
    for n in NAMES:
        getattr(m, n).main_grad = torch.zeros(getattr(m, n).shape)
    spec = mok.torch.layer_spec(H, I, E, K, S)

    def f(xx):
        return mok.torch.moe_experts(xx, idx, w, m.w1, m.w2, m.w3, m.shared_w1, m.shared_w2, m.shared_w3, spec=spec)

    dy = torch.randn(T, H).bfloat16()
    torch.compile(f, fullgraph=True)(x.clone().requires_grad_()).backward(dy)
    _, ref = layer_and_grads(x, idx, w, dy, weights)
    for n in NAMES:
        assert getattr(m, n).grad is None
        assert_close(getattr(m, n).main_grad, ref[n], f"main_grad {n}")


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router(score_func):
    torch.manual_seed(0)
    r = mok.torch.TopKRouter(H, E, K, score_func=score_func)
    x = torch.randn(3, 5, H).bfloat16()
    idx, w = r(x)
    assert idx.shape == (3, 5, K) and idx.dtype == torch.int32 and w.dtype == torch.float32
    assert int(idx.min()) >= 0 and int(idx.max()) < E
    assert all(len(set(row.tolist())) == K for row in idx.view(-1, K))
    if score_func == "sigmoid":  # route_norm on by default
        assert torch.allclose(w.sum(-1), torch.ones(3, 5))
    idx2, w2 = r(x)
    assert torch.equal(idx, idx2) and torch.equal(w, w2)


def test_router_scores_stay_fp32_under_autocast():
    torch.manual_seed(0)
    r = mok.torch.TopKRouter(H, E, K)
    x = torch.randn(16, H).bfloat16()
    idx, w = r(x)
    with torch.autocast(device_type="cpu", dtype=torch.bfloat16):
        idx_a, w_a = r(x)
    assert w_a.dtype == torch.float32
    assert torch.equal(idx, idx_a) and torch.equal(w, w_a)


def test_outputs_unfilled_under_deterministic_mode():
    # mok writes every element of its outputs; the deterministic mode's fill must not cost a memset
    import torch.utils.deterministic as det
    from mok.torch._runtime import empty_unfilled
    prev = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert det.fill_uninitialized_memory
        t = empty_unfilled(4, dtype=torch.float32)
        assert t.shape == (4,) and det.fill_uninitialized_memory  # restored
    finally:
        torch.use_deterministic_algorithms(prev)


def test_router_aux_loss_reaches_the_gate():
    torch.manual_seed(0)
    x = torch.randn(32, H).bfloat16()
    plain = mok.torch.TopKRouter(H, E, K)
    aux = mok.torch.TopKRouter(H, E, K, aux_loss_coeff=0.5)
    aux.load_state_dict(plain.state_dict())
    plain(x)[1].sum().backward()
    aux(x)[1].sum().backward()
    assert not torch.equal(plain.gate.weight.grad, aux.gate.weight.grad)
    with torch.no_grad():
        idx, w, loss = aux(x, return_aux_loss=True)
    assert loss.dim() == 0 and loss.item() > 0


def test_block_in_two_lines_with_compile():
    torch.manual_seed(0)
    router = mok.torch.TopKRouter(H, E, K, aux_loss_coeff=0.01)
    moe = mok.torch.MoE(H, I, E, K, S)

    def block(x):
        return x + moe(x, *router(x))

    x = torch.randn(T, H).bfloat16()
    y = torch.compile(block, fullgraph=True)(x)
    y.float().sum().backward()
    assert moe.w1.grad is not None and router.gate.weight.grad is not None
    assert torch.equal(y, block(x))


def test_fp8_copies_tell_a_new_weight_at_a_freed_address():
    """The FP8 weight copies' staleness test (docs/python.md, "FP8"): a new tensor that the allocator puts where a freed
    weight was has the same address and version counter 0, so only its storage tells it apart."""
    from mok.torch._runtime import _same_storages, _storage_refs

    w = [torch.randn(8, 8), None, torch.randn(4)]
    refs = _storage_refs(w)
    assert _same_storages(refs, w)
    assert _same_storages(refs, [w[0].view(64), None, w[2]])  # a view of the same weight: the same copies
    assert not _same_storages(refs, [w[0].clone(), None, w[2]])
    assert not _same_storages(refs, [w[0], torch.randn(2), w[2]])
    assert not _same_storages(refs, w[:2])
    del w[0]
    w.insert(0, torch.randn(8, 8))  # the old storage is gone
    assert not _same_storages(refs, w)
    assert not _same_storages((), w)


def test_fp8_copies_of_freed_layers_are_dropped_on_every_workspace():
    """A new set of FP8 copies drops, on every workspace, the sets whose weights were freed, and on its own
    workspace the set keyed on the same gate address; live sets elsewhere stay (docs/python.md, "FP8")."""
    from types import SimpleNamespace

    from mok.torch._runtime import _pop_stale_copies, _storage_refs

    def entry(weights):
        return SimpleNamespace(storages=_storage_refs(weights))

    live, freed = [torch.randn(4)], [torch.randn(4)]
    a = SimpleNamespace(fp8_weights={(1, 2): entry(live), (3, 4): entry(freed), (5, 6): entry(live)})
    b = SimpleNamespace(fp8_weights={(1, 7): entry(live), (8, 9): entry(freed)})
    del freed[0]
    stale = _pop_stale_copies([a, b], b, (1, 10))
    assert len(stale) == 3
    assert set(a.fp8_weights) == {(1, 2), (5, 6)}  # same gate address on another workspace: a live layer's set
    assert set(b.fp8_weights) == set()  # (1, 7): this workspace's set at the same gate address; (8, 9): freed


def test_fp8_copies_of_freed_weights_are_found():
    """A layer's first call drops the FP8 copies whose weights were freed (docs/python.md, "FP8"): a weight
    freed while another of the layer's weights lives is enough, a view keeping the storage alive is not."""
    from mok.torch._runtime import _storage_refs, _weights_freed

    w = [torch.randn(8, 8), None, torch.randn(4)]
    refs = _storage_refs(w)
    assert not _weights_freed(refs) and not _weights_freed(())
    view = w[0].view(64)
    del w[0]
    assert not _weights_freed(refs)  # the view holds the storage
    del view
    assert _weights_freed(refs)
