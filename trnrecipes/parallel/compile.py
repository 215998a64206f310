"""`train.compile`: torch.compile applied per transformer block from outside, as torchtitan does.

Why per block and not the whole model: the blocks are identical code, so one compiled graph serves all of them
(torch >= 2.5 inlines nn.Modules and passes their parameters as graph inputs, so a second block with other weights
is not a recompile), compile time does not grow with depth, and what sits outside the blocks (the fused head + loss,
a custom autograd.Function with its own chunk loop; pipeline stage boundaries; TP hooks between blocks) stays eager
where it already runs at full speed.

`nn.Module.compile()` compiles a module's __call__ in place: no wrapper module, so parameter names, state-dict keys
and the checkpoint format are unchanged (torch.compile(module) would prefix every name with `_orig_mod.`). It is
applied after tensor parallelism and activation checkpointing, which it traces through (torch.utils.checkpoint
becomes a higher-order op that dynamo understands).

Shapes are static (packed sequences, fixed micro-batch), so after warm-up (one training step, one validation pass:
the first eval is a second graph since `self.training` is a guard) nothing recompiles; tests/test_torch_compile.py
proves it under torch.compiler.set_stance("fail_on_recompile").

With tensor (and sequence) parallelism and FSDP2, as torchtitan composes them: the TP plan first, then activation
checkpointing, then compile per block, then FSDP last (TorchBackend.parallelize). Two things had to change for it on
torch 2.13: the vocab-parallel embedding's output, an AsyncCollectiveTensor, is made a plain tensor before the first
block (trnrecipes/parallel/tensor.py, wait_for_output), since as a compiled graph's input it broke DTensor's backward;
and with activation checkpointing, torch's misplaced RNG states behind a saved DeviceMesh are put back
(trnrecipes/parallel/compile_fixes.py). tests/test_compiled_tp.py: compiled TP 2 (with and without SP, and with FSDP
over 2 more ranks) trains as eager TP 2 does, never recompiles after warm-up and resumes bitwise.

Not for xla/neuron (trn1): torch-xla traces and compiles the whole step's graph anyway (the recipe check refuses
train.compile there).
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from recipes.common.eager import MARK
from trnrecipes.parallel.compile_fixes import fix_rng_states_after_opaque_values


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """torch.compile every block of `model.layers` (a ModuleList, or a pipeline rank's ModuleDict) in place with
    `backend`; returns how many. Idempotent: compiling a compiled block again only replaces its compile options."""
    fix_rng_states_after_opaque_values()  # checkpointed blocks under DTensor TP, off CUDA (compile_fixes.py)
    disable_marked(model)
    blocks = list(model.layers.children())
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    return len(blocks)


def disable_marked(model: nn.Module) -> None:
    """torch.compiler.disable, in place, on what recipes.common.eager marked in `model`: a module's forward (its class
    becomes a subclass with the disabled forward), a callable held as a module's attribute (context parallelism's
    attention kernel, a functools.partial, and RoPE) and forward hooks (the routing statistics' sum over TP)."""
    for module in model.modules():
        if _marked(type(module).forward):
            module.__class__ = _with_eager_forward(type(module))
        for name, value in list(vars(module).items()):
            if _marked(value):
                setattr(module, name, _disabled(value))
        for hooks in (module._forward_pre_hooks, module._forward_hooks):
            for key, hook in list(hooks.items()):
                if _marked(hook):
                    hooks[key] = _disabled(hook)


def _marked(value) -> bool:
    """Marked and not yet disabled (disable_marked may run again: torch's wrapper copies the mark)."""
    fn = value.func if isinstance(value, functools.partial) else value
    return callable(fn) and getattr(fn, MARK, False) and not getattr(fn, "_torchdynamo_disable", False)


def _disabled(value):
    if isinstance(value, functools.partial):
        return functools.partial(torch.compiler.disable(value.func), *value.args, **value.keywords)
    return torch.compiler.disable(value)


@functools.cache
def _with_eager_forward(cls: type) -> type:
    return type(cls.__name__, (cls,), {"forward": torch.compiler.disable(cls.forward), "__module__": cls.__module__})


def is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None
