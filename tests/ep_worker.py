"""Run under tests/ranks.py by tests/test_expert_parallel.py: qwen3-moe-tiny at several layout.ep in one process group,
saving to OUT (rank 0) what the test compares.

    python tests/ep_worker.py OUT RUN_DIR EP [EP ...]

- fixed[ep]: 4 steps on tests/train_worker.py's fixed micro-batches: losses, grad norms, the first step's averaged
  gradients and the final weights, whole (experts gathered over the EP group);
- runs of the real Trainer on the demo corpus, validation at steps 2 and 4: 4 steps straight at ep 1, and resumes
  across layouts through its checkpoints, in one run dir;
- with 2 ranks: EP 2 with full activation checkpointing, TP 2 (DP 1) with and without sequence parallelism,
  resumes EP 2 -> 1 and 1 -> 2 (2 steps each), and
  `dropless`: one sparse block whose router sends every token to experts 0 and 7, at EP 2 against the single-device
  block on each rank's tokens;
- with 4 ranks: EP 2 with ZeRO-1 and with FSDP (2 ranks hold each expert), TP 2 x EP 2 (DP 2) alone, with ZeRO-1
  and with FSDP + full activation checkpointing; one step each of EP 2 + FSDP, EP 2 + ZeRO-1, EP 1, EP 2 + FSDP,
  each resuming from the one before; 2 fixed steps at TP 2 x EP 2 then 2 at TP 1 EP 1 (DP 4) from its step_2.
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from train_worker import fixed_steps

from recipes.qwen3.moe import SparseMLP
from trnrecipes.config.recipe import load_recipe
from trnrecipes.parallel.dims import ParallelDims, full_tensor
from trnrecipes.parallel.expert import ExpertShard, expert_layouts, gather_experts, shard_experts
from trnrecipes.plan.layout import compute_layout
from trnrecipes.train.loop import Trainer

SMALL = ["batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2", "train.val_every=1000"]


def recipe(nproc: int, *overrides: str):
    return load_recipe("qwen3-moe-tiny", overrides=[*SMALL, f"cluster.workers_per_node={nproc}", *overrides])


def fixed(nproc: int, run_dir: Path, *overrides: str, then: tuple[str, ...] | None = None) -> dict:
    """`then`: after 2 steps, save step_2 and resume from it under the overrides `then` (another DP size) for 2."""
    trainer = Trainer(recipe(nproc, *overrides), run_dir=run_dir, log=lambda *a, **k: None)
    losses, norms, grads = [], [], {}
    for step in range(4):
        if then is not None and step == 2:
            trainer.save(2, None)
            trainer.close()  # waits for the write
            resumed = recipe(nproc, *then, "checkpoint.allow_changes=[layout.dp]")
            trainer = Trainer(resumed, run_dir=run_dir, log=lambda *a, **k: None)
            assert trainer.start_step == 2
        experts = expert_layouts(trainer.model)
        mine = fixed_steps(trainer, 4)[step]
        loss = trainer.accumulate(iter(mine), compute_layout(trainer.recipe).grad_accum)
        losses.append(trainer.dims.mean_over_holders(loss, trainer.backend.device))  # the step's, as logged
        norms.append(float(trainer.reduce_and_clip()))
        if step == 0:
            for name, p in trainer.model.named_parameters():
                g = full_tensor(p.grad).detach().clone()  # FSDP: whole over the ranks that split it
                grads[name] = gather_experts(g, experts[name], trainer.dims.ep_group) if name in experts else g
        trainer.optimizer_step(step)
    result = {"losses": losses, "norms": norms, "grads": grads, "params": trainer.full_state_dict()}
    # One more forward on the same micro-batch on every rank: its loss (with the load-balancing loss) and router
    # health, whole over the TP ranks that each routed part of its tokens.
    with torch.no_grad():
        tokens = torch.randint(0, 4000, (2, 33), generator=torch.Generator().manual_seed(7))
        result["same_batch"] = {"loss": float(trainer._forward(tokens)[0]), **trainer.model.router_health()}
    result["local_experts"] = {name: tuple(p.shape) for name, p in trainer.model.named_parameters() if name in experts}
    trainer.close()
    return result


def train(nproc: int, run_dir: Path, steps: int, *overrides: str) -> list[float | None]:
    """The losses of steps 1 to `steps` (None before a resumed run's first), then the validation loss at the last."""
    r = recipe(nproc, "checkpoint.every_steps=2", "train.val_every=2", *overrides, f"run_dir={run_dir}")
    trainer = Trainer(r, log=lambda *a, **k: None)
    try:
        start = trainer.start_step
        result = trainer.run(steps)
        return [None] * start + result.losses + [result.val_losses.get(steps)]
    finally:
        trainer.close()


def dropless(nproc: int) -> dict:
    """Every token picks experts 0 and 7 (held by different EP ranks): nothing is dropped, all picks are combined."""
    args = recipe(nproc).model
    torch.manual_seed(0)
    block = SparseMLP(args)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.1)
        block.router.weight.zero_()
        block.router.weight[0] = 1.0
        block.router.weight[7] = 0.5
    rank = dist.get_rank()
    x = torch.rand(nproc, 16, args.hidden_size, generator=torch.Generator().manual_seed(1))  # > 0: 0 and 7 win
    sharded = copy.deepcopy(block)
    shard_experts(sharded.experts, dist.group.WORLD, ExpertShard(nproc, rank, args.num_experts))
    outputs = {}
    for name, module in (("single", block), ("ep", sharded)):
        mine = x[rank].clone().requires_grad_()
        out = module(mine)
        out.square().sum().backward()
        outputs[name] = {"out": out.detach(), "x_grad": mine.grad}
    # The single-device block's expert gradient over every rank's tokens: the sum of each rank's.
    for p in block.experts.parameters():
        dist.all_reduce(p.grad)
    local = slice(rank * args.num_experts // nproc, (rank + 1) * args.num_experts // nproc)
    outputs["expert_grads_equal"] = all(
        torch.allclose(q.grad, p.grad[local], rtol=1e-5, atol=1e-6)
        for p, q in zip(block.experts.parameters(), sharded.experts.parameters(), strict=True)
    )
    outputs["picks"] = sharded.routing.picks.tolist()
    return outputs


def main() -> None:
    out, run_dir, *eps = sys.argv[1:]
    nproc = int(os.environ["WORLD_SIZE"])
    root = Path(run_dir)
    ParallelDims.close = lambda self: None  # one process group for every run (gloo hangs on a second one)
    results: dict = {"fixed": {ep: fixed(nproc, root / f"ep{ep}", f"layout.ep={ep}") for ep in map(int, eps)}}
    results["straight"] = train(nproc, root / "straight", 4)

    def across(name: str, first: tuple[str, ...], then: tuple[str, ...]) -> list[float | None]:
        """2 steps under `first`, then 2 more under `then` from its step_2, in one run dir."""
        return [*train(nproc, root / name, 2, *first)[:2], *train(nproc, root / name, 4, *then)[2:]]

    ep2 = ("layout.ep=2",)
    if nproc == 2:
        results["fixed"]["ep2-ac"] = fixed(nproc, root / "ac", *ep2, "model.activation_checkpointing=full")
        results["fixed"]["tp2"] = fixed(nproc, root / "tp2", "layout.tp=2")
        results["fixed"]["tp2-sp"] = fixed(nproc, root / "tp2-sp", "layout.tp=2", "layout.sequence_parallel=true")
        results["ep2-then-ep1"] = across("a", ep2, ())
        results["ep1-then-ep2"] = across("b", (), ep2)
        results["dropless"] = dropless(nproc)
    else:  # ZeRO-1 and FSDP where 2 ranks hold the same experts
        for mode in ("zero1", "fsdp"):
            results["fixed"][f"ep2-{mode}"] = fixed(nproc, root / mode, *ep2, f"layout.{mode}=true")
        tp2 = ("layout.tp=2", *ep2)
        results["fixed"]["tp2-ep2"] = fixed(nproc, root / "tp2", *tp2)
        results["fixed"]["tp2-ep2-zero1"] = fixed(nproc, root / "tp2-zero1", *tp2, "layout.zero1=true")
        ac = "model.activation_checkpointing=full"
        results["fixed"]["tp2-ep2-fsdp-ac"] = fixed(nproc, root / "tp2-fsdp", *tp2, "layout.fsdp=true", ac)
        results["fixed"]["tp2-ep2-then-tp1"] = fixed(nproc, root / "tp2-then-tp1", *tp2, then=())
        # One step each, saved every step, in one run dir: EP 2 + FSDP -> EP 2 + ZeRO-1 -> EP 1 -> EP 2 + FSDP
        chain = [(*ep2, "layout.fsdp=true"), (*ep2, "layout.zero1=true"), (), (*ep2, "layout.fsdp=true")]
        each = ("checkpoint.every_steps=1", "checkpoint.keep_last=4")
        losses = [train(nproc, root / "chain", step, *layout, *each) for step, layout in enumerate(chain, 1)]
        results["chain"] = [run[step] for step, run in enumerate(losses)] + [losses[-1][-1]]
    if dist.get_rank() == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
