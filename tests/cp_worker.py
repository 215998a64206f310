"""Run under tests/ranks.py (4 ranks) by tests/test_context_parallel.py: tiny causal models at several layout.cp in one
process group, saving to OUT (rank 0) what the test compares.

    python tests/cp_worker.py OUT RUN_DIR

- fixed[name]: 4 steps on tests/train_worker.py's fixed micro-batches (the same global batches in every layout):
  the logged losses, the grad norms, the first step's averaged gradients (whole, in the stored layout) and the final
  weights, and rank 0's numbers of parameter and moment elements (sharded over dp x cp under ZeRO-1 and FSDP).
  llama3.1-tiny (GQA: 4 query heads over 1 KV head) at CP 1 (DP 4), CP 2 (DP 2), CP 4 (DP 1), TP 2 x CP 2 (the KV
  head replicated over TP) with and without sequence parallelism, CP 2 and CP 4 with ZeRO-1 and FSDP, CP 2 with
  selective, elementwise and full activation checkpointing; neox-tiny and qwen3-tiny at CP 1 and CP 2 (2 steps);
- resumed[name]: the weights and whole moments a run held at its step-2 save, the files of that save, and what a run
  in another layout restored from it: CP 2 (DP 2) -> CP 1 (DP 4) and the reverse, CP 2 + FSDP -> CP 1 without it and
  -> CP 1 with ZeRO-1;
- received[name][rank]: the token ids and labels (and the count of labelled tokens the loss is weighed by) of the
  first training micro-batch each rank's loader yields and of its first validation batch, at CP 2 (DP 2) and at
  TP 2 (CP 1, DP 2: the same DP rank on the same global rank, whole samples).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from train_worker import fixed_steps

from trnrecipes.config.recipe import load_recipe
from trnrecipes.parallel.dims import ParallelDims, local_tensor
from trnrecipes.parallel.kv_replication import layouts, stored_full
from trnrecipes.plan.layout import compute_layout
from trnrecipes.train.loop import Trainer

NPROC = 4
SMALL = ["batch.seq_len=64", "batch.global_batch=8", "batch.micro_batch=2", "train.val_every=1000",
         f"cluster.workers_per_node={NPROC}"]  # fmt: skip
QUIET = {"log": lambda *a, **k: None}


def fixed(run_dir: Path, name: str, steps: int, *overrides: str) -> dict:
    trainer = Trainer(load_recipe(name, overrides=[*SMALL, *overrides]), run_dir=run_dir, **QUIET)
    replicated = layouts(trainer.model)
    grad_accum = compute_layout(trainer.recipe).grad_accum
    losses, norms, grads = [], [], {}
    for step, mine in enumerate(fixed_steps(trainer, steps)):
        loss = trainer.accumulate(map(trainer.rank_batch, mine), grad_accum)  # under CP each rank its chunks
        losses.append(trainer.dims.mean_over_holders(loss, trainer.backend.device))  # the step's, as logged
        norms.append(float(trainer.reduce_and_clip()))
        if step == 0:
            grads = {n: stored_full(p.grad, replicated.get(n)).clone() for n, p in trainer.model.named_parameters()}
        trainer.optimizer_step(step)
    result = {"losses": losses, "norms": norms, "grads": grads, "params": trainer.full_state_dict()}
    result["local_params"] = sum(local_tensor(p).numel() for p in trainer.model.parameters())
    result["local_moments"] = sum(m.numel() for m in trainer.optimizer.exp_avg)
    trainer.close()
    return result


def received(run_dir: Path, *overrides: str) -> list[dict]:
    """By global rank: what the model is given of the first training micro-batch the rank's loader yields and of
    its first validation batch (a whole [b, s + 1] batch's inputs and labels; under CP, SequenceChunks' fields)."""
    trainer = Trainer(load_recipe("llama3.1-tiny", overrides=[*SMALL, *overrides]), run_dir=run_dir, **QUIET)
    loader, _ = trainer._train_loader(None)
    mine = {"train": next(loader), "val": trainer.val_batches[0]}
    trainer._prefetch.close()
    trainer.close()
    for part, b in mine.items():
        if isinstance(b, torch.Tensor):
            mine[part] = {"tokens": b[:, :-1], "labels": b[:, 1:], "labelled": torch.tensor(b[:, 1:].numel())}
        else:
            mine[part] = {"tokens": b.tokens, "labels": b.labels, "labelled": b.labelled}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return every


def state(trainer: Trainer) -> dict:
    """The weights and the moments, whole, by parameter name (DP and CP only here: under ZeRO-1 and FSDP each rank's
    rows, in shard order = global rank order, concatenated)."""
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    opt = trainer.optimizer
    moments = {
        names[id(p)]: (local_tensor(m).clone(), local_tensor(v).clone())
        for p, m, v in zip(opt.params, opt.exp_avg, opt.exp_avg_sq, strict=True)
    }
    if trainer.dims.shards_moments:
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, moments)
        moments = {n: tuple(torch.cat([rank[n][i] for rank in every]) for i in (0, 1)) for n in moments}
    return {"params": trainer.full_state_dict(), "moments": moments, "steps": opt.steps()}


def resumed(run_dir: Path, first: tuple[str, ...], then: tuple[str, ...]) -> dict:
    """2 steps under `first`, saved at step 2, then the state a run under `then` resumes with from that save."""
    each = [*SMALL, f"run_dir={run_dir}", "checkpoint.every_steps=2", "checkpoint.allow_changes=[layout.dp]"]
    trainer = Trainer(load_recipe("llama3.1-tiny", overrides=[*each, *first]), **QUIET)
    trainer.run(2)
    saved = state(trainer)
    trainer.close()
    saved["files"] = sorted(f.name for f in (run_dir / "checkpoints/step_2").iterdir())
    trainer = Trainer(load_recipe("llama3.1-tiny", overrides=[*each, *then]), **QUIET)
    restored = state(trainer)
    trainer.close()
    return {"saved": saved, "restored": restored, "start_step": trainer.start_step}


def main() -> None:
    out, run_dir = sys.argv[1:]
    root = Path(run_dir)
    ParallelDims.close = lambda self: None  # one process group for every run (gloo hangs on a second one)
    cp2, llama = ("layout.cp=2",), "llama3.1-tiny"
    layouts_ = {
        "cp1": (),
        "cp2": cp2,
        "cp4": ("layout.cp=4",),
        "tp2-cp2": ("layout.tp=2", *cp2),
        "tp2-cp2-sp": ("layout.tp=2", *cp2, "layout.sequence_parallel=true"),
        "cp2-zero1": (*cp2, "layout.zero1=true"),
        "cp2-fsdp": (*cp2, "layout.fsdp=true"),
        "cp4-zero1": ("layout.cp=4", "layout.zero1=true"),  # DP 1: sharded over the CP ranks alone
        "cp4-fsdp": ("layout.cp=4", "layout.fsdp=true"),
        "cp2-selective": (*cp2, "model.activation_checkpointing=selective"),
        "cp2-elementwise": (*cp2, "model.activation_checkpointing=elementwise"),
        "cp2-full": (*cp2, "model.activation_checkpointing=full"),
        # the long-context recipes' layout, TP x CP x FSDP with SP: two KV heads, so that TP 2 replicates none
        "cp1-kv2": ("model.num_kv_heads=2",),
        "tp2-cp2-fsdp": (
            "model.num_kv_heads=2",
            "layout.tp=2",
            *cp2,
            "layout.sequence_parallel=true",
            "layout.fsdp=true",
        ),
    }
    results: dict = {"fixed": {k: fixed(root / k, llama, 4, *v) for k, v in layouts_.items()}}
    for family in ("neox-tiny", "qwen3-tiny"):
        for name, layout in (("cp1", ()), ("cp2", cp2)):
            results["fixed"][f"{family}-{name}"] = fixed(root / f"{family}-{name}", family, 2, *layout)
    results["resumed"] = {
        "cp2-then-cp1": resumed(root / "a", cp2, ()),
        "cp1-then-cp2": resumed(root / "b", (), cp2),
        "cp2-fsdp-then-cp1": resumed(root / "c", (*cp2, "layout.fsdp=true"), ()),
        "cp2-fsdp-then-cp1-zero1": resumed(root / "d", (*cp2, "layout.fsdp=true"), ("layout.zero1=true",)),
    }
    results["received"] = {"cp2": received(root / "r-cp2", *cp2), "tp2": received(root / "r-tp2", "layout.tp=2")}
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
