"""Activation checkpointing applied to a model from outside, as torchtitan's parallelize step does.

Model code stays plain single-device PyTorch; the parallelize step calls apply_activation_checkpointing(model, mode)
with the recipe's `model.activation_checkpointing`:

- "full": every block in `model.layers` keeps only its input and recomputes its whole forward in backward.
- "selective": every CoreAttention (recipes/common/attention.py) recomputes the O(s^2) core attention in backward;
  the projections' activations, cheap to store next to it, stay saved.
- "none": nothing.

Why the forward is wrapped in place rather than the module (torch's checkpoint_wrapper): a wrapper module inserts a
name into every parameter path (`layers.0._checkpoint_wrapped_module.attn.qkv.weight`), and the checkpoint format,
the init rules, the tensor-parallel plans and the HF converters all key on those names. Here each chosen module gets
an instance-level `forward` that runs the class's forward under torch.utils.checkpoint (non-reentrant) when the
module is training and grad is enabled, and runs it directly otherwise (eval, no_grad: nothing to save). The tree,
the parameter names and the state dict keys are unchanged, and the module's own hooks still run from its __call__.
Hooks on submodules (DTensor's tensor-parallel styles on attn/mlp and their linears, Neuron's sequence-parallel
pre-hooks) run inside the checkpointed forward and so run again, with their collectives, during recomputation: the
same as torchtitan's wrapped blocks.

Applying twice is a no-op on each module already wrapped (whatever the mode that wrapped it), so a second call
never nests checkpoints on the same module. Mixing modes ("selective" after "full") checkpoints core attention inside
recomputed blocks: correct, but pointless; use one mode.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from recipes.common.attention import CoreAttention

MODES = ("none", "selective", "full")
_INNER = "_activation_checkpointing_inner_forward"  # the forward a wrapped module runs, checkpointed or not


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    inner = getattr(self, _INNER)  # an instance attribute: found before nn.Module.__getattr__ is asked
    if self.training and torch.is_grad_enabled():
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return inner(*args, **kwargs)


def checkpoint_module(module: nn.Module) -> None:
    """Make `module` recompute its forward in backward while training, in place (no wrapper module). Idempotent."""
    if _INNER in module.__dict__:
        return
    # The forward it has now: the class's, or an instance-level one something else set before us. Bound methods
    # (this one and the one installed below) are deep-copied onto the copy of their module, so copy.deepcopy of a
    # checkpointed model runs the copy's own weights.
    module.__dict__[_INNER] = module.forward
    module.forward = types.MethodType(_checkpointed_forward, module)


def is_checkpointed(module: nn.Module) -> bool:
    return _INNER in module.__dict__


def apply_activation_checkpointing(model: nn.Module, mode: str) -> None:
    """Apply activation checkpointing `mode` ("none", "selective" or "full", see the module docstring) to `model`
    in place. "full" needs the blocks in `model.layers`; "selective" finds every CoreAttention submodule."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, not {mode!r}")
    if mode == "full":
        for (
            block
        ) in model.layers.children():  # a ModuleList, or a pipeline rank's ModuleDict (trnrecipes/parallel/pipeline.py)
            checkpoint_module(block)
    elif mode == "selective":
        cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
        if not cores:
            raise ValueError(f"selective activation checkpointing found no CoreAttention in {type(model).__name__}")
        for core in cores:
            checkpoint_module(core)
