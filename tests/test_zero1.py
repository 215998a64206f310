"""ZeRO-1 (optimizer states sharded over data parallel) on real torch.distributed (gloo, 2 processes): the same
weights as plain DP, half the moments per rank, and checkpoints that cross ZeRO-1 on/off and DP 1 <-> 2."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import REPO, rank_launcher
from test_resume import finish, last_losses, start

from trnrecipes.checkpoint import verify_training
from trnrecipes.config.recipe import load_recipe

pytestmark = pytest.mark.slow

DP2 = ["cluster.workers_per_node=2"]
FIXED = ["batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2", "optim.clip_grad_norm=1.0"]


def worker(tmp_path: Path, overrides: list[str], steps: int) -> tuple[dict, list[dict], list[dict]]:
    out = tmp_path / f"w{abs(hash(tuple(overrides)))}.pt"
    cmd = [*rank_launcher(2), str(REPO / "tests/train_worker.py"), str(out), "pythia-tiny",
           *overrides]  # fmt: skip
    env = {**os.environ, "TRAIN_WORKER_STEPS": str(steps), "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [torch.load(f"{out}.rank{r}", weights_only=True) for r in (0, 1)]
    sizes = [json.loads(Path(f"{out}.rank{r}.json").read_text()) for r in (0, 1)]
    return torch.load(out, weights_only=True), ranks, sizes


def test_zero1_at_dp2_gives_the_same_weights_as_plain_dp2_for_10_steps(tmp_path: Path):
    """fp32, 10 steps with clipping and weight decay, NeoX (biases and norms: 1-d parameters split too)."""
    plain, _, plain_sizes = worker(tmp_path, [*DP2, *FIXED], 10)
    zero, zero_ranks, zero_sizes = worker(tmp_path, [*DP2, *FIXED, "layout.zero1=true"], 10)
    assert zero["norms"] == plain["norms"]
    for name, p in plain["params"].items():
        assert torch.equal(zero["params"][name], p), name
    for name, p in zero_ranks[0].items():  # the replicas hold every row after each step, not only their own
        assert torch.equal(zero_ranks[1][name], p), name
    # Each rank holds about half the moments; together exactly one copy.
    assert sum(s["moments"] for s in zero_sizes) == plain_sizes[0]["moments"] == 2 * plain_sizes[0]["params"]
    assert all(s["moments"] < 0.6 * plain_sizes[0]["moments"] for s in zero_sizes)


SMALL = ["batch.seq_len=32", "batch.global_batch=4", "batch.micro_batch=2", "train.log_every=1",
         "train.val_every=1000", "checkpoint.every_steps=5", "checkpoint.allow_changes=[layout.dp]"]  # fmt: skip


def launch(tmp_path: Path, run: Path, nproc: int, steps: int, *overrides: str) -> str:
    recipe = load_recipe(
        "llama2-tiny", overrides=[*SMALL, f"cluster.workers_per_node={nproc}", f"run_dir={run}", *overrides]
    )
    cfg = tmp_path / f"cfg-{nproc}-{steps}-{abs(hash(overrides))}.yaml"
    cfg.write_text(yaml.safe_dump({**recipe.to_dict(), "train": {**recipe.to_dict()["train"], "max_steps": steps}}))
    if nproc == 1:
        return finish(start(cfg))
    cmd = [*rank_launcher(nproc), "-m", "trnrecipes", "train", "--config", str(cfg)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


def test_checkpoints_cross_zero1_on_and_off_bitwise(tmp_path: Path):
    """Same DP size, so the data stream carries over: a run saved with ZeRO-1 and resumed without it (and the other
    way round) continues bitwise as the uninterrupted ZeRO-1 run does."""
    straight = tmp_path / "straight"
    launch(tmp_path, straight, 2, 10, "layout.zero1=true")
    reference = last_losses(straight)
    saved = straight / "checkpoints/step_5"
    assert "optim-tp00-of-01-dp0001-of-0002.safetensors" in verify_training(saved)["files"]
    for first, then in (("true", "false"), ("false", "true")):
        run = tmp_path / f"{first}-{then}"
        launch(tmp_path, run, 2, 5, f"layout.zero1={first}")
        out = launch(tmp_path, run, 2, 10, f"layout.zero1={then}")
        assert "resuming from" in out and "(step 5)" in out
        assert [last_losses(run)[s] for s in range(6, 11)] == [reference[s] for s in range(6, 11)], (first, then)


@pytest.mark.parametrize(
    ("first", "then", "layouts"),
    [(1, 2, ["layout.zero1=false", "layout.zero1=true"]), (2, 1, ["layout.zero1=true", "layout.zero1=false"]),
     (2, 1, ["layout.tp=2", "layout.tp=1"])],
    ids=["dp1-to-dp2-zero1", "dp2-zero1-to-dp1", "tp2-to-tp1"],
)  # fmt: skip
def test_checkpoints_cross_layouts(tmp_path: Path, first: int, then: int, layouts: list[str]):
    """DP 1 -> DP 2 with ZeRO-1 (moments split on load), back (the two ranks' slices joined), and TP 2 -> TP 1 (the
    TP shards joined, replicated norms read once): training goes on from the checkpoint, not from scratch."""
    run, fast = tmp_path / "run", ["optim.warmup_steps=0", "optim.lr=3e-3"]
    launch(tmp_path, run, first, 5, layouts[0], *fast)
    out = launch(tmp_path, run, then, 8, layouts[1], *fast)
    assert "resuming from" in out and "(step 5)" in out
    dp = [n // (2 if "tp=2" in layout else 1) for n, layout in ((first, layouts[0]), (then, layouts[1]))]
    assert (f"data parallel size changed ({dp[0]} -> {dp[1]})" in out) == (dp[0] != dp[1])
    losses = last_losses(run)
    assert sorted(losses) == list(range(1, 9))
    assert losses[6] < losses[1] - 0.3, losses  # a fresh start would be back near the first step's loss
    assert (run / "checkpoints/step_8/done").exists()


def test_the_shard_reader_joins_and_splits_zero1_slices_for_any_layout(tmp_path: Path):
    """Moments saved as TP x DP slices (ZeRO-1 files) read back as any other TP x DP slice, exactly."""
    from safetensors.torch import save_file

    from trnrecipes.checkpoint import SHARDS, ShardReader, shard_file
    from trnrecipes.parallel.sharding import shard_region

    full = {"a": torch.randn(10, 6), "b": torch.randn(7), "c": torch.randn(4, 9)}
    dims = {"a": 0, "b": None, "c": 1}
    for saved_tp, saved_dp in ((1, 2), (2, 2), (2, 3), (1, 1)):
        ckpt = tmp_path / f"tp{saved_tp}dp{saved_dp}"
        ckpt.mkdir()
        (ckpt / SHARDS).write_text(json.dumps({"tp": saved_tp, "dims": dims, "optim_dp": saved_dp}))
        for t in range(saved_tp):
            for d in range(saved_dp):
                tensors = {}
                for name, value in full.items():
                    r = shard_region(tuple(value.shape), dims[name], saved_tp, t, saved_dp, d)
                    tensors[f"exp_avg.{name}"] = value[r.slices_within(shard_region(value.shape, None, 1, 0))].clone()
                save_file(tensors, ckpt / shard_file("optim", t, saved_tp, d, saved_dp))
        reader = ShardReader(ckpt, "optim")
        for tp, dp in ((1, 1), (2, 1), (1, 2), (2, 2), (1, 3)):
            for t in range(tp):
                for d in range(dp):
                    for name, value in full.items():
                        r = shard_region(tuple(value.shape), dims[name], tp, t, dp, d)
                        out = torch.empty(r.size)
                        reader.read_into(f"exp_avg.{name}", out, tuple(value.shape), r.start)
                        assert torch.equal(out, value[r.slices_within(shard_region(value.shape, None, 1, 0))])


# Over 3 DP ranks: rows that split unevenly (7, 5, 11; 1 row: two ranks own none) and evenly (3, 6), no rows, a
# non-contiguous tensor (the [5, 4] transpose of a [4, 5] one), two dtypes.
GATHER_SHAPES = [((7, 3), torch.float32), ((5,), torch.bfloat16), ((1, 4), torch.float32), ((3, 2, 2), torch.bfloat16),
                 ((11,), torch.float32), ((6, 4), torch.float32), ((0, 4), torch.float32), ((5, 4), torch.float32),
                 ((3, 2), torch.float32)]  # fmt: skip
NON_CONTIGUOUS = 7


def _gather_rank(rank: int, world: int, store: str, out: str) -> None:
    import torch.distributed as dist

    from trnrecipes.parallel import dims as parallel_dims
    from trnrecipes.parallel.sharding import chunk_range

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    calls = []
    for name in ("all_gather_single", "all_gather_into_tensor"):  # whichever this torch's gather_zero1 uses
        if hasattr(dist, name):
            real = getattr(dist, name)
            setattr(dist, name, lambda *a, _real=real, **k: calls.append(a[1].numel()) or _real(*a, **k))
    # Into themselves: even splits of which each rank sends >= 4 elements ([3, 2, 2], [6, 4]). Bucketed, fp32 (20
    # elements a bucket): [7, 3] (21) alone; [1, 4] + [11] + [0, 4]; [5, 4]; [3, 2] (even, but 2 elements a rank);
    # bf16: [5]. 7 all-gathers for 9 tensors.
    parallel_dims.BUCKET_ELEMENTS, parallel_dims.GATHER_ALONE_ELEMENTS = 20, 4
    dims = parallel_dims.ParallelDims.__new__(parallel_dims.ParallelDims)  # only the fields gather_zero1 reads
    dims.zero1, dims.dp, dims.dp_rank, dims.cp, dims.cp_rank = True, world, rank, 1, 0
    dims.shard_group = dist.group.WORLD
    truth = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(dtype) for i, (shape, dtype) in
             enumerate(GATHER_SHAPES)]  # fmt: skip
    truth[0][1, 2], truth[4][9] = -0.0, float("nan")  # bitwise: signed zero and NaN come through as they are
    mine, rows = [], []
    for t in truth:
        start, stop = chunk_range(t.shape[0], world, rank)
        local = torch.full_like(t, 100.0 + rank)  # what the rows this rank does not own held before the gather
        if len(mine) == NON_CONTIGUOUS:
            local = local.t().contiguous().t()
            assert not local.is_contiguous()
        local[start:stop] = t[start:stop]
        mine.append(local)
        rows.append((start, stop))
    parallel_dims.ParallelDims.gather_zero1(dims, mine, rows)
    torch.save({"tensors": mine, "calls": calls, "truth": truth}, f"{out}.rank{rank}")
    dist.destroy_process_group()


def test_zero1_gather_is_bucketed_and_gives_every_rank_the_owners_rows_bitwise(tmp_path: Path):
    """ParallelDims.gather_zero1 at DP 3 (gloo): uneven splits, a rank owning no row, a tensor with no rows, a
    non-contiguous one, bf16 and fp32 in separate buckets, large even splits gathered into themselves, -0.0 and NaN
    kept bit for bit; one all-gather per bucket, not one collective per small parameter."""
    import torch.multiprocessing as mp

    world = 3
    mp.spawn(_gather_rank, args=(world, str(tmp_path / "store"), str(tmp_path / "out")), nprocs=world, join=True)
    for rank in range(world):
        got = torch.load(tmp_path / f"out.rank{rank}", weights_only=True)
        for t, truth in zip(got["tensors"], got["truth"], strict=True):
            assert t.dtype == truth.dtype and torch.equal(_bits(t), _bits(truth)), (rank, t, truth)
        assert not got["tensors"][NON_CONTIGUOUS].is_contiguous()  # written in place, not replaced
        # Elements each rank sent per all-gather, ceil(rows / 3) rows each: [3, 2, 2] 4, [6, 4] 8, [7, 3] 9,
        # [1, 4] + [11] + [0, 4] 4 + 4 + 0, [5, 4] 8, [3, 2] 2, [5] 2.
        assert sorted(got["calls"]) == [2, 2, 4, 8, 8, 8, 9], got["calls"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int16 if t.element_size() == 2 else torch.int32)
