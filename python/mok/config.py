"""Config (the knobs) and LayerShape (the sizes) of a mok layer, validated by libmok itself.

These mirror ``mok::Config`` and ``mok::LayerShape`` (include/mok/config.hpp, shape.hpp): the same
fields, the same defaults (read from ``mok_config_default``), the same validation
(``mok_validate``), so a shape or knob that Python accepts is one the C++ library accepts.
"""

from __future__ import annotations

import ctypes
import dataclasses
from dataclasses import dataclass

from . import _lib
from .errors import invalid_argument

__all__ = ["Config", "LayerShape", "validate", "context_bytes", "KEEP_ACTIVATIONS", "KEEP_ROUTING_ONLY",
           "KEEP_DEFERRED_WGRAD", "FORWARD_ENGINES", "BACKWARD_ENGINES", "PRECISIONS", "fp8_weights_bytes"]

# The engines (mok::ForwardEngine, mok::BackwardEngine): the names Config takes, in the C API's order.
FORWARD_ENGINES = ("fused", "staged")
BACKWARD_ENGINES = ("auto", "fused", "staged")
# The precisions (mok::Precision), in the C API's order; "fp8" is accepted for "fp8_block" and stored as it.
PRECISIONS = ("bf16", "fp8_block")
_PRECISION_ALIASES = {"fp8": "fp8_block"}
# The knobs that are names in Python and indices into these tuples in the C API.
_ENGINES = {"forward_engine": FORWARD_ENGINES, "backward_engine": BACKWARD_ENGINES}
_NAMED = {**_ENGINES, "precision": PRECISIONS}
_FLAGS = ("fp8_weight_grads",)  # bool in Python, int32 0/1 in the C API

# mok_context_bytes / mok_context_create_in `keep` (mok::Context::Keep).
KEEP_ACTIVATIONS = 0
KEEP_ROUTING_ONLY = 1
KEEP_DEFERRED_WGRAD = 2


def precision_name(value, argument: str = "Config.precision") -> str:
    """The PRECISIONS name of ``value`` (a name or an alias: "fp8" -> "fp8_block"); else MokInvalidArgument
    naming ``argument`` and the accepted values."""
    if isinstance(value, str) and value in PRECISIONS:
        return value
    if isinstance(value, str) and value in _PRECISION_ALIASES:
        return _PRECISION_ALIASES[value]
    aliases = ", ".join(f"the alias {a!r} of {n!r}" for a, n in _PRECISION_ALIASES.items())
    raise invalid_argument(argument, f"{' or '.join(map(repr, PRECISIONS))} (or {aliases})", repr(value))


def _defaults() -> dict:
    c = _lib.ConfigC()
    _lib.call("mok_config_default", ctypes.byref(c))
    d = {name: getattr(c, name) for name, _ in _lib.ConfigC._fields_}
    for name, names in _NAMED.items():
        d[name] = names[d[name]]
    for name in _FLAGS:
        d[name] = bool(d[name])
    return d


@dataclass(frozen=True)
class Config:
    """mok's knobs (mok::Config). Knobs change speed and memory, never results; the precision is the exception.

    ``None`` fields take libmok's documented defaults (include/mok/config.hpp). ``forward_engine``
    ("fused" or "staged") and ``backward_engine`` ("auto", "fused" or "staged") choose the kernels
    (the same bits; "auto" runs the faster one for the gradient mode, docs/megakernel.md).
    ``precision`` is the arithmetic of the expert GEMMs: "bf16" (the default) or "fp8_block"
    (DeepSeek-V3's block-scaled FP8, docs/fp8.md; "fp8" is accepted and stored as "fp8_block"); with
    "fp8_block", ``fp8_weight_grads`` (default True) runs the weight-gradient GEMMs in FP8 too, False
    in bf16.
    ``max_tokens`` is the binding's own: the tokens per rank a workspace is sized for
    (``LayerShape.tokens``); 0 sizes it for each call's T rounded up to a power of two
    (docs/python.md, "Workspaces").
    """

    comm_sms_forward: int | None = None
    comm_sms_backward: int | None = None
    minibatch: int | None = None
    macrobatch: int | None = None
    capacity: float | None = None
    grid_sms: int | None = None
    wait_timeout_s: float | None = None
    forward_engine: str | None = None
    backward_engine: str | None = None
    precision: str | None = None
    fp8_weight_grads: bool | None = None
    max_tokens: int = 0

    def resolved(self) -> "Config":
        """This config with every ``None`` replaced by libmok's default."""
        d = _defaults()
        values = {f.name: (getattr(self, f.name) if getattr(self, f.name) is not None else d[f.name])
                  for f in dataclasses.fields(self) if f.name != "max_tokens"}
        return Config(**values, max_tokens=self.max_tokens)

    def to_c(self) -> _lib.ConfigC:
        r = self.resolved()
        c = _lib.ConfigC()
        for name, _ in _lib.ConfigC._fields_:
            v = getattr(r, name)
            setattr(c, name, _NAMED[name].index(v) if name in _NAMED else int(v) if name in _FLAGS else v)
        return c

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if v is None:
                continue
            if f.name == "precision":
                object.__setattr__(self, "precision", precision_name(v))  # frozen: the one normalisation ("fp8")
            elif f.name in _ENGINES:
                if v not in _ENGINES[f.name]:
                    raise invalid_argument(f"Config.{f.name}", " or ".join(map(repr, _ENGINES[f.name])), repr(v))
            elif f.name in _FLAGS:
                if not isinstance(v, bool):
                    raise invalid_argument(f"Config.{f.name}", "True or False", repr(v))
            elif f.name in ("capacity", "wait_timeout_s"):
                if isinstance(v, bool) or not isinstance(v, (int, float)):
                    raise invalid_argument(f"Config.{f.name}", "a number", repr(v))
            elif isinstance(v, bool) or not isinstance(v, int):
                raise invalid_argument(f"Config.{f.name}", "an integer", repr(v))
        if self.max_tokens < 0:
            raise invalid_argument("Config.max_tokens", "0 (automatic) or a positive token count", self.max_tokens)


@dataclass(frozen=True)
class LayerShape:
    """The sizes of one MoE layer on one expert-parallel rank (mok::LayerShape).

    tokens: T per rank; hidden: H; intermediate: I of a routed expert; shared_intermediate: I of
    the shared expert (0: none); experts: E over all ranks; topk: K; ep: expert-parallel ranks.
    """

    tokens: int
    hidden: int
    intermediate: int
    experts: int
    topk: int
    shared_intermediate: int = 0
    ep: int = 1

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep if self.ep else 0

    def to_c(self) -> _lib.LayerShapeC:
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, bool) or not isinstance(v, int):
                raise invalid_argument(f"LayerShape.{f.name}", "an integer", repr(v))
        return _lib.LayerShapeC(self.tokens, self.hidden, self.intermediate, self.shared_intermediate, self.experts,
                                self.topk, self.ep)


def validate(shape: LayerShape, config: Config | None = None) -> None:
    """Raises MokInvalidArgument naming the first bad field of ``shape`` or knob of ``config``."""
    config = config or Config()
    _lib.call("mok_validate", ctypes.byref(shape.to_c()), ctypes.byref(config.to_c()))


def context_bytes(shape: LayerShape, config: Config | None = None, keep: int = KEEP_ACTIVATIONS) -> int:
    """Device bytes of one layer's forward context (mok::Context::bytes)."""
    config = config or Config()
    out = ctypes.c_uint64()
    _lib.call("mok_context_bytes", ctypes.byref(shape.to_c()), ctypes.byref(config.to_c()), int(keep),
              ctypes.byref(out))
    return int(out.value)


def fp8_weights_bytes(shape: LayerShape) -> int:
    """Device bytes of one layer's FP8 weight copies (mok::Fp8WeightCache::bytes; precision "fp8_block"): about
    those of its bf16 weights."""
    out = ctypes.c_uint64()
    _lib.call("mok_fp8_weights_bytes", ctypes.byref(shape.to_c()), ctypes.byref(out))
    return int(out.value)
