"""What eval.sbatch costs where it runs, for the sbatch "next:" text and its Slurm header (torch-free).

The 128-node Llama 2 post's table, run whole, scores about EVAL_TABLE_TOKENS tokens through the model (lm-eval
runs every loglikelihood request and generation separately): MMLU 5-shot ~37M (14,042 questions x 4 choices x ~650
tokens), HumanEval at n=200 for pass@100 ~15M (164 x 200 x ~450), BBH 3-shot CoT ~12M, TriviaQA and HellaSwag ~5M
each, the rest a few million. A forward pass costs 2 x parameters FLOPs a token. On a trn1 or trn2 node lm-eval runs
on the host CPUs in fp32 (no Neuron backend here); on a GPU in bf16. Effective rates are assumptions, stated:
CPU_TFLOPS for 32 cores' fp32 matmuls through torch (the CPU_CORES an eval job asks for by default), GPU_TFLOPS for
one H100 in bf16 at ~30% of peak.
Generation is slower than its FLOPs (memory-bound), so these are lower bounds.
"""

from __future__ import annotations

import math
import shlex
from pathlib import Path

from trnrecipes.config.sections import Recipe

EVAL_TABLE_TOKENS = 8e7
CPU_TFLOPS = 1.0
GPU_TFLOPS = 300.0
LM_EVAL_GB = 8  # lm-eval, the tokenizer, the datasets and the batch's activations, beside the weights


CPU_CORES = 32  # --cpus-per-task of a CPU-scoring eval job without eval.cpus: what CPU_TFLOPS assumes


def eval_mem_gb(r: Recipe) -> int:
    """eval.mem_gb (0: no --mem), or the weights in fp32 (4 B a parameter; bf16 on a GPU needs less) + LM_EVAL_GB."""
    if r.eval.mem_gb is not None:
        return r.eval.mem_gb
    return math.ceil(r.model.param_count() * 4 / 1e9) + LM_EVAL_GB


def eval_estimate(r: Recipe) -> dict[str, float | None]:
    """Hours of the whole table on one node's CPUs and on one GPU; the CPU run's cost on this recipe's node."""
    # a forward pass reads the parameters one token uses: a mixture of experts' active ones (memory counts them all)
    active = getattr(r.model, "active_params", None)
    flops = 2 * (active() if active else r.model.param_count()) * EVAL_TABLE_TOKENS
    cpu_h = flops / (CPU_TFLOPS * 1e12) / 3600
    price = r.price_per_hour
    return {"cpu_hours": cpu_h, "cpu_cost": cpu_h * price if price is not None else None,
            "gpu_hours": flops / (GPU_TFLOPS * 1e12) / 3600}  # fmt: skip


def offers_eval_sbatch(r: Recipe) -> bool:
    """Whether eval.sbatch is a next step: off Neuron, or where eval.partition names another partition than
    training's (on a Neuron instance it would hold a training node and score on its host CPUs)."""
    return r.cluster.backend != "neuron" or (r.eval.partition is not None and r.eval.partition != r.slurm.partition)


def eval_next_steps(r: Recipe, job_dir: Path, run_dir: Path) -> list[str]:
    """The "next:" lines that evaluate a causal LM after run.sbatch. On a Neuron instance eval.sbatch would hold a
    training node and score on its host CPUs (lm-eval has no Neuron backend), so the step is `make eval` on a GPU
    node, and eval.sbatch is offered only where eval.partition names another partition than training's."""
    eval_sbatch = f"  sbatch --dependency=afterok:$id {job_dir}/eval.sbatch   # the 128-node Llama 2 post's eval table"
    if r.cluster.backend != "neuron":
        return [eval_sbatch]
    e = eval_estimate(r)
    h = e["cpu_hours"]
    on_cpus = f"at least ~{h:,.0f} h" if h < 48 else f"at least ~{h / 24:,.0f} days"
    if offers_eval_sbatch(r):
        cpus_only = [f"    # eval.gpus is 0: on CPUs the whole table takes {on_cpus}; --tasks / --limit for a subset"]
        return [f"{eval_sbatch}, on partition {r.eval.partition}", *(cpus_only if not r.eval.gpus else [])]
    gpus = max(1, math.ceil(2 * r.model.param_count() / 75e9))  # bf16 weights on 80 GB GPUs, room for the batch
    gpu_h, h100s = max(e["gpu_hours"], 0.1), "1 H100" if gpus == 1 else f"{gpus} H100s"
    cost = f", ~${e['cpu_cost']:,.0f} of {r.cluster.instance} time" if e["cpu_cost"] is not None else ""
    return [
        f"  make eval ckpt={shlex.quote(str(run_dir))}   # when run.sbatch is done, on a GPU node (~{gpu_h:,.1f} h on"
        f" {h100s}): the 128-node Llama 2 post's eval table; tasks= / limit= for a subset",
        f"    # not eval.sbatch: on {r.cluster.instance} it scores on the host CPUs (lm-eval has no Neuron backend),"
        f" {on_cpus} for the whole table{cost}",
        f"    # as a Slurm job: --overrides 'eval.partition=<a GPU partition> eval.gpus={gpus}', then"
        f" sbatch --dependency=afterok:$id {job_dir}/eval.sbatch",
    ]
