"""The memory estimate (trnrecipes/plan/memory.py): within 15% of every peak measured on a GPU, every shipped recipe
fits at its published layout, known non-fitting layouts are refused at render naming what would fit, and a layout
within 10% of the device is warned about."""

from __future__ import annotations

import json

import pytest
from conftest import REPO

from trnrecipes.config.recipe import known_recipes, load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.jobs.render import render_job, render_warnings
from trnrecipes.plan.layout import layout_memory, plan
from trnrecipes.plan.memory import GIB, memory_plan
from trnrecipes.plan.report import format_plan

MEASURED = REPO / "bench/results/gpu_memory_h100_2026-11-26.jsonl"


def measured_rows():
    for line in MEASURED.read_text().splitlines():
        record = json.loads(line)
        for row_name, row in record["rows"].items():
            yield f"{record['name']}:{row_name}", record, row


@pytest.mark.parametrize("name, record, row", list(measured_rows()), ids=lambda v: v if isinstance(v, str) else "")
def test_the_estimate_is_within_15_percent_of_each_measured_peak(name, record, row):
    s = record["shape"]
    recipe = load_recipe("llama2-tiny", overrides=[
        f"model.hidden_size={s['hidden']}", f"model.num_layers={s['layers']}", f"model.num_heads={s['heads']}",
        f"model.num_kv_heads={s['kv_heads']}", f"model.ffn_hidden_size={s['ffn']}", f"model.vocab_size={s['vocab']}",
        f"model.max_seq_len={s['seq']}", f"batch.seq_len={s['seq']}", f"batch.micro_batch={s['micro_batch']}",
        f"batch.global_batch={s['micro_batch']}", "cluster.workers_per_node=1",
        "cluster.instance=p5.48xlarge", "cluster.backend=cuda", f"precision.dtype={s['dtype']}",
        f"model.activation_checkpointing={record['activation_checkpointing']}"])  # fmt: skip
    assert recipe.model.param_count() == record["params"]  # the same model as measured
    estimate = memory_plan(recipe, dp=1, grad_accum=1)
    allocated = estimate.total - estimate.reserve  # max_memory_allocated does not count the CUDA context
    assert abs(allocated / GIB / row["peak_gib"] - 1) < 0.15, (estimate.to_dict(), row["peak_gib"])


SHIPPED = sorted(known_recipes())


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_recipe_fits_at_its_published_layout(name):
    recipe = load_recipe(name)
    if recipe.cluster.nodes * recipe.workers_per_node % (recipe.layout.tp * recipe.layout.pp):
        recipe = load_recipe(name, nodes=recipe.layout.tp * recipe.layout.pp // recipe.workers_per_node)
    estimate, _ = layout_memory(recipe)
    assert estimate.verdict != "does not fit", (name, estimate.to_dict())
    if name == "neox20b":  # one node: DP 1, so ZeRO-1 shards nothing (tight); the post's 4+ nodes leave room
        assert layout_memory(load_recipe(name, nodes=4))[0].verdict == "fits"


@pytest.mark.parametrize(
    "name, nodes, overrides, says",
    [
        (
            "llama2-7b",
            16,
            "layout.tp=1 layout.sequence_parallel=false",
            "it would fit with layout.tp=4 layout.sequence_parallel=true",
        ),
        ("neox20b", 4, "layout.pp=1 layout.zero1=false", "it would fit with layout.zero1=true"),
    ],
)
def test_layouts_that_cannot_fit_are_refused_at_render_naming_what_would(tmp_path, name, nodes, overrides, says):
    recipe = load_recipe(name, nodes=nodes, overrides=overrides)
    with pytest.raises(RecipeError) as err:
        render_job(recipe, tmp_path / "job", "cmd", tmp_path)
    message = str(err.value)
    assert message.startswith(f"{name} needs ~") and "GiB per worker on trn1.32xlarge, which has 16" in message
    assert says in message and "\n" not in message
    assert not (tmp_path / "job").exists()
    suggested = says.removeprefix("it would fit with ").split(" (")[0]
    fixed = load_recipe(name, nodes=nodes, overrides=f"{overrides} {suggested}")
    assert layout_memory(fixed)[0].verdict in ("fits", "tight")


def test_a_layout_within_ten_percent_is_warned_about_and_plan_prints_the_table():
    # llama2-7b at TP8 with 4 sequences of 3840 a micro-batch: about 15 of 16 GiB
    recipe = load_recipe(
        "llama2-7b", nodes=16, overrides="batch.micro_batch=4 batch.global_batch=2048 batch.seq_len=3840"
    )
    estimate, _ = layout_memory(recipe)
    assert estimate.verdict == "tight", estimate.to_dict()
    (warning,) = [w for w in render_warnings(recipe) if w.startswith("memory:")]
    assert f"~{estimate.total / GIB:.1f} of 16 GiB per worker" in warning
    text = format_plan(plan(load_recipe("llama2-7b", nodes=16)), load_recipe("llama2-7b", nodes=16))
    (line,) = [x for x in text.splitlines() if x.startswith("memory")]
    assert "of 16 GiB per worker" in line and "fits" in line and "weights 1.57 + grads 1.57" in line


def test_a_pipelines_first_stage_holds_its_in_flight_micro_batches():
    seventy = load_recipe("llama2-70b", nodes=4)  # PP16 1F1B at DP 1: 512 micro-batches a step, 16 held
    estimate, _ = layout_memory(seventy)
    assert estimate.micro_batches_held == 16
    cuda = "cluster.instance=p5.48xlarge cluster.backend=cuda layout.pp=4 layout.tp=8 layout.zero1=false"
    one_f_one_b = layout_memory(load_recipe("llama2-70b", nodes=4, overrides=cuda))[0]
    gpipe = layout_memory(load_recipe("llama2-70b", nodes=4, overrides=f"{cuda} layout.pp_schedule=gpipe"))[0]
    # DP 1 (32 GPUs = TP8 x PP4): 512 micro-batches a step; 1F1B holds PP of them, GPipe all
    assert (one_f_one_b.micro_batches_held, gpipe.micro_batches_held) == (4, 512)
    assert gpipe.activations > 90 * one_f_one_b.activations and gpipe.verdict == "does not fit"


def test_the_loss_phase_counts_a_chunk_of_each_ranks_vocabulary_columns_where_the_chunked_loss_runs():
    """Llama 3.1 8B at 8192 tokens: on cuda (TP 1 fused, TP 2 vocab-parallel) a chunk of 4096 rows of V / TP
    columns, not the micro-batch's [8192, V] logits; on XLA/NxD (torch-xla traces the step whole; NxD's TP loss is
    unchunked) every token's row, of V / TP columns. The chunk sizes are the loss's own."""
    from recipes.common.loss import CHUNK_SIZES, DEFAULT_CHUNK_SIZE
    from trnrecipes.plan.memory import LOGIT_BYTES, LOSS_CHUNK_ROWS

    assert LOSS_CHUNK_ROWS == {**CHUNK_SIZES, "neuron-native": DEFAULT_CHUNK_SIZE}
    seq = ["batch.seq_len=8192", "model.max_seq_len=8192", "batch.micro_batch=1"]
    vocab = 128_256
    cuda = "cluster.instance=p5.48xlarge cluster.backend=cuda model.attention=sdpa"
    for backend, rows in ((cuda, 4096), ("", 8192)):
        for tp in (1, 2):
            layout = [f"layout.tp={tp}", f"layout.sequence_parallel={tp > 1}"]
            r = load_recipe("llama3.1-8b", overrides=[*seq, *layout, *backend.split()])
            assert r.model.vocab_size == vocab and (r.stack == "cuda") is (rows == 4096)
            assert memory_plan(r, dp=1, grad_accum=1).loss == pytest.approx(LOGIT_BYTES * rows * vocab / tp)


@pytest.mark.parametrize("mode", ["fsdp", "zero1"])
def test_under_context_parallelism_fsdp_and_zero1_divide_the_states_by_dp_x_cp(mode):
    """They shard over the dp x cp ranks (torchtitan's dp_shard_cp; trnrecipes/parallel/fsdp.py): at CP 2 x DP 2 a
    rank holds the moments (and under FSDP the weights and gradients) DP 4 holds, half of what DP 2 alone would."""

    def at(cp: int, dp: int):
        overrides = ["cluster.workers_per_node=4", f"layout.cp={cp}", f"layout.{mode}=true"]
        return memory_plan(load_recipe("llama3.1-tiny", overrides=overrides), dp=dp, grad_accum=1)

    cp2, dp4, dp2 = at(2, 2), at(1, 4), at(1, 2)
    assert cp2.optimizer == pytest.approx(dp4.optimizer) and cp2.optimizer == pytest.approx(dp2.optimizer / 2)
    states = (cp2.weights, cp2.grads)
    assert states == pytest.approx((dp4.weights, dp4.grads) if mode == "fsdp" else (dp2.weights, dp2.grads))
