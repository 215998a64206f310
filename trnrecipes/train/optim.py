"""AdamW, the learning-rate schedule and stochastic rounding, written for every backend at once.

One AdamW instead of torch.optim's because three backends need things it does not give together:
- XLA/Neuron: lr and the step count stay device tensors, so the optimizer graph has no host-side scalar at all.
  (torch.optim keeps `step` on the host and passes lr and the bias corrections as Python scalars; torch-xla 2.9
  uploads such scalars as device data, so it does not recompile either: torch.optim.AdamW with a changing lr on
  PJRT CPU compiled 2 graphs in 8 steps, none after the 2nd step. NxD's zero-1 optimizer,
  used on Neuron under layout.zero1, relies on that.)
- Tensor parallel: parameters may be DTensors; AdamW is elementwise, so it runs on each rank's local shard.
- bf16 weights without fp32 masters: the update is computed in fp32 and rounded to bf16 either to nearest or
  stochastically (off Neuron in software here; on Neuron the runtime flag does it in hardware).
- ZeRO-1: given `rows`, each parameter's moments exist only for this data-parallel rank's rows (dim 0 of its local
  tensor, trnrecipes.sharding) and only those rows are updated; ParallelDims.gather_zero1 then shares the updated
  rows. AdamW is elementwise, so the update of a row is bitwise the same whichever rank makes it.
"""

from __future__ import annotations

import math

import torch

from trnrecipes.recipe import OptimConfig
from trnrecipes.train.parallel_dims import local_tensor


def lr_at(step: int, cfg: OptimConfig) -> float:
    """Linear warmup from lr/warmup to lr over warmup_steps, then decay to min_lr at decay_steps (counted from 0,
    warmup included, like Megatron's lr-decay-iters), then min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.decay_steps - cfg.warmup_steps))
    if cfg.schedule == "linear":
        return cfg.min_lr + (cfg.lr - cfg.min_lr) * (1.0 - progress)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1.0 + math.cos(math.pi * progress))


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the distance from the lower neighbour, so that
    E[round(x)] = x. bf16 keeps the top 16 bits of fp32: add uniform noise to the 16 bits that are dropped, then
    truncate."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536 == 0xFFFF0000


class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter) with fp32 states; see the module docstring for why."""

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        cfg: OptimConfig,
        no_decay: set[int] | None = None,  # id()s of parameters that get no weight decay
        stochastic_rounding: bool = False,
        seed: int = 0,
        rows: list[tuple[int, int]] | None = None,  # ZeRO-1: per parameter, the dim-0 rows this rank updates
    ):
        self.params = [p for p in params if p.requires_grad]
        if rows is not None and len(rows) != len(self.params):
            raise ValueError(f"ZeRO-1 rows for {len(rows)} parameters, but {len(self.params)} are trained")
        self.rows = rows
        self.betas, self.eps, self.weight_decay = cfg.betas, cfg.eps, cfg.weight_decay
        self.no_decay = no_decay or set()
        self.stochastic_rounding = stochastic_rounding
        device = local_tensor(self.params[0]).device
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self.exp_avg = [torch.zeros_like(self._mine(p, i), dtype=torch.float32) for i, p in enumerate(self.params)]
        self.exp_avg_sq = [torch.zeros_like(self._mine(p, i), dtype=torch.float32) for i, p in enumerate(self.params)]
        # An own generator where torch has one per device (cpu, cuda): checkpoints save and restore its state, so a
        # resumed run draws the same rounding noise as an uninterrupted one. XLA: the device's default RNG.
        self.generator = None
        if stochastic_rounding and device.type in ("cpu", "cuda"):
            self.generator = torch.Generator(device=device).manual_seed(seed)

    def steps(self) -> int:
        """Optimizer steps taken (what a checkpoint saves; the count drives bias correction)."""
        return int(self.step_count.item())

    def set_steps(self, steps: int) -> None:
        self.step_count.fill_(float(steps))

    def _mine(self, t: torch.Tensor, index: int) -> torch.Tensor:
        """The part of a parameter (or its gradient) this rank updates: its local tensor, or under ZeRO-1 a view of
        its rows."""
        local = local_tensor(t)
        if self.rows is None:
            return local
        start, stop = self.rows[index]
        return local[start:stop]

    def set_lr(self, lr: float) -> None:
        # Copied in from a host tensor: on XLA this is new input data for the same graph, never a new constant.
        self.lr.copy_(torch.tensor(lr, dtype=torch.float32))

    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        self.step_count += 1
        bias1 = 1 - beta1**self.step_count
        bias2 = 1 - beta2**self.step_count
        step_size = self.lr / bias1
        for i, (p, m, v) in enumerate(zip(self.params, self.exp_avg, self.exp_avg_sq, strict=True)):
            if p.grad is None:
                continue
            param, grad = self._mine(p, i), self._mine(p.grad, i).float()
            # In place and few passes over memory: on CPU an optimizer step is bandwidth-bound.
            m.lerp_(grad, 1 - beta1)  # beta1 * m + (1 - beta1) * g
            v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            update = (v / bias2).sqrt_().add_(self.eps).reciprocal_().mul_(m).mul_(step_size)
            decay = self.weight_decay and id(p) not in self.no_decay
            if param.dtype == torch.float32:
                if decay:
                    param.mul_(1 - self.lr * self.weight_decay)
                param.sub_(update)
                continue
            master = param.float()  # bf16 weights: the update is computed in fp32, then rounded once
            if decay:
                master.mul_(1 - self.lr * self.weight_decay)
            master.sub_(update)
            if self.stochastic_rounding:
                param.copy_(stochastic_round_bf16(master, self.generator))
            else:
                param.copy_(master)  # to nearest

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict[str, torch.Tensor | list[torch.Tensor]]:
        return {"step": self.step_count, "exp_avg": self.exp_avg, "exp_avg_sq": self.exp_avg_sq}

    def load_state_dict(self, state: dict) -> None:
        self.step_count.copy_(state["step"])
        for dst, src in zip(self.exp_avg + self.exp_avg_sq, state["exp_avg"] + state["exp_avg_sq"], strict=True):
            dst.copy_(src)


def no_decay_params(model: torch.nn.Module, decay_norms_and_biases: bool) -> set[int]:
    """Seed 002 decays every parameter, norms included (decay_norms_and_biases: true); the common alternative
    exempts biases and norm weights (every parameter with fewer than 2 dims)."""
    if decay_norms_and_biases:
        return set()
    return {id(p) for p in model.parameters() if p.dim() < 2}


def rounding_seed(seed: int, dims) -> int:
    """Seed of the stochastic-rounding noise: one per TP rank, the same on every DP replica. The replicas apply the
    same averaged update to the same weights; different noise would round them apart, and nothing re-syncs them.
    (Under ZeRO-1 each row is rounded by one rank and then shared, so the replicas agree either way.)"""
    return seed + dims.tp_rank
