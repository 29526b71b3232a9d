"""Wrong inputs raise mok.MokInvalidArgument (a ValueError) naming the argument and the expected value.

Metadata errors are the same on every device (they are raised in the fake implementations too, so
torch.compile reports them while tracing); the value errors here are the CPU path's, the GPU's are
libmok's (tests/python/test_gpu.py)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import mok  # noqa: E402
import mok.torch  # noqa: E402
from reference import random_problem  # noqa: E402

H, I, E, K, T = 128, 64, 4, 2, 16


@pytest.fixture
def layer():
    x, idx, w, weights = random_problem(T, H, I, E, K, seed=3)
    m = mok.torch.MoE(H, I, E, K)
    return m, x, idx, w


def expect(match, fn):
    with pytest.raises(mok.MokInvalidArgument, match=match) as e:
        fn()
    assert isinstance(e.value, ValueError) and isinstance(e.value, RuntimeError)
    return str(e.value)


def test_wrong_dtype_of_x(layer):
    m, x, idx, w = layer
    text = expect(r"^x: expected a contiguous bf16 tensor \[T, H=128\]", lambda: m(x.float(), idx, w))
    assert "got float32 [16, 128]" in text


def test_wrong_hidden_size(layer):
    m, x, idx, w = layer
    expect(r"x: expected .*\[T, H=128\].*got bfloat16 \[16, 64\]", lambda: m(x[:, :64].contiguous(), idx, w))


def test_wrong_dtype_of_weights_and_index(layer):
    m, x, idx, w = layer
    expect(r"topk_weights: expected a contiguous float32 tensor \[T=16, K=2\]", lambda: m(x, idx, w.double()))
    expect(r"topk_idx: expected a contiguous int32 or int64 tensor", lambda: m(x, idx.float(), w))


def test_wrong_topk_shape(layer):
    m, x, idx, w = layer
    expect(r"topk_idx: expected .*\[T=16, K=2\].*got int32 \[16, 1\]", lambda: m(x, idx[:, :1].contiguous(), w))
    expect(r"topk_weights: expected .*\[T=16, K=2\].*got float32 \[8, 2\]", lambda: m(x, idx, w[:8]))


def test_non_contiguous(layer):
    m, x, idx, w = layer
    wide = torch.zeros(T, 2 * H, dtype=torch.bfloat16)[:, :H]
    expect(r"x: expected a contiguous bf16 tensor .*call \.contiguous\(\)", lambda: m(wide, idx, w))
    expect(r"topk_weights: .*not contiguous", lambda: m(x, idx, w.t().contiguous().t()))


def test_weight_of_wrong_layout():
    x, idx, w, weights = random_problem(T, H, I, E, K, seed=3)
    expect(r"w2: expected a contiguous bf16 tensor \[E_local=4, H=128, I=64\]",
           lambda: mok.torch.moe_experts(x, idx, w, weights["w1"], weights["w1"], weights["w3"]))
    expect(r"w1: expected .*not contiguous",
           lambda: mok.torch.moe_experts(x, idx, w, weights["w1"].transpose(1, 2).contiguous().transpose(1, 2),
                                         weights["w2"], weights["w3"]))


def test_device_mismatch(layer):
    m, x, idx, w = layer
    expect(r"topk_weights: expected .* on cpu, got float32 \[16, 2\] on meta", lambda: m(x, idx, w.to("meta")))


def test_expert_id_out_of_range(layer):
    m, x, idx, w = layer
    bad = idx.clone()
    bad[5, 1] = E
    expect(r"topk_idx\[token 5, k 1\]: expected an expert id in \[0, 4\), got 4", lambda: m(x, bad, w))
    bad[5, 1] = -1
    expect(r"topk_idx\[token 5, k 1\]: expected an expert id in \[0, 4\), got -1", lambda: m(x, bad, w))


def test_duplicate_expert_in_a_token(layer):
    m, x, idx, w = layer
    bad = idx.clone()
    bad[3, 1] = bad[3, 0]
    expect(r"topk_idx\[token 3, k 1\]: expected distinct experts within one token", lambda: m(x, bad, w))


def test_non_finite_router_weight(layer):
    m, x, idx, w = layer
    for value, shown in ((float("nan"), "nan"), (float("inf"), "inf")):
        bad = w.clone()
        bad[7, 0] = value
        expect(rf"topk_weights\[token 7, k 0\]: expected a finite router weight, got {shown}", lambda: m(x, idx, bad))


def test_module_argument_errors():
    expect(r"dtype: expected torch.bfloat16", lambda: mok.torch.MoE(H, I, E, K, dtype=torch.float16))
    expect(r"LayerShape.hidden: expected a positive multiple of 64", lambda: mok.torch.MoE(100, I, E, K))
    expect(r"ep_group: expected None, mok.torch.LOCAL", lambda: mok.torch.MoE(H, I, E, K, ep_group="world"))
    expect(r"score_func: expected 'softmax' or 'sigmoid'", lambda: mok.torch.TopKRouter(H, E, K, score_func="relu"))
    expect(r"mode: expected 'sync' or 'off'", lambda: mok.torch.set_checks("sometimes"))


def test_module_precision_arguments():
    assert mok.torch.MoE(H, I, E, K).spec.config.precision == "bf16"
    for name in ("fp8", "fp8_block"):
        m = mok.torch.MoE(H, I, E, K, precision=name)
        assert m.spec.config.precision == "fp8_block" and m.spec.fp8 and m.spec.config.fp8_weight_grads is True
        assert "precision=fp8_block" in repr(m)
    m = mok.torch.MoE(H, I, E, K, precision="fp8", fp8_weight_grads=False)
    assert m.spec.config.fp8_weight_grads is False
    m = mok.torch.MoE(H, I, E, K, config=mok.Config(precision="fp8", capacity=3.0), precision="fp8_block")
    assert m.spec.config.precision == "fp8_block" and m.spec.config.capacity == 3.0  # agreeing is fine
    expect(r"^precision: expected 'bf16' or 'fp8_block' \(or the alias 'fp8' of 'fp8_block'\), got 'fp16'$",
           lambda: mok.torch.MoE(H, I, E, K, precision="fp16"))
    expect(r"^fp8_weight_grads: expected None, True or False, got 'no'$",
           lambda: mok.torch.MoE(H, I, E, K, precision="fp8", fp8_weight_grads="no"))
    expect(r"^precision: expected None or config.precision \('bf16'\): set in both, they must agree, got 'fp8_block'",
           lambda: mok.torch.MoE(H, I, E, K, config=mok.Config(precision="bf16"), precision="fp8"))
    expect(r"Config.macrobatch: .*fp8_block",  # libmok's rule, reached through the module's config
           lambda: mok.torch.MoE(H, I, E, K, config=mok.Config(minibatch=128, macrobatch=256, max_tokens=512),
                                 precision="fp8"))


def test_fp8_layer_on_the_cpu_names_a_non_finite_input(layer):
    """The CPU path's FP8 emulation refuses what it cannot quantize, naming the tensor (as the GPU's check() does)."""
    _, x, idx, w = layer
    m = mok.torch.MoE(H, I, E, K, precision="fp8")
    bad = x.clone()
    bad[3, 7] = float("nan")
    with pytest.raises(mok.MokInvalidArgument, match=r"x: expected finite values to quantize to fp8.*row 3, column 7"):
        m(bad, idx, w)


def test_ep_group_needs_torch_distributed():
    class FakeGroup:
        pass

    expect(r"ep_group: expected None or mok.torch.LOCAL \(torch.distributed is not initialised\)",
           lambda: mok.torch.MoE(H, I, E, K, ep_group=FakeGroup()))


def test_errors_surface_while_tracing(layer):
    """torch.compile reports the fake implementation's MokInvalidArgument (wrapped by dynamo) while tracing."""
    m, x, idx, w = layer
    compiled = torch.compile(m, fullgraph=True, backend="eager")
    with pytest.raises(Exception) as e:
        compiled(x.float(), idx, w)
    assert "MokInvalidArgument" in str(e.value)
    assert "x: expected a contiguous bf16 tensor [T, H=128], got float32 [16, 128]" in str(e.value)
