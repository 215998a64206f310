"""A fix for one bug of torch.compile that compiled tensor parallelism meets: activation checkpointing around a
random op under DTensor, off CUDA.

The bug (torch 2.13, torch/_functorch/partitioners.py, functionalize_rng_ops): where a checkpointed region holds an
op tagged nondeterministic_seeded (scaled_dot_product_attention is, for its dropout), AOTAutograd saves the RNG
state of each such op for its recompute in backward, as extra forward outputs and backward inputs. It puts them
after all the saved values but the SymInts, and in backward just before the tangents. Since DeviceMesh became an
opaque type of compiled graphs (DTensor's collectives take it), the saved values end with opaque objects, so the
states land after them, where the runtime expects tensors: "expected all tensors_saved_with_vc_check to be Tensors,
got types: [..., DeviceMesh]". On CUDA the graph-safe RNG path is taken instead and never meets it; on the CPU (and
any device without graph-safe RNG, TorchNeuron's among them) every compiled TP block with activation checkpointing
fails on its first forward.

The fix puts the states where the runtime reads them: in forward right after the saved tensors, in backward right
after their placeholders, before the opaque ones. It wraps torch's function and applies only while torch's source
still has the line that misplaces them, so a torch that fixes it upstream is left alone.
"""

from __future__ import annotations

import functools
import inspect

BUGGY_LINE = "sym_node_start_idx = len(fw_outputs) - num_sym_nodes"
STATE_PLACEHOLDER = "rng_state_output_"  # the name torch gives each RNG state's backward input


def fix_rng_states_after_opaque_values() -> bool:
    """Wrap torch's functionalize_rng_ops where it still misplaces the RNG states; returns whether it is wrapped."""
    from torch._functorch import partitioners

    try:
        from torch._functorch._aot_autograd.graph_compile import is_opaque_node
    except ImportError:  # another torch's layout: its own partitioner stands
        return False
    original = partitioners.functionalize_rng_ops
    if getattr(original, "_trnrecipes_fixed", False):
        return True
    try:
        buggy = BUGGY_LINE in inspect.getsource(original)
    except (OSError, TypeError):  # no source shipped: leave it
        return False
    if not buggy:
        return False

    @functools.wraps(original)
    def functionalize_rng_ops(joint_module, fw_module, bw_module, num_sym_nodes: int):
        outputs = next(iter(fw_module.graph.find_nodes(op="output"))).args[0]
        saved_before_syms = outputs[: len(outputs) - num_sym_nodes]
        opaque = 0  # the opaque values saved just before the SymInts
        while opaque < len(saved_before_syms) and is_opaque_node(saved_before_syms[-1 - opaque]):
            opaque += 1
        if not opaque:
            return original(joint_module, fw_module, bw_module, num_sym_nodes)
        fw_module, bw_module = original(joint_module, fw_module, bw_module, num_sym_nodes + opaque)
        states = len(next(iter(fw_module.graph.find_nodes(op="output"))).args[0]) - len(outputs)
        placeholders = list(bw_module.graph.find_nodes(op="placeholder"))
        moved = [n for n in placeholders if n.name.startswith(STATE_PLACEHOLDER)]
        if len(moved) != states:  # torch named them otherwise: forward and backward would disagree in silence
            raise RuntimeError(
                f"trnrecipes/parallel/compile_fixes.py: {states} RNG states saved in forward but {len(moved)}"
                f" backward inputs named {STATE_PLACEHOLDER}*; this torch needs another fix (or none)"
            )
        first_opaque = next((n for n in placeholders if is_opaque_node(n)), None)
        if first_opaque is not None:
            for node in moved:
                first_opaque.prepend(node)
            bw_module.recompile()
        return fw_module, bw_module

    functionalize_rng_ops._trnrecipes_fixed = True
    partitioners.functionalize_rng_ops = functionalize_rng_ops
    return True
