"""Start N ranks of one node the way torchrun does for the tests' workers, without importing torch.

    python tests/ranks.py N SCRIPT [ARG ...]        or        python tests/ranks.py N -m MODULE [ARG ...]

Each rank gets what torch.distributed's env:// rendezvous and the Trainer read: RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT (a free port). Why not torchrun: its own start-up imports torch (about 3 s
of one core) before any rank starts, and the suite starts well over a hundred worlds. What users run (run.sbatch,
the Slurm and local-run tests) still goes through torchrun; tests of torchrun's own behaviour (tests/test_health.py)
keep it too.

When a rank fails, the others are stopped (SIGTERM, then SIGKILL after 30 s) and the launcher exits non-zero (a
failed rank's code, 1 for a signal), as torchrun stops a world. Ranks run unbuffered (`python -u`, as torchrun starts
them), so a rank that is killed has still printed what it wrote. The port is free when chosen and taken by rank 0
seconds later: a race torchrun's own store does not have, harmless while the suite runs one test at a time.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> int:
    if len(sys.argv) < 3 or not sys.argv[1].isdigit():
        print("usage: ranks.py N SCRIPT [ARG ...] | ranks.py N -m MODULE [ARG ...]", file=sys.stderr)
        return 2
    nproc, argv = int(sys.argv[1]), sys.argv[2:]
    base = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "WORLD_SIZE": str(nproc),
            "LOCAL_WORLD_SIZE": str(nproc), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # fmt: skip
    procs = [
        subprocess.Popen([sys.executable, "-u", *argv], env={**base, "RANK": str(r), "LOCAL_RANK": str(r)})
        for r in range(nproc)
    ]

    def stop(*_: object) -> None:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 30
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()

    signal.signal(signal.SIGTERM, lambda *_: (stop(), sys.exit(143)))
    while True:
        codes = [p.poll() for p in procs]
        failed = [c for c in codes if c not in (None, 0)]
        if failed:
            stop()
            print(f"[ranks] a rank exited with {failed[0]}; stopped the others", file=sys.stderr)
            return failed[0] if failed[0] > 0 else 1
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
