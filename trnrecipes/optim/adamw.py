"""AdamW, written for every backend at once (the learning-rate schedule: schedule.py; stochastic rounding:
rounding.py).

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
- One compiled graph per step where the backend compiles (train.compile: inductor on cpu/cuda, TorchNeuron's
  "neuron" backend): the eager step is a handful of multi-tensor passes per group, each reading and writing every
  weight, gradient and moment (H200, 1.07B bf16 parameters: 38.6 ms against torch's fused AdamW's 5.5 ms); compiled,
  each parameter's whole update is one fused kernel (torch.compile of adamw_update_per_tensor, below).
"""

from __future__ import annotations

import torch

from trnrecipes.config.sections import OptimConfig
from trnrecipes.optim.rounding import EXP_AVG, EXP_AVG_SQ, WEIGHTS, round_flat_, stream_constant, stream_key
from trnrecipes.parallel.dims import local_tensor

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


def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    decayed: tuple[bool, ...],
    bias2: torch.Tensor,
    step_size: torch.Tensor,
    shrink: torch.Tensor | None,
    betas: tuple[float, float],
    eps: float,
    rounding: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """AdamW on tensors of one device and one dtype, in place: the eager step calls it per pass (a chunk of a group);
    the compiled step calls adamw_update_per_tensor, its twin with the same arguments, once per group. `decayed`: per
    tensor, whether weight decay applies; `rounding`: None (round bf16 to nearest) or (start, then this step's keys
    of the weights', exp_avg's and exp_avg_sq's noise streams) for stochastic rounding, `start` being the first
    element's place in its group (rounding.py). Moments may be bf16 (optim.state_dtype): then they are updated in fp32
    and stored rounded the way the weights are."""
    beta1, beta2 = betas
    grads = _as_fp32(grads)
    low_ms, low_vs = (ms, vs) if ms[0].dtype != torch.float32 else (None, None)
    if low_ms is not None:
        (flat_m, ms), (flat_v, vs) = _fp32_copies(ms), _fp32_copies(vs)
    # m = beta1 * m + (1 - beta1) * g, v = beta2 * v + (1 - beta2) * g * g, each op rounded once: eager CPU kernels
    # fuse lerp and addcmul into FMAs that inductor's code does not, so with those the compiled step differed from
    # the eager one in the last bit of 10-30% of the moments; with these it is bitwise the same.
    scaled = torch._foreach_mul(grads, 1 - beta1)
    torch._foreach_mul_(ms, beta1)
    torch._foreach_add_(ms, scaled)
    del scaled
    squared = torch._foreach_mul(grads, grads)  # not in place: fp32 gradients are the parameters' own
    torch._foreach_mul_(squared, 1 - beta2)
    torch._foreach_mul_(vs, beta2)
    torch._foreach_add_(vs, squared)
    del grads, squared
    update = torch._foreach_div(vs, bias2)
    torch._foreach_sqrt_(update)
    torch._foreach_add_(update, eps)
    torch._foreach_reciprocal_(update)
    torch._foreach_mul_(update, ms)
    torch._foreach_mul_(update, step_size)
    if low_ms is not None:
        for flat, stream, low in ((flat_m, EXP_AVG, low_ms), (flat_v, EXP_AVG_SQ, low_vs)):
            if rounding is not None:
                round_flat_(flat, rounding[0], rounding[1 + stream])
            torch._foreach_copy_(low, _views(flat, low))
    if params[0].dtype == torch.float32:
        weights, flat = params, None
    else:  # bf16 weights: the update is computed in fp32, then rounded once
        flat, weights = _fp32_copies(params)
    if shrink is not None:
        decay = [w for w, d in zip(weights, decayed, strict=True) if d]
        if decay:
            torch._foreach_mul_(decay, shrink)
    torch._foreach_sub_(weights, update)
    if flat is None:
        return
    if rounding is not None:  # the result's low 16 bits are zero: the copy below is exact
        round_flat_(flat, rounding[0], rounding[1 + WEIGHTS])
    torch._foreach_copy_(params, weights)  # to nearest (exact after stochastic rounding)


def adamw_update_per_tensor(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    ms: list[torch.Tensor],
    vs: list[torch.Tensor],
    decayed: tuple[bool, ...],
    bias2: torch.Tensor,
    step_size: torch.Tensor,
    shrink: torch.Tensor | None,
    betas: tuple[float, float],
    eps: float,
    rounding: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None,
) -> None:
    """adamw_update written tensor by tensor, for torch.compile: the same ops on every element in the same order (so
    the same numbers, rounding noise included: each tensor's noise starts at its place in the group), but with no
    flat fp32 buffer spanning the group, which a compiled graph would have to materialise whole (4 bytes a bf16
    parameter, more with bf16 moments). Each parameter's chain of elementwise ops fuses into one kernel that reads
    weight, gradient and moments once and writes them once."""
    beta1, beta2 = betas
    keys = None if rounding is None else rounding[1:]
    offset = 0 if rounding is None else rounding[0]
    for p, g, m_low, v_low, decay in zip(params, grads, ms, vs, decayed, strict=True):
        g = g.float()
        m, v = m_low.float(), v_low.float()  # fp32 moments: themselves (updated in place), bf16: fp32 copies
        m.mul_(beta1).add_(g * (1 - beta1))
        v.mul_(beta2).add_(g * g * (1 - beta2))
        update = (v / bias2).sqrt_().add_(eps).reciprocal_().mul_(m).mul_(step_size)
        if m_low.dtype != torch.float32:
            for fp32, low, stream in ((m, m_low, EXP_AVG), (v, v_low, EXP_AVG_SQ)):
                if keys is not None:
                    round_flat_(fp32.view(-1), offset, keys[stream])
                low.copy_(fp32)
        w = p.float()  # fp32 weights: itself
        if shrink is not None and decay:
            w.mul_(shrink)
        w.sub_(update)
        if p.dtype != torch.float32:
            if keys is not None:
                round_flat_(w.view(-1), offset, keys[WEIGHTS])
            p.copy_(w)
        offset += p.numel()


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
        compile_backend: str | None = None,  # torch.compile the step with this backend (train.compile)
        # id()s of the parameters every TP rank holds whole, and their rounding seed (the same on every TP rank):
        # their own groups, so that each TP rank rounds its copy with the same noise (optim/rounding.rounding_seed)
        tp_replicated: set[int] | None = None,
        tp_replicated_seed: int | None = None,
    ):
        self.params = [p for p in params if p.requires_grad]
        if rows is not None and len(rows) != len(self.params):
            raise ValueError(f"ZeRO-1 rows for {len(rows)} parameters, but {len(self.params)} are trained")
        self.rows = rows
        # ZeRO-1: indices of parameters whose rows are all this rank's (expert parallelism's experts): not gathered
        self.whole_rows: set[int] = set()
        self.betas, self.eps, self.weight_decay = cfg.betas, cfg.eps, cfg.weight_decay
        self.no_decay = no_decay or set()
        self.stochastic_rounding, self.seed = stochastic_rounding, seed
        self.tp_replicated = tp_replicated or set()
        self.tp_replicated_seed = seed if tp_replicated_seed is None else tp_replicated_seed
        device = local_tensor(self.params[0]).device
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.step_count = torch.zeros((), dtype=torch.float32, device=device)
        self.state_dtype = torch.bfloat16 if getattr(cfg, "state_dtype", "fp32") == "bf16" else torch.float32
        self.exp_avg = [torch.zeros_like(self._mine(p, i), dtype=self.state_dtype) for i, p in enumerate(self.params)]
        self.exp_avg_sq = [
            torch.zeros_like(self._mine(p, i), dtype=self.state_dtype) for i, p in enumerate(self.params)
        ]
        # fullgraph: a graph break raises instead of silently splitting the step; dynamic=False: the shapes never
        # change, and TorchNeuron's backend refuses dynamic shapes.
        self.compiled_update = (
            None
            if compile_backend is None
            else torch.compile(adamw_update_per_tensor, backend=compile_backend, fullgraph=True, dynamic=False)
        )

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

    # One optimizer step as multi-tensor (torch._foreach_*) passes instead of a loop over parameters (eager), or as
    # one compiled graph per group. Eager, the math is the old per-parameter loop's, op for op (on CPU the foreach
    # ops run exactly those ops, so results are bitwise the same), but an accelerator launches ~15 small kernels per
    # parameter for it: with hundreds of parameters the step was launch-bound (H100, 1.07B bf16 parameters:
    # 59.7 ms, torch's foreach AdamW 17.8 ms). Here each pass is one foreach call over a whole group (same device,
    # same parameter dtype), i.e. a handful of launches. The 0-dim lr and step-count tensors are passed to the
    # foreach ops as tensors (their `.Tensor` overloads), never as host numbers, so XLA still traces one graph
    # whatever the lr and a compiled step never recompiles for it. Eager passes are cut into chunks (_CHUNK_NUMEL,
    # _CPU_CHUNK_NUMEL) that bound the fp32 temporaries (the update; for bf16 also fp32 copies of gradient and
    # weight); compiled, a group is one call of the per-tensor version, whose temporaries fuse into each kernel.
    @torch.no_grad()
    def step(self) -> None:
        beta1, beta2 = self.betas
        self.step_count += 1
        bias1 = 1 - beta1**self.step_count
        bias2 = 1 - beta2**self.step_count
        step_size = self.lr / bias1
        shrink = 1 - self.lr * self.weight_decay if self.weight_decay else None
        groups: dict[tuple[torch.device, torch.dtype, bool], list[int]] = {}
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            param = self._mine(p, i)
            if param.numel():  # a ZeRO-1 rank may own no rows of a small parameter
                groups.setdefault((param.device, param.dtype, id(p) in self.tp_replicated), []).append(i)
        for (device, _, replicated), indices in groups.items():
            scalars = [None if t is None else t.to(device) for t in (bias2, step_size, shrink)]
            seed = self.tp_replicated_seed if replicated else self.seed
            # This step's keys of the group's noise streams, computed once here, not in the update: a key is two hash
            # rounds of the step count, and inside a compiled update inductor inlined them into every element's hash
            # (each round reads its input twice), so generating its code took minutes (155k expression nodes for five
            # small tensors); as an input, a key is one value.
            keys = (
                tuple(
                    stream_key(self.step_count, stream_constant(seed, indices[0], s))
                    for s in (WEIGHTS, EXP_AVG, EXP_AVG_SQ)
                )
                if self.stochastic_rounding
                else ()
            )
            if self.compiled_update is not None:
                self._update(self.compiled_update, indices, 0, keys, scalars)
                continue
            limit = _CPU_CHUNK_NUMEL if device.type == "cpu" else _CHUNK_NUMEL
            start = 0  # the chunk's first element's place in the group: where its rounding noise starts
            for chunk in _chunks(indices, [self._mine(self.params[i], i).numel() for i in indices], limit):
                self._update(adamw_update, chunk, start, keys, scalars)
                start += sum(self._mine(self.params[i], i).numel() for i in chunk)

    def _update(self, update, indices: list[int], start: int, keys: tuple[torch.Tensor, ...], scalars) -> None:
        """`update` (adamw_update, eager or compiled) on parameters `indices` of one group; `keys`: the group's
        rounding keys (empty without stochastic rounding)."""
        update(
            [self._mine(self.params[i], i) for i in indices],
            [self._mine(self.params[i].grad, i) for i in indices],
            [self.exp_avg[i] for i in indices],
            [self.exp_avg_sq[i] for i in indices],
            tuple(id(self.params[i]) not in self.no_decay for i in indices),
            *scalars,
            self.betas,
            self.eps,
            (start, *keys) if self.stochastic_rounding else None,
        )

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
