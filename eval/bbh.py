"""BBH (BIG-Bench Hard, 27 subtasks) built offline from the `bigbench` 1.0.0 sdist on PyPI.

The exact 250-item BBH subsets ship in no registry package. The bigbench sdist (358 MB, Apache-2.0) holds the source
task.json of 24 of the 27 subtasks (supersets of BBH's items); we convert each item to BBH's prompt form ("Options:\n
(A) ...", target "(A)" / "Yes" / a word list) and draw a seeded sample of 250. The other three (boolean_expressions,
multistep_arithmetic_two, web_of_lies) are programmatic in bigbench (a task.py), so we generate 250 items each in BBH's
form with a seeded generator and compute the answers exactly. So these are BBH-format items, NOT the published BBH
subsets: numbers are comparable across our checkpoints, and near (not equal to) published BBH numbers.

Items whose text equals one of lm-eval's 3-shot exemplars are dropped, so no exemplar is also a test item.
Output: <out>/bbh/<subtask>.jsonl with {"input", "target"} (the SaylorTwift/bbh schema lm-eval's bbh tasks read).
"""

from __future__ import annotations

import hashlib
import json
import random
import re
import tarfile
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from eval.data import EvalDataError, write_atomic

SDIST = "bigbench-1.0.0.tar.gz"
SDIST_URL = (
    "https://files.pythonhosted.org/packages/95/f8/c019b3579df548a04cac12342cfcb878e50ddf6cfcd7fddba8cfc721c157/"
    + SDIST
)
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
TASKS_IN_SDIST = "bigbench-1.0.0/bigbench/benchmark_tasks/"
ITEMS = 250  # BBH's subset size (three subtasks have fewer source items and keep them all)
SEED = 1234
FORMAT = 2  # written into bbh/done; data of another format is rebuilt by prepare-data and refused by eval run

YES_NO = "Options:\n- Yes\n- No"


class BBHDataError(EvalDataError):
    pass


# -- prompt pieces in BBH's form ------------------------------------------------------------------------------------


def _choices(example: dict, drop_digits: bool = False) -> tuple[list[str], str]:
    """The options and the correct one. Where bigbench marks several options correct (circle and ellipse; "3" and
    "three"), the extra correct ones are dropped so exactly one option is right, as in BBH."""
    scores = {k: v for k, v in example["target_scores"].items() if not (drop_digits and k.strip().isdigit())}
    best = max(scores.values())
    correct = example.get("target") if isinstance(example.get("target"), str) else None
    correct = correct if correct in scores else next(k for k, v in scores.items() if v == best)
    return [k for k, v in scores.items() if k == correct or v != best], correct


def _lettered(options: list[str], correct: str, strip: str = "") -> tuple[str, str] | None:
    """("Options:\n(A) ...", "(B)"); None when two options read the same (a defect of a few bigbench items), which
    makes the item unanswerable."""
    texts = [o.strip().rstrip(strip) for o in options]
    if len(set(texts)) < len(texts):
        return None
    lines = [f"({chr(65 + i)}) {text}" for i, text in enumerate(texts)]
    return "Options:\n" + "\n".join(lines), f"({chr(65 + options.index(correct))})"


def _multiple_choice(
    question: Callable[[dict, dict], str], shuffle: bool = False, strip: str = "", drop_digits: bool = False
) -> Callable[[dict, dict, random.Random], dict]:
    def convert(task: dict, example: dict, rng: random.Random) -> dict | None:
        options, correct = _choices(example, drop_digits)
        if shuffle:  # bigbench lists the right answer first in these tasks; BBH shuffled them
            rng.shuffle(options)
        lettered = _lettered(options, correct, strip)
        if lettered is None:
            return None
        return {"input": question(task, example) + "\n" + lettered[0], "target": lettered[1]}

    return convert


def _binary(question: Callable[[dict, dict], str], options: str, answers: dict[str, str]):
    def convert(task: dict, example: dict, rng: random.Random) -> dict:
        _, correct = _choices(example)
        suffix = "\n" + options if options else ""
        return {"input": question(task, example) + suffix, "target": answers.get(correct, correct)}

    return convert


def _prefix_one_line(task: dict) -> str:
    return task["task_prefix"].replace("\n", " ")


def _one_blank(text: str) -> str:
    """Blank lines collapsed: in lm-eval's prompts "\n\n" separates the few-shot examples."""
    return re.sub(r"\s*\n\s*\n", "\n", text).strip()


def _pair(pattern: str, example: dict) -> list[str]:
    match = re.search(pattern, example["input"], re.S)
    if not match:
        raise ValueError(f"unexpected bigbench item {example['input'][:80]!r}")
    return [m.strip().rstrip(".") for m in match.groups()]


def _two_way(question: str, pattern: str):
    """hyperbaton and snarks carry their two options inside the input as a/b; BBH lists them as (A)/(B)."""

    def convert(task: dict, example: dict, rng: random.Random) -> dict | None:
        first, second = _pair(pattern, example)
        _, correct = _choices(example)
        lettered = _lettered([first, second], first if correct.strip("() ") == "a" else second)
        if lettered is None:
            return None
        return {"input": f"{question}\n{lettered[0]}", "target": lettered[1]}

    return convert


def _free(question: Callable[[dict, dict], str], target: Callable[[dict], str]):
    return lambda task, example, rng: {"input": question(task, example), "target": target(example)}


def _only_correct(example: dict) -> str:
    return _choices(example)[1]


CONVERT: dict[str, tuple[str, Callable]] = {
    "causal_judgement": (
        "causal_judgment",
        _binary(lambda t, e: t["task_prefix"].strip() + "\n" + e["input"].strip(), YES_NO, {}),
    ),
    "date_understanding": ("date_understanding", _multiple_choice(lambda t, e: e["input"].strip(), shuffle=True)),
    "disambiguation_qa": (
        "disambiguation_qa",
        _multiple_choice(lambda t, e: t["task_prefix"].strip() + "\nSentence: " + e["input"].strip()),
    ),
    "dyck_languages": (
        "dyck_languages",
        _free(
            lambda t, e: (
                "Complete the rest of the sequence, making sure that the parentheses are closed properly."
                " Input: " + e["input"].strip()
            ),
            _only_correct,
        ),
    ),
    "formal_fallacies": (
        "formal_fallacies_syllogisms_negation",
        _binary(lambda t, e: e["input"].replace("\n Is", "\nIs").strip(), "Options:\n- valid\n- invalid", {}),
    ),
    "geometric_shapes": ("geometric_shapes", _multiple_choice(lambda t, e: e["input"].strip())),
    "hyperbaton": (
        "hyperbaton",
        _two_way("Which sentence has the correct adjective order:", r'a " (.*) " b " (.*) " \?'),
    ),
    "movie_recommendation": (
        "movie_recommendation",
        _multiple_choice(lambda t, e: "Find a movie similar to " + e["input"].strip()),
    ),
    "navigate": (
        "navigate",
        _binary(
            lambda t, e: t["task_prefix"].strip() + " " + e["input"].strip(), YES_NO, {"True": "Yes", "False": "No"}
        ),
    ),
    "object_counting": (
        "object_counting",
        _free(lambda t, e: e["input"].strip(), lambda e: next(x for x in e["target"] if x.isdigit())),
    ),
    "penguins_in_a_table": (
        "penguins_in_a_table",
        _multiple_choice(lambda t, e: _prefix_one_line(t) + " " + _one_blank(e["input"])),
    ),
    "reasoning_about_colored_objects": (
        "reasoning_about_colored_objects",
        _multiple_choice(lambda t, e: e["input"].strip(), drop_digits=True),
    ),
    "ruin_names": ("ruin_names", _multiple_choice(lambda t, e: e["input"].strip())),
    "salient_translation_error_detection": (
        "salient_translation_error_detection",
        _multiple_choice(lambda t, e: _prefix_one_line(t) + " " + e["input"].strip()),
    ),
    "snarks": ("snarks", _two_way("Which statement is sarcastic?", r"\(a\) (.*) \(b\) (.*)$")),
    "sports_understanding": (
        "sports_understanding",
        _binary(
            lambda t, e: f'Is the following sentence plausible? "{e["input"].strip().rstrip(".")}."',
            "",
            {"plausible": "yes", "implausible": "no"},
        ),
    ),
    "temporal_sequences": (
        "temporal_sequences",
        _multiple_choice(lambda t, e: e["input"].replace("We know that: \n", "We know that:\n").strip(), shuffle=True),
    ),
    "word_sorting": (
        "word_sorting",
        _free(
            lambda t, e: "Sort the following words alphabetically: List: " + e["input"].strip(), lambda e: e["target"]
        ),
    ),
}
for _n in ("three", "five", "seven"):
    CONVERT[f"logical_deduction_{_n}_objects"] = (
        f"logical_deduction/{_n}_objects",
        _multiple_choice(lambda t, e: t["task_prefix"].strip() + " " + e["input"].strip(), strip="."),
    )
    CONVERT[f"tracking_shuffled_objects_{_n}_objects"] = (
        f"tracking_shuffled_objects/{_n}_objects",
        _multiple_choice(lambda t, e: _one_blank(e["input"]), strip="."),
    )


# -- the three programmatic subtasks --------------------------------------------------------------------------------


def _boolean_expression(rng: random.Random) -> dict:
    """BBH form: 'not ( True ) and ( False or True ) is' with five value/operator tokens besides brackets."""

    def expr(budget: int) -> str:
        if budget == 1:
            return rng.choice(("True", "False"))
        if rng.random() < 0.3:
            return "not " + expr(budget - 1)
        if budget >= 3 and rng.random() < 0.8:
            left = rng.randint(1, budget - 2)
            return f"{expr(left)} {rng.choice(('and', 'or'))} {expr(budget - 1 - left)}"
        return f"( {expr(budget)} )" if budget < 5 else "not " + expr(budget - 1)

    text = expr(5) + " is"
    return {"input": text, "target": boolean_answer(text)}


def boolean_answer(text: str) -> str:
    """The value of a BBH boolean expression ('... is'), from its tokens only (True False and or not ( ))."""
    tokens = text.removesuffix(" is").split()
    if not set(tokens) <= {"True", "False", "and", "or", "not", "(", ")"}:
        raise ValueError(f"not a BBH boolean expression: {text!r}")
    return str(eval(" ".join(tokens), {"__builtins__": {}}))  # checked: only those tokens


def _arithmetic(rng: random.Random) -> dict:
    """BBH form: '((-5 + 9 * -4 - 0) * (4 + -7 + 0 * -5)) =': two groups of four one-digit numbers."""

    def group() -> str:
        numbers = [rng.randint(-9, 9) for _ in range(4)]
        ops = [rng.choice("+-*") for _ in range(3)]
        return " ".join(f"{n} {o}" for n, o in zip(numbers, ops, strict=False)) + f" {numbers[-1]}"

    text = f"(({group()}) {rng.choice('+-*')} ({group()})) ="
    return {"input": text, "target": arithmetic_answer(text)}


def arithmetic_answer(text: str) -> str:
    expression = text.removesuffix(" =")
    if not re.fullmatch(r"[-+*() 0-9]+", expression):
        raise ValueError(f"not a BBH arithmetic expression: {text!r}")
    return str(eval(expression, {"__builtins__": {}}))  # checked: integers, + - * ( )


NAMES = (
    "Fidel Jerry Vina Millicent Raymond Crista Lorine Alejandro Millie Leda Amberly Audrie Andree Antwan Michaela "
    "Willian Delfina Maybelle Jaymie Helene Shaunda Ka Bernita Conception Gwenn Alexis Christie Fletcher Kandi "
    "Elanor Sherrie Sima Phoebe Teressa Delbert Inga Shenna Sal Michael Tamika Vernell Kristian Jim Rashida Yoland "
    "Jamey Ryan Dallas Osvaldo Shalonda"
).split()


def _web_of_lies(rng: random.Random) -> dict:
    """BBH form: a truth-teller or liar, then four people each vouching for the previous one."""
    names = rng.sample(NAMES, 5)
    claims = ["tells the truth" if rng.random() < 0.5 else "lies" for _ in names]
    sentences = [f"{names[0]} {claims[0]}."]
    pairs = zip(names[:-1], names[1:], claims[1:], strict=True)
    sentences += [f"{name} says {prev} {claim}." for prev, name, claim in pairs]
    question = f"Question: {' '.join(sentences)} Does {names[-1]} tell the truth?"
    return {"input": question, "target": web_of_lies_answer(question)}


def web_of_lies_answer(question: str) -> str:
    """Each 'lies' flips the truth down the chain, so the last person tells the truth iff the count is even."""
    chain = question.split("Does ")[0]
    return "Yes" if len(re.findall(r"\blies\.", chain)) % 2 == 0 else "No"


GENERATE = {
    "boolean_expressions": _boolean_expression,
    "multistep_arithmetic_two": _arithmetic,
    "web_of_lies": _web_of_lies,
}
SUBTASKS = sorted([*CONVERT, *GENERATE])


# -- building the data ----------------------------------------------------------------------------------------------


def _normal(text: str) -> str:
    return " ".join(text.split())


def _stem(text: str) -> str:
    """The question without its options."""
    return _normal(text.split("\nOptions:")[0])


def _exemplars(subtask: str) -> list[str]:
    """The inputs of lm-eval's shipped 3-shot exemplars for `subtask`."""
    import lm_eval.tasks
    import yaml

    path = Path(lm_eval.tasks.__file__).parent / "bbh/cot_fewshot" / f"{subtask}.yaml"
    spec = yaml.safe_load(path.read_text())
    return [s["input"] for s in spec["fewshot_config"]["samples"]]


def _not_exemplars(items: list[dict], exemplars: list[str]) -> list[dict]:
    """Items that are not one of the 3-shot exemplars: neither the same text nor the same question with its options
    split differently (BBH's movie_recommendation exemplar splits a title in two). A question shared by many items
    ("Which statement is sarcastic?") is a task's fixed stem, not an exemplar's question, and is not matched."""
    texts = {_normal(e) for e in exemplars}
    stems = Counter(_stem(i["input"]) for i in items)
    questions = {_stem(e) for e in exemplars if stems[_stem(e)] <= 3}
    return [i for i in items if _normal(i["input"]) not in texts and _stem(i["input"]) not in questions]


def _download(downloads: Path, log) -> Path:
    sdist = downloads / SDIST
    if sdist.exists():
        return sdist
    downloads.mkdir(parents=True, exist_ok=True)
    log(f"downloading {SDIST} from PyPI (358 MB, once; source of the BBH tasks) ...")
    partial = sdist.with_name(SDIST + ".part")
    digest = hashlib.sha256()
    with urllib.request.urlopen(SDIST_URL, timeout=120) as response, partial.open("wb") as f:
        while chunk := response.read(1 << 20):
            digest.update(chunk)
            f.write(chunk)
    if digest.hexdigest() != SDIST_SHA256:
        partial.unlink()
        raise BBHDataError(f"{SDIST_URL}: sha256 {digest.hexdigest()} is not the pinned {SDIST_SHA256}")
    partial.replace(sdist)
    return sdist


def _source_tasks(sdist: Path, log) -> dict[str, dict]:
    """task.json of every source task we convert, read in one streaming pass over the sdist (no extraction)."""
    wanted = {TASKS_IN_SDIST + source + "/task.json": source for source, _ in CONVERT.values()}
    found: dict[str, dict] = {}
    log(f"reading {len(wanted)} bigbench task.json files from {sdist.name} ...")
    with tarfile.open(sdist, mode="r|gz") as tar:
        for member in tar:
            if member.name in wanted:
                found[wanted[member.name]] = json.load(tar.extractfile(member))
    missing = sorted(set(wanted.values()) - set(found))
    if missing:
        raise BBHDataError(f"{sdist} lacks the bigbench tasks {', '.join(missing)}")
    return found


def build_items(subtask: str, task: dict | None, n: int = ITEMS, seed: int = SEED) -> list[dict]:
    """`n` BBH-form items of `subtask` (fewer when the source has fewer), none equal to a 3-shot exemplar."""
    rng = random.Random(f"{seed}-{subtask}")
    exemplars = _exemplars(subtask)
    if subtask in GENERATE:
        items, seen = [], {_normal(e) for e in exemplars}
        while len(items) < n:
            item = GENERATE[subtask](rng)
            if _normal(item["input"]) not in seen:
                seen.add(_normal(item["input"]))
                items.append(item)
        return items
    convert = CONVERT[subtask][1]
    converted = [item for e in task["examples"] if (item := convert(task, e, rng)) is not None]
    items = _not_exemplars(list({_normal(i["input"]): i for i in converted}.values()), exemplars)
    return items if len(items) <= n else rng.sample(items, n)


def data_format(bbh: Path) -> int | None:
    """The format of the BBH data in `bbh` (None: not built; 1: the first, whose marker was empty)."""
    try:
        text = (bbh / "done").read_text().strip()
    except FileNotFoundError:
        return None
    return int(text) if text.isdigit() else 1


def prepare_bbh(out: Path, downloads: Path, log=print) -> Path:
    bbh = out / "bbh"
    if data_format(bbh) == FORMAT:
        return bbh
    tasks = _source_tasks(_download(downloads, log), log)
    bbh.mkdir(parents=True, exist_ok=True)
    for subtask in SUBTASKS:
        source = CONVERT[subtask][0] if subtask in CONVERT else None
        items = build_items(subtask, tasks.get(source))
        write_atomic(bbh / f"{subtask}.jsonl", "".join(json.dumps(i) + "\n" for i in items).encode())
    (bbh / "done").write_text(f"{FORMAT}\n")
    log(f"wrote {bbh} ({len(SUBTASKS)} subtasks)")
    return bbh
