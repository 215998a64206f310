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

Not with tensor parallelism yet: on torch 2.13 (CPU, inductor and TP 2, with or without sequence parallelism) the
backward of a compiled block fails inside DTensor's redistribute (a plain tensor where a DTensor's gradient is
expected), so the recipe check refuses train.compile with layout.tp > 1 and the cuda default leaves TP runs eager.
FSDP is fine (tests/test_fsdp.py's layouts ran compiled with inductor by hand: the same grad norms as eager).

Not for xla/neuron (trn1): torch-xla traces and compiles the whole step's graph anyway (the recipe check refuses
train.compile there).
"""

from __future__ import annotations

from torch import nn


def compile_blocks(model: nn.Module, backend: str = "inductor") -> int:
    """torch.compile every block of `model.layers` (a ModuleList, or a pipeline rank's ModuleDict) in place with
    `backend`; returns how many. Idempotent: compiling a compiled block again only replaces its compile options."""
    blocks = list(model.layers.children())
    for block in blocks:
        block.compile(backend=backend, dynamic=False)
    return len(blocks)


def is_compiled(module: nn.Module) -> bool:
    return getattr(module, "_compiled_call_impl", None) is not None
