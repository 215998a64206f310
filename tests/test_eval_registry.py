"""The eval task registry (eval/registry.py) is the one place tasks are defined: `--tasks`, the CLI help, the
Makefile's data list, the task table in docs/evaluation.md and the group averages all follow it. And the local lm-eval
configs (eval/tasks.py) read no training split: few-shot examples come from the evaluated split, the question
excluded."""

from __future__ import annotations

import math
import subprocess

import pytest
from conftest import REPO, run_cli

from eval.registry import DEFAULT, GROUPS, SEED_ROWS, TASKS, data_files, readme_table, resolve

DATA = REPO / "data/eval"


def test_groups_and_single_tasks_resolve_in_registry_order_each_once():
    reasoning = ["piqa", "social_iqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge", "openbookqa"]
    assert resolve("common_reasoning") == reasoning
    assert resolve("boolq, common_reasoning,piqa") == [*reasoning, "boolq"]
    assert resolve("world_knowledge") == ["nq_open", "triviaqa"] and resolve(["math"]) == ["gsm8k"]
    assert resolve(",".join(DEFAULT)) == list(TASKS)
    assert set(SEED_ROWS) <= set(GROUPS) and len(SEED_ROWS) == 7


@pytest.mark.parametrize(("tasks", "message"), [("piqa,nope", "unknown eval task or group 'nope'"), (" , ", "empty")])
def test_an_unknown_or_empty_task_list_is_refused_listing_what_is_valid(tasks, message):
    with pytest.raises(ValueError, match=message) as err:
        resolve(tasks)
    assert "groups mmlu, bbh, common_reasoning (piqa+social_iqa+" in str(err.value) and "tasks piqa," in str(err.value)


def test_every_task_is_whole():
    for task in TASKS.values():
        assert task.group in GROUPS and task.name in GROUPS[task.group].tasks
        assert (task.config is None) == (task.lm_eval_name is None) == (task.name == "humaneval")
        assert task.executes_code == (task.name == "humaneval")
        assert (DATA / task.data_file).exists(), f"{task.name}: make setup prepares {task.data_file}"
        assert all(metric.split(",")[0] in task.metric_names for metric in task.metrics)
    for group in GROUPS.values():
        assert group.tasks and all(any(m in TASKS[t].metric_names for t in group.tasks) for m in group.metrics), (
            group.name
        )


def test_the_makefile_reads_its_data_list_from_the_registry_with_the_bare_system_python(tmp_path):
    for cwd, args in ((REPO, []), (tmp_path, ["-f", str(REPO / "Makefile")])):  # also from another directory
        done = subprocess.run(["make", *args, "-pn", "data"], cwd=cwd, capture_output=True, text=True, timeout=60)
        (line,) = [x for x in done.stdout.splitlines() if x.startswith("EVAL_DATA := ")]
        assert line.split(" := ")[1].split() == data_files("data/eval")
    # the registry needs nothing beyond the standard library (-S: no site-packages; -E: no PYTHONPATH)
    done = subprocess.run(["python3", "-S", "-E", "-m", "eval.registry", "data-files", "d"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0 and done.stdout.split() == data_files("d"), done.stderr


def test_the_readme_table_is_the_registrys():
    assert readme_table() in (REPO / "docs/evaluation.md").read_text(), (
        "docs/evaluation.md: paste `python3 -m eval.registry readme-table`"
    )


def test_the_cli_help_and_default_name_every_task():
    done = run_cli("eval", "run", "--help")
    assert done.returncode == 0
    text = " ".join(done.stdout.split())
    for name in [*TASKS, *GROUPS]:
        assert name in text, name
    done = run_cli("eval", "run", "--ckpt", str(REPO), "--tasks", "piqa,nope")
    assert done.returncode == 2 and "unknown eval task or group 'nope'; valid: groups" in done.stderr


def test_missing_data_is_named_before_anything_is_exported_or_run(tmp_path):
    (tmp_path / "data/piqa").mkdir(parents=True)
    (tmp_path / "data/piqa/validation.jsonl").write_text("")
    done = run_cli(
        "eval", "run", "--ckpt", str(tmp_path), "--tasks", "piqa,boolq", "--data-dir", str(tmp_path / "data")
    )
    assert done.returncode == 2, done.stderr
    assert (
        f"eval data missing: {tmp_path}/data/boolq/validation.jsonl; `trnrecipes eval prepare-data --out" in done.stderr
    )
    assert list(tmp_path.iterdir()) == [tmp_path / "data"]  # nothing exported, nothing written


# -- group averages ------------------------------------------------------------------------------------------------


def row(task: str, metric: str, value: float, stderr: float | None = 0.1) -> dict:
    return {
        "task": task,
        "kind": "task",
        "shots": TASKS[task].shots,
        "metric": metric,
        "value": value,
        "stderr": stderr,
    }


def test_a_group_average_is_the_plain_mean_and_a_task_without_acc_norm_gives_its_accuracy():
    from eval.run import group_rows

    rows = [row("boolq", "acc", 0.7)]
    for i, name in enumerate(GROUPS["common_reasoning"].tasks):
        rows.append(row(name, "acc", 0.1 * (i + 1)))
        if "acc_norm" in TASKS[name].metric_names:
            rows.append(row(name, "acc_norm", 0.9))
    averages = {r["metric"]: r for r in group_rows(rows)}
    assert set(averages) == {"acc", "acc_norm"}  # boolq's group has one task: its row is the group's
    assert averages["acc"]["value"] == pytest.approx(sum(0.1 * i for i in range(1, 8)) / 7)
    # social_iqa (0.2) and winogrande (0.4) have accuracy only
    assert averages["acc_norm"]["value"] == pytest.approx((5 * 0.9 + 0.2 + 0.4) / 7)
    assert averages["acc"]["stderr"] == pytest.approx(math.sqrt(7 * 0.01) / 7)
    assert averages["acc"]["shots"] == 0 and averages["acc"]["of"] == list(GROUPS["common_reasoning"].tasks)


def test_a_group_partly_evaluated_gets_no_average():
    from eval.run import group_rows, table

    rows = [row("nq_open", "exact_match", 0.3), row("piqa", "acc", 0.6, None), row("piqa", "acc_norm", 0.5, None)]
    assert group_rows(rows) == []
    text = table(rows)
    assert "| · piqa | 0 | acc | 0.6000 |  |" in text and "average" not in text
    assert "- nq_open, triviaqa, commonsense_qa: few-shot examples from the evaluated split" in text


# -- the local lm-eval configs -------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lm_eval_tasks(tmp_path_factory):
    from lm_eval.tasks import TaskManager, get_task_dict

    from eval.registry import write_task_dir

    out = tmp_path_factory.mktemp("tasks")
    names = [t for t in TASKS if TASKS[t].lm_eval_name and t not in ("mmlu", "bbh", "gsm8k")]
    written = write_task_dir(out, DATA, names)
    manager = TaskManager(include_path=str(out), include_defaults=False)
    loaded = {task.config.task: task for task in get_task_dict(written, manager).values()}
    return {name: loaded[TASKS[name].lm_eval_name] for name in names}


@pytest.mark.parametrize(("name", "shots", "question"), [("nq_open", 5, "question"), ("triviaqa", 5, "question"),
                                                         ("commonsense_qa", 7, "question")])  # fmt: skip
def test_few_shot_examples_come_from_the_evaluated_split_never_the_question_asked(lm_eval_tasks, name, shots, question):
    task = lm_eval_tasks[name]
    docs = list(task.eval_docs)
    assert task.config.training_split is None and task.config.num_fewshot == shots and len(docs) > 1000
    assert task.fewshot_cfg.split == task.config.test_split == "validation"  # lm-eval's condition for leaving it out
    for doc in docs[:20]:
        context = task.fewshot_context(doc, shots)
        asked = doc[question].strip()
        assert context.count(asked) == 1 and context.rstrip().endswith(task.doc_to_text(doc).rstrip()), context
        examples = [d for d in docs if d is not doc and d[question].strip() in context]
        assert len(examples) >= shots, (name, len(examples))


def test_zero_shot_tasks_read_only_the_split_they_score(lm_eval_tasks):
    for name, task in lm_eval_tasks.items():
        cfg = task.config
        assert cfg.training_split is None, name
        scored = cfg.test_split or cfg.validation_split
        assert list(task.dataset) == [scored], (name, list(task.dataset))
        assert len(task.eval_docs) == sum(1 for _ in (DATA / TASKS[name].data_file).open()), name


def test_results_written_before_humaneval_say_they_are_incomplete(tmp_path):
    import json

    from eval.run import write_results

    rows = [row("boolq", "acc", 0.7)]
    write_results(tmp_path, {"incomplete": "HumanEval was running or failed: its rows are missing"}, rows, None, None)
    assert json.loads((tmp_path / "results.json").read_text())["incomplete"].startswith("HumanEval was running")
    assert (
        (tmp_path / "results.md")
        .read_text()
        .endswith("**incomplete:** HumanEval was running or failed: its rows are missing\n")
    )
    write_results(tmp_path, {}, rows, None, None)  # the finished run's write replaces it
    assert "incomplete" not in (tmp_path / "results.md").read_text() + (tmp_path / "results.json").read_text()
