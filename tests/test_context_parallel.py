"""Context parallelism (layout.cp, trnrecipes/parallel/context.py): the load-balanced split of a sequence and its
inverse, exact chunked causal attention, and on real torch.distributed (gloo, 4 ranks: tests/cp_worker.py, each
a process) CP 2 and 4, TP 2 x CP 2, CP 2 with ZeRO-1, FSDP and activation checkpointing train as CP 1 (fp32: losses,
every gradient, the weights), for llama3.1-tiny (GQA) and at CP 2 for neox-tiny and qwen3-tiny; ZeRO-1 and FSDP shard
over the dp x cp ranks (at DP 1 too); a checkpoint written at CP 2 resumes at CP 1 bitwise in what it restores, and
the reverse, and one written at CP 2 under FSDP (dp x cp moment files) at CP 1 without FSDP and with ZeRO-1; each
CP rank's loader yields only its chunks of the samples; the layout counts cp; the refusals."""

from __future__ import annotations

import os
import subprocess
import types
from pathlib import Path

import pytest
import torch
from conftest import REPO, rank_launcher

from recipes.common.attention import causal_attention
from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.parallel.context import chunked_causal_attention, local_positions, merge_sequence, split_sequence
from trnrecipes.parallel.sharding import chunk_range
from trnrecipes.plan.layout import compute_layout, plan, rank_coords
from trnrecipes.plan.report import format_plan


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_each_rank_holds_the_front_and_the_back_chunk_and_merging_gives_the_sequence_back(cp):
    seq = 4 * cp
    tokens = torch.arange(2 * seq).view(2, seq)  # [batch, sequence]
    parts = [split_sequence(tokens, cp, r) for r in range(cp)]
    c = seq // (2 * cp)
    for r, part in enumerate(parts):
        positions = local_positions(seq, cp, r)
        assert positions.tolist() == [*range(r * c, (r + 1) * c), *range((2 * cp - 1 - r) * c, (2 * cp - r) * c)]
        assert torch.equal(part, tokens[:, positions])
    assert sorted(torch.cat([local_positions(seq, cp, r) for r in range(cp)]).tolist()) == list(range(seq))
    # the causal work (keys each rank's queries see) is the same on every rank
    assert len({int((local_positions(seq, cp, r) + 1).sum()) for r in range(cp)}) == 1
    assert torch.equal(merge_sequence(torch.stack(parts), dim=1), tokens)
    heads = torch.randn(2, 3, seq, 5)  # [b, heads, s, d]: the sequence on dim 2, as keys and values are gathered
    assert torch.equal(merge_sequence(torch.stack([split_sequence(heads, cp, r, dim=2) for r in range(cp)]), 2), heads)


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_chunked_causal_attention_is_causal_attention_over_the_whole_sequence(cp):
    """Each rank's queries against the whole keys and values (GQA: 4 query heads over 2 KV heads), merged back in
    order, give SDPA's causal attention of the whole sequence."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 8 * cp, 16, generator=g) for h in (4, 2, 2))
    outputs = [chunked_causal_attention(split_sequence(q, cp, r, dim=2), k, v, cp, r) for r in range(cp)]
    torch.testing.assert_close(merge_sequence(torch.stack(outputs), dim=2), causal_attention(q, k, v))


def launch(tmp_path: Path) -> dict:
    out = tmp_path / "out.pt"
    worker = [str(REPO / "tests/cp_worker.py"), str(out), str(tmp_path / "runs")]
    cmd = [*rank_launcher(4), *worker]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> dict:
    return launch(tmp_path_factory.mktemp("cp"))


def assert_trains_like(got: dict, want: dict, weights_atol: float = 1e-5) -> None:
    """fp32: the same sums in other orders (attention in chunks, gradients over dp x cp), so equal to 1e-5."""
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-5)
    assert got["norms"] == pytest.approx(want["norms"], rel=1e-5)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        assert float((got["grads"][name] - grad).norm() / grad.norm()) < 1e-5, name
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=0, atol=weights_atol, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2", "cp4", "tp2-cp2", "tp2-cp2-sp"])
def test_context_parallel_trains_as_cp1(four_ranks, layout):
    """llama3.1-tiny (4 query heads over 1 KV head, llama3 RoPE scaling) over 4 ranks: CP 2 (DP 2), CP 4 (DP 1) and
    TP 2 x CP 2 (the KV head replicated over TP; with sequence parallelism too) as CP 1 (DP 4), 4 steps."""
    assert_trains_like(four_ranks["fixed"][layout], four_ranks["fixed"]["cp1"])


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["zero1", "fsdp", "selective", "elementwise", "full"])
def test_context_parallel_composes_with_sharding_and_activation_checkpointing(four_ranks, mode):
    """CP 2 x DP 2 with ZeRO-1 or FSDP (sharded over the dp x cp ranks; FSDP's reduce-scatter averages over them),
    and with core attention (selective), everything but matmuls, attention and collectives (elementwise) or whole
    blocks (full) recomputed in backward: the all-gather of keys and values runs again there."""
    assert_trains_like(four_ranks["fixed"][f"cp2-{mode}"], four_ranks["fixed"]["cp1"])


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["cp2-zero1", "cp2-fsdp", "cp4-zero1", "cp4-fsdp"])
def test_zero1_and_fsdp_shard_over_the_dp_x_cp_ranks(four_ranks, layout):
    """As torchtitan's dp_shard_cp: at CP 2 x DP 2 and CP 4 x DP 1 each rank keeps 1/4 of every parameter's dim-0
    rows (shard index dp_rank x cp + cp_rank; rank 0 the first chunk) of the moments, and under FSDP of the
    parameters too, not the 1/dp (at DP 1 all) of sharding over DP alone; and trains as CP 1."""
    got, whole = four_ranks["fixed"][layout], four_ranks["fixed"]["cp1"]["params"]
    first = 0  # elements of the first of 4 chunks of each tensor's rows
    for p in whole.values():
        start, stop = chunk_range(p.shape[0], 4, 0)
        first += (stop - start) * p[0].numel()
    assert first < sum(p.numel() for p in whole.values()) / 3
    assert got["local_moments"] == first
    assert got["local_params"] == (first if layout.endswith("fsdp") else sum(p.numel() for p in whole.values()))
    assert_trains_like(got, four_ranks["fixed"]["cp1"])


@pytest.mark.slow
def test_tp_by_cp_with_fsdp_trains_as_cp1(four_ranks):
    """The long-context recipes' combination: TP 2 + SP x CP 2 with FSDP over the dp x cp ranks (here the 2 CP
    ranks: DP 1), llama3.1-tiny with 2 KV heads (none replicated over TP), as CP 1 of the same model."""
    # The weights after 4 steps within 5e-5: the vocab-parallel embedding's gradient, summed in another order over
    # TP and the reduce-scatter, differs in its last bits (within 1e-5 relative, checked), and Adam's m / sqrt(v)
    # turns that into up to ~2e-5 on the rows whose gradients are near zero (measured 1.9e-5; every other weight 1e-6)
    assert_trains_like(four_ranks["fixed"]["tp2-cp2-fsdp"], four_ranks["fixed"]["cp1-kv2"], weights_atol=5e-5)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["neox-tiny", "qwen3-tiny"])
def test_the_other_causal_families_train_at_cp2_as_at_cp1(four_ranks, family):
    """NeoX (partial rotary, parallel residual) and Qwen3 (q/k norms before RoPE): 2 steps."""
    assert_trains_like(four_ranks["fixed"][f"{family}-cp2"], four_ranks["fixed"][f"{family}-cp1"])


@pytest.mark.slow
@pytest.mark.parametrize("run", ["cp2-then-cp1", "cp1-then-cp2", "cp2-fsdp-then-cp1", "cp2-fsdp-then-cp1-zero1"])
def test_a_checkpoint_resumes_across_cp_bitwise_in_what_it_restores(four_ranks, run):
    """Saved at step 2 at one cp (CP rank 0 of each replica writes; under FSDP every rank of dp x cp its moments'
    rows, 4 files), resumed at the other (CP 1 without FSDP: the 4 files re-chunked into whole moments; with ZeRO-1
    at DP 4: each rank its rows): the weights and both moments of every parameter, and the optimizer's step count,
    are the saving run's, bit for bit."""
    result = four_ranks["resumed"][run]
    saved, restored = result["saved"], result["restored"]
    optim_files = [f for f in saved["files"] if f.startswith("optim")]
    if "fsdp" in run:
        assert optim_files == [f"optim-tp00-of-01-dp{i:04d}-of-0004.safetensors" for i in range(4)]
    else:
        assert optim_files == ["optim-tp00-of-01.safetensors"]
    assert result["start_step"] == 2 and restored["steps"] == saved["steps"] == 2
    assert saved["params"].keys() == restored["params"].keys() and saved["moments"].keys() == restored["moments"].keys()
    for name, p in saved["params"].items():
        assert torch.equal(restored["params"][name], p), name
    for name, (m, v) in saved["moments"].items():
        assert torch.equal(restored["moments"][name][0], m) and torch.equal(restored["moments"][name][1], v), name


@pytest.mark.slow
@pytest.mark.parametrize("part", ["train", "val"])
def test_each_cp_rank_reads_only_its_chunks_of_the_samples_packed_at_the_full_length(four_ranks, part):
    """At CP 2 each rank's loader yields (and moves to the device) seq_len / 2 token ids and labels a sample: its
    chunks of the whole packed samples a CP-1 run reads at the same DP rank (TP 2 x DP 2 here), with the whole
    samples' count of labelled tokens; its validation batches likewise."""
    cp2, whole = four_ranks["received"]["cp2"], four_ranks["received"]["tp2"]
    for rank, (got, samples) in enumerate(zip(cp2, whole, strict=True)):
        got, samples = got[part], samples[part]
        assert samples["tokens"].shape == (2, 64)  # batch.micro_batch 2 x batch.seq_len 64
        assert got["tokens"].shape == got["labels"].shape == (2, 32), rank
        assert torch.equal(got["tokens"], split_sequence(samples["tokens"], 2, rank % 2)), rank
        assert torch.equal(got["labels"], split_sequence(samples["labels"], 2, rank % 2)), rank
        assert int(got["labelled"]) == int(samples["labelled"]) == 2 * 64, rank


def tiny(*overrides: str):
    return load_recipe("llama3.1-tiny", overrides=["cluster.workers_per_node=8", *overrides])


def test_the_layout_counts_cp_between_dp_and_tp():
    """world = pp x dp x cp x tp; a replica's CP ranks share its sequences (the batch divides by DP only); rank order
    TP fastest, then CP, DP."""
    lay = compute_layout(tiny("layout.cp=2", "layout.tp=2"))
    assert (lay.world_size, lay.dp, lay.cp, lay.tp, lay.grad_accum) == (8, 2, 2, 2, 2)
    assert [tuple(rank_coords(r, pp=1, dp=2, cp=2, tp=2)) for r in (0, 1, 2, 4, 7)] == [
        (0, 0, 0, 0), (0, 0, 0, 1), (0, 0, 1, 0), (0, 1, 0, 0), (0, 1, 1, 1)]  # fmt: skip
    assert "parallelism  TP 2 x CP 2 x PP 1 x DP 2" in format_plan(plan(tiny("layout.cp=2", "layout.tp=2")))
    four = load_recipe("llama3.1-tiny", overrides=["cluster.workers_per_node=4"])
    assert "parallelism  TP 1 x PP 1 x DP 4\n" in format_plan(plan(four))  # CP 1: the line as it was
    with pytest.raises(RecipeError, match=r"8 workers is not divisible by tp 1 x pp 1 x cp 16 = 16"):
        compute_layout(load_recipe("llama3.1-tiny", overrides=["cluster.workers_per_node=8", "layout.cp=16"]))


def test_sbatch_renders_a_cp_job_and_refuses_a_sequence_that_does_not_cut_into_2_cp_chunks(cli, tmp_path):
    out = tmp_path / "job"
    ok = cli("sbatch", "--recipe", "llama3.1-tiny", "--nodes", "1", "--out", str(out),
             "--overrides", "cluster.workers_per_node=4 layout.cp=2")  # fmt: skip
    assert ok.returncode == 0, ok.stderr
    assert "= 4; TP 1 x CP 2 x PP 1 x DP 2;" in (out / "run.sbatch").read_text()
    assert load_recipe(str(out / "recipe.yaml")).layout.cp == 2
    bad = cli("sbatch", "--recipe", "llama3.1-tiny", "--nodes", "1", "--out", str(tmp_path / "bad"),
              "--overrides", "cluster.workers_per_node=4 layout.cp=4 batch.seq_len=100")  # fmt: skip
    assert bad.returncode == 2 and not (tmp_path / "bad").exists()
    assert "batch.seq_len 100 with layout.cp 4: each sequence is cut into 2 x cp = 8 equal chunks" in bad.stderr
    assert "use a batch.seq_len divisible by 8, e.g. 96 or 104" in bad.stderr


@pytest.mark.parametrize(
    ("name", "nodes", "smallest"),
    [("llama3.1-8b-128k-trn2", 16, 8), ("llama3.1-70b-128k-trn2", 16, 16), ("qwen3-8b-32k-trn2", 4, 4)],
)
def test_the_long_context_recipes_fit_with_cp_and_not_without_it(name, nodes, smallest, tmp_path):
    """plan's memory estimate: the recipe's CP layout fits a worker; at CP 1 the same model does not, and the refusal
    names the smallest CP that fits (the layer's s x s probabilities, over seq_len / cp local tokens, dominate)."""
    from trnrecipes.jobs.render import render_job
    from trnrecipes.plan.layout import layout_memory

    recipe = load_recipe(name, nodes=nodes)
    assert recipe.layout.cp > 1 and layout_memory(recipe)[0].verdict == "fits"
    whole = load_recipe(name, nodes=nodes, overrides="layout.cp=1")
    assert layout_memory(whole)[0].verdict == "does not fit"
    with pytest.raises(RecipeError, match=rf"it would fit with (.*, or )?layout.cp={smallest} \("):
        render_job(whole, tmp_path / "job", "cmd", tmp_path)
    assert not (tmp_path / "job").exists()


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("llama3.1-tiny", "layout.pp=2", "layout.cp 2 with layout.pp 2: context parallelism over pipeline stages is"
         " not built"),
        ("qwen3-moe-tiny", "layout.ep=2", "layout.cp 2 with layout.ep 2: expert parallelism with context parallelism"
         " is not built (torchtitan carves EP from the dp x cp ranks)"),
        ("qwen3-moe-tiny", "", "layout.cp 2 with model.num_experts 8: the load-balancing loss"),
        ("llama3.1-tiny", "cluster.backend=xla", "layout.cp 2: backend xla has no context parallelism"),
        ("llama2-7b", "cluster.nodes=1 batch.global_batch=16",
         "NxD Training has its own context_parallel_size that this adapter does not wire"),
        ("bert-tiny", "", "layout.cp 2: model.family bert is not a causal language model"),
        ("llama3.1-tiny", "layout.tp=4 layout.sequence_parallel=true batch.seq_len=124",
         "batch.seq_len 124 must be divisible by layout.tp 4 x layout.cp 2 = 8 with sequence parallelism; e.g. 120"
         " or 128"),
        # both rules speak; each suggests lengths the other takes too (it said 120 or 124, and 124 was refused)
        ("llama3.1-tiny", "layout.tp=4 layout.sequence_parallel=true batch.seq_len=122",
         "use a batch.seq_len divisible by 4, e.g. 120 or 128"),
    ],
    ids=["pp", "ep", "moe", "xla", "nxd", "encoder", "sequence-parallel", "both-rules"],
)  # fmt: skip
def test_what_context_parallelism_refuses(recipe, overrides, message):
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(recipe, overrides=["cluster.workers_per_node=8", "layout.cp=2", *overrides.split()])


def test_parallel_dims_refuses_a_backend_without_context_parallelism():
    """Where the recipe check cannot see the backend a run gets (the neuron backend's stack decides it)."""
    from trnrecipes.parallel.dims import ParallelDims

    backend = types.SimpleNamespace(name="xla", supports_pp=False, no_pp_reason="", supports_cp=False)
    with pytest.raises(RecipeError, match=r"^layout.cp 2: backend xla has no context parallelism .* use layout.cp 1$"):
        ParallelDims(tiny("layout.cp=2"), backend)
