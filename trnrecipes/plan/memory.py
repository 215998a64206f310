"""Does the recipe's layout fit a worker's device memory? `plan` prints the estimate; `sbatch` refuses a layout over
the capacity and warns within 10% of it (torch-free).

Per worker (one NeuronCore or GPU), on the most loaded pipeline stage:
- weights and gradients: the stage's parameters / TP, at 2 bytes each in bf16, 4 in fp32 and bf16-mixed (fp32
  master weights, autocast in the forward); / (DP x CP) as well under FSDP (it shards over the dp x cp ranks);
- AdamW: two moments, 8 bytes a parameter in fp32 or 4 in bf16 (optim.state_dtype), / (DP x CP) under ZeRO-1 or
  FSDP;
- activations of the micro-batches a stage holds at once (1: no pipeline; under 1F1B and interleaved schedules
  min(PP, micro-batches) on the first stage; GPipe: all of them), per token and layer ACT_ELEMENTS(h, f) elements
  of the activation dtype with none or selective checkpointing (selective recomputes the attention core, which
  scaled-dot-product attention never stores anyway: measured the same as none), plus the attention probabilities
  (heads x seq) without checkpointing where no flash kernel runs (off CUDA, and not model.attention nki_flash), the
  layer inputs (h each) with full checkpointing plus one layer being recomputed (with its probabilities where they
  are kept: a recompute materialises them too); / TP with sequence parallelism (the norms' inputs too); over
  seq_len / CP tokens under context parallelism, plus the K and V rows attention gathers from the other CP ranks;
- the loss phase: LOGIT_BYTES x vocab / TP bytes a row of logits (their fp32 values and their gradient), when the
  layers' activations are all still held but no gradient is yet: the larger of it and the gradients counts, not
  both. Rows: one chunk of the last micro-batch's tokens where the chunked loss runs eagerly (cpu, cuda, TorchNeuron:
  the fused loss, and under TP its vocab-parallel form, each rank holding its V / TP columns), all its tokens on
  torch-xla, which traces the step whole (and under TP on XLA/NxD NxD's parallel_cross_entropy is unchunked);
- a reserve for the runtime (collective buffers, the compiler's scratch, the CUDA context): RESERVE_GIB.

Calibration (bench/results/gpu_memory_h100_2026-11-26.jsonl, trnrecipes' own step on one H100, 15 shapes): the
coefficients below give every measured peak within 15% (tests/test_memory_fit.py holds them to it). The Neuron
compiler plans its own buffers, so on Trainium the estimate is the same arithmetic with a larger reserve: an
assumption until measured there (docs/plan.md).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from trnrecipes.config.cluster import get_instance
from trnrecipes.config.sections import Recipe
from trnrecipes.config.stages import pipeline_stages, stage_params

GIB = 2**30
LOGIT_BYTES = 5.2  # a token's bytes per vocab entry in the loss phase (bf16 logits, fp32 copy, its gradient): fitted
# Rows of logits per chunk of the eager loss, by the trnrecipes backend: recipes/common/loss.py's CHUNK_SIZES (cpu
# and cuda; its default, 1024, elsewhere), copied here to keep plan/ torch-free (tests/test_memory_fit.py compares).
LOSS_CHUNK_ROWS = {"cpu": 1024, "cuda": 4096, "neuron-native": 1024}
RESERVE_GIB = {"neuron": 2.0, "cuda": 1.0}  # runtime, collectives, scratch; Neuron's an assumption (not measured)
WARN_FRACTION = 0.9


def act_elements(h: int, f: int) -> int:
    """Elements a transformer layer keeps a token for its backward: the attention's norm output, Q, K, V, its output
    and the projection's input (~6h), the MLP's input and its gate, up, activation and down inputs (~h + 4f), the
    two norms' inputs (2h). Counted for SwiGLU; GeLU MLPs keep fewer (an overestimate there)."""
    return 9 * h + 4 * f


def elementwise_elements(h: int, f: int) -> int:
    """Elements a layer keeps a token under model.activation_checkpointing elementwise (the norms, RoPE, the
    activation and the residual sums recomputed): its input, Q K V, attention's output, the output projection's and
    the gate/up projection's outputs (6h + 2f; GeLU MLPs keep f of the last: an overestimate there). Measured on an
    H200 through torch.compile's partitioner: docs/benchmarks.md."""
    return 6 * h + 2 * f


def _sparse(m, layer: int) -> bool:
    return bool(getattr(m, "num_experts", 0)) and m.is_sparse(layer)


def moe_extra_elements(m, elementwise: bool) -> int:
    """Elements a token's sparse block keeps beyond a dense SwiGLU MLP of ffn_hidden_size (0 for a dense model): its
    top-k rows gathered for the experts and their outputs kept for the routing weights (2kh), the experts' SwiGLU
    on them (4kI, as 4f; under elementwise their matmul outputs, 2kI) and the router's probabilities (E)."""
    if not getattr(m, "num_experts", 0):
        return 0
    h, f, k, i, e = m.hidden_size, m.ffn_hidden_size, m.num_experts_per_tok, m.moe_intermediate_size, m.num_experts
    return 2 * k * h + e + (2 * k * i - 2 * f if elementwise else 4 * k * i - 4 * f)


@dataclass(frozen=True)
class MemoryPlan:
    weights: float  # bytes per worker
    grads: float
    optimizer: float
    activations: float
    loss: float
    reserve: float
    capacity: float | None  # bytes per worker; None: the instance's memory is not in the catalog (a CPU host)
    micro_batches_held: int
    accumulates: bool = False  # gradient accumulation: a step's earlier gradients are there in its later forwards

    @property
    def total(self) -> float:
        # The gradients appear during the backward, as the layers' activations are freed and after the loss phase:
        # the two peaks do not add (measured: the larger of them, not their sum, fits all 15 shapes), unless earlier
        # micro-batches of the step left their gradients (accumulation).
        grads_and_loss = self.grads + self.loss if self.accumulates else max(self.grads, self.loss)
        return self.weights + self.optimizer + self.activations + grads_and_loss + self.reserve

    @property
    def verdict(self) -> str:
        if self.capacity is None:
            return "unknown"
        if self.total > self.capacity:
            return "does not fit"
        return "tight" if self.total > WARN_FRACTION * self.capacity else "fits"

    def to_dict(self) -> dict[str, object]:
        return {**self.__dict__, "total": self.total, "verdict": self.verdict}


def memory_plan(r: Recipe, dp: int, grad_accum: int) -> MemoryPlan:
    """The estimate for `r` laid out with `dp` data-parallel ranks and `grad_accum` micro-batches a step: the most
    loaded pipeline rank's (all its virtual stages)."""
    by_rank: dict[int, list] = {}
    for stage in pipeline_stages(r):
        by_rank.setdefault(stage.rank, []).append(stage)
    return max((_rank_plan(r, stages, dp, grad_accum) for stages in by_rank.values()), key=lambda p: p.total)


def _rank_plan(r: Recipe, stages: list, dp: int, grad_accum: int) -> MemoryPlan:
    m, lay, b = r.model, r.layout, r.batch
    tp = lay.tp
    last = any(s.last for s in stages)
    layers = sum(len(s.layers) for s in stages)
    params = sum(stage_params(m, s) for s in stages) / tp
    kv = getattr(m, "num_kv_heads", None)
    if kv is not None and tp > kv:  # each rank also holds a copy of one KV head (trnrecipes/parallel/kv_replication.py)
        params += layers * 2 * m.head_dim * m.hidden_size * (1 - kv / tp)
    experts = 0.0  # expert parallelism: each rank holds 1 / ep of every sparse block's experts (parallel/expert.py)
    if getattr(m, "num_experts", 0):
        sparse = sum(m.is_sparse(i) for s in stages for i in s.layers)
        whole = sparse * m.num_experts * 3 * m.hidden_size * m.moe_intermediate_size
        params += (whole + sparse * m.num_experts * m.hidden_size) * (1 - 1 / tp)  # experts, router whole per TP rank
        if lay.ep > 1:
            experts = whole / lay.ep
            params -= whole - experts
    dtype = r.precision.dtype
    weight_bytes = 2 if dtype == "bf16" else 4
    shard_n = dp * lay.cp  # ZeRO-1 and FSDP shard over the dp x cp ranks (ParallelDims.shard_n; DP at CP 1)
    sharded = shard_n if lay.fsdp else 1
    experts_split = dp // lay.ep if lay.fsdp else 1  # FSDP splits a rank's experts over the ranks holding them too
    per_rank = (params - experts) / sharded + experts / experts_split
    weights = per_rank * weight_bytes
    grads = per_rank * weight_bytes
    moments = 4.0 if r.optim.state_dtype == "bf16" else 8.0
    if lay.zero1 and r.stack == "xla-nxd" and dtype == "bf16":
        moments += 4 + 4  # torch-xla's ZeRO-1 keeps fp32 master and gradient shards of bf16 parameters
    # ZeRO-1 keeps the moments of a rank's experts whole (EP has split them already)
    optimizer = ((params - experts) / (shard_n if lay.zero1 or lay.fsdp else 1) + experts / experts_split) * moments
    act_bytes = 4 if dtype == "fp32" else 2
    cp = lay.cp  # context parallelism: a rank holds 1 / cp of each sequence's tokens
    tokens = b.micro_batch * b.seq_len // cp
    held = 1
    if lay.pp > 1:  # the first rank holds the most: every micro-batch (GPipe), or up to PP of them (1F1B schedules)
        held = grad_accum if lay.pp_schedule == "gpipe" else min(lay.pp, grad_accum)
    h, f = m.hidden_size, m.ffn_hidden_size
    split = tp if lay.sequence_parallel else 1  # without SP the norms' and residual inputs are whole on every rank
    plain = act_elements(h, f) / tp if lay.sequence_parallel else (act_elements(h, f) - 3 * h) / tp + 3 * h
    per_layer = plain
    if m.activation_checkpointing == "elementwise":  # matmul, attention, collective outputs (elementwise_elements)
        kept = elementwise_elements(h, f)
        # without SP the layer's input and the output projection's sum are whole on every rank. Under SP (as for
        # "none") everything is counted split: DTensor's SP keeps the all-gathered inputs of QKV and gate/up whole
        # (2h a token not counted, in both modes), NxD's re-gathers them in backward
        per_layer = kept / tp if lay.sequence_parallel else (kept - 2 * h) / tp + 2 * h
    flash = r.cluster.backend == "cuda" or getattr(m, "attention", "sdpa") == "nki_flash"
    # a local query attends to the whole sequence's keys, so the probabilities span seq_len whatever cp is
    probabilities = m.num_heads / tp * b.seq_len if not flash else 0
    # context parallelism all-gathers K and V over the CP ranks; attention keeps the other ranks' rows for backward:
    # 2 x the KV heads this TP rank holds (at least one) x head_dim, for each of the (cp - 1) x tokens not its own
    kv_heads = getattr(m, "num_kv_heads", None) or m.num_heads
    gathered_kv = 2 * max(kv_heads / tp, 1) * m.head_dim * (cp - 1)
    if m.activation_checkpointing in ("none", "elementwise"):
        # without a flash kernel (CUDA's fused SDPA, Neuron's NKI kernel: they keep only a logsumexp row per head),
        # attention keeps its probabilities: heads/TP x seq per token, per layer
        per_layer += probabilities + gathered_kv
    # the first activation_checkpointing_full_layers blocks of each stage are checkpointed whole, whatever the mode
    n_full = m.activation_checkpointing_full_layers
    whole = layers if m.activation_checkpointing == "full" else sum(min(len(s.layers), n_full) for s in stages)
    # A mixture of experts' sparse blocks keep more than a dense MLP of ffn_hidden_size (moe_extra_elements)
    # (under TP each rank routes and runs the experts for 1/tp of the tokens: parallel/expert.py's token split)
    moe_extra = moe_extra_elements(m, m.activation_checkpointing == "elementwise") / tp
    live_sparse = (
        0
        if m.activation_checkpointing == "full"
        else sum(_sparse(m, i) for s in stages for i in list(s.layers)[n_full:])
    )
    # One whole layer recomputed at a time, with its probabilities (SDPA without a flash kernel materialises them in
    # the recompute too) and gathered K/V. Where those are not kept per layer (selective, full), one layer's are still
    # materialised while its attention runs, in the forward and again in the recompute: at the peak once.
    biggest = plain + (moe_extra if any(_sparse(m, i) for s in stages for i in s.layers) else 0)
    transient = 0 if m.activation_checkpointing in ("none", "elementwise") else probabilities + gathered_kv
    recomputing = max(transient, (biggest + probabilities + gathered_kv) if whole else 0)
    stored = (whole * h / split + (layers - whole) * per_layer + live_sparse * moe_extra) * held + recomputing
    activations = stored * tokens * act_bytes
    classifies = getattr(m, "num_labels", None) is not None
    rows = min(tokens, LOSS_CHUNK_ROWS[r.runtime_backend]) if r.runtime_backend in LOSS_CHUNK_ROWS else tokens
    loss = LOGIT_BYTES * m.vocab_size / tp * rows if last and not classifies else 0.0
    inst = get_instance(r.cluster.instance)
    capacity = inst.hbm_gib * GIB / inst.workers_per_node if inst.hbm_gib else None
    reserve = RESERVE_GIB.get(r.cluster.backend, 0.0) * GIB if capacity is not None else 0.0
    return MemoryPlan(weights, grads, optimizer, activations, loss, reserve, capacity, held, grad_accum > 1)


def fits_with(r: Recipe, dp_of) -> list[str]:
    """Changes that would bring an over-capacity recipe within its capacity, each with its estimate and each a recipe
    the checks accept. `dp_of(recipe)` -> (dp, grad_accum) for a changed recipe, or None where that layout is not
    valid."""
    from trnrecipes.config.recipe import check_recipe

    tries: list[tuple[str, Recipe]] = []
    if r.model.activation_checkpointing != "full":
        tries.append(("model.activation_checkpointing=full", _with(r, "model", activation_checkpointing="full")))
    if not (r.layout.zero1 or r.layout.fsdp):
        tries.append(("layout.zero1=true", _with(r, "layout", zero1=True)))
    tp = r.layout.tp * 2
    while tp <= r.workers_per_node:  # the smallest larger TP that fits (with SP, which shards the norms' inputs too)
        sp = "" if r.layout.sequence_parallel else " layout.sequence_parallel=true"
        tries.append((f"layout.tp={tp}{sp}", _with(r, "layout", tp=tp, sequence_parallel=True)))
        tp *= 2
    pp = r.layout.pp * 2
    while pp <= r.model.num_layers:  # the smallest larger PP that fits
        tries.append((f"layout.pp={pp}", _with(r, "layout", pp=pp)))
        pp *= 2
    cp = r.layout.cp * 2
    while cp * r.layout.tp <= r.workers_per_node * r.cluster.nodes and r.batch.seq_len % (2 * cp) == 0:
        # the smallest larger context parallelism that fits: long sequences, whose activations and attention
        # probabilities it divides (it does not run with PP: the try leaves the pipeline, keeping its FSDP/ZeRO-1)
        no_pp = " layout.pp=1" if r.layout.pp > 1 else ""
        tries.append((f"layout.cp={cp}{no_pp}", _with(r, "layout", cp=cp, pp=1, pp_stage_layers=None)))
        cp *= 2
    if r.batch.micro_batch > 1:
        tries.append(("batch.micro_batch=1", _with(r, "batch", micro_batch=1)))
    found = []
    for change, changed in tries:
        key = change.split("=")[0]
        if any(f.startswith(key + "=") for f in found) or check_recipe(changed):
            continue
        shape = dp_of(changed)
        if shape is None:
            continue
        est = memory_plan(changed, *shape)
        if est.capacity is not None and est.total <= est.capacity:
            found.append(f"{change} ({est.total / GIB:.1f} GiB)")
    return found


def _with(r: Recipe, section: str, **changes) -> Recipe:
    return replace(r, **{section: replace(getattr(r, section), **changes)})


def format_memory(p: MemoryPlan, width: int) -> list[str]:
    """The plan's memory lines: the parts per worker and the verdict."""
    parts = [("weights", p.weights), ("grads", p.grads), ("AdamW", p.optimizer), ("activations", p.activations),
             ("loss", p.loss), ("reserve", p.reserve)]  # fmt: skip
    listed = " + ".join(f"{name} {value / GIB:.2f}" for name, value in parts if value)
    held = f"; {p.micro_batches_held} micro-batches in flight" if p.micro_batches_held > 1 else ""
    if p.capacity is None:
        return [f"{'memory':<{width}}  {p.total / GIB:.2f} GiB per worker ({listed}{held}); no device capacity known"]
    return [
        f"{'memory':<{width}}  {p.total / GIB:.2f} of {p.capacity / GIB:.0f} GiB per worker"
        f" ({p.total / p.capacity:.0%}, {p.verdict}): {listed}{held} (estimate: trnrecipes/plan/memory.py)"
    ]


def memory_problem(r: Recipe, p: MemoryPlan, dp_of) -> str | None:
    """The render-time refusal of a layout over capacity, naming what would fit; None when it fits."""
    if p.capacity is None or p.total <= p.capacity:
        return None
    alternatives = fits_with(r, dp_of)
    hint = (
        f"; it would fit with {', or '.join(alternatives)}"
        if alternatives
        else (
            "; no single change of activation checkpointing, ZeRO-1, TP, PP, CP or micro-batch makes it fit: combine"
            " them"
        )
    )
    return (
        f"{r.name} needs ~{p.total / GIB:.1f} GiB per worker on {r.cluster.instance}, which has"
        f" {p.capacity / GIB:.0f} (weights {p.weights / GIB:.1f}, grads {p.grads / GIB:.1f}, AdamW"
        f" {p.optimizer / GIB:.1f}, activations {p.activations / GIB:.1f}, loss {p.loss / GIB:.1f}, reserve"
        f" {p.reserve / GIB:.1f}){hint}"
    )
