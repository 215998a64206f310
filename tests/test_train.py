"""The training engine on CPU: loss falls for every tiny recipe, DP/TP gradient averaging, bf16 + stochastic
rounding, stop requests and compile mode. Real data (the demo corpus), real gloo processes for the 2-process cases."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, rank_launcher, run_cli

from trnrecipes.config.cluster import get_instance
from trnrecipes.config.recipe import load_recipe
from trnrecipes.plan.layout import flops_per_token
from trnrecipes.train.loop import Trainer

pytestmark = pytest.mark.slow

# Small enough for 2 cores: one process, short sequences.
FAST = ["cluster.workers_per_node=1", "batch.seq_len=64", "batch.global_batch=4", "batch.micro_batch=2"]


def run(name: str, tmp_path: Path, *overrides: str, steps: int = 25):
    recipe = load_recipe(name, overrides=[*FAST, f"train.max_steps={steps}", f"run_dir={tmp_path}", *overrides])
    trainer = Trainer(recipe)
    try:
        return trainer.run(), trainer
    finally:
        trainer.close()


@pytest.mark.parametrize("name", ["pythia-tiny", "neox-tiny", "llama2-tiny"])
def test_tiny_recipes_learn_the_demo_corpus(name: str, tmp_path: Path):
    result, _ = run(name, tmp_path, "train.val_every=25", "train.log_every=5", steps=40)
    # nats below the first step's (uniform over the vocabulary): the mean of the last 10 steps, since which documents
    # the last batches hold moves a 5-step mean by about +-0.3 (the 4096-id vocabularies start lowest), and
    # the held-out loss, which no data order moves
    first, last = result.losses[0], sum(result.losses[-10:]) / 10
    assert last < first - 1.25, result.losses
    assert result.val_losses[40] < first - 1.25
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert {"loss", "grad_norm", "lr", "tokens_per_s", "seq_per_s", "mfu", "tokens_per_dollar"} <= set(records[0])
    assert "param_norm" in records[4] and records[-1]["val_loss"] == result.val_losses[40]
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    (ckpt,) = result.checkpoints
    assert ckpt.name == "step_40" and (ckpt / "done").exists() and (ckpt / "tokenizer/tokenizer.json").exists()


def test_mfu_in_the_metrics_is_against_the_cores_the_run_uses(tmp_path: Path):
    """FAST runs one worker, whose torch threads take every core: measured against one catalog worker (half of
    local-cpu's two cores at AVX2's rate) it read 109-162% on an AVX-512 host."""
    import os

    import torch

    run("llama2-tiny", tmp_path, steps=2)
    recipe = load_recipe("llama2-tiny", overrides=FAST)
    per_core = get_instance("local-cpu").peak_bf16_tflops / get_instance("local-cpu").workers_per_node
    wide = "avx512f" in Path("/proc/cpuinfo").read_text().split()
    peak = per_core * (2 if wide else 1) * min(os.cpu_count(), torch.get_num_threads())
    for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()):
        fpt = flops_per_token(recipe.model, recipe.batch.seq_len)
        assert r["mfu"] == pytest.approx(fpt * r["tokens_per_s"] / (peak * 1e12)) and r["mfu"] < 1


def _torchrun(tmp_path: Path, name: str, overrides: list[str], nproc: int) -> dict:
    out = tmp_path / f"{name}-{nproc}-{abs(hash(tuple(overrides)))}.pt"
    worker = [str(REPO / "tests/train_worker.py"), str(out), name, *overrides]
    if nproc == 1:
        cmd = [sys.executable, *worker]
    else:
        cmd = [*rank_launcher(nproc), *worker]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300, env={**os.environ})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return torch.load(out, weights_only=True)


def test_dp2_equals_dp1_with_doubled_accumulation_and_tp_averages_over_dp_only(tmp_path: Path):
    # eps 1e-4: Adam turns a grad of 1e-9 and one of -1e-9 (reduction-order noise) into opposite full-size steps
    common = ["batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2", "optim.clip_grad_norm=0",
              "optim.eps=1e-4"]  # fmt: skip
    dp1 = _torchrun(tmp_path, "pythia-tiny", [*common, "cluster.workers_per_node=1"], 1)  # accum 4
    dp2 = _torchrun(tmp_path, "pythia-tiny", [*common, "cluster.workers_per_node=2"], 2)  # DP 2 x accum 2
    tp2 = _torchrun(tmp_path, "pythia-tiny", [*common, "cluster.workers_per_node=2", "layout.tp=2"], 2)  # accum 4
    for other in (dp2, tp2):
        for name, grad in dp1["grads"].items():
            # a TP run averaging over the world (2) instead of DP (1) would give half of these gradients
            torch.testing.assert_close(other["grads"][name], grad, rtol=2e-4, atol=2e-6, msg=name)
        assert other["norms"] == pytest.approx(dp1["norms"], rel=1e-4)
        for name, p in dp1["params"].items():
            torch.testing.assert_close(other["params"][name], p, rtol=1e-4, atol=1e-5, msg=name)


def test_dp_replicas_stay_bitwise_equal_under_bf16_stochastic_rounding(tmp_path: Path):
    """The DP replicas apply the same averaged update to the same weights, so their rounding noise must be the same
    too: seeded per rank, it rounded them apart, and nothing re-syncs replicas."""
    over = ["batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2", "cluster.workers_per_node=2",
            "precision.dtype=bf16", "precision.stochastic_rounding=true"]  # fmt: skip
    _torchrun(tmp_path, "pythia-tiny", over, 2)
    (out,) = [p for p in tmp_path.glob("pythia-tiny-2-*.pt")]
    rank0, rank1 = (torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1))
    assert rank0.keys() == rank1.keys() and all(v.dtype == torch.bfloat16 for v in rank0.values())
    for name, p in rank0.items():
        assert torch.equal(p, rank1[name]), name


def test_bf16_stochastic_rounding_tracks_fp32_better_than_round_to_nearest(tmp_path: Path):
    # bf16 matmuls are slow on CPUs without AVX512-BF16: a very small llama2 keeps this test short.
    small = ["model.hidden_size=64", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=2",
             "model.ffn_hidden_size=128", "batch.seq_len=32", "optim.lr=3e-4", "optim.warmup_steps=0",
             "train.val_every=1000", "checkpoint.every_steps=1000"]  # fmt: skip
    curves = {}
    for label, precision in [("fp32", ["precision.dtype=fp32"]), ("rtn", ["precision.dtype=bf16"]),
                             ("sr", ["precision.dtype=bf16", "precision.stochastic_rounding=true"])]:  # fmt: skip
        result, _ = run("llama2-tiny", tmp_path / label, *small, *precision, steps=40)
        curves[label] = torch.tensor(result.losses)
    gap_sr = (curves["sr"] - curves["fp32"]).abs().mean()
    gap_rtn = (curves["rtn"] - curves["fp32"]).abs().mean()
    print(f"mean |loss - fp32 loss|: bf16+SR {gap_sr:.4f}, bf16 round-to-nearest {gap_rtn:.4f}")
    assert gap_sr < gap_rtn, (gap_sr, gap_rtn, curves)


def test_stop_file_saves_and_exits_early(tmp_path: Path, monkeypatch):
    stop = tmp_path / ".stop-123"
    stop.write_text("")
    monkeypatch.setenv("TRNRECIPES_STOP_FILE", str(stop))
    result, _ = run("llama2-tiny", tmp_path, steps=10)
    assert result.stopped_early and len(result.losses) == 1
    assert (tmp_path / "checkpoints/step_1/done").exists()
    assert Path(f"{stop}.saved").read_text() == "1\n"


def test_no_held_out_data_means_no_validation_not_a_nan_loss(tmp_path: Path):
    """data.val_fraction 0 (docs: validation only when it is > 0): the last step validated nothing and logged
    "val nan", and metrics.jsonl held NaN, which strict JSON readers refuse."""
    result, _ = run("llama2-tiny", tmp_path, "data.val_fraction=0", "train.val_every=1", steps=2)
    assert result.val_losses == {} and len(result.losses) == 2
    text = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in text and "val_loss" not in text


def test_compile_mode_traces_validation_and_checkpoint_but_writes_nothing(tmp_path: Path, cli):
    config = tmp_path / "recipe.yaml"
    recipe = load_recipe("llama2-tiny", overrides=[*FAST, f"run_dir={tmp_path / 'run'}", "compile.steps=2"])
    import yaml

    config.write_text(yaml.safe_dump(recipe.to_dict(), sort_keys=False))
    done = cli("train", "--config", str(config), "--compile")
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 1/2" in done.stdout and "val" in done.stdout
    assert not (tmp_path / "run").exists() or not any((tmp_path / "run").rglob("*"))


def test_train_refuses_a_world_size_that_is_not_the_layout(tmp_path: Path, cli):
    done = cli("train", "--config", "pythia-tiny", f"run_dir={tmp_path}")
    assert done.returncode == 2
    assert "launched with 1 rank(s), but recipe pythia-tiny at 1 node(s) needs 2" in done.stderr


def test_xla_refuses_pipeline_parallelism_before_any_collective():
    # torch's pipelining has no XLA stage coordinator: the xla (PJRT) backend must refuse pp > 1 at start
    from trnrecipes.backends.xla import XlaBackend
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.config.sections import RecipeError
    from trnrecipes.parallel.dims import ParallelDims

    over = ["layout.pp=2", "cluster.workers_per_node=2", "cluster.backend=xla"]
    with pytest.raises(RecipeError) as refused:
        ParallelDims(load_recipe("llama2-tiny", overrides=over), XlaBackend("xla", torch.device("cpu")))
    message = str(refused.value)
    assert message.startswith("layout.pp 2: backend xla has no pipeline parallelism (torch.distributed.pipelining")
    assert "pipeline parallelism runs on cpu, cuda and neuron" in message and "layout.tp=2" in message


def test_the_pipeline_refusal_suggests_a_tensor_parallel_degree_only_when_it_is_valid():
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.parallel.dims import _wider_tp_hint

    # NeoX-20B, tp 8 x pp 4: tp 32 divides its 64 heads and a trn1 node's 32 workers.
    assert (
        _wider_tp_hint(load_recipe("neox20b", nodes=4), 32)
        == ", e.g. layout.tp=32, which keeps the model's memory per core"
    )
    # Llama 2 70B, tp 8 x pp 16: tp 128 is wider than a node and does not divide its 8 KV heads.
    hint = _wider_tp_hint(load_recipe("llama2-70b", nodes=8), 128)
    assert hint.startswith("; layout.tp=128 would keep the model's memory per core but is not a valid layout here")


def test_backends_that_are_not_installed_say_how_to_get_them(tmp_path: Path, cli):
    # the main venv has torch 2.13 and no torch-xla (it needs torch 2.9: .venv-xla); test_xla covers neuron
    done = cli("train", "--config", "llama2-tiny", *FAST, "cluster.backend=xla", f"run_dir={tmp_path}")
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "cluster.backend xla needs torch-xla" in done.stderr and "make xla-venv" in done.stderr
    done = cli("train", "--config", "llama2-tiny", *FAST, "cluster.backend=neuron", f"run_dir={tmp_path}")
    assert done.returncode == 2 and "cluster.backend 'neuron' does not run on local-cpu; valid: cpu, xla" in done.stderr


def test_fine_tuning_starts_from_a_checkpoints_weights(tmp_path: Path):
    first, _ = run("llama2-tiny", tmp_path / "a", steps=30)
    (ckpt,) = first.checkpoints
    tune = [f"train.init_from={ckpt}", "optim.lr=1e-4", "optim.min_lr=1e-5"]
    tuned, _ = run("llama2-tiny", tmp_path / "b", *tune, steps=1)
    # both runs see the same first batch (same seed and data): only the starting weights differ
    assert tuned.losses[0] < first.losses[0] - 1.0
    with pytest.raises(Exception, match="its model section differs from this recipe's"):
        run("llama2-tiny", tmp_path / "c", f"train.init_from={ckpt}", "model.num_layers=3", steps=1)


def test_a_step_whose_grad_norm_is_not_finite_stops_before_its_save_prunes_the_good_one(tmp_path: Path):
    """At lr 1e4 step 2's grad norm is nan with a finite loss: its update made every weight nan, and that checkpoint
    (which verifies) pruned step_1 under keep_last 1; every resume then diverged at once."""
    from safetensors.torch import load_file

    loud = ["optim.lr=1e4", "optim.min_lr=1", "optim.clip_grad_norm=1e9", "optim.warmup_steps=1"]
    saves = ["checkpoint.every_steps=1", "checkpoint.keep_last=1", "checkpoint.async_save=false"]
    done = run_cli("train", "--config", "pythia-tiny", "cluster.workers_per_node=1", "train.max_steps=3", *loud,
                   *saves, f"run_dir={tmp_path}")  # fmt: skip
    assert done.returncode == 3 and "error: grad norm is nan at step 2 (loss " in done.stderr, done.stderr[-2000:]
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step_1"]
    weights = load_file(tmp_path / "checkpoints/step_1/model.safetensors")
    assert all(bool(t.isfinite().all()) for t in weights.values())
