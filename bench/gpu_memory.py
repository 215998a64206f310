"""Where a training step's peak GPU memory goes, from torch.cuda.memory's recorded history (bench_gpu.py
--memory-snapshot): the allocations alive at the step's peak, grouped by where they were made.

torch's own viewer (pytorch.org/memory_viz) needs the whole pickled snapshot, tens of MB for one step of a
compiled model, and a browser; a GPU session brings back a few files of text. This walks the trace once: every
allocation made while recording is an `alloc` event, and its `free_completed` event (or its `free_requested`, where
the trace has no completion) ends it. The live bytes rise from the memory already allocated when recording began
(weights, gradients and optimizer states made before the step: the baseline), the highest point is the peak, and
what is alive at that point is grouped by its innermost frame in code we can change (trnrecipes, recipes, bench,
transformers, or a compiled graph's generated file), each group with its bytes, count and outermost such frame.
"""

from __future__ import annotations

from collections import defaultdict

OURS = ("trnrecipes/", "recipes/", "bench/", "transformers/", "torchinductor", "<eval_with_key>")
FREES = ("free_completed", "free_requested")


def _where(frames: list[dict]) -> tuple[str, str]:
    """(innermost, outermost) frame of `frames` (innermost first, as torch records them) in code of OURS."""
    mine = [f for f in frames if any(k in f.get("filename", "") for k in OURS)]
    if not mine:
        mine = frames[:1] or [{"filename": "?", "line": 0, "name": "?"}]

    def name(f: dict) -> str:
        path = f.get("filename", "?")
        short = "/".join(path.split("/")[-2:])
        return f"{short}:{f.get('line', 0)} {f.get('name', '?')}"

    return name(mine[0]), name(mine[-1])


def peak_breakdown(trace: list[dict], baseline: int, top: int = 25) -> tuple[int, int, list[tuple[str, str, int, int]]]:
    """(peak bytes, index of the peak event, [(innermost, outermost, bytes, count)] of what is alive there, largest
    first, at most `top`). `trace`: one device's events from torch.cuda.memory._snapshot()["device_traces"];
    `baseline`: bytes allocated when recording began."""
    has_completed = any(e.get("action") == "free_completed" for e in trace)
    free_action = "free_completed" if has_completed else "free_requested"

    def replay(until: int | None) -> tuple[int, int, dict[int, dict]]:
        """(peak, its index, what is alive after event `until`): the running total counts every free, a block
        allocated before recording began included (its event carries its size)."""
        live: dict[int, dict] = {}
        current = peak = baseline
        peak_at = -1
        for i, event in enumerate(trace):
            action = event.get("action")
            if action == "alloc":
                live[event["addr"]] = event
                current += event["size"]
                if current > peak:
                    peak, peak_at = current, i
            elif action == free_action:
                live.pop(event["addr"], None)
                current -= event.get("size", 0)
            if i == until:
                break
        return peak, peak_at, live

    peak, peak_at, _ = replay(None)
    peak_live = replay(peak_at)[2] if peak_at >= 0 else {}
    groups: dict[tuple[str, str], list[int]] = defaultdict(lambda: [0, 0])
    for event in peak_live.values():
        group = groups[_where(event.get("frames", []))]
        group[0] += event["size"]
        group[1] += 1
    ranked = sorted(((a, b, n, c) for (a, b), (n, c) in groups.items()), key=lambda g: -g[2])
    return peak, peak_at, ranked[:top]


def report(snapshot: dict, baseline: int, device: int = 0, top: int = 25) -> str:
    """peak_breakdown as text lines."""
    traces = snapshot.get("device_traces", [])
    trace = traces[device] if device < len(traces) else []
    peak, at, ranked = peak_breakdown(trace, baseline, top)
    gib = 2**30
    lines = [
        f"recorded events: {len(trace)}; baseline (allocated when recording began) {baseline / gib:.2f} GiB;"
        f" peak {peak / gib:.2f} GiB at event {at}; alive at the peak and made while recording:"
        f" {sum(r[2] for r in ranked) / gib:.2f} GiB in the top {len(ranked)} groups",
        "GiB | count | made at (innermost frame of ours) | called from (outermost)",
    ]
    lines += [f"{n / gib:7.3f} | {c:5d} | {inner} | {outer}" for inner, outer, n, c in ranked]
    return "\n".join(lines)
