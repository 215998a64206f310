"""Benchmark: wall time of `make recipe=neox20b nodes=4 sbatch` (goal < 0.5 s), and proof that rendering never
imports torch. The side-by-side baseline is a generator that imports the training stack first (as launchers that
share code with the trainer do): `python -c "import torch"` alone, measured in the same run.

    make bench        (or: .venv/bin/python bench/bench_render.py [--repeat N])
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
GOAL_S = 0.5


def timed(argv: list[str], repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        subprocess.run(argv, cwd=REPO, check=True, capture_output=True)
        times.append(time.perf_counter() - start)
    return times


def imported_top_level_modules(argv: list[str]) -> set[str]:
    done = subprocess.run([sys.executable, "-X", "importtime", *argv], cwd=REPO, check=True, capture_output=True)
    lines = done.stderr.decode().splitlines()
    return {line.split("|")[-1].strip().split(".")[0] for line in lines if line.startswith("import time:")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = f"out={tmp}/job"
        make = ["make", "--no-print-directory", "recipe=neox20b", "nodes=4", out, "sbatch"]
        subprocess.run(make, cwd=REPO, check=True, capture_output=True)  # warm: setup done, files cached
        make_s = timed(make, args.repeat)
        cli = [sys.executable, "-m", "trnrecipes", "sbatch", *"--recipe neox20b --nodes 4".split(), "--out", f"{tmp}/j"]
        cli_s = timed(cli, args.repeat)
        torch_s = timed([sys.executable, "-c", "import torch"], max(3, args.repeat // 3))
        modules = imported_top_level_modules(cli[1:])

    med = statistics.median
    print(f"make recipe=neox20b nodes=4 sbatch   median {med(make_s):.3f} s  (min {min(make_s):.3f}, n={len(make_s)})")
    print(f"python -m trnrecipes sbatch ...      median {med(cli_s):.3f} s")
    print(f"baseline: python -c 'import torch'   median {med(torch_s):.3f} s")
    print(f"ratio make-sbatch / import-torch-alone: {med(make_s) / med(torch_s):.2f}x")
    leaked = sorted(modules & {"torch", "numpy", "transformers", "torch_xla"})
    print(f"modules imported by sbatch: {len(modules)}; torch-stack modules among them: {leaked or 'none'}")
    ok = med(make_s) < GOAL_S and not leaked
    print(f"goal < {GOAL_S} s and no torch import: {'met' if ok else 'NOT met'}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
