"""Activation checkpointing applied to a model from outside, as torchtitan's parallelize step does.

Model code stays plain single-device PyTorch; the parallelize step calls apply_activation_checkpointing(model, mode)
with the recipe's `model.activation_checkpointing`:

- "full": every block in `model.layers` keeps only its input and recomputes its whole forward in backward.
- "selective": every CoreAttention (recipes/common/attention.py) recomputes the O(s^2) core attention in backward;
  the projections' activations, cheap to store next to it, stay saved.
- "elementwise": every block keeps the outputs of its matmuls, of attention and of collectives, and recomputes the
  rest in backward: norms, RoPE, the SwiGLU product, residual sums, casts and copies, which cost memory traffic
  only (Megatron-LM's recompute of layernorm and activation, torchtitan's op-level selective checkpointing). Under
  torch.compile the recomputation fuses into the backward's kernels. The block then holds about 11 hidden-sized
  tensors a token instead of the ~17 that transformers + torch.compile (and "none") keep (SwiGLU, ffn 2.7 x hidden:
  docs/benchmarks.md), with no matmul or attention recomputed.
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
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from recipes.common.attention import CoreAttention

MODES = ("none", "selective", "elementwise", "full")
_INNER = "_activation_checkpointing_inner_forward"  # the forward a wrapped module runs, checkpointed or not


_CONTEXT = "_activation_checkpointing_context_fn"  # "elementwise": what decides, op by op, what is saved
_SELECTIVE = "_activation_checkpointing_selective"  # whether _CONTEXT applies: a bool, which compile guards on


def _saved_ops() -> frozenset:
    """The ops whose outputs "elementwise" keeps: matmuls, attention kernels (whichever SDPA picks) and collectives
    (recomputing one would repeat its communication). Looked up by name: a torch without one just lacks it."""
    aten = torch.ops.aten
    ops = [aten.mm, aten.addmm, aten.bmm, aten.baddbmm]
    names = (
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
        "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_fused_attention_overrideable",  # out-of-tree devices (PrivateUse1: TorchNeuron)
        "_flash_attention_forward",
        "_efficient_attention_forward",
    )
    ops += [getattr(aten, n) for n in names if hasattr(aten, n)]
    functional = getattr(torch.ops, "_c10d_functional", None)
    for n in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce", "all_to_all_single"):
        if functional is not None and hasattr(functional, n):
            ops.append(getattr(functional, n))
    return frozenset(o.default if hasattr(o, "default") else o for o in ops)


_SAVED_OPS: frozenset | None = None


def _elementwise_policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    global _SAVED_OPS
    if _SAVED_OPS is None:
        _SAVED_OPS = _saved_ops()
    return CheckpointPolicy.MUST_SAVE if op in _SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _elementwise_context():
    return create_selective_checkpoint_contexts(_elementwise_policy)


def _checkpointed_forward(self: nn.Module, *args, **kwargs):
    inner = getattr(self, _INNER)  # an instance attribute: found before nn.Module.__getattr__ is asked
    if self.training and torch.is_grad_enabled():
        # A plain attribute, which torch.compile guards on: the blocks share one compiled code object, and a block
        # checkpointed whole must not run the graph traced for an elementwise one (or the reverse).
        if getattr(self, _SELECTIVE):
            return checkpoint(inner, *args, use_reentrant=False, context_fn=self.__dict__[_CONTEXT], **kwargs)
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)
    return inner(*args, **kwargs)


def checkpoint_module(module: nn.Module, context_fn=None) -> None:
    """Make `module` recompute its forward in backward while training, in place (no wrapper module); with
    `context_fn` (torch.utils.checkpoint's selective checkpointing contexts), only what its policy does not save.
    Idempotent."""
    if _INNER in module.__dict__:
        return
    module.__dict__[_SELECTIVE] = context_fn is not None
    if context_fn is not None:
        module.__dict__[_CONTEXT] = context_fn
    # The forward it has now: the class's, or an instance-level one something else set before us. Bound methods
    # (this one and the one installed below) are deep-copied onto the copy of their module, so copy.deepcopy of a
    # checkpointed model runs the copy's own weights.
    module.__dict__[_INNER] = module.forward
    module.forward = types.MethodType(_checkpointed_forward, module)


def is_checkpointed(module: nn.Module) -> bool:
    return _INNER in module.__dict__


def _first_blocks(model: nn.Module, n: int) -> list[nn.Module]:
    """The first `n` blocks of `model.layers`, or of each of its pipeline stages (a pipeline rank's StagedModel,
    trnrecipes/parallel/pipeline.py: one ModuleDict keyed by the blocks' indices, and the stages that cut it)."""
    blocks = dict(model.layers.named_children())
    stages = getattr(model, "stages", None)
    if not stages:
        return list(blocks.values())[:n]
    return [blocks[str(i)] for stage in stages for i in list(stage.layers)[:n]]


def apply_activation_checkpointing(model: nn.Module, mode: str, full_layers: int = 0) -> None:
    """Apply activation checkpointing `mode` ("none", "selective", "elementwise" or "full", see the module
    docstring) to `model` in place, after checkpointing the first `full_layers` blocks of `model.layers` whole.
    "full" and "elementwise" need the blocks in `model.layers`; "selective" finds every CoreAttention submodule."""
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode must be one of {MODES}, not {mode!r}")
    if full_layers:
        # The first blocks of each stage whole; checkpoint_module is idempotent, so the loops below leave them as
        # they are.
        for block in _first_blocks(model, full_layers):
            checkpoint_module(block)
    if mode in ("full", "elementwise"):
        context = _elementwise_context if mode == "elementwise" else None
        for block in model.layers.children():
            checkpoint_module(block, context)
    elif mode == "selective":
        whole = [b for b in model.layers.children() if is_checkpointed(b)] if full_layers else []
        inside = {id(m) for b in whole for m in b.modules()}  # recomputed with their block already
        cores = [m for m in model.modules() if isinstance(m, CoreAttention) and id(m) not in inside]
        if not cores and not whole:
            raise ValueError(f"selective activation checkpointing found no CoreAttention in {type(model).__name__}")
        for core in cores:
            checkpoint_module(core)
