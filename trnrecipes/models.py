"""Model family registry: from a recipe's `model` section to the code in recipes/<family>/ and back.

recipes/<family>/model.py knows nothing of trnrecipes; this module translates between the recipe schema
(trnrecipes.recipe.ModelConfig) and each family's own argument dataclass, and finds its HF conversion module.
"""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import nn

from trnrecipes.recipe import ModelConfig


@dataclass(frozen=True)
class Family:
    name: str
    package: str  # recipes.<family>: model.py and hf.py
    model_class: str
    args_class: str
    hf_architectures: tuple[str, ...]
    hf_model_type: str

    @property
    def model_module(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.model")

    @property
    def hf(self) -> ModuleType:
        return importlib.import_module(f"{self.package}.hf")


FAMILIES = {
    "neox": Family("neox", "recipes.neox", "NeoX", "NeoXArgs", ("GPTNeoXForCausalLM",), "gpt_neox"),
    "llama2": Family("llama2", "recipes.llama2", "Llama2", "Llama2Args", ("LlamaForCausalLM",), "llama"),
}


def model_args(cfg: ModelConfig) -> Any:
    """The family's own argument dataclass, filled from the recipe's model section."""
    family = FAMILIES[cfg.family]
    args_cls = getattr(family.model_module, family.args_class)
    names = {f.name for f in dataclasses.fields(args_cls)}
    return args_cls(**{k: v for k, v in dataclasses.asdict(cfg).items() if k in names})


def model_config_from_args(family: str, args: Any) -> ModelConfig:
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    values = {k: v for k, v in dataclasses.asdict(args).items() if k in names}
    return ModelConfig(family=family, **values)  # type: ignore[arg-type]


def build_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> nn.Module:
    """Uninitialized on `device` ("meta" costs nothing); call .init_weights() or load a state dict."""
    family = FAMILIES[cfg.family]
    with torch.device(device):
        return getattr(family.model_module, family.model_class)(model_args(cfg))


def family_of_hf_config(hf_config: dict[str, Any]) -> Family:
    archs = set(hf_config.get("architectures") or [])
    for family in FAMILIES.values():
        if archs & set(family.hf_architectures) or hf_config.get("model_type") == family.hf_model_type:
            return family
    known = ", ".join(a for f in FAMILIES.values() for a in f.hf_architectures)
    raise ValueError(
        f"HF config with architectures {sorted(archs)} / model_type {hf_config.get('model_type')!r} is not a"
        f" supported family; supported: {known}"
    )
