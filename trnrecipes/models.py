"""Building a family's model (recipes/<family>/model.py) from a recipe's model section: the torch side of
trnrecipes.config.families, which holds the registry.

The model section *is* the model's argument dataclass (recipes/<family>/spec.py), so nothing is translated.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from trnrecipes.config.families import FAMILIES, ModelSection, family_of_hf_config  # noqa: F401  (importers' names)


def build_model(cfg: ModelSection, device: str | torch.device = "cpu") -> nn.Module:
    """Uninitialized on `device` ("meta" costs nothing); call .init_weights() or load a state dict."""
    spec = FAMILIES[cfg.family]
    with torch.device(device), _NoFillsOnMeta() if torch.device(device).type == "meta" else nullcontext():
        return getattr(spec.model_module, spec.model_class)(cfg)


class _NoFillsOnMeta(TorchFunctionMode):
    """Skips the in-place fills torch's modules run in their constructors (reset_parameters) on meta tensors: those
    have no values to fill, and the fills' meta kernels are torch's Python references, whose first call imports
    torch._dynamo (about 1.5 s of CPU at every rank's start; recipes/common/eager.py)."""

    FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.fill_, torch.Tensor.zero_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self.FILLS or getattr(func, "__module__", None) == "torch.nn.init":  # all return their tensor
            tensor = args[0] if args else kwargs.get("tensor")
            if isinstance(tensor, torch.Tensor) and tensor.is_meta:
                return tensor
        return func(*args, **kwargs)


def model_args(cfg: ModelSection) -> Any:
    """The model's argument dataclass: the model section itself (kept for bench/bench_model.py)."""
    return cfg
