"""mok.torch: the mok layer in PyTorch (custom ops, autograd, torch.compile, CUDA graphs, torchrun).

    import mok.torch
    router = mok.torch.TopKRouter(hidden, num_experts, topk)
    moe = mok.torch.MoE(hidden, intermediate, num_experts, topk, shared_intermediate).cuda()
    y = moe(x, *router(x))                      # a full MoE block in two lines

The ops are ``torch.ops.mok.moe_forward`` / ``moe_backward``; the design is in docs/python.md.
Uses the torch the process already has (any torch >= 2.5; CUDA tensors need a CUDA 13 build).
"""

from __future__ import annotations

import torch  # noqa: F401  (first: libmok then shares torch's CUDA runtime and NCCL)

from . import _ops, hf  # noqa: F401  (registers the ops)
from ._runtime import check, get_checks, mark_fp8_weights_stale, memory_stats, release, set_checks
from .functional import LOCAL, layer_spec, moe_experts
from .hf import HFExperts
from .modules import MoE, TopKRouter

__all__ = [
    "MoE",
    "TopKRouter",
    "HFExperts",
    "moe_experts",
    "layer_spec",
    "LOCAL",
    "check",
    "set_checks",
    "get_checks",
    "release",
    "memory_stats",
    "mark_fp8_weights_stale",
    "hf",
]
