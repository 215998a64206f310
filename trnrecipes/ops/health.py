"""`trnrecipes health [--collectives]`, run by run.sbatch on every rank before training.

Every rank joins the job's own process group the way training will (the recipe's runtime backend: gloo on cpu,
nccl on cuda, TorchNeuron's neuron + gloo, XLA's), then:
1. Device sanity: an fp32 matmul on this rank's device (cpu, cuda:N, xla:N, neuron:0) against a float64 host
   reference, within a tolerance for the precision the device really multiplies fp32 in (`matmul_precision`).
2. With --collectives: all-gather, all-reduce and reduce-scatter on the device, each checked element by element
   against the value every rank can compute, and timed like nccl-tests (algbw = bytes / time; busbw scales it by
   the bytes each rank really moves: 2(n-1)/n for all-reduce, (n-1)/n for the other two). Each size is the TOTAL
   per operation, whatever the world size (all-gather output, reduce-scatter input, all-reduce buffer), in one
   buffer the three share in place: the memory is the same at 2 ranks and at 1024 (the `buffers:` line).
   Skipped on every rank when a device raised in step 1 (its collectives would hang or fail the others); a matmul
   that merely came out wrong does not skip them.

Then all ranks agree on what every rank found (`Findings`, summed over a host-side gloo group, so the verdict does
not depend on the device network under test), and rank 0 names the node of each rank at fault (`blame`):
"[health] FAILED on node <name> (rank r): <what>" on stderr, and, when TRNRECIPES_BAD_NODES_FILE is set, appends
each such node's name to that file, one per line (a rank whose node has no device for the backend, a NodeError,
appends its own before it stops). A node is its Slurm name (SLURMD_NODENAME, which srun gives
every task and torchrun's workers inherit), else the host name. Every rank exits non-zero if anything failed.

Test-only fault injection (to test this checker itself; never set in a real job):
- TRNRECIPES_HEALTH_FAULT_RANK=R: rank R sends wrong data in every collective;
- TRNRECIPES_HEALTH_FAULT_NODE=<node>: every rank on that node sends wrong data and reports a wrong matmul.
"""

from __future__ import annotations

import os
import re
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from trnrecipes.config.sections import NodeError, Recipe

SIZES_MIB = (1, 16)  # bytes per collective in total, not per rank
ITERS = 5
# Max |error| / max |reference| of a 512^3 fp32 matmul of randn inputs, ~20x (fp32) and ~5x (tf32, bf16) above what
# each precision gives (measured on CPU, tf32 and bf16 emulated by rounding the inputs: 5e-7, 3e-4, 2e-3 to 4e-3).
# A broken device is off by far more (or NaN).
MATMUL_TOLERANCE = {"fp32": 1e-5, "tf32": 2e-3, "bf16": 2e-2}
BAD_NODES_ENV = "TRNRECIPES_BAD_NODES_FILE"
# What a rank can find about a rank: its own matmul (wrong, or the device raised), another rank's slot in the
# all-gather (the sender), the slots it received wrong (a count, about itself: the receiver), and its own results
# of the two reductions.
DEVICE_KINDS = ("matmul", "device error")
COLLECTIVE_KINDS = ("all_gather", "all_gather received", "all_reduce", "reduce_scatter")
KINDS = DEVICE_KINDS + COLLECTIVE_KINDS


def node_name() -> str:
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def check_node(recipe: Recipe, collectives: bool = False, size: int = 512) -> int:
    """The checks above on this rank; 0 when every rank passed them all, else 1 (on every rank)."""
    from trnrecipes.backends import make_backend
    from trnrecipes.parallel.dims import ParallelDims

    try:
        backend = make_backend(recipe.runtime_backend, int(os.environ.get("LOCAL_RANK", "0")))
    except NodeError:  # no device here: this node is at fault (its launcher's exit stops the others)
        record_bad_nodes([node_name()])
        raise
    dims = ParallelDims(recipe, backend)  # the job's process group, joined as the trainer joins it
    rank, world, node = dims.rank, dims.world, node_name()
    group = _host_group(backend, world)
    nodes = _gather_nodes(node, world, group)
    findings = Findings(rank, world)
    check_matmul(backend, findings, node, size)
    counts = findings.agree(group)
    ran_collectives = collectives and world > 1 and not any(counts["device error"])
    if ran_collectives:
        check_collectives(backend, findings, node)
        counts = findings.agree(group)
    if rank == 0:
        report(counts, nodes, collectives=None if not collectives or world == 1 else ran_collectives)
    failed = any(any(v) for v in counts.values())
    dims.close()  # only once all ranks agree: its barrier must not wait for a rank that stopped
    return 1 if failed else 0


class Findings:
    """What this rank found about each rank (`KINDS` x world: 0 or 1, or for "all_gather received" how many
    slots, the most over the sizes tried), and the sum over all ranks (`agree`): how many ranks found it. Each
    check notes its own kinds; a further check (another collective benchmark) adds its kinds and a rule in `blame`."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world
        self.local = {kind: [0] * world for kind in KINDS}

    def note(self, kind: str, about: int, count: int = 1) -> None:
        self.local[kind][about] = max(self.local[kind][about], count)

    def agree(self, group) -> dict[str, list[int]]:
        """Every rank's findings summed, the same on all ranks (a collective: every rank calls it together)."""
        import torch
        import torch.distributed as dist

        table = torch.tensor([self.local[kind] for kind in KINDS], dtype=torch.int64)
        if self.world > 1:
            dist.all_reduce(table, group=group)
        return dict(zip(KINDS, table.tolist(), strict=True))


def blame(counts: Mapping[str, list[int]], world: int) -> tuple[dict[int, list[str]], list[str]]:
    """(rank -> what is wrong with it, problems no rank can be named for) from the agreed counts.

    A rank's own matmul names it. Wrong all-gather data names its sender when most ranks saw it wrong, and a
    receiver that saw more wrong slots than those senders explain when few ranks did; a wrong reduction names the
    ranks that got it when few did (when most did, a bad sender is the likely cause, named by the all-gather)."""
    named: dict[int, list[str]] = {}
    loose: list[str] = []

    def name(r: int, what: str) -> None:
        named.setdefault(r, []).append(what)

    for r in range(world):
        if counts["matmul"][r]:
            name(r, "matmul result wrong")
        if counts["device error"][r]:
            name(r, "the device raised during the matmul")
    senders = [r for r, k in enumerate(counts["all_gather"]) if 2 * k > world]
    for r in senders:
        name(r, f"its all_gather data came back wrong on {counts['all_gather'][r]} of {world} ranks")
    receivers = [r for r, k in enumerate(counts["all_gather received"]) if k > len(senders)]
    if receivers and 2 * len(receivers) < world:
        for r in receivers:
            name(r, f"all_gather: received {counts['all_gather received'][r]} wrong slot(s) here")
    elif receivers:
        loose.append(f"all_gather: {len(receivers)} of {world} ranks received wrong data from ranks not named here")
    for op in ("all_reduce", "reduce_scatter"):
        wrong = [r for r, k in enumerate(counts[op]) if k]
        if wrong and 2 * len(wrong) < world:
            for r in wrong:
                name(r, f"{op}: result wrong here ({len(wrong)} of {world} ranks)")
        elif wrong and not senders:
            loose.append(f"{op}: results wrong on {len(wrong)} of {world} ranks, no rank sent bad all_gather data")
    return named, loose


def say(line: str, stream=None) -> None:
    """Print one line in ONE write. Every rank of a node writes these lines to the same stream, and print() on an
    unbuffered stream (PYTHONUNBUFFERED=1, common on clusters and set here) writes the text and its newline
    separately: two ranks' lines then run together ("...localhost[health] nodeY rank 1/2: ...")."""
    stream = stream or sys.stdout
    stream.write(line + "\n")
    stream.flush()


def report(counts: Mapping[str, list[int]], nodes: list[str], collectives: bool | None) -> None:
    """Rank 0: a FAILED line per rank at fault, the bad-nodes file, and the collectives' verdict (None: not asked)."""
    world = len(nodes)
    named, loose = blame(counts, world)
    for r, what in sorted(named.items()):
        say(f"[health] FAILED on node {nodes[r]} (rank {r}): {'; '.join(what)}", sys.stderr)
    for what in loose:
        say(f"[health] FAILED (no node named): {what}", sys.stderr)
    record_bad_nodes(list(dict.fromkeys(nodes[r] for r in sorted(named))))
    if collectives is None:
        return
    if not collectives:
        verdict = "skipped (a device raised during the matmul)"
    elif any(any(counts[k]) for k in COLLECTIVE_KINDS):
        verdict = "FAILED (see the FAILED lines)"
    else:
        verdict = "ok"
    say(f"[health] collectives over {world} ranks: {verdict}")


def record_bad_nodes(names: list[str], env: Mapping[str, str] = os.environ) -> Path | None:
    """Append the failing nodes to $TRNRECIPES_BAD_NODES_FILE, one name a line (several launches may write)."""
    path = env.get(BAD_NODES_ENV)
    if not path or not names:
        return None
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("a") as f:
        f.write("".join(f"{n}\n" for n in names))
    return out


def matmul_precision(device_type: str, env: Mapping[str, str] = os.environ) -> str:
    """The precision an fp32 matmul really runs in on this device type: fp32, tf32 or bf16."""
    import torch

    pjrt = env.get("PJRT_DEVICE", "CPU")
    if device_type == "neuron" or (device_type == "xla" and pjrt == "NEURON"):
        # neuronx-cc casts fp32 matmuls to bf16 unless --auto-cast=none (its default is matmult: Neuron's "Mixed
        # Precision and Performance-accuracy Tuning (neuronx-cc)"). TorchNeuron passes --auto-cast=none, then
        # NEURON_CC_FLAGS: the last one given wins.
        casts = re.findall(r"--auto-cast[= ](\w+)", env.get("NEURON_CC_FLAGS", ""))
        cast = casts[-1] if casts else ("none" if device_type == "neuron" else "matmult")
        return "fp32" if cast == "none" else "bf16"
    if device_type == "xla":
        # PJRT CPU multiplies in fp32; on TPU/GPU an fp32 dot at XLA's default precision may be one bf16 pass.
        return "fp32" if pjrt == "CPU" else "bf16"
    return {"highest": "fp32", "high": "tf32", "medium": "bf16"}[torch.get_float32_matmul_precision()]


def check_matmul(backend, findings: Findings, node: str, size: int) -> None:
    """An fp32 size^3 matmul on the backend's device against float64 on the host; prints this rank's line."""
    import torch

    rank, world, device = findings.rank, findings.world, backend.device
    head = f"[health] {node} rank {rank}/{world}: {device} matmul {size}^3"
    gen = torch.Generator().manual_seed(1000 + rank)
    a = torch.randn(size, size, generator=gen)
    b = torch.randn(size, size, generator=gen)
    try:
        da, db = a.to(device), b.to(device)
        _product(backend, da, db)  # warm-up (XLA compiles the graph here)
        start = time.perf_counter()
        got = _product(backend, da, db)
        seconds = time.perf_counter() - start  # up to the result on the host
    except Exception as err:  # a broken device: reported and agreed on, not a crash the other ranks would wait on
        findings.note("device error", rank)
        say(f"{head} FAILED ({type(err).__name__}: {err})", sys.stderr)
        return
    want = a.double() @ b.double()
    if _fault_node(node):
        got[0, 0] += want.abs().max()
    err = ((got.double() - want).abs().max() / want.abs().max()).item()
    precision = matmul_precision(device.type)
    limit = MATMUL_TOLERANCE[precision]
    ok = err <= limit  # False for NaN
    if not ok:
        findings.note("matmul", rank)
    say(
        f"{head} {'ok' if ok else 'FAILED'} (max rel err {err:.1e}, limit {limit:.0e} for {precision},"
        f" {2 * size**3 / seconds / 1e9:.1f} GFLOP/s); rendezvous host {os.environ.get('MASTER_ADDR', 'none')}",
        sys.stdout if ok else sys.stderr,
    )


def _product(backend, a, b):
    c = a @ b
    backend.sync()
    return c.cpu()


def check_collectives(backend, findings: Findings, node: str) -> None:
    """All-gather, all-reduce and reduce-scatter of each SIZES_MIB total on the device, checked and timed; rank 0
    prints the timing rows and the bytes of collective buffer each rank held at once."""
    rank, world = findings.rank, findings.world
    fault = 1000.0 if _fault_node(node) or os.environ.get("TRNRECIPES_HEALTH_FAULT_RANK") == str(rank) else 0.0
    rows = [row for mib in SIZES_MIB for row in _check_size(backend, findings, mib, fault)]
    if rank == 0:
        for op, mib, nbytes, secs, factor in rows:
            algbw = nbytes / secs / 1e9
            say(
                f"[health] {op:<14} {mib:>3} MiB x {world} ranks: {secs * 1e3:8.2f} ms  algbw {algbw:6.2f} GB/s"
                f"  busbw {algbw * factor:6.2f} GB/s"
            )
        peak = max(nbytes for _op, _mib, nbytes, _secs, _factor in rows)
        say(f"[health] buffers: {peak} bytes per rank (largest collective buffer, any world size)")


def _check_size(backend, findings: Findings, mib: int, fault: float) -> list[tuple[str, int, int, float, float]]:
    """The three collectives over one buffer of `mib` MiB in total, the size rounded down to a multiple of the world:
    each works in place in it (as nccl-tests' in-place runs and FSDP2's all-gather do), rank r's slot being view[r].
    Rows of (op, MiB, bytes, seconds, busbw factor)."""
    import torch
    import torch.distributed as dist

    from trnrecipes.parallel.collectives import all_gather_into, reduce_scatter_into

    rank, world, device = findings.rank, findings.world, backend.device
    buf = torch.empty(mib * (1 << 20) // 4 // world * world, device=device)
    view, nbytes = buf.view(world, -1), buf.numel() * buf.element_size()
    slots = torch.arange(1, world + 1, dtype=buf.dtype, device=device)

    def wait() -> None:  # until the device has run everything queued on buf (the XLA graph, the CUDA stream)
        backend.sync()
        buf[:1].cpu()

    # all-gather: slot r holds rank r's value r + 1
    secs = _timed(lambda: all_gather_into(buf, view[rank], None), lambda: view[rank].fill_(rank + 1 + fault), wait)
    wrong = (view != slots[:, None]).any(dim=1).cpu().tolist()
    for r in (r for r, w in enumerate(wrong) if w):
        findings.note("all_gather", r)
    findings.note("all_gather received", rank, sum(wrong))
    rows = [("all_gather", mib, nbytes, secs, (world - 1) / world)]

    # all-reduce: the sum of 1..world everywhere
    secs = _timed(lambda: dist.all_reduce(buf), lambda: buf.fill_(rank + 1 + fault), wait)
    if bool((buf != world * (world + 1) / 2).any()):
        findings.note("all_reduce", rank)
    rows.append(("all_reduce", mib, nbytes, secs, 2 * (world - 1) / world))

    # reduce-scatter: rank s sends slot j the value (s + 1) + (j + 1), so slot r sums to world(world + 1)/2 +
    # world(r + 1): distinct per slot, and every partial sum an integer exact in fp32 up to ~3000 ranks.
    def fill_slots() -> None:
        view.copy_((slots + (rank + 1 + fault))[:, None].expand_as(view))

    secs = _timed(lambda: reduce_scatter_into(view[rank], buf, None), fill_slots, wait)
    if bool((view[rank] != world * (world + 1) / 2 + world * (rank + 1)).any()):
        findings.note("reduce_scatter", rank)
    rows.append(("reduce_scatter", mib, nbytes, secs, (world - 1) / world))
    return rows


def _fault_node(node: str) -> bool:
    """Test-only fault injection (module docstring)."""
    return os.environ.get("TRNRECIPES_HEALTH_FAULT_NODE") == node


def _timed(op, prepare, wait) -> float:
    """Median seconds of ITERS runs after one warm-up, each from freshly prepared data (the last run's result stays
    in the buffer)."""
    import torch.distributed as dist

    times = []
    for i in range(ITERS + 1):
        prepare()
        wait()
        dist.barrier()
        start = time.perf_counter()
        op()
        wait()
        if i:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _host_group(backend, world: int):
    """A group over all ranks for host (CPU) tensors: the job's own where it takes them (gloo on cpu, TorchNeuron's
    gloo half), else a gloo group beside it (nccl and XLA reduce device tensors only). The verdict and the node
    names go over it, so they do not depend on the device network under test."""
    import torch.distributed as dist

    if world == 1 or not backend.collectives_on_device:
        return None
    return dist.new_group(backend="gloo")


def _gather_nodes(node: str, world: int, group) -> list[str]:
    import torch.distributed as dist

    if world == 1:
        return [node]
    nodes: list[str] = [""] * world
    dist.all_gather_object(nodes, node, group=group)
    return nodes
