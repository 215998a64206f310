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
                spec = {
                    "include": str(shipped / "mmlu/default/_default_template_yaml"),
                    "task": f"trn_mmlu_{subject}",
                    "tag": "trn_mmlu_subjects",
                    "dataset_path": "json",
                    "dataset_name": None,
                    "dataset_kwargs": {
                        "data_files": {
                            "test": str(_need(data, "mmlu", subject, "test.jsonl")),
                            "dev": str(_need(data, "mmlu", subject, "dev.jsonl")),
                        }
                    },
                    "num_fewshot": 5,
                    "description": f"The following are multiple choice questions (with answers) about"
                    f" {subject.replace('_', ' ')}.\n\n",
                }
                (out / f"trn_mmlu_{subject}.yaml").write_text(json.dumps(spec, indent=1))
            group = {
                "group": "trn_mmlu",
                "task": ["trn_mmlu_subjects"],
                "aggregate_metric_list": [{"metric": "acc", "weight_by_size": True}],
                "metadata": {"version": 2},
            }
            (out / "trn_mmlu.yaml").write_text(json.dumps(group, indent=1))
        elif task == "bbh":
            from eval.bbh import FORMAT, SUBTASKS, data_format

            built = data_format(_need(data, "bbh", "done").parent)
            if built != FORMAT:
                raise TaskDataError(
                    f"eval data {data / 'bbh'} is BBH data format {built}, this trnrecipes reads format {FORMAT}:"
                    f" `trnrecipes eval prepare-data --out {data}` rebuilds it"
                )
            for subtask in SUBTASKS:
                spec = {
                    "include": str(shipped / "bbh/cot_fewshot" / f"{subtask}.yaml"),
                    "task": f"trn_bbh_cot_{subtask}",
                    "tag": "trn_bbh_cot_subtasks",
                    "dataset_path": "json",
                    "dataset_name": None,
                    "dataset_kwargs": {"data_files": {"test": str(_need(data, "bbh", f"{subtask}.jsonl"))}},
                }
                (out / f"trn_bbh_cot_{subtask}.yaml").write_text(json.dumps(spec, indent=1))
            group = {
                "group": "trn_bbh_cot",
                "task": ["trn_bbh_cot_subtasks"],
                "aggregate_metric_list": [
                    {"metric": "exact_match", "weight_by_size": True, "filter_list": "get-answer"}
                ],
                "metadata": {"version": 1},
            }
            (out / "trn_bbh_cot.yaml").write_text(json.dumps(group, indent=1))
        elif task == "gsm8k":
            spec = {
                "include": str(shipped / "gsm8k/gsm8k-cot.yaml"),
                "task": "trn_gsm8k_cot",
                "dataset_path": "json",
                "dataset_name": None,
                "dataset_kwargs": {"data_files": {"test": str(_need(data, "gsm8k", "test.jsonl"))}},
            }
            (out / "trn_gsm8k_cot.yaml").write_text(json.dumps(spec, indent=1))
    return names
