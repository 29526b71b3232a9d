"""LayerSpec: everything but T that identifies a mok layer, encoded in one string.

The custom ops take the spec as a ``str`` argument: torch.compile bakes it into the graph as a
constant, and the op implementations (real and fake) parse it back (cached), so no registry
has to be kept in step with the graph. Workspaces are shared by every layer with the same
spec on the same device (docs/python.md, "Workspaces").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import mok
from mok.errors import invalid_argument

_VERSION = "mok2"  # the key's layout; bumped when it changes (mok2: the precision knobs)
_CONFIG_FIELDS = [f.name for f in dataclasses.fields(mok.Config)]


@dataclass(frozen=True)
class LayerSpec:
    hidden: int
    intermediate: int
    shared_intermediate: int
    experts: int  # E over all ranks
    topk: int
    ep: int
    group: str  # "" = this process alone (a 1-rank communicator), else a torch.distributed group name
    config: mok.Config  # resolved: no None fields

    @property
    def local_experts(self) -> int:
        return self.experts // self.ep

    @property
    def fp8(self) -> bool:
        """The expert GEMMs run in FP8 (precision "fp8_block"): the layer keeps FP8 copies of its weights."""
        return self.config.precision == "fp8_block"

    def key(self) -> str:
        cfg = ",".join(repr(getattr(self.config, n)) for n in _CONFIG_FIELDS)
        return (f"{_VERSION};H={self.hidden};I={self.intermediate};S={self.shared_intermediate};E={self.experts};"
                f"K={self.topk};ep={self.ep};cfg={cfg};g={self.group}")

    def shape(self, tokens: int) -> mok.LayerShape:
        return mok.LayerShape(tokens=tokens, hidden=self.hidden, intermediate=self.intermediate, experts=self.experts,
                              topk=self.topk, shared_intermediate=self.shared_intermediate, ep=self.ep)

    def workspace_tokens(self, tokens: int) -> int:
        """T of the workspace a call of ``tokens`` tokens runs on: Config.max_tokens, else the next power of two
        (at least 128). Deterministic in T alone, so fake tensors know the context's size."""
        if self.config.max_tokens:
            return self.config.max_tokens
        t = 128
        while t < tokens:
            t *= 2
        return t


def make_spec(hidden: int, intermediate: int, shared_intermediate: int, experts: int, topk: int, ep: int, group: str,
              config: mok.Config | None) -> LayerSpec:
    """A validated spec (mok_validate on a shape of the spec's workspace size)."""
    config = (config or mok.Config()).resolved()
    spec = LayerSpec(int(hidden), int(intermediate), int(shared_intermediate), int(experts), int(topk), int(ep),
                     group, config)
    if spec.ep < 1 or spec.experts % spec.ep != 0:
        raise invalid_argument("num_experts", f"a multiple of the EP group's size ({spec.ep})", spec.experts)
    mok.validate(spec.shape(spec.workspace_tokens(config.max_tokens or 128)), config)
    return spec


def _number(text: str) -> int | float | str | bool:
    """One config value of a key: an int, a float, a bool (fp8_weight_grads) or a quoted name (the engines, the
    precision)."""
    if len(text) >= 2 and text[0] == text[-1] == "'":
        return text[1:-1]
    if text in ("True", "False"):
        return text == "True"
    try:
        return int(text)
    except ValueError:
        return float(text)


@functools.lru_cache(maxsize=1024)
def parse_spec(key: str) -> LayerSpec:
    """The LayerSpec that ``LayerSpec.key()`` encoded."""
    try:
        head, rest = key.split(";", 1)
        if head != _VERSION:
            raise ValueError(head)
        body, group = rest.split(";g=", 1)
        fields = dict(item.split("=", 1) for item in body.split(";"))
        cfg_values = [_number(v) for v in fields["cfg"].split(",")]
        config = mok.Config(**dict(zip(_CONFIG_FIELDS, cfg_values)))
        return LayerSpec(int(fields["H"]), int(fields["I"]), int(fields["S"]), int(fields["E"]), int(fields["K"]),
                         int(fields["ep"]), group, config)
    except Exception as e:  # noqa: BLE001 - any malformed key is one error
        raise invalid_argument("spec", "a key made by mok.torch (LayerSpec.key())", repr(key)) from e
