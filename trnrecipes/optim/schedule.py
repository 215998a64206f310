"""The learning-rate schedule: warmup, then cosine, linear or constant decay to optim.min_lr."""

from __future__ import annotations

import math

from trnrecipes.config.sections import OptimConfig


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
