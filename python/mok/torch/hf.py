"""Hugging Face transformers: mok as an experts implementation (``config._experts_implementation``).

transformers' MoE models keep each layer's experts in one module with ``gate_up_proj`` [E, 2I, H]
(gate rows first, then up rows: "concatenated", not transposed, no bias), ``down_proj`` [E, H, I]
and ``act_fn`` (SiLU), and call ``experts(hidden_states, top_k_index, top_k_weights)``. mok takes
the fused ``gate_up_proj`` as it is (the C API's per-expert stride: no copy, and its gradient is
written straight into the [E, 2I, H] layout).

    import mok.torch
    mok.torch.hf.register()                      # adds "mok" to transformers' ExpertsInterface
    model.config._experts_implementation = "mok"  # (or from_pretrained(..., experts_implementation="mok"))

or call :func:`experts_forward` from your own experts module, or use :class:`HFExperts`.
The module's expert count decides EP: ``gate_up_proj.shape[0] == num_experts`` runs this process
alone; fewer means EP over ``module.mok_ep_group`` (default: the world group). Set
``module.mok_config`` (a mok.Config) to change mok's knobs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

import mok
from mok.errors import MokError, invalid_argument

from .functional import LOCAL, apply, resolve_ep_group
from ._spec import make_spec
from .modules import init_trunc_normal_

NAME = "mok"


def _module_spec(module: nn.Module) -> str:
    key = getattr(module, "_mok_spec_key", None)
    if key is not None:
        return key
    prepare(module)
    return module._mok_spec_key


def prepare(module: nn.Module) -> str:
    """Works out (and validates) the module's mok spec once; call it before torch.compile traces the module."""
    for flag, want in (("has_bias", False), ("is_transposed", False)):
        if getattr(module, flag, want) != want:
            raise invalid_argument(f"{type(module).__name__}.{flag}", f"{want} (mok's experts layout)", not want)
    if not getattr(module, "is_concatenated", True):
        raise invalid_argument(f"{type(module).__name__}.is_concatenated", "True ([gate; up] rows per expert)", False)
    act = getattr(module, "act_fn", None)
    if act is not None and not isinstance(act, nn.SiLU) and "silu" not in type(act).__name__.lower():
        raise invalid_argument(f"{type(module).__name__}.act_fn", "SiLU (mok's experts are SwiGLU)",
                               type(act).__name__)
    gate_up, down = module.gate_up_proj, module.down_proj
    el, two_i, hidden = gate_up.shape
    num_experts = int(getattr(module, "num_experts", el))
    if el == num_experts:
        group, ep = resolve_ep_group(LOCAL)
    else:
        group, ep = resolve_ep_group(getattr(module, "mok_ep_group", None))
    if el * ep != num_experts:
        raise invalid_argument("gate_up_proj", f"[num_experts / EP size = {num_experts} / {ep}, 2I, H]",
                               list(gate_up.shape))
    topk = int(getattr(module, "mok_topk", 0) or getattr(getattr(module, "config", None), "num_experts_per_tok", 0))
    if topk <= 0:
        raise MokError(f"{type(module).__name__}: mok needs the top-k: set module.mok_topk or "
                       "config.num_experts_per_tok")
    spec = make_spec(hidden, two_i // 2, 0, num_experts, topk, ep, group, getattr(module, "mok_config", None))
    module._mok_spec_key = spec.key()
    return module._mok_spec_key


def experts_forward(module: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The transformers experts interface: routed experts of ``module`` on ``hidden_states`` [T, H]."""
    key = _module_spec(module)
    x = hidden_states if hidden_states.dtype == torch.bfloat16 else hidden_states.to(torch.bfloat16)
    y = apply(key, x.contiguous(), top_k_index.contiguous(), top_k_weights.float().contiguous(),
              [module.gate_up_proj, None, module.down_proj, None, None, None], recompute=False)
    return y.to(hidden_states.dtype)


def register(name: str = NAME) -> None:
    """Adds mok to transformers' experts implementations under ``name``."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    except ImportError as e:
        raise MokError("mok.torch.hf.register: transformers with the experts interface "
                       "(transformers.integrations.moe.ALL_EXPERTS_FUNCTIONS) is not installed") from e
    ALL_EXPERTS_FUNCTIONS.register(name, experts_forward)


class HFExperts(nn.Module):
    """An experts module in transformers' layout (``gate_up_proj`` [E_local, 2I, H], ``down_proj``
    [E_local, H, I]) whose forward is mok: ``forward(hidden_states, top_k_index, top_k_weights)``."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, topk: int, ep_group=None,
                 config: mok.Config | None = None, *, dtype: torch.dtype = torch.bfloat16, device=None):
        super().__init__()
        self.num_experts, self.mok_topk, self.mok_config = num_experts, topk, config
        self.mok_ep_group = ep_group
        group, ep = resolve_ep_group(ep_group)
        el = num_experts // ep
        self.gate_up_proj = nn.Parameter(torch.empty(el, 2 * intermediate, hidden, dtype=dtype, device=device))
        self.down_proj = nn.Parameter(torch.empty(el, hidden, intermediate, dtype=dtype, device=device))
        self.act_fn = nn.SiLU()
        for p in self.parameters():
            init_trunc_normal_(p, 0.02)
        if ep == 1:
            self.mok_ep_group = LOCAL
        prepare(self)

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        return experts_forward(self, hidden_states, top_k_index, top_k_weights)
