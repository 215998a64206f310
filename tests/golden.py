"""Golden job dirs: every recipe x a few node counts, rendered with fixed paths and compared with tests/golden/.

Regenerate after an intended template or recipe change, then review the diff:  make golden
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.k8s import render_k8s
from trnrecipes.jobs.render import render_job, sbatch_command

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
FAKE_REPO = Path("/opt/trnrecipes")  # stands in for the checkout so the files do not depend on where it lives
# Variants: a recipe rendered with overrides, in a dir named <recipe>-<nodes>n-<variant>.
VARIANTS: dict[str, str] = {"trn3": "cluster.instance=trn3.48xlarge"}
CASES: list[tuple[str, int, str]] = [
    ("neox20b", 1, ""), ("neox20b", 4, ""), ("neox20b", 16, ""),
    ("pythia6.9b", 1, ""), ("pythia6.9b", 4, ""),
    ("llama2-7b", 1, ""), ("llama2-7b", 16, ""),
    ("llama2-70b", 8, ""),
    ("llama2-7b-trn2", 1, ""), ("llama2-7b-trn2", 16, ""), ("llama2-7b-trn2", 4, "trn3"),
    ("llama2-70b-trn2", 8, ""), ("llama2-70b-trn2", 8, "trn3"),
    ("llama2-smoke-trn2", 1, ""), ("llama2-smoke-trn1", 1, ""),
    ("neox-tiny", 1, ""), ("neox-tiny", 2, ""),
    ("pythia-tiny", 1, ""), ("pythia-tiny", 2, ""),
    ("llama2-tiny", 1, ""), ("llama2-tiny", 2, ""),
    ("bert-base-cls", 1, ""), ("m5-encoder-mlp", 1, ""), ("m5-encoder-mlp", 2, ""),
    ("llama3.1-8b", 32, ""), ("llama3.1-70b", 32, ""), ("llama3.1-8b-trn2", 4, ""), ("llama3.1-70b-trn2", 8, ""),
    ("llama3.1-tiny", 1, ""),
    ("qwen3-tiny", 1, ""), ("qwen3-8b-trn2", 1, ""), ("qwen3-8b-trn2", 4, "trn3"), ("qwen3-moe-tiny", 1, ""),
    ("qwen3-30b-a3b-trn2", 16, ""),
    ("llama3.1-8b-128k-trn2", 16, ""), ("llama3.1-70b-128k-trn2", 16, ""), ("qwen3-8b-32k-trn2", 4, ""),
]  # fmt: skip


# `trnrecipes k8s` cases: <case dir>/k8s/ beside the sbatch scripts (the checkout stands in for the FSx mount).
K8S_OVERRIDES = f"k8s.pvc=fsx-claim k8s.mount={FAKE_REPO}"
# TorchNeuron (SDK 2.33) has no AWS container to default to: a stand-in image name.
K8S_CASES: list[tuple[str, int, str]] = [
    ("llama2-7b", 16, ""), ("llama3.1-8b", 32, ""),
    ("llama2-7b-trn2", 16, "k8s.image=registry.example.com/trnrecipes/torchneuron:2.33"),
]  # fmt: skip


def render_k8s_case(name: str, nodes: int, extra: str = "") -> dict[str, str]:
    overrides = f"{K8S_OVERRIDES} {extra}".strip()
    recipe = load_recipe(name, nodes=nodes, overrides=overrides)
    job_dir = FAKE_REPO / "jobs" / case_dir(name, nodes)
    return render_k8s(recipe, job_dir, sbatch_command(name, nodes, overrides, verb="k8s"), FAKE_REPO).files


def case_dir(name: str, nodes: int, variant: str = "") -> str:
    return f"{name}-{nodes}n" + (f"-{variant}" if variant else "")


def render_case(name: str, nodes: int, variant: str = "") -> dict[str, str]:
    overrides = VARIANTS[variant] if variant else ""
    recipe = load_recipe(name, nodes=nodes, overrides=overrides)
    job_dir = FAKE_REPO / "jobs" / case_dir(name, nodes, variant)
    return render_job(recipe, job_dir, sbatch_command(name, nodes, overrides), FAKE_REPO).files


def launch_lines(script: str) -> list[str]:
    """The torchrun command and the training command of a script, as written (compile and run must agree)."""
    return [line for line in script.splitlines() if line.startswith(("TORCHRUN=(", "  --rdzv", "TRAIN=("))]


def regenerate() -> None:
    for case in CASES:
        out = GOLDEN_DIR / case_dir(*case)
        out.mkdir(parents=True, exist_ok=True)
        for file_name, text in render_case(*case).items():
            (out / file_name).write_text(text)
    for name, nodes, extra in K8S_CASES:
        out = GOLDEN_DIR / case_dir(name, nodes) / "k8s"
        out.mkdir(parents=True, exist_ok=True)
        for file_name, text in render_k8s_case(name, nodes, extra).items():
            (out / file_name).write_text(text)
    stale = {p.name for p in GOLDEN_DIR.iterdir() if p.is_dir()} - {case_dir(*c) for c in CASES}
    for name in sorted(stale):
        print(f"stale golden dir (delete it): {GOLDEN_DIR / name}")
    print(f"wrote {len(CASES)} golden job dirs under {GOLDEN_DIR}")


if __name__ == "__main__":
    if sys.argv[1:] != ["--regenerate"]:
        sys.exit("usage: python tests/golden.py --regenerate")
    regenerate()
