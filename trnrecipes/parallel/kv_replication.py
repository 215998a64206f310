"""KV heads replicated for tensor parallelism wider than the KV heads (Llama 3.1 8B / 70B: 8 KV heads at TP 32).

The fused qkv weight's rows are grouped per KV group g: [q heads of g | k_g | v_g] (recipes/llama2/model.py), so a TP
that divides the KV heads gives every rank whole groups. For TP = r x num_kv_heads (r > 1 replicas of each KV head)
each rank holds a slice of one group's query heads and a copy of that group's k and v heads, [q slice | k | v]:
- Which group and slice rank t holds: consecutive ranks share a KV head on the DTensor path (cpu, cuda, TorchNeuron:
  group t // r, slice t % r); NxD on trn1 tiles them (group t % kv, slice t // kv: neuronx-distributed 2.29,
  modules/qkv_linear.py and scripts/checkpoint_converter.py), `interleaved`.
- Built (DTensor): on the meta device, before the TP plan, each attention's qkv becomes the replicated layout, so the
  plan's plain row split (Shard(0)) hands each rank exactly its rows, and the attention's q_per_kv becomes the local
  query heads. The model code is unchanged: it reads its local groups from the weight's shape. (NxD:
  trnrecipes/parallel/nxd.py builds NxD's own GQAQKVColumnParallelLinear.)
- Gradients: each copy of k_g, v_g gets the gradient of its own rank's query heads only; the true gradient is their
  sum, so after the DP average the k/v rows are summed over the r ranks sharing them (sync_grads; NxD's layer does
  it in its backward). The copies then hold the same gradient, take the same AdamW update and stay bitwise equal.
- Norms count each KV head once here (stored_full drops the copies before squaring); NxD's clip_grad_norm counts
  each copy (AWS's behaviour there, kept).
- Checkpoints: tensors keep their unreplicated ("stored") shape, the one TP 1 has. Each rank writes its own rows, as
  for any sharded tensor (no collective at save), and shards.json records the replication (describe); every reader
  (ShardReader: resume at any TP and layout, consolidate: eval and export) maps the rows back onto the stored tensor
  (pieces), taking k/v from the first copy.
- Which parameters are replicated: an attribute of their qkv module (layouts(model)); materializing the model makes
  new Parameter objects, the modules stay.
Not (yet) with FSDP or stochastic rounding in software (the recipe check refuses them: trnrecipes/config/recipe.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from trnrecipes.parallel.dims import full_tensor, local_tensor

ATTRIBUTE = "kv_replication"  # set on a replicated qkv Linear (modules outlive materialize's new Parameters)
OUT_ATTRIBUTE = "kv_replication_out"  # set on the attention's output projection where its column blocks move with q


@dataclass(frozen=True)
class KVReplication:
    kv_heads: int  # KV groups in the stored layout
    replicas: int  # TP ranks sharing each KV head: tp / kv_heads
    q_per_kv: int  # query heads per KV head in the stored layout
    head_dim: int
    interleaved: bool = False  # NxD on trn1: rank t holds group t % kv_heads (else t // replicas)

    @property
    def tp(self) -> int:
        return self.kv_heads * self.replicas

    def place(self, tp_rank: int) -> tuple[int, int]:
        """(KV group, slice of its query heads) that TP rank `tp_rank` holds."""
        if self.interleaved:
            return tp_rank % self.kv_heads, tp_rank // self.kv_heads
        return divmod(tp_rank, self.replicas)

    @property
    def local_q_heads(self) -> int:
        return self.q_per_kv // self.replicas

    @property
    def stored_group_rows(self) -> int:
        return (self.q_per_kv + 2) * self.head_dim

    @property
    def local_rows(self) -> int:
        return (self.local_q_heads + 2) * self.head_dim

    @property
    def stored_rows(self) -> int:
        return self.kv_heads * self.stored_group_rows

    def row_pieces(self, tp_rank: int, start: int = 0, stop: int | None = None) -> list[tuple[int, int, int]]:
        """(first row in `start:stop`, first stored row, rows) of TP rank `tp_rank`'s rows start:stop (default: all
        of them) of its local qkv tensor: its query heads, then its KV group's k and v rows, each contiguous in both
        layouts; cut to start:stop (ZeRO-1's rows of the moments)."""
        stop = self.local_rows if stop is None else stop
        group, j = self.place(tp_rank)
        base, q_rows = group * self.stored_group_rows, self.local_q_heads * self.head_dim
        whole = [(0, base + j * q_rows, q_rows), (q_rows, base + self.q_per_kv * self.head_dim, 2 * self.head_dim)]
        pieces = []
        for local, stored, n in whole:
            a, b = max(local, start), min(local + n, stop)
            if a < b:
                pieces.append((a - start, stored + a - local, b - a))
        return pieces

    def block(self, tp_rank: int) -> int:
        """Which block of query heads (in stored order, H / tp heads each) TP rank `tp_rank` holds: its own index
        when copies sit on consecutive ranks; on NxD's tiled order another, and the attention's output projection,
        split by those heads' columns, holds the same block (AWS's checkpoint_converter.py permutes o_proj so)."""
        group, j = self.place(tp_rank)
        return group * self.replicas + j

    def holds_kv_copy(self, tp_rank: int) -> bool:
        """Whether this rank's k/v rows are a second (or later) copy: readers take them from the first."""
        return self.place(tp_rank)[1] > 0

    def unreplicate(self, full: torch.Tensor) -> torch.Tensor:
        """A whole replicated-layout tensor (the TP ranks' local tensors in rank order) in the stored layout."""
        hd, rest = self.head_dim, full.shape[1:]
        if self.interleaved:  # rank j * kv + g holds slice j of group g
            full = full.reshape(self.replicas, self.kv_heads, self.local_rows, *rest).transpose(0, 1)
        groups = full.reshape(self.kv_heads, self.replicas, self.local_rows, *rest)
        q = groups[:, :, : self.local_q_heads * hd].reshape(self.kv_heads, self.q_per_kv * hd, *rest)
        kv = groups[:, 0, self.local_q_heads * hd :]  # the first replica's copy
        return torch.cat([q, kv], dim=1).reshape(self.kv_heads * self.stored_group_rows, *rest)


def replicas(kv_heads: int, tp: int) -> int:
    """How many TP ranks share each KV head: 1 when TP divides the KV heads."""
    return tp // kv_heads if tp > kv_heads else 1


def replicate_kv(model: nn.Module, tp: int) -> KVReplication | None:
    """Before the TP plan, on the meta device: every attention's qkv in the replicated layout for `tp` ranks (see
    the module docstring); None (nothing done) when TP divides the KV heads."""
    args = model.args
    r = replicas(args.num_kv_heads, tp)
    if r == 1:
        return None
    layout = KVReplication(args.num_kv_heads, r, args.num_heads // args.num_kv_heads, args.head_dim)
    for layer in model.layers.children():
        attn = layer.attn
        old = attn.qkv
        attn.qkv = nn.Linear(
            old.in_features, tp * layout.local_rows, bias=False, device=old.weight.device, dtype=old.weight.dtype
        )
        attn.q_per_kv = layout.local_q_heads
        setattr(attn.qkv, ATTRIBUTE, layout)
    return layout


def layouts(model: nn.Module, attribute: str = ATTRIBUTE) -> dict[str, KVReplication]:
    """{parameter name: its KVReplication} of the model's replicated qkv weights (none without replication); with
    OUT_ATTRIBUTE, of the output projections whose column blocks follow the query heads (NxD's tiled order)."""
    return {
        f"{name}.weight": layout
        for name, module in model.named_modules()
        if (layout := getattr(module, attribute, None)) is not None
    }


def block_of(blocks: dict[str, list[int]], name: str, tp_rank: int) -> int:
    """The block of tensor `name`'s split dim TP rank `tp_rank` holds, given tp_block's (or shards.json's) map."""
    return blocks[name][tp_rank] if name in blocks else tp_rank


def tp_block(model: nn.Module) -> dict[str, list[int]]:
    """{parameter name: the block of its split dim each TP rank holds} where that is not the rank's own index (the
    output projections under NxD's tiled order): what shards.json records so readers find each block."""
    return {name: [layout.block(t) for t in range(layout.tp)] for name, layout in layouts(model, OUT_ATTRIBUTE).items()}


def stored_full(t: torch.Tensor, layout: KVReplication | None) -> torch.Tensor:
    """The whole of a parameter, or of its gradient, in the stored layout (`layout`: its KVReplication, or None)."""
    full = full_tensor(t)
    return full if layout is None else layout.unreplicate(full)


def describe(layouts: dict[str, KVReplication]) -> dict[str, dict]:
    """What shards.json records of the replicated tensors (read back by from_description)."""
    return {name: dataclasses.asdict(layout) for name, layout in layouts.items()}


def from_description(value: object) -> KVReplication:
    """A KVReplication from shards.json; ValueError naming what is wrong."""
    fields = {f.name for f in dataclasses.fields(KVReplication)}
    if not isinstance(value, dict) or set(value) != fields:
        raise ValueError(f"a KV replication needs exactly {sorted(fields)}")
    layout = KVReplication(**value)
    numbers = (layout.kv_heads, layout.replicas, layout.q_per_kv, layout.head_dim)
    if not all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in numbers):
        raise ValueError(f"kv_heads, replicas, q_per_kv and head_dim must be whole numbers >= 1, got {numbers}")
    if layout.q_per_kv % layout.replicas or not isinstance(layout.interleaved, bool):
        raise ValueError(f"{layout.replicas} replicas cannot split {layout.q_per_kv} query heads per KV head")
    return layout


def kv_groups(mesh, tp: int, layout: KVReplication):
    """A process group per set of TP ranks sharing a KV head (consecutive TP ranks: `place`), for every TP group of
    the mesh (pp, dp, tp); every rank creates every group (torch.distributed requires it) and returns its own."""
    ranks = mesh.mesh.reshape(-1, tp).tolist()  # one row per TP group
    me = dist.get_rank()
    mine = None
    for tp_ranks in ranks:
        for g in range(layout.kv_heads):
            members = tp_ranks[g * layout.replicas : (g + 1) * layout.replicas]
            group = dist.new_group(members)
            if me in members:
                mine = group
    return mine


@torch.no_grad()
def sync_grads(model: nn.Module, group) -> None:
    """Sum the k/v rows of each replicated qkv gradient over the ranks sharing them (after the DP average)."""
    params = dict(model.named_parameters())
    for name, layout in layouts(model).items():
        p = params[name]
        if p.grad is None:
            continue
        grad = local_tensor(p.grad)
        kv = grad[layout.local_q_heads * layout.head_dim :]
        summed = kv.contiguous()
        dist.all_reduce(summed, group=group)
        kv.copy_(summed)
