"""The model families: name -> FamilySpec (recipes/<family>/spec.py). Torch-free: the rendering path reads it.

A recipe's `model:` section is one family's config dataclass, picked by its `family` key (ModelSection, a tagged
union the schema understands); adding a family = one entry here (recipes/README.md has the checklist).
"""

from __future__ import annotations

from typing import Any, Union

from recipes.bert.spec import SPEC as BERT
from recipes.common.spec import FamilySpec
from recipes.llama2.spec import SPEC as LLAMA2
from recipes.neox.spec import SPEC as NEOX
from recipes.qwen3.spec import SPEC as QWEN3

FAMILIES: dict[str, FamilySpec] = {spec.name: spec for spec in (NEOX, LLAMA2, BERT, QWEN3)}

ModelSection = Union[tuple(spec.config for spec in FAMILIES.values())]  # type: ignore[valid-type]  # noqa: UP007


def family_spec(name: str) -> FamilySpec:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r}; known: {', '.join(FAMILIES)}")
    return FAMILIES[name]


def model_config(family: str, **fields: Any) -> Any:
    """The model section of `family` from its fields: model_config("llama2", vocab_size=..., ...)."""
    return family_spec(family).config(**fields)


def family_of_hf_config(hf_config: dict[str, Any]) -> FamilySpec:
    """The family whose HF adapter (recipes/<family>/hf.py) reads this config.json."""
    archs = set(hf_config.get("architectures") or [])
    for spec in FAMILIES.values():
        if archs & set(spec.hf_architectures):
            return spec
        if hf_config.get("model_type") == spec.hf_model_type:
            if archs:  # another head of this model type (BertForTokenClassification's classifier, shaped as the
                # sequence classifier's, was read as one): its weights would mean something else here
                raise ValueError(
                    f"HF config with architectures {sorted(archs)}: a {spec.hf_model_type} model with a head this"
                    f" family does not build; supported: {', '.join(spec.hf_architectures)}"
                )
            return spec
    known = ", ".join(a for spec in FAMILIES.values() for a in spec.hf_architectures)
    raise ValueError(
        f"HF config with architectures {sorted(archs)} / model_type {hf_config.get('model_type')!r} is not a"
        f" supported family; supported: {known}"
    )
