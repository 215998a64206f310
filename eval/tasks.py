"""Local lm-eval tasks: lm-eval's own shipped prompt configs (`include:`), pointed at our offline data files.

They are written into a directory at run time because `include:` needs the path of the installed lm_eval package.
Tasks: `trn_mmlu` (57 subjects, 5-shot, accuracy weighted by subject size, as lm-eval's `mmlu`), `trn_bbh_cot`
(27 subtasks, 3-shot chain of thought, exact match of "the answer is X" weighted by subtask size, as lm-eval's
`bbh_cot_fewshot`; data from eval/bbh.py) and `trn_gsm8k_cot` (8-shot chain of thought, exact match): the prompts of
seed 002's table.
"""

from __future__ import annotations

import json
from pathlib import Path

TASKS = {"mmlu": "trn_mmlu", "bbh": "trn_bbh_cot", "gsm8k": "trn_gsm8k_cot"}
SHOTS = {"trn_mmlu": 5, "trn_bbh_cot": 3, "trn_gsm8k_cot": 8}


class TaskDataError(FileNotFoundError):
    pass


def _shipped() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _need(data: Path, *parts: str) -> Path:
    path = data.joinpath(*parts)
    if not path.exists():
        raise TaskDataError(f"eval data {path} is missing; `trnrecipes eval prepare-data --out {data}` builds it")
    return path


def _local_task(out: Path, name: str, include: Path, data_files: dict[str, Path], **extra) -> None:
    """One task: a shipped lm-eval config (`include:`) with its data pointed at local JSON files."""
    spec = {
        "include": str(include),
        "task": name,
        "dataset_path": "json",
        "dataset_name": None,
        "dataset_kwargs": {"data_files": {split: str(path) for split, path in data_files.items()}},
        **extra,
    }
    (out / f"{name}.yaml").write_text(json.dumps(spec, indent=1))


def _group(out: Path, name: str, tag: str, aggregate: dict, version: int) -> None:
    """A group over every task tagged `tag`, its metric averaged weighted by each task's size."""
    spec = {
        "group": name,
        "task": [tag],
        "aggregate_metric_list": [aggregate | {"weight_by_size": True}],
        "metadata": {"version": version},
    }
    (out / f"{name}.yaml").write_text(json.dumps(spec, indent=1))


def write_task_dir(out: Path, data: Path, tasks: list[str]) -> list[str]:
    """Write the YAMLs of `tasks` (keys of TASKS) into `out`; returns the lm-eval task names."""
    shipped = _shipped()
    data = Path(data).resolve()  # the task files are read from other directories too (lm-eval's own CLI)
    out.mkdir(parents=True, exist_ok=True)
    names = []
    for task in tasks:
        if task not in TASKS:
            raise ValueError(f"unknown eval task {task!r}; valid: {', '.join(TASKS)}, humaneval")
        names.append(TASKS[task])
        if task == "mmlu":
            subjects = sorted(p.name for p in _need(data, "mmlu").iterdir() if p.is_dir())
            for subject in subjects:
                _local_task(
                    out,
                    f"trn_mmlu_{subject}",
                    shipped / "mmlu/default/_default_template_yaml",
                    {split: _need(data, "mmlu", subject, f"{split}.jsonl") for split in ("test", "dev")},
                    tag="trn_mmlu_subjects",
                    num_fewshot=5,
                    description=f"The following are multiple choice questions (with answers) about"
                    f" {subject.replace('_', ' ')}.\n\n",
                )
            _group(out, "trn_mmlu", "trn_mmlu_subjects", {"metric": "acc"}, version=2)
        elif task == "bbh":
            from eval.bbh import FORMAT, SUBTASKS, data_format

            built = data_format(_need(data, "bbh", "done").parent)
            if built != FORMAT:
                raise TaskDataError(
                    f"eval data {data / 'bbh'} is BBH data format {built}, this trnrecipes reads format {FORMAT}:"
                    f" `trnrecipes eval prepare-data --out {data}` rebuilds it"
                )
            for subtask in SUBTASKS:
                _local_task(
                    out,
                    f"trn_bbh_cot_{subtask}",
                    shipped / "bbh/cot_fewshot" / f"{subtask}.yaml",
                    {"test": _need(data, "bbh", f"{subtask}.jsonl")},
                    tag="trn_bbh_cot_subtasks",
                )
            aggregate = {"metric": "exact_match", "filter_list": "get-answer"}
            _group(out, "trn_bbh_cot", "trn_bbh_cot_subtasks", aggregate, version=1)
        elif task == "gsm8k":
            _local_task(
                out, "trn_gsm8k_cot", shipped / "gsm8k/gsm8k-cot.yaml", {"test": _need(data, "gsm8k", "test.jsonl")}
            )
    return names
