"""``import mok`` without torch: library loading, version, engine info, Config/LayerShape validation, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import mok

ROOT = Path(__file__).resolve().parents[2]


def test_import_needs_no_torch():
    code = ("import sys; sys.modules['torch'] = None\n"  # any import of torch now fails
            "import mok; mok.validate(mok.LayerShape(tokens=128, hidden=256, intermediate=128, experts=8, topk=2))\n"
            "print(mok.__version__, mok.engine_info().gpu_forward)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == mok.__version__


def test_version_matches_library():
    assert mok.library_version() == mok.__version__


def test_engine_info():
    info = mok.engine_info()
    assert info.version == mok.__version__
    assert os.path.isfile(info.library)
    assert info.nccl_headers >= 22800  # NCCL >= 2.28 (the device API)
    assert "mok" in str(info)


def test_python_dash_m_mok_runs():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-m", "mok"], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "engine:" in out.stdout


def test_error_hierarchy():
    assert issubclass(mok.MokError, RuntimeError)
    assert issubclass(mok.MokInvalidArgument, mok.MokError) and issubclass(mok.MokInvalidArgument, ValueError)
    assert issubclass(mok.MokNotImplemented, NotImplementedError)
    assert issubclass(mok.MokTimeout, TimeoutError)
    assert mok.MokInvalidArgument("x").status == 1


def test_config_defaults_come_from_libmok():
    c = mok.Config().resolved()
    assert c.capacity == 2.0 and c.wait_timeout_s == 10.0 and c.minibatch == 0
    assert mok.Config(capacity=3.0).resolved().capacity == 3.0
    assert c.forward_engine == "fused" and c.backward_engine == "auto"


def test_config_engines_reach_libmok_and_bad_names_are_refused():
    c = mok.Config(forward_engine="staged", backward_engine="fused")
    raw = c.to_c()
    assert (raw.forward_engine, raw.backward_engine) == (1, 1)
    assert mok.Config(backward_engine="staged").to_c().backward_engine == 2
    mok.validate(mok.LayerShape(**SHAPE), c)
    with pytest.raises(mok.MokInvalidArgument, match="Config.backward_engine: expected 'auto' or 'fused' or 'staged'"):
        mok.Config(backward_engine="fast")
    with pytest.raises(mok.MokInvalidArgument, match="Config.forward_engine"):
        mok.Config(forward_engine=0)


def test_config_precision_names_alias_and_defaults():
    assert mok.PRECISIONS == ("bf16", "fp8_block")
    c = mok.Config().resolved()
    assert c.precision == "bf16" and c.fp8_weight_grads is True  # libmok's defaults
    raw = c.to_c()
    assert (raw.precision, raw.fp8_weight_grads) == (0, 1)
    assert mok.Config(precision="fp8").precision == "fp8_block"  # the alias is stored as the name
    assert mok.Config(precision="fp8") == mok.Config(precision="fp8_block")
    raw = mok.Config(precision="fp8", fp8_weight_grads=False).to_c()
    assert (raw.precision, raw.fp8_weight_grads) == (1, 0)
    assert mok.Config(precision="bf16").resolved().fp8_weight_grads is True
    mok.validate(mok.LayerShape(**SHAPE), mok.Config(precision="fp8_block", fp8_weight_grads=False))


@pytest.mark.parametrize("value", ["fp16", "FP8", "", 1, ["bf16"]])
def test_config_precision_refuses_other_values(value):
    with pytest.raises(mok.MokInvalidArgument) as e:
        mok.Config(precision=value)
    assert str(e.value).startswith("Config.precision: expected 'bf16' or 'fp8_block' (or the alias 'fp8' of "
                                   "'fp8_block'), got ")
    assert isinstance(e.value, ValueError)


def test_config_fp8_weight_grads_is_a_bool_and_precision_reaches_libmok():
    with pytest.raises(mok.MokInvalidArgument, match="Config.fp8_weight_grads: expected True or False, got 1"):
        mok.Config(fp8_weight_grads=1)
    # libmok's own rule: fp8_block keeps every routed row (no macrobatch ring), named by the knob
    shape = mok.LayerShape(**SHAPE)
    ring = mok.Config(minibatch=256, macrobatch=512)
    mok.validate(shape, ring)
    with pytest.raises(mok.MokInvalidArgument, match="Config.macrobatch: .*precision = fp8_block"):
        mok.validate(shape, mok.Config(minibatch=256, macrobatch=512, precision="fp8"))


def test_fp8_weights_bytes_about_the_bf16_weights():
    shape = mok.LayerShape(**SHAPE, shared_intermediate=768)
    n = mok.fp8_weights_bytes(shape)
    bf16 = 2 * 3 * (shape.experts * shape.intermediate + shape.shared_intermediate) * shape.hidden
    assert bf16 <= n <= 1.01 * bf16  # codes twice (as is, transposed) and the block scales


SHAPE = dict(tokens=4096, hidden=2048, intermediate=768, experts=128, topk=8)


def test_validate_accepts_a_good_shape():
    mok.validate(mok.LayerShape(**SHAPE))
    mok.validate(mok.LayerShape(**SHAPE, shared_intermediate=768, ep=2), mok.Config(minibatch=256))


@pytest.mark.parametrize("field,value,needle", [
    ("hidden", 2047, "LayerShape.hidden: expected a positive multiple of 64, got 2047"),
    ("topk", 0, "LayerShape.topk"),
    ("experts", 127, "experts"),
    ("ep", 0, "LayerShape.ep"),
])
def test_validate_names_the_bad_field(field, value, needle):
    shape = mok.LayerShape(**{**SHAPE, field: value, **({"ep": 2} if field == "experts" else {})})
    with pytest.raises(mok.MokInvalidArgument) as e:
        mok.validate(shape)
    assert needle in str(e.value)
    assert isinstance(e.value, ValueError)


def test_validate_names_the_bad_knob():
    with pytest.raises(mok.MokInvalidArgument, match="minibatch"):
        mok.validate(mok.LayerShape(**SHAPE), mok.Config(minibatch=100))
    with pytest.raises(mok.MokInvalidArgument, match="capacity"):
        mok.validate(mok.LayerShape(**SHAPE), mok.Config(capacity=-1.0))


def test_config_type_errors():
    with pytest.raises(mok.MokInvalidArgument, match="Config.minibatch: expected an integer"):
        mok.Config(minibatch=1.5)
    with pytest.raises(mok.MokInvalidArgument, match="Config.max_tokens"):
        mok.Config(max_tokens=-1)
    with pytest.raises(mok.MokInvalidArgument, match="LayerShape.hidden: expected an integer"):
        mok.validate(mok.LayerShape(**{**SHAPE, "hidden": 2048.0}))


def test_context_bytes():
    shape = mok.LayerShape(**SHAPE)
    full = mok.context_bytes(shape)
    routing = mok.context_bytes(shape, keep=mok.KEEP_ROUTING_ONLY)
    assert full > routing > 0
    assert mok.context_bytes(shape, keep=mok.KEEP_DEFERRED_WGRAD) > full
    with pytest.raises(mok.MokInvalidArgument, match="keep"):
        mok.context_bytes(shape, keep=7)


def test_missing_library_is_a_clear_error(tmp_path):
    code = "import mok; mok.engine_info()"
    env = dict(os.environ, MOK_LIBRARY=str(tmp_path / "nope.so"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "libmok.so not found" in out.stderr and "MOK_LIBRARY" in out.stderr
