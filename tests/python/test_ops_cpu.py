"""The ops on the CPU: registration, fake shapes, opcheck, argument errors, and the CPU path's numbers
against the independent reference (tests/python/reference.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
import mok.torch  # noqa: E402
from reference import assert_close, layer_and_grads, random_problem  # noqa: E402

H, I, E, K, S, T = 128, 64, 4, 2, 64, 24


def op_args(x, idx, w, weights, spec, keep=0, main_grads=None, fused=False):
    if fused:
        ws = [weights["gate_up_proj"], None, weights["down_proj"], None, None, None]
    else:
        ws = [weights["w1"], weights["w3"], weights["w2"], weights.get("shared_w1"), weights.get("shared_w3"),
              weights.get("shared_w2")]
    return (x, idx, w, *ws, *(main_grads or [None] * 6), spec, keep, 0)


@pytest.fixture
def problem():
    return random_problem(T, H, I, E, K, shared=S, seed=1)


def test_ops_are_registered():
    assert hasattr(torch.ops.mok, "moe_forward") and hasattr(torch.ops.mok, "moe_backward")
    schema = str(torch.ops.mok.moe_backward.default._schema)
    assert "Tensor(a11!) grad_gate" in schema or "grad_gate" in schema and "!" in schema
    assert "mutable" not in str(torch.ops.mok.moe_forward.default._schema)


def test_layer_spec_roundtrip():
    from mok.torch._spec import parse_spec

    key = mok.torch.layer_spec(H, I, E, K, S, config=mok.Config(capacity=3.0, max_tokens=512, backward_engine="fused"))
    spec = parse_spec(key)
    assert (spec.hidden, spec.intermediate, spec.experts, spec.topk, spec.shared_intermediate) == (H, I, E, K, S)
    assert spec.config.capacity == 3.0 and spec.config.max_tokens == 512 and spec.key() == key
    assert spec.config.backward_engine == "fused" and spec.config.forward_engine == "fused"
    with pytest.raises(mok.MokInvalidArgument, match="spec"):
        parse_spec("garbage")
    fp8 = parse_spec(mok.torch.layer_spec(H, I, E, K, S, config=mok.Config(precision="fp8", fp8_weight_grads=False)))
    assert fp8.fp8 and fp8.config.precision == "fp8_block" and fp8.config.fp8_weight_grads is False
    assert fp8.key() != key and parse_spec(fp8.key()) == fp8 and not spec.fp8


def _fake_cuda_args(tokens, keep, shared=True):
    spec = mok.torch.layer_spec(H, I, E, K, S if shared else 0)
    bf = dict(dtype=torch.bfloat16, device="cuda")
    ws = [torch.empty(E, I, H, **bf), torch.empty(E, I, H, **bf), torch.empty(E, H, I, **bf)]
    ws += [torch.empty(S, H, **bf), torch.empty(S, H, **bf), torch.empty(H, S, **bf)] if shared else [None] * 3
    return (torch.empty(tokens, H, **bf), torch.empty(tokens, K, dtype=torch.int32, device="cuda"),
            torch.empty(tokens, K, device="cuda"), *ws, *[None] * 6, spec, keep, 0)


def test_fake_shapes_on_cuda_without_a_gpu():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        y, ctx = torch.ops.mok.moe_forward(*_fake_cuda_args(200, keep=0))
        assert y.shape == (200, H) and y.dtype == torch.bfloat16 and y.device.type == "cuda"
        # T = 200 runs on a workspace of 256 tokens (the next power of two): its context size
        shape = mok.LayerShape(tokens=256, hidden=H, intermediate=I, experts=E, topk=K, shared_intermediate=S)
        assert ctx.shape == (mok.context_bytes(shape),) and ctx.dtype == torch.uint8
        _, ctx1 = torch.ops.mok.moe_forward(*_fake_cuda_args(200, keep=mok.KEEP_ROUTING_ONLY))
        assert ctx1.shape == (mok.context_bytes(shape, keep=mok.KEEP_ROUTING_ONLY),)
        _, none = torch.ops.mok.moe_forward(*_fake_cuda_args(200, keep=-1))
        assert none.shape == (0,)


def test_fake_context_size_of_a_symbolic_T_is_unbacked():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    env = ShapeEnv()
    with FakeTensorMode(shape_env=env):
        t = env.create_unbacked_symint()
        torch._check(t > 0)
        args = list(_fake_cuda_args(8, keep=0))
        args[0] = torch.empty(t, H, dtype=torch.bfloat16, device="cuda")
        args[1] = torch.empty(t, K, dtype=torch.int32, device="cuda")
        args[2] = torch.empty(t, K, device="cuda")
        y, ctx = torch.ops.mok.moe_forward(*args)
        assert not isinstance(ctx.shape[0], int)


@pytest.mark.parametrize("shared", [True, False])
def test_opcheck_forward(problem, shared):
    x, idx, w, weights = problem
    if not shared:
        weights = {k: v for k, v in weights.items() if not k.startswith("shared")}
    spec = mok.torch.layer_spec(H, I, E, K, S if shared else 0)
    x.requires_grad_()
    w.requires_grad_()
    for t in weights.values():
        t.requires_grad_()
    torch.library.opcheck(torch.ops.mok.moe_forward.default, op_args(x, idx, w, weights, spec))


def test_opcheck_forward_hf_layout_and_main_grads(problem):
    x, idx, w, weights = problem
    hf = {"gate_up_proj": torch.cat([weights["w1"], weights["w3"]], dim=1).requires_grad_(),
          "down_proj": weights["w2"].clone().requires_grad_()}
    spec = mok.torch.layer_spec(H, I, E, K, 0)
    mgs = [torch.zeros(E, 2 * I, H), None, torch.zeros(E, H, I), None, None, None]
    torch.library.opcheck(torch.ops.mok.moe_forward.default,
                          op_args(x.requires_grad_(), idx.long(), w, hf, spec, main_grads=mgs, fused=True),
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))


@pytest.mark.parametrize("accumulate", [0, 1])
def test_opcheck_backward(problem, accumulate):
    x, idx, w, weights = problem
    spec = mok.torch.layer_spec(H, I, E, K, S)
    ws = [weights[n] for n in ("w1", "w3", "w2", "shared_w1", "shared_w3", "shared_w2")]
    dtype = torch.float32 if accumulate else torch.bfloat16
    buffers = [torch.zeros(t.shape, dtype=dtype) for t in ws]
    dy = torch.randn(T, H).bfloat16()
    torch.library.opcheck(torch.ops.mok.moe_backward.default,
                          (torch.empty(0, dtype=torch.uint8), x, idx, w, dy, *ws, *buffers, spec, accumulate))


def _module_like(weights, shared=True):
    m = mok.torch.MoE(H, I, E, K, S if shared else 0)
    with torch.no_grad():
        for name in ("w1", "w2", "w3") + (("shared_w1", "shared_w2", "shared_w3") if shared else ()):
            getattr(m, name).copy_(weights[name])
    return m


@pytest.mark.parametrize("shared", [True, False])
def test_cpu_path_matches_the_reference(problem, shared):
    x, idx, w, weights = problem
    if not shared:
        weights = {k: v for k, v in weights.items() if not k.startswith("shared")}
    m = _module_like(weights, shared)
    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = m(xg, idx, wg)
    dy = torch.randn(T, H, generator=torch.Generator().manual_seed(5)).bfloat16()
    y.backward(dy)
    ref_y, ref = layer_and_grads(x, idx, w, dy, weights)
    assert_close(y, ref_y, "y")
    assert_close(xg.grad, ref["x"], "dx")
    assert_close(wg.grad, ref["topk_weights"], "d topk_weights")
    for name in weights:
        assert_close(getattr(m, name).grad, ref[name], f"d {name}")


def test_hf_experts_match_the_reference(problem):
    x, idx, w, weights = problem
    hf = mok.torch.HFExperts(E, H, I, K)
    with torch.no_grad():
        hf.gate_up_proj.copy_(torch.cat([weights["w1"], weights["w3"]], dim=1))
        hf.down_proj.copy_(weights["w2"])
    xg = x.clone().requires_grad_()
    y = hf(xg, idx.long(), w.to(torch.bfloat16).float())
    dy = torch.randn(T, H).bfloat16()
    y.backward(dy)
    ref_y, ref = layer_and_grads(x, idx, w, dy, {"gate_up_proj": hf.gate_up_proj, "down_proj": hf.down_proj})
    assert_close(y, ref_y, "y")
    assert_close(xg.grad, ref["x"], "dx")
    assert hf.gate_up_proj.grad.shape == (E, 2 * I, H)
    assert_close(hf.gate_up_proj.grad, ref["gate_up_proj"], "d gate_up_proj")
    assert_close(hf.down_proj.grad, ref["down_proj"], "d down_proj")


def test_hf_interface_function_on_a_transformers_style_module(problem):
    x, idx, w, weights = problem

    class Experts(torch.nn.Module):  # the shape of transformers' experts modules
        def __init__(self):
            super().__init__()
            self.num_experts = E
            self.config = type("Cfg", (), {"num_experts_per_tok": K})()
            self.gate_up_proj = torch.nn.Parameter(torch.cat([weights["w1"], weights["w3"]], dim=1))
            self.down_proj = torch.nn.Parameter(weights["w2"].clone())
            self.act_fn = torch.nn.SiLU()

    ex = Experts()
    y = mok.torch.hf.experts_forward(ex, x.float(), idx.long(), w)  # fp32 hidden states come back fp32
    assert y.dtype == torch.float32
    routed = {k: v for k, v in weights.items() if not k.startswith("shared")}
    assert_close(y, layer_and_grads(x, idx, w, torch.ones(T, H), routed)[0], "y")
    ex.act_fn = torch.nn.GELU()
    del ex._mok_spec_key
    with pytest.raises(mok.MokInvalidArgument, match="act_fn"):
        mok.torch.hf.experts_forward(ex, x, idx, w)


def test_hf_register_without_transformers_is_a_clear_error():
    try:
        import transformers  # noqa: F401
        pytest.skip("transformers is installed")
    except ImportError:
        pass
    with pytest.raises(mok.MokError, match="transformers"):
        mok.torch.hf.register()


def test_fp8_cpu_emulation_quantizer_and_layer():
    """The CPU path's FP8 emulation (mok.torch._reference): power-of-two scales with amax in (224, 448], e4m3
    round to nearest even, and the layer a few percent from bf16, bitwise repeatable, through autograd."""
    from mok.torch import _reference as ref

    v = torch.tensor([[1.0, -3.0, 0.0, 2.0 ** -12] + [0.0] * 124 + [448.0 * 8]])
    codes, scales = ref._q_rows(v, "v")
    # amax 3: 448 * 2^-8 < 3 <= 448 * 2^-7; amax 3584 = 448 * 2^3 exactly
    assert scales[0, 0].item() == 2.0 ** -7 and scales[0, 128].item() == 8.0
    assert codes[0, 0].item() == 128.0 and codes[0, 1].item() == -384.0 and codes[0, 128].item() == 448.0
    assert codes[0, 3].item() == 2.0 ** -5 and codes[0, 2].item() == 0.0
    t = torch.tensor([[448.0, 1.0 + 2.0 ** -4, 1.0 + 3 * 2.0 ** -4] + [0.0] * 125])  # scale 1; two ties to even
    c, sc = ref._q_rows(t, "t")
    assert sc[0, 0].item() == 1.0 and c[0, 1].item() == 1.0 and c[0, 2].item() == 1.25
    H_, I_, E_, K_, T_ = 256, 192, 4, 2, 96
    torch.manual_seed(1)
    outs = {}
    for prec in ("bf16", "fp8", "fp8"):
        torch.manual_seed(1)
        m = mok.torch.MoE(H_, I_, E_, K_, shared_intermediate=128, precision=prec)
        x = torch.randn(T_, H_).bfloat16().requires_grad_()
        idx = torch.stack([torch.randperm(E_)[:K_] for _ in range(T_)]).int()
        w = torch.rand(T_, K_).requires_grad_()
        y = m(x, idx, w)
        y.float().square().sum().backward()
        got = [y.detach().float(), x.grad.float(), w.grad] + [p.grad.float() for p in m.parameters()]
        if prec in outs:  # D1: the second FP8 run
            assert all(torch.equal(a, b) for a, b in zip(got, outs[prec]))
        outs[prec] = got
    rel = [((a - b).norm() / b.norm()).item() for a, b in zip(outs["fp8"], outs["bf16"])]
    assert all(0.01 < r < 0.15 for r in rel), rel
