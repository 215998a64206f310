"""Building a family's model (recipes/<family>/model.py) from a recipe's model section: the torch side of
trnrecipes.config.families, which holds the registry.

The model section *is* the model's argument dataclass (recipes/<family>/spec.py), so nothing is translated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from trnrecipes.config.families import FAMILIES, ModelSection, family_of_hf_config  # noqa: F401  (importers' names)


def build_model(cfg: ModelSection, device: str | torch.device = "cpu") -> nn.Module:
    """Uninitialized on `device` ("meta" costs nothing); call .init_weights() or load a state dict."""
    spec = FAMILIES[cfg.family]
    with torch.device(device):
        return getattr(spec.model_module, spec.model_class)(cfg)


def model_args(cfg: ModelSection) -> Any:
    """The model's argument dataclass: the model section itself (kept for bench/bench_model.py)."""
    return cfg
