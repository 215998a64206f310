"""A stand-in for a Neuron SDK virtualenv and node, for the pre-flight tests (trnrecipes/ops/doctor.py): a `python`
that is this interpreter with stand-in distributions first on its path (torch, torch-xla, torch-neuronx, neuronx-cc,
neuronx-distributed at the versions a Neuron SDK release ships, importable, each with its dist-info), a
`neuron_parallel_compile` beside it, and a `neuron-ls` that prints AWS's JSON for N devices."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

from trnrecipes.config.stacks import SDK_RELEASES, sdk_version

IMPORT_NAME = {"torch": "torch", "torch-xla": "torch_xla", "torch-neuronx": "torch_neuronx",
               "neuronx-cc": "neuronxcc", "neuronx-distributed": "neuronx_distributed"}  # fmt: skip


def release_versions(sdk: str) -> dict[str, str]:
    """A version of each stack package that the release allows: its first prefix, completed."""
    return {dist: prefixes[0] + "0" for dist, prefixes in SDK_RELEASES[sdk_version(sdk)].packages.items()}


def standin_venv(root: Path, sdk: str, versions: dict[str, str | None] | None = None, compile_tool=True) -> Path:
    """root/bin/python: this interpreter, with stand-ins of the stack's packages shadowing the real ones. `versions`
    changes a package's version, or leaves it out (None). Returns the python's path."""
    chosen = {**release_versions(sdk), **(versions or {})}
    site, bin_dir = root / "site", root / "bin"
    site.mkdir(parents=True)
    bin_dir.mkdir()
    for dist, version in chosen.items():
        if version is None:
            continue
        module = site / IMPORT_NAME[dist]
        module.mkdir()
        (module / "__init__.py").write_text(f"__version__ = {version!r}  # a stand-in\n")
        info = site / f"{dist.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    python = bin_dir / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={site}${{PYTHONPATH:+:$PYTHONPATH}} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    if compile_tool:
        tool = bin_dir / "neuron_parallel_compile"
        tool.write_text('#!/bin/sh\necho "neuron_parallel_compile (stand-in): $*"\n')
        tool.chmod(0o755)
    return python


def neuron_ls(bin_dir: Path, devices: int, cores_per_device: int) -> Path:
    """A neuron-ls on PATH that prints AWS's --json-output: one object per device with its nc_count."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    listing = [{"neuron_device": i, "bdf": f"{i:02x}:1e.0", "nc_count": cores_per_device, "memory_size": 32 << 30}
               for i in range(devices)]  # fmt: skip
    tool = bin_dir / "neuron-ls"
    tool.write_text(f"#!/bin/sh\ncat <<'EOF'\n{json.dumps(listing)}\nEOF\n")
    tool.chmod(0o755)
    return tool


def env_with(bin_dir: Path, **extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **extra}


def megatron_corpus(prefix: Path, documents: int = 200) -> Path:
    """A small real Megatron .bin/.idx (megatron-core's builder): enough documents for the DP ranks of a few trn1
    nodes, ids well inside every recipe's vocabulary. Returns the prefix."""
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    prefix.parent.mkdir(parents=True, exist_ok=True)
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for i in range(documents):
        doc = np.array([1 + i % 97, 2, 3, 0], dtype=np.uint16)
        builder.add_document(doc, [len(doc)])
    builder.finalize(f"{prefix}.idx")
    return prefix
