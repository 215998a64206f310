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
    flops = 2 * r.model.param_count() * EVAL_TABLE_TOKENS
    cpu_h = flops / (CPU_TFLOPS * 1e12) / 3600
    price = r.price_per_hour
    return {"cpu_hours": cpu_h, "cpu_cost": cpu_h * price if price is not None else None,
            "gpu_hours": flops / (GPU_TFLOPS * 1e12) / 3600}  # fmt: skip


def eval_advice(r: Recipe) -> list[str]:
    """The "next:" lines under eval.sbatch for an LM on a Neuron instance: its time and cost there, and elsewhere."""
    e = eval_estimate(r)
    h = e["cpu_hours"]
    gpus = max(1, math.ceil(2 * r.model.param_count() / 75e9))  # bf16 weights on 80 GB GPUs, room for the batch
    when = f"{h:,.0f} h" if h < 48 else f"{h / 24:,.0f} days"
    cost = f", ~${e['cpu_cost']:,.0f} of {r.cluster.instance} time" if e["cpu_cost"] is not None else ""
    return [
        f"    # on {r.cluster.instance} it scores on the host CPUs (lm-eval has no Neuron backend): the whole table"
        f" takes at least ~{when}{cost}",
        f"    # elsewhere: eval.partition=<a GPU partition> eval.gpus={gpus} (~{max(e['gpu_hours'], 0.1):,.1f} h on"
        f" H100s), or `make eval ckpt=<run dir>` on a GPU machine, or pass --tasks / --limit for a subset",
    ]
