"""A wheelhouse on shared storage from which every node of a job makes its own job Python ready, without the network
and without touching the Neuron packages (trnrecipes/ops/ready.py runs it first in every script).

`trnrecipes wheels --sdk 2.26` (make wheels sdk=2.26), once on the login node: downloads the wheels that
requirements/wheels/neuron-<sdk>.txt locks, for that DLAMI venv's Python and platform, into wheels/neuron-<sdk>/ in
the checkout, with wheels.json saying what it was made from. The lock holds what trnrecipes' `neuron` extra and
PyYAML need beyond the DLAMI venv's own stack (torch, torch-xla, transformers, numpy, protobuf and what they pull
in): `python -m trnrecipes.ops.wheels --relock` re-resolves every lock against the package registry (maintainers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from trnrecipes import REPO_ROOT
from trnrecipes.config.sections import RecipeError
from trnrecipes.jobs.wheelhouse import RECORD, lock_digest, lock_header, lock_path, wheels_dir

STACK_PINS = REPO_ROOT / "tests" / "constraints"  # each DLAMI venv's published pins (test_install.py holds them)
# glibc of the DLAMIs' Ubuntu: 22.04 has 2.35, 24.04 2.39.
PLATFORM = {"3.10": "manylinux_2_35_x86_64", "3.12": "manylinux_2_39_x86_64"}


def platform_flags(top: str) -> list[str]:
    """pip's --platform for a manylinux_2_N_x86_64 host: that tag and every older one (pip takes only those given)."""
    glibc = int(re.fullmatch(r"manylinux_2_(\d+)_x86_64", top)[1])
    tags = [f"manylinux_2_{n}_x86_64" for n in range(glibc, 16, -1)]
    tags += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    return [flag for tag in tags for flag in ("--platform", tag)]


def download(lock: Path, out: Path, sdk: str | None = None) -> Path:
    """Fill `out` with the wheels `lock` pins, for the Python and platform its header names (needs the package
    registry), and record what it was made from. Returns `out`."""
    if not lock.is_file():
        known = ", ".join(sorted(p.stem.removeprefix("neuron-") for p in lock.parent.glob("neuron-*.txt")))
        raise RecipeError(f"no wheel lock {lock}" + (f" for Neuron SDK {sdk}; locked: {known}" if sdk else ""))
    python, platform = lock_header(lock, "python"), lock_header(lock, "platform")
    if not python or not platform:
        raise RecipeError(f"{lock} names no '# python:' and '# platform:' lines")
    if out.exists() and any(out.iterdir()) and not (out / RECORD).is_file():
        raise RecipeError(f"{out} holds files this command did not make; give --out a new or empty directory")
    if os.path.ismount(out):  # the new wheelhouse replaces it by a rename, which a mount point refuses (EBUSY)
        raise RecipeError(f"{out} is a mount point; give --out a directory on it (e.g. {out / 'neuron-wheels'})")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        # Into a new directory, which then replaces the old one whole: no wheel of another lock stays behind, and
        # the nodes never see a half-filled wheelhouse.
        fresh = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    except OSError as err:
        raise RecipeError(
            f"--out {out}: cannot write beside it ({err.strerror or err}); give a writable --out"
        ) from None
    try:
        argv = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
                "--python-version", python, *platform_flags(platform), "-r", str(lock), "-d", str(fresh)]  # fmt: skip
        done = subprocess.run(argv, capture_output=True, text=True)
        if done.returncode != 0:
            said = (done.stderr.strip().splitlines() or ["nothing"])[-1]
            raise SystemExit(f"error: pip download of {lock} (Python {python}, {platform}) failed: {said}")
        record = {"sdk": sdk, "python": python, "platform": platform, "lock": str(lock),
                  "lock_sha256": lock_digest(lock)}  # fmt: skip
        (fresh / RECORD).write_text(json.dumps(record, indent=1) + "\n")
        fresh.chmod(0o755)
        old = out.with_name(f".{out.name}.old-{os.getpid()}")
        if out.exists():
            out.rename(old)
        fresh.rename(out)
        shutil.rmtree(old, ignore_errors=True)  # the wheelhouse this command made before (its record says so)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
    return out


def _resolve(python: str, platform: str, pins: Path, requirements: list[str]) -> dict[str, str]:
    """name -> version pip chooses for `requirements` with the stack's pins, for that Python (metadata only)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        argv = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet", "--report",
                str(report), "--python-version", python, *platform_flags(platform), "--only-binary=:all:", "-c",
                str(pins), *requirements]  # fmt: skip
        subprocess.run(argv, check=True, capture_output=True, text=True)
        chosen = json.loads(report.read_text())["install"]
    return {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in chosen}


def relock(sdk: str) -> Path:
    """Write requirements/wheels/neuron-<sdk>.txt: what the neuron extra and PyYAML add to the stack's closure."""
    pins = STACK_PINS / f"neuron-{sdk}.txt"
    python = lock_header(pins, "python")
    platform = PLATFORM[python]
    stack = [line.split("==")[0] for line in pins.read_text().splitlines() if line and not line.startswith("#")]
    ours = [line for line in (REPO_ROOT / "requirements/neuron.txt").read_text().splitlines() if line[:1].isalpha()]
    everything = _resolve(python, platform, pins, [*ours, "pyyaml>=6", *stack])
    dlami = _resolve(python, platform, pins, stack)
    extra = sorted((name, version) for name, version in everything.items() if name not in dlami)
    lines = [f"# python: {python}", f"# platform: {platform}",
             f"# What trnrecipes needs beyond Neuron SDK {sdk}'s DLAMI venv ({pins.relative_to(REPO_ROOT)}): its",
             "# `neuron` extra and PyYAML, resolved with the stack's pins. `python -m trnrecipes.ops.wheels --relock`.",
             *(f"{name}=={version}" for name, version in extra)]  # fmt: skip
    lock = lock_path(sdk, REPO_ROOT)
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.write_text("\n".join(lines) + "\n")
    return lock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="trnrecipes wheels", description=__doc__.split("\n\n")[0])
    parser.add_argument("--sdk", help="the recipe's cluster.neuron_sdk (e.g. 2.26): its lock, requirements/wheels/")
    parser.add_argument("--lock", help="another lock file (a '# python:' and a '# platform:' line, then pins)")
    parser.add_argument("--out", help="default: wheels/neuron-<sdk> in the checkout")
    parser.add_argument("--relock", action="store_true", help="maintainers: re-resolve every lock")
    args = parser.parse_args(argv)
    if args.relock:
        for pins in sorted(STACK_PINS.glob("neuron-*.txt")):
            print(f"wrote {relock(pins.stem.removeprefix('neuron-'))}")
        return 0
    if not (args.sdk or (args.lock and args.out)):
        parser.error("give --sdk, or --lock with --out")
    lock = Path(args.lock) if args.lock else lock_path(args.sdk, REPO_ROOT)
    try:
        out = download(lock, Path(args.out) if args.out else wheels_dir(args.sdk, REPO_ROOT), args.sdk)
    except RecipeError as err:  # what the command was given: exit 2 (a failed download stays 1: a retry may pass)
        print(f"error: {err}", file=sys.stderr)
        return 2
    count = len(list(out.glob("*.whl")))
    print(f"wrote {count} wheels to {out}: every job's nodes install from it what their Python lacks, offline")
    return 0


if __name__ == "__main__":
    sys.exit(main())
