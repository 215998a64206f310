"""AdamW and stochastic rounding, written for every backend at once (the learning-rate schedule: schedule.py).

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
  tensor, trnrecipes.parallel.sharding) and only those rows are updated; ParallelDims.gather_zero1 then shares the
  updated rows. AdamW is elementwise, so the update of a row is bitwise the same whichever rank makes it.
"""

from __future__ import annotations

import torch

from trnrecipes.config.sections import OptimConfig
from trnrecipes.parallel.dims import local_tensor


def stochastic_round_bf16(x: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """fp32 -> bf16, rounding up with probability equal to the distance from the lower neighbour, so that
    E[round(x)] = x. bf16 keeps the top 16 bits of fp32: add uniform noise to the 16 bits that are dropped, then
    truncate."""
    bits = x.float().contiguous().view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=x.device, generator=generator)
    return ((bits + noise) & -65536).view(torch.float32).to(torch.bfloat16)  # -65536 == 0xFFFF0000


# Elements per multi-tensor pass (AdamW.step). On an accelerator, where a step is bound by kernel launches, passes
# are long: 64M elements keep the fp32 temporaries of a pass under ~1 GB. On CPU, where a step is bound by memory
# bandwidth, each foreach op reads and writes everything it is given before the next op starts, so long passes
# stream each tensor from memory once per op; passes of about a cache's worth (64K elements, 256 KB per fp32 list)
# keep the old loop's locality (with 64M-element passes, 201 parameters of 23.6M elements in all stepped 2x slower
# than the per-parameter loop on one CPU thread; with 64K ones, as fast).
_CHUNK_NUMEL = 1 << 26
_CPU_CHUNK_NUMEL = 1 << 16


def _chunks(indices: list[int], numels: list[int], limit: int) -> list[list[int]]:
    """`indices` cut, in order, into runs of at most `limit` elements in all (a bigger tensor alone)."""
    out: list[list[int]] = []
    total = 0
    for i, n in zip(indices, numels, strict=True):
        if not out or total + n > limit:
            out.append([])
            total = 0
        out[-1].append(i)
        total += n
    return out


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """`flat` (1-D) split into consecutive views shaped like `like`."""
    if len(like) == 1:  # e.g. a CPU pass of one big tensor: a view, without the split
        return [flat.view(like[0].shape)]
    return [v.view(t.shape) for v, t in zip(flat.split([t.numel() for t in like]), like, strict=True)]


def _fp32_copies(tensors: list[torch.Tensor]) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """fp32 copies of the tensors (one foreach pass) as views of one new flat buffer: (buffer, views)."""
    flat = torch.empty(sum(t.numel() for t in tensors), dtype=torch.float32, device=tensors[0].device)
    copies = _views(flat, tensors)
    torch._foreach_copy_(copies, tensors)
    return flat, copies


def _as_fp32(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors in fp32: fp32 ones as they are, the others copied (_fp32_copies)."""
    convert = [t for t in tensors if t.dtype != torch.float32]
    if not convert:
        return tensors
    converted = iter(_fp32_copies(convert)[1])
    return [t if t.dtype == torch.float32 else next(converted) for t in tensors]


class AdamW:
    """Decoupled weight decay Adam (Loshchilov & Hutter) with fp32 (or, optim.state_dtype bf16, bf16) moments; see the
    module docstring for why."""

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
        self.state_dtype = torch.bfloat16 if getattr(cfg, "state_dtype", "fp32") == "bf16" else torch.float32
        self.exp_avg = [torch.zeros_like(self._mine(p, i), dtype=self.state_dtype) for i, p in enumerate(self.params)]
        self.exp_avg_sq = [
            torch.zeros_like(self._mine(p, i), dtype=self.state_dtype) for i, p in enumerate(self.params)
        ]
        self.generator = rounding_generator(device, seed) if stochastic_rounding else None

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

    # One optimizer step as multi-tensor (torch._foreach_*) passes instead of a loop over parameters. The math is
    # the old per-parameter loop's, op for op (on CPU the foreach ops run exactly those ops, so results are bitwise
    # the same), but an accelerator launches ~15 small kernels per parameter for it: with hundreds of parameters the
    # step was launch-bound (H100, 1.07B bf16 parameters: 59.7 ms, torch's foreach AdamW 17.8 ms). Here each pass
    # is one foreach call over a whole group (same device, same parameter dtype), i.e. a handful of launches.
    # What stays per tensor: the Python that builds the lists (views of this rank's rows / DTensor local tensors)
    # and, for bf16 weights, splitting one flat fp32 buffer into per-parameter views (no kernels). The 0-dim lr and
    # step-count tensors are passed to the foreach ops as tensors (their `.Tensor` overloads), never as host numbers,
    # so XLA still traces one graph whatever the lr. Groups are cut into chunks (_CHUNK_NUMEL, _CPU_CHUNK_NUMEL) that
    # bound the fp32 temporaries (the update; for bf16 also fp32 copies of gradient and weight), which the old loop
    # held for one parameter at a time.
    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        self.step_count += 1
        bias1 = 1 - beta1**self.step_count
        bias2 = 1 - beta2**self.step_count
        step_size = self.lr / bias1
        shrink = 1 - self.lr * self.weight_decay if self.weight_decay else None
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            param = self._mine(p, i)
            if param.numel():  # a ZeRO-1 rank may own no rows of a small parameter
                groups.setdefault((param.device, param.dtype), []).append(i)
        for (device, dtype), indices in groups.items():
            scalars = [None if t is None else t.to(device) for t in (bias2, step_size, shrink)]
            limit = _CPU_CHUNK_NUMEL if device.type == "cpu" else _CHUNK_NUMEL
            for chunk in _chunks(indices, [self._mine(self.params[i], i).numel() for i in indices], limit):
                self._update(chunk, dtype == torch.float32, *scalars)

    def _update(
        self,
        indices: list[int],
        fp32: bool,
        bias2: torch.Tensor,
        step_size: torch.Tensor,
        shrink: torch.Tensor | None,
    ) -> None:
        """AdamW on parameters `indices` (one device, one dtype): the old loop's ops, each over the whole list."""
        beta1, beta2 = self.betas
        params = [self._mine(self.params[i], i) for i in indices]
        grads = _as_fp32([self._mine(self.params[i].grad, i) for i in indices])
        ms, vs = [self.exp_avg[i] for i in indices], [self.exp_avg_sq[i] for i in indices]
        stored = None
        if self.state_dtype != torch.float32:  # optim.state_dtype bf16: updated in fp32, stored rounded
            stored = ms + vs
            ms, vs = _as_fp32(ms), _as_fp32(vs)
        torch._foreach_lerp_(ms, grads, 1 - beta1)  # beta1 * m + (1 - beta1) * g
        torch._foreach_mul_(vs, beta2)
        torch._foreach_addcmul_(vs, grads, grads, value=1 - beta2)
        del grads
        update = torch._foreach_div(vs, bias2)
        torch._foreach_sqrt_(update)
        torch._foreach_add_(update, self.eps)
        torch._foreach_reciprocal_(update)
        torch._foreach_mul_(update, ms)
        torch._foreach_mul_(update, step_size)
        if stored is not None:
            self._store(stored, ms + vs)
        if fp32:
            weights, flat = params, None
        else:  # bf16 weights: the update is computed in fp32, then rounded once
            flat, weights = _fp32_copies(params)
        if shrink is not None:
            decayed = [w for w, i in zip(weights, indices, strict=True) if id(self.params[i]) not in self.no_decay]
            if decayed:
                torch._foreach_mul_(decayed, shrink)
        torch._foreach_sub_(weights, update)
        if flat is None:
            return
        if self.stochastic_rounding:
            # stochastic_round_bf16 over the whole chunk at once: one noise draw, one add, one mask. The result has
            # zero low 16 bits, so the copy below (round to nearest) is exact.
            noise = torch.randint(
                0, 1 << 16, flat.shape, dtype=torch.int32, device=flat.device, generator=self.generator
            )
            flat = noise.add_(flat.view(torch.int32)).bitwise_and_(-65536).view(torch.float32)  # -65536 == 0xFFFF0000
            weights = _views(flat, params)
        torch._foreach_copy_(params, weights)  # to nearest (exact after stochastic rounding)

    def _store(self, low: list[torch.Tensor], fp32: list[torch.Tensor]) -> None:
        """fp32 moments back into their bf16 storage: stochastically where the weights are rounded so in software
        (the same generator, so a resumed run draws the same), else to nearest (one foreach pass)."""
        if self.generator is None:
            torch._foreach_copy_(low, fp32)
            return
        for dst, src in zip(low, fp32, strict=True):
            dst.copy_(stochastic_round_bf16(src, self.generator))

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
    """The 128-node Llama 2 post decays every parameter, norms included (decay_norms_and_biases: true); the common
    alternative exempts biases and norm weights (every parameter with fewer than 2 dims)."""
    if decay_norms_and_biases:
        return set()
    return {id(p) for p in model.parameters() if p.dim() < 2}


def rounding_generator(device: torch.device, seed: int) -> torch.Generator | None:
    """An own generator for the rounding noise where the device has one (cpu, cuda, TorchNeuron's neuron if it
    registers one): checkpoints save and restore its state, so a resumed run draws the same noise as an uninterrupted
    one, seeded per TP rank (rounding_seed). None on XLA, whose lazy tensors take the device's default RNG, and on a
    device without generators."""
    if device.type == "xla":
        return None
    try:
        return torch.Generator(device=device).manual_seed(seed)
    except (RuntimeError, NotImplementedError):
        return None


def rounding_seed(seed: int, dims) -> int:
    """Seed of the stochastic-rounding noise: one per TP rank, the same on every DP replica. The replicas apply the
    same averaged update to the same weights; different noise would round them apart, and nothing re-syncs them.
    (Under ZeRO-1 each row is rounded by one rank and then shared, so the replicas agree either way.)"""
    return seed + dims.tp_rank
