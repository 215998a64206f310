"""Expert parallelism (layout.ep, trnrecipes/parallel/expert.py) on real torch.distributed (gloo), qwen3-moe-tiny at
seq 32 (tests/ep_worker.py, 2 or 4 gloo ranks): EP 2 over DP 2, EP 2 and 4 over DP 4 train as EP 1 (4 steps: losses,
grad norms, every gradient of the first step, the weights after the last), with activation checkpointing too;
checkpoints hold whole [E, ...] experts and resume EP 2 -> 1 and 1 -> 2; dispatch is dropless; the refusals. Under
TP 2 (with SP, with EP 2, ZeRO-1, FSDP) the experts stay whole per TP rank, each routing half the tokens."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, rank_launcher
from safetensors import safe_open

from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.plan.layout import compute_layout

EXPERTS = "layers.1.mlp.experts.gate_up"  # qwen3-moe-tiny: 8 experts, [8, 2 x 64, 64]


def launch(tmp_path: Path, nproc: int, *eps: int) -> tuple[dict, Path]:
    out, root = tmp_path / "out.pt", tmp_path / "runs"
    worker = [str(REPO / "tests/ep_worker.py"), str(out), str(root), *map(str, eps)]
    cmd = [*rank_launcher(nproc), *worker]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True), root


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[dict, Path]:
    return launch(tmp_path_factory.mktemp("ep-dp2"), 2, 1, 2)


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> tuple[dict, Path]:
    return launch(tmp_path_factory.mktemp("ep-dp4"), 4, 1, 2, 4)


def assert_trains_like(got: dict, want: dict) -> None:
    """fp32: the experts' rows are computed in other batches than at EP 1, so equal up to float rounding."""
    assert got["losses"] == pytest.approx(want["losses"], rel=1e-4)
    assert got["norms"] == pytest.approx(want["norms"], rel=1e-4)
    assert got["grads"].keys() == want["grads"].keys()
    for name, grad in want["grads"].items():
        torch.testing.assert_close(got["grads"][name], grad, rtol=1e-4, atol=1e-7, msg=name)
    for name, p in want["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=0, atol=1e-5, msg=name)
    # The trained model's loss (cross-entropy + load-balancing) and router health on one micro-batch
    assert got["same_batch"] == pytest.approx(want["same_batch"], rel=1e-5)


@pytest.mark.slow
def test_ep2_over_dp2_trains_as_ep1_each_rank_holding_half_the_experts(two_ranks):
    results, _ = two_ranks
    ep1, ep2 = results["fixed"][1], results["fixed"][2]
    assert ep1["local_experts"] == {}
    assert ep2["local_experts"][EXPERTS] == (4, 128, 64)
    assert_trains_like(ep2, ep1)
    assert_trains_like(results["fixed"]["ep2-ac"], ep1)  # full activation checkpointing: the all-to-alls run again


@pytest.mark.slow
def test_ep2_and_ep4_over_dp4_train_as_ep1(four_ranks):
    """EP 2 over DP 4: each expert on 2 ranks, its gradient summed over them (expert_replica_group); EP 4: on one.
    EP 2 with ZeRO-1: the other parameters' moments split over the 4 DP ranks, the experts' kept whole per rank;
    with FSDP: the other parameters split over the 4, the experts over the 2 ranks holding them."""
    results, _ = four_ranks
    for ep in (2, 4, "ep2-zero1", "ep2-fsdp"):
        assert results["fixed"][ep]["local_experts"][EXPERTS] == (8 // (4 if ep == 4 else 2), 128, 64)
        assert_trains_like(results["fixed"][ep], results["fixed"][1])


@pytest.mark.slow
def test_tp2_trains_as_tp1_each_tp_rank_routing_half_the_tokens(two_ranks):
    """TP 2 (DP 1) with and without sequence parallelism: attention and the dense MLP split over TP, the router and
    experts whole on both ranks, their gradients summed over TP; the load-balancing loss and router health over both
    ranks' tokens. Against EP 1 over DP 2: the same global batch."""
    results, _ = two_ranks
    for name in ("tp2", "tp2-sp"):
        assert results["fixed"][name]["local_experts"] == {}
        assert_trains_like(results["fixed"][name], results["fixed"][1])


@pytest.mark.slow
def test_trainer_runs_and_checkpoints_hold_whole_experts_and_resume_across_ep(two_ranks):
    """On the demo corpus: 2 steps at one ep then 2 more at the other from its step_2 (one run dir) have the losses
    and step-4 validation loss of the straight EP 1 run (the same DP 2, so the data carries over). The EP 2 save
    holds the [8, ...] experts and moments of EP 1."""
    results, root = two_ranks
    straight = results["straight"]  # 4 losses, then the validation loss at step 4
    assert len(straight) == 5
    for run in ("ep2-then-ep1", "ep1-then-ep2"):
        assert results[run] == pytest.approx(straight, rel=1e-4), run
    step_2 = root / "a/checkpoints/step_2"  # saved at EP 2
    with safe_open(step_2 / "model.safetensors", "pt") as f:
        assert f.get_slice(EXPERTS).get_shape() == [8, 128, 64]
    with safe_open(step_2 / "optim-tp00-of-01.safetensors", "pt") as f:
        assert f.get_slice(f"exp_avg.{EXPERTS}").get_shape() == [8, 128, 64]
        assert f.get_tensor(f"exp_avg_sq.{EXPERTS}").count_nonzero() == 8 * 128 * 64  # every expert's, none zero


@pytest.mark.slow
def test_tp2_by_ep2_trains_as_tp1_ep1_and_resumes_at_tp1(four_ranks):
    """TP 2 x EP 2 (DP 2): each tp_rank's EP group exchanges its TP half of the tokens; alone, with ZeRO-1, and with
    FSDP and full activation checkpointing, as TP 1 EP 1 over DP 4. Its step_2 holds whole experts and their moments,
    and 2 more steps resumed from it at TP 1 EP 1 (DP 4) end as the 4 steps straight at TP 1 EP 1."""
    results, root = four_ranks
    for name in ("tp2-ep2", "tp2-ep2-zero1", "tp2-ep2-fsdp-ac"):
        assert results["fixed"][name]["local_experts"][EXPERTS] == (4, 128, 64)
        assert_trains_like(results["fixed"][name], results["fixed"][1])
    resumed = results["fixed"]["tp2-ep2-then-tp1"]
    assert resumed["local_experts"] == {}  # the last 2 steps at EP 1
    assert_trains_like(resumed, results["fixed"][1])
    step_2 = root / "tp2-then-tp1/checkpoints/step_2"  # a file per TP rank, each with the whole (replicated) experts
    for tp_rank in range(2):
        with safe_open(step_2 / f"model-tp0{tp_rank}-of-02.safetensors", "pt") as f:
            assert f.get_slice(EXPERTS).get_shape() == [8, 128, 64]
        with safe_open(step_2 / f"optim-tp0{tp_rank}-of-02.safetensors", "pt") as f:
            assert f.get_tensor(f"exp_avg_sq.{EXPERTS}").count_nonzero() == 8 * 128 * 64  # every expert's moments


@pytest.mark.slow
def test_zero1_and_fsdp_checkpoints_hold_each_dp_ranks_rows_of_the_whole_experts(four_ranks):
    """DP 4: one step each of EP 2 + FSDP, EP 2 + ZeRO-1, EP 1 and EP 2 + FSDP, each resuming from the one before,
    has the losses and step-4 validation loss of the straight EP 1 run. The saves of EP 2 with FSDP (the experts
    split over the 2 ranks holding them) and with ZeRO-1 (a rank's experts' moments whole) are ZeRO-1's files at EP 1:
    DP rank d holds rows [2d, 2d + 2) of each whole [8, ...] expert moment, and the weights are whole."""
    results, root = four_ranks
    assert results["chain"] == pytest.approx(results["straight"], rel=1e-4)
    for step in (1, 2):  # saved at EP 2 with FSDP, then with ZeRO-1
        with safe_open(root / f"chain/checkpoints/step_{step}/model.safetensors", "pt") as f:
            assert f.get_slice(EXPERTS).get_shape() == [8, 128, 64]
        for dp_rank in range(4):
            name = f"optim-tp00-of-01-dp000{dp_rank}-of-0004.safetensors"
            with safe_open(root / f"chain/checkpoints/step_{step}/{name}", "pt") as f:
                assert f.get_slice(f"exp_avg.{EXPERTS}").get_shape() == [2, 128, 64]


@pytest.mark.slow
def test_dispatch_is_dropless_when_every_token_picks_the_same_experts(two_ranks):
    """Every token of both ranks picks experts 0 (rank 0's) and 7 (rank 1's): no capacity, each pick computed and
    combined; outputs, input gradients and each rank's expert gradients as the single-device block's."""
    d = two_ranks[0]["dropless"]
    assert d["picks"] == [16.0, 0, 0, 0, 0, 0, 0, 16.0]
    torch.testing.assert_close(d["ep"]["out"], d["single"]["out"], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(d["ep"]["x_grad"], d["single"]["x_grad"], rtol=1e-5, atol=1e-6)
    assert d["expert_grads_equal"]


MOE = "qwen3-moe-tiny"


@pytest.mark.parametrize(
    ("recipe", "overrides", "message"),
    [
        ("qwen3-tiny", "cluster.workers_per_node=2", "layout.ep 2: model.num_experts is 0 (model.family qwen3)"),
        (MOE, "cluster.workers_per_node=2 layout.ep=3", "layout.ep 3 must divide model.num_experts 8"),
        (MOE, "cluster.workers_per_node=4 layout.pp=2", "layout.pp 2 with model.num_experts 8: the load-balancing"),
        (MOE, "cluster.workers_per_node=2 cluster.backend=xla", "layout.ep 2: backend xla has no expert parallelism"),
        (MOE, "cluster.instance=trn1.32xlarge cluster.backend=neuron batch.global_batch=64",
         "neuronx-distributed's own MoE module, which this project does not build on"),
        (MOE, "cluster.instance=trn1.32xlarge cluster.backend=neuron batch.global_batch=64 layout.tp=2 layout.ep=1",
         "model.family qwen3 runs on TorchNeuron .*, not on torch-xla \\+ NxD"),
        (MOE, "cluster.workers_per_node=1 cluster.backend=xla layout.ep=1",
         "model.num_experts 8 on cluster.backend xla: each micro-batch's tokens per expert are a new shape, so every"
         " step compiles a new graph; train a mixture of experts on cpu, cuda or TorchNeuron"),
        (MOE, "cluster.workers_per_node=2 layout.tp=2 layout.ep=1 batch.seq_len=63",
         "batch.seq_len 63 must be divisible by layout.tp 2 with model.num_experts 8 (each TP rank routes 1/2 of a"
         " sequence's tokens); e.g. 62 or 64"),
    ],
    ids=["dense", "experts", "pp", "xla", "nxd", "nxd-tp", "xla-moe", "tp-seq"],
)  # fmt: skip
def test_what_expert_parallelism_refuses(recipe, overrides, message):
    extra = [] if "layout.ep=" in overrides else ["layout.ep=2"]
    with pytest.raises(RecipeError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_recipe(recipe, overrides=[*overrides.split(), *extra])


def test_experts_run_under_tensor_parallelism():
    """TP splits attention and the dense MLP; the experts stay whole per TP rank, EP groups per tp_rank."""
    r = load_recipe(MOE, overrides=["cluster.workers_per_node=4", "layout.tp=2", "layout.ep=2"])
    assert (compute_layout(r).tp, compute_layout(r).dp) == (2, 2)


def test_ep_must_divide_the_data_parallel_degree():
    r = load_recipe(MOE, overrides=["cluster.workers_per_node=2", "layout.ep=4"])
    with pytest.raises(RecipeError, match=r"layout.ep 4 must divide the data-parallel degree 2 .* valid ep: 1, 2$"):
        compute_layout(r)
    assert compute_layout(load_recipe(MOE, overrides=["cluster.workers_per_node=4", "layout.ep=4"])).dp == 4
    # each refusal offers only what the other takes too: 3 experts over DP 2 leaves ep 1 (they offered 3 and 2)
    three = ["cluster.workers_per_node=2", "model.num_experts=3"]
    with pytest.raises(RecipeError, match=r"valid ep: 1 \(dividing the data-parallel degree 2 too\)$"):
        load_recipe(MOE, overrides=[*three, "layout.ep=2"])
    with pytest.raises(RecipeError, match=r"layout.ep 3 must divide the data-parallel degree 2 .* valid ep: 1$"):
        compute_layout(load_recipe(MOE, overrides=[*three, "layout.ep=3"]))
    # FSDP splits a rank's experts over the dp / ep ranks holding them: evenly (8 / 2 = 4 experts over 8 / 2 = 4)
    uneven_keys = ["cluster.workers_per_node=8", "batch.global_batch=16", "layout.ep=2", "layout.fsdp=true",
                   "model.num_experts=4"]  # fmt: skip
    uneven = load_recipe(MOE, overrides=uneven_keys)
    with pytest.raises(RecipeError, match=r"a rank's 2 experts do not split evenly over the 4 data-parallel ranks"):
        compute_layout(uneven)
    # the advice holds: no layout.ep mends it (it is num_experts over DP), the advised ZeRO-1 does
    for ep in (2, 4):
        fsdp = ["layout.fsdp=true", f"layout.ep={ep}", "model.num_experts=4"]
        with pytest.raises(RecipeError, match=r"needs model\.num_experts 4 divisible by DP 8 whatever layout\.ep is"):
            compute_layout(load_recipe(MOE, overrides=[*uneven_keys[:2], *fsdp]))
    zero1 = ["layout.ep=2", "layout.fsdp=false", "layout.zero1=true", "model.num_experts=4"]
    assert compute_layout(load_recipe(MOE, overrides=[*uneven_keys[:2], *zero1])).dp == 8
    # and an ep that does not divide the experts is offered only ep 1 there (it offered 1, 2, 4: each then refused)
    with pytest.raises(RecipeError, match=r"valid ep: 1 \(under layout.fsdp an ep above 1 needs model.num_experts 4"
                                          r" divisible by DP 8\)$"):  # fmt: skip
        load_recipe(MOE, overrides=[*uneven_keys[:2], "layout.fsdp=true", "layout.ep=3", "model.num_experts=4"])


def test_plan_counts_each_ranks_share_of_the_experts():
    """qwen3-moe-tiny: 3 sparse blocks of 8 experts x 3 x 64 x 64; at EP 2 a rank holds half of them."""
    from trnrecipes.plan.layout import plan
    from trnrecipes.plan.report import format_plan

    one, two = (plan(load_recipe(MOE, overrides=["cluster.workers_per_node=2", f"layout.ep={ep}"])) for ep in (1, 2))
    half = 3 * 8 * 3 * 64 * 64 / 2  # the experts' parameters a rank no longer holds
    assert one["memory"]["weights"] - two["memory"]["weights"] == half * 4  # fp32 bytes
    zero1 = plan(load_recipe(MOE, overrides=["cluster.workers_per_node=2", "layout.ep=2", "layout.zero1=true"]))
    others = one["memory"]["weights"] / 4 - 2 * half  # ZeRO-1 halves their moments; the rank's experts' stay whole
    assert zero1["memory"]["optimizer"] == others * 8 / 2 + half * 8
    fsdp = plan(load_recipe(MOE, overrides=["cluster.workers_per_node=4", "layout.ep=2", "layout.fsdp=true"]))
    assert fsdp["memory"]["weights"] == (others / 4 + half / 2) * 4  # the experts over the 2 ranks holding them
    assert "ep" not in one and "TP 1 x PP 1 x DP 2 (EP 2)" in format_plan(two)
    # TP 2: the experts and routers whole on both TP ranks, the rest split
    tp2 = plan(load_recipe(MOE, overrides=["cluster.workers_per_node=2", "layout.tp=2"]))
    whole = 2 * half + 3 * 8 * 64  # the experts and the 3 routers
    assert tp2["memory"]["weights"] == ((one["memory"]["weights"] / 4 - whole) / 2 + whole) * 4
