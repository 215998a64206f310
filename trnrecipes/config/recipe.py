"""Recipes: loading by name or path, `key=value` overrides and validation (the typed sections: sections.py).

A recipe is data (recipes/<family>/<name>.yaml). This module never imports torch: it is on the rendering path.
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import shlex
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from trnrecipes import REPO_ROOT
from trnrecipes.config.changes import check_allow_changes
from trnrecipes.config.cluster import INSTANCES
from trnrecipes.config.families import FAMILIES
from trnrecipes.config.preemption import signal_seconds
from trnrecipes.config.sections import (
    Recipe,
    RecipeError,
)
from trnrecipes.config.stacks import STACKS, TORCHNEURON, XLA_NXD, sdk_span, stack_problem
from trnrecipes.config.stages import neuron_pipeline_problem, split_problem
from trnrecipes.schema import (
    FRACTION,
    NON_NEGATIVE,
    POSITIVE,
    Bound,
    SchemaError,
    from_dict,
    shown,
    tagged_union,
)

RECIPES_DIR = REPO_ROOT / "recipes"
MAX_RECIPE_BYTES = 1 << 20  # the largest shipped recipe is ~2 KB; a bigger file is a wrong path, not a recipe
MAX_PROBLEMS_SHOWN = 20


def _recipes_by_name() -> dict[str, list[Path]]:
    found: dict[str, list[Path]] = {}
    for path in sorted(RECIPES_DIR.glob("*/*.yaml")):
        found.setdefault(path.stem, []).append(path)
    return found


def known_recipes() -> dict[str, Path]:
    return {name: paths[0] for name, paths in _recipes_by_name().items()}


def find_recipe(name_or_path: str) -> Path:
    paths = _recipes_by_name().get(name_or_path, [])
    if len(paths) > 1:  # a copy under recipes/<mine>/ with a shipped name: which one was meant is not ours to pick
        shown_paths = ", ".join(str(p.relative_to(REPO_ROOT)) for p in paths)
        raise RecipeError(
            f"recipe {name_or_path!r} is ambiguous: {shown_paths} share the name; give one as a path, or rename it"
        )
    if paths:
        return paths[0]
    path = Path(name_or_path)
    if path.suffix in (".yaml", ".yml") and path.is_file():
        return path
    raise RecipeError(
        f"unknown recipe {shown(name_or_path)}; known recipes: {', '.join(known_recipes())} (or a path to a .yaml file)"
    )


MAX_NODES = 100_000  # beyond any cluster: a typo's 30 digits would reach the schema as an int64 overflow


def parse_nodes(text: str | int) -> int:
    value = str(text).strip()
    if not re.fullmatch(r"[0-9]+", value) or not 1 <= int(value) <= MAX_NODES:
        raise RecipeError(f"nodes must be a whole number from 1 to {MAX_NODES:,}, got {shown(str(text))}")
    return int(value)


def parse_overrides(items: list[str] | str | None) -> list[tuple[str, Any]]:
    """`optim.lr=1e-4 slurm.partition=train` -> [(dotted key, YAML-typed value)]. A string is split like a shell."""
    if items is None:
        return []
    if isinstance(items, str):
        try:
            items = shlex.split(items)
        except ValueError as err:  # an unbalanced quote: shlex says "No closing quotation"
            raise RecipeError(
                f"overrides {shown(items)} cannot be split into words ({err}); close every quote, e.g."
                " \"data.path='my corpus.arrow'\""
            ) from None
    parsed = []
    for item in items:
        key, sep, raw = item.partition("=")
        if any(ord(c) < 32 for c in item):
            raise RecipeError(f"override {shown(item)} contains a control character (newline, tab, ...)")
        if not sep or not re.fullmatch(r"[a-z_][a-z0-9_]*(\.[a-z_][a-z0-9_]*)*", key):
            raise RecipeError(f"override {shown(item)} is not of the form section.key=value (e.g. optim.lr=1e-4)")
        parsed.append((key, _typed_value(key, raw)))
    return parsed


def _typed_value(key: str, raw: str) -> Any:
    """Text for string fields, verbatim (`cluster.neuron_sdk=2.20` must not become the number 2.2); YAML elsewhere,
    so `optim.betas=[0.9,0.95]` is a list and `layout.sequence_parallel=false` a bool."""
    tp: Any = Recipe
    for part in key.split("."):
        tagged = tagged_union(tp)  # the model section: the field of whichever family has it
        classes = tagged[1].values() if tagged else [tp] if dataclasses.is_dataclass(tp) else []
        hints = [h[part] for h in map(typing.get_type_hints, classes) if part in h]
        if not hints:
            tp = None
            break
        tp = hints[0]
    optional = typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in typing.get_args(tp)
    if optional and raw in ("null", "~"):
        return None  # `slurm.partition=null` clears it
    if tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and str in typing.get_args(tp)):
        return raw
    try:
        return _load_yaml(raw) if raw else ""
    except _RefusedYaml as err:
        raise RecipeError(f"override {key}: {err}") from None
    except (yaml.YAMLError, ValueError, RecursionError):
        return raw  # not YAML: keep the text; the schema says whether text is valid there


class _RefusedYaml(yaml.YAMLError):
    pass


class _NoAliasLoader(yaml.SafeLoader):
    """PyYAML builds one shared object per anchor, so ten lines of `&b [*a, *a, ...]` make a value of a billion
    items that explodes only when something walks or prints it. Recipes have no use for aliases: refuse them. A key
    given twice is refused too (PyYAML keeps the last: a section appended to a copied recipe replaced the whole
    section, defaults and all), and numbers read as written, by YAML 1.2's rules: 010 is ten, not eight, and 1:00
    or 12:00:00 are text, not sixty or a base-60 number."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise _RefusedYaml(
                f"YAML aliases are not allowed (*{event.anchor[:40]} at line {event.start_mark.line + 1});"
                " write the value out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise _RefusedYaml(
                    f"line {line}: key {key[:60]!r} appears twice (first at line {seen[key]}); give each once"
                )
            if isinstance(key, str):
                seen[key] = line
        return super().construct_mapping(node, deep=deep)


def _yaml12_int(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    sign, digits = (-1, text[1:]) if text[:1] == "-" else (1, text.lstrip("+"))
    if digits[:2] in ("0x", "0o"):
        return sign * int(digits[2:], 16 if digits[1] == "x" else 8)
    return sign * int(digits, 10)


# YAML 1.2's core schema for numbers, in place of PyYAML's 1.1 rules (leading-zero octal, base 60, '_' separators)
_NoAliasLoader.yaml_implicit_resolvers = {
    first: [(tag, rule) for tag, rule in resolvers if tag not in ("tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_NoAliasLoader.add_implicit_resolver(
    "tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), list("-+0123456789")
)
_NoAliasLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"
    ),
    list("-+.0123456789"),
)
_NoAliasLoader.add_constructor("tag:yaml.org,2002:int", _yaml12_int)


def _load_yaml(text: str | bytes) -> Any:
    loader = _NoAliasLoader(text)
    try:
        return loader.get_single_data()
    finally:
        loader.dispose()


def _apply_override(data: dict[str, Any], key: str, value: Any) -> None:
    node = data
    *parents, leaf = key.split(".")
    for i, part in enumerate(parents):
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise RecipeError(f"override {key}: {'.'.join(parents[: i + 1])} is not a section")
        node = child
    node[leaf] = value


def read_recipe_file(path: Path) -> dict[str, Any]:
    """A recipe file's mapping: at most MAX_RECIPE_BYTES, no YAML aliases, errors that name the file."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_RECIPE_BYTES + 1)
    except OSError as err:
        raise RecipeError(f"{path}: cannot read ({err.strerror or err})") from None
    if len(raw) > MAX_RECIPE_BYTES:
        raise RecipeError(
            f"{path}: {path.stat().st_size:,} bytes is too big for a recipe; the limit is {MAX_RECIPE_BYTES:,} bytes"
        )
    try:
        data = _load_yaml(raw)
    except _RefusedYaml as err:
        raise RecipeError(f"{path}: {err}") from None
    except (yaml.YAMLError, ValueError) as err:
        raise RecipeError(f"{path}: not valid YAML{_yaml_error_line(err)}") from None
    except RecursionError:
        raise RecipeError(f"{path}: not valid YAML: nested too deeply") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: expected a mapping at the top level")
    return data


def load_recipe(name_or_path: str, nodes: int | str | None = None, overrides: list[str] | str | None = None) -> Recipe:
    path = find_recipe(name_or_path)
    data = read_recipe_file(path)
    parsed = parse_overrides(overrides)
    for key, value in parsed:
        _apply_override(data, key, value)
    if nodes is not None:
        count = parse_nodes(nodes)
        for key, value in parsed:
            if key == "cluster.nodes" and not (type(value) is int and value == count):
                raise RecipeError(
                    f"the overrides set cluster.nodes={shown(value)} but nodes is {count}: give the node count once"
                    " (nodes=, --nodes)"
                )
        _apply_override(data, "cluster.nodes", count)
    return recipe_from_dict(data, path.name)


def _yaml_error_line(err: Exception) -> str:
    """PyYAML's error on one line: where (its problem's mark, else its context's), then what, without the excerpt
    of the file its str() adds (four to six lines)."""
    if not isinstance(err, yaml.MarkedYAMLError):
        return f": {_clip(' '.join(str(err).split()))}"

    def at(mark) -> str:
        return f"line {mark.line + 1}, column {mark.column + 1}"

    mark = err.problem_mark or err.context_mark
    context = err.context or ""
    if context and err.context_mark and err.problem_mark and err.context_mark.line != err.problem_mark.line:
        context += f" (from {at(err.context_mark)})"  # an unclosed bracket or quote: where it opened
    what = ", ".join(part for part in (context, err.problem) if part)
    return f"{f' at {at(mark)}' if mark else ''}: {_clip(' '.join(what.split()) or type(err).__name__)}"


def _clip(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def recipe_from_dict(data: dict[str, Any], source: str, launching: bool = True) -> Recipe:
    """Typed and checked; `source` names the origin in error messages. `launching` False: a checkpoint's saved
    recipe read back, which launch_problems leave alone."""
    if control := list(_with_control_characters(data)):
        raise RecipeError(_problems(source, control))
    try:
        recipe = from_dict(Recipe, data)
    except SchemaError as err:
        raise RecipeError(_problems(source, err.problems)) from None
    problems = check_recipe(recipe)
    if launching and not problems:
        problems = launch_problems(recipe)
    if problems:
        raise RecipeError(_problems(source, problems))
    return recipe


def _with_control_characters(node: Any, key: str = "") -> Iterator[str]:
    """A problem for each text value holding a newline, tab or other control character: a run_dir or data path with
    one would be cut in two by the scripts and by every tool that reads a line at a time."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _with_control_characters(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _with_control_characters(v, f"{key}[{i}]")
    elif isinstance(node, str) and re.search(r"[\x00-\x1f\x7f]", node):
        yield f"{key} {shown(node)} contains a control character (newline, tab, ...): give it on one line"


def _problems(source: str, problems: list[str]) -> str:
    """One problem: one line. Several: the recipe, then each on its own line (a copied recipe's unknown keys, its
    missing ones), so a user fixes them in one pass."""
    if len(problems) == 1:
        return f"recipe {source}: {problems[0]}"
    lines = problems[:MAX_PROBLEMS_SHOWN]
    if len(problems) > len(lines):
        lines.append(f"... and {len(problems) - len(lines)} more")
    return f"recipe {source}:\n  " + "\n  ".join(lines)


# Values that land in #SBATCH lines, which sbatch parses itself: no shell quoting can protect them, so they must
# be plain words.
_SLURM_WORD = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_SLURM_TIME = re.compile(r"([0-9]{1,4}-)?[0-9]{1,2}:[0-9]{2}:[0-9]{2}")


# Every numeric field and its range (a tuple field: each item); None passes (the default applies). The model
# section's come from its family: model_bounds().
FIELD_BOUNDS: dict[str, Bound] = {
    "layout.tp": POSITIVE, "layout.pp": POSITIVE, "layout.ep": POSITIVE, "layout.cp": POSITIVE,
    "layout.pp_virtual_stages": POSITIVE, "layout.pp_stage_layers": NON_NEGATIVE,
    "batch.global_batch": POSITIVE, "batch.micro_batch": POSITIVE, "batch.seq_len": POSITIVE,
    "optim.lr": POSITIVE, "optim.min_lr": NON_NEGATIVE, "optim.warmup_steps": NON_NEGATIVE,
    "optim.decay_steps": NON_NEGATIVE, "optim.betas": FRACTION, "optim.eps": POSITIVE,
    "optim.weight_decay": NON_NEGATIVE, "optim.clip_grad_norm": NON_NEGATIVE,  # 0: no clipping
    "train.max_steps": POSITIVE, "train.seed": NON_NEGATIVE, "train.log_every": POSITIVE,
    "train.val_every": POSITIVE, "train.val_batches": POSITIVE,
    "data.val_fraction": FRACTION,
    "checkpoint.every_steps": POSITIVE, "checkpoint.every_minutes": POSITIVE, "checkpoint.keep_last": POSITIVE,
    "compile.steps": POSITIVE,
    "cluster.nodes": POSITIVE, "cluster.workers_per_node": POSITIVE,
    # The run model's inputs (trnrecipes.plan.run_model), capped where a value can mean nothing and its products
    # would overflow: a million $ a node-hour; a token in 17 minutes to a trillion a second per node (past any
    # hardware: a 1M-parameter model at 6 EFLOP/s); a node failing once in 100,000 years ("never"); a restart of
    # two years; a checkpoint written at 1 MB/s.
    "cluster.price_per_hour": Bound(0, 1e6), "cluster.tokens_per_s_per_node": Bound(1e-3, 1e12),
    "cluster.node_mtbf_hours": Bound(0, 1e9, low_open=True), "slurm.restart_minutes": Bound(0, 1e6),
    "eval.cpus": POSITIVE, "eval.mem_gb": NON_NEGATIVE, "eval.gpus": NON_NEGATIVE,
    "slurm.signal_seconds": Bound(60, 65535),  # Slurm: at least its 60 s resolution; sbatch --signal takes <= 65535
    "slurm.checkpoint_write_gbps": Bound(1e-3),
    "slurm.max_restarts": NON_NEGATIVE,
    "monitor.profile_steps": POSITIVE,
}  # fmt: skip


def model_bounds(family: str) -> dict[str, Bound]:
    """The numeric ranges of a family's model section, as FIELD_BOUNDS keys (model.<field>)."""
    return {f"model.{name}": bound for name, bound in FAMILIES[family].bounds.items()}


def _field(r: Recipe, key: str) -> Any:
    """The value at a dotted key; None where a section on the way is unset (model.rope_scaling without scaling)."""
    value: Any = r
    for part in key.split("."):
        if value is None:
            return None
        value = getattr(value, part)
    return value


def _classification_problems(r: Recipe, nxd: bool) -> list[str]:
    """What a classification family (one label per padded sequence: trnrecipes/data/classify.py) cannot do yet."""
    fam, lay, problems = r.model.family, r.layout, []
    if lay.pp > 1:
        problems.append(f"layout.pp {lay.pp}: the {fam} family is not cut into pipeline stages; use layout.pp 1")
    if lay.sequence_parallel:
        problems.append(
            f"layout.sequence_parallel true: the {fam} family's blocks take a padding mask that the sequence-parallel"
            " re-layout does not carry; use layout.sequence_parallel false"
        )
    if lay.tp > 1 and (nxd or r.cluster.backend == "xla"):
        problems.append(
            f"layout.tp {lay.tp}: tensor parallelism for the {fam} family runs on DTensor (cpu, cuda, TorchNeuron),"
            " not through XLA/NxD; use data parallelism (layout.tp 1)"
        )
    if r.data.sources:
        problems.append("data.sources: classification reads one labelled Arrow file; give it as data.path")
    elif r.data.format != "arrow":
        problems.append(
            f"data.format {r.data.format!r}: classification reads text and labels from an Arrow file (data.format"
            " 'arrow'; `trnrecipes data to-arrow --label-field` writes one)"
        )
    if r.model.pad_token_id is None:
        problems.append("model.pad_token_id is null: classification pads every sequence and masks the padding")
    return problems


def _data_problems(r: Recipe) -> list[str]:
    """data.path or data.sources, not both; a blend's weights positive and finite, its paths distinct."""
    d = r.data
    if d.path is None and not d.sources:
        return ["data: give data.path (one corpus) or data.sources (a blend: [{path: ..., weight: ...}, ...])"]
    if d.path is not None and d.sources:
        return [
            f"data.path {shown(d.path)} and data.sources are both set: give one (data.path is a blend of one source)"
        ]
    named = (
        [("data.path", d.path)]
        if d.path is not None
        else [(f"data.sources[{i}].path", s.path) for i, s in enumerate(d.sources)]
    )
    problems = [
        f"{key} {shown(path)} names no file (the checkout itself, where it is relative); give the corpus's path"
        for key, path in named
        if not str(path).strip() or os.path.normpath(str(path)) == "."
    ]
    problems += [
        f"data.sources[{i}].weight: must be a positive number (its share is weight / sum of weights), got"
        f" {shown(s.weight)}"
        for i, s in enumerate(d.sources)
        if not (math.isfinite(s.weight) and s.weight > 0)
    ]
    if not problems and not math.isfinite(sum(s.weight for s in d.sources)):
        problems.append("data.sources: the weights' sum is not a finite number; use weights of a sane size")
    paths = [os.path.normpath(s.path) for s in d.sources]
    twice = sorted({p for p in paths if paths.count(p) > 1})
    if twice:
        problems.append(f"data.sources: {shown(twice[0])} is listed twice; give each corpus once, weighted")
    return problems


def kv_replication_problems(r: Recipe) -> list[str]:
    """With TP wider than the KV heads (trnrecipes/parallel/kv_replication.py): what is not built with it yet."""
    kv, tp = getattr(r.model, "num_kv_heads", None), r.layout.tp
    if kv is None or tp <= kv:
        return []
    if any("model.num_kv_heads" in p for p in r.model.tp_problems(tp)):  # a family that never replicates (qwen3)
        return []  # its TP rule says the one thing to change
    why = f"layout.tp {tp} over model.num_kv_heads {kv} replicates each KV head on {tp // kv} ranks"
    problems = []
    if r.cluster.backend == "neuron" and not r.cluster.instance.startswith("trn1"):
        if stack_problem(r.cluster.instance, r.cluster.neuron_sdk) is None and r.stack == XLA_NXD:
            problems.append(
                f"{why}: NxD places the copies by platform, and only trn1's tiled order is built; on"
                f" {r.cluster.instance} use a layout.tp that divides {kv}, or TorchNeuron (cluster.neuron_sdk 2.33)"
            )
    if r.cluster.backend == "xla":
        problems.append(
            f"{why}, which is built on cpu, cuda and neuron-native (DTensor) and on neuron (NxD's GQA QKV layer), not"
            f" on plain torch-xla: use a layout.tp that divides {kv}"
        )
    for on, what in (
        (r.layout.fsdp, "layout.fsdp"),
        (r.precision.stochastic_rounding, "precision.stochastic_rounding"),
    ):
        if on:
            problems.append(f"{why}, which is not built with {what} yet (the copies must stay bitwise equal)")
    return problems


NKI_FLASH_SEQ_MULTIPLE, NKI_FLASH_MAX_HEAD_DIM = 2048, 128  # NxD's flash_attn.py and the kernel's asserts


def attention_problems(r: Recipe, stack: str | None) -> list[str]:
    """model.attention nki_flash (trnrecipes/parallel/nki_attention.py): where NxD's NKI flash attention kernel runs
    (torch-xla + NxD) and what it takes (NxD refuses other sequence lengths; the kernel asserts head_dim <= 128)."""
    m = r.model
    if getattr(m, "attention", "sdpa") != "nki_flash":
        return []
    problems = []
    if stack == TORCHNEURON:
        problems.append(
            f"model.attention nki_flash on TorchNeuron (cluster.neuron_sdk {r.cluster.neuron_sdk}): AWS documents"
            " neither an SDPA-to-NKI dispatch nor an NKI flash-attention op for training there; use model.attention"
            f" sdpa, or torch-xla + NxD (cluster.neuron_sdk {sdk_span(STACKS[XLA_NXD].sdks)})"
        )
    elif stack != XLA_NXD and not (r.cluster.backend == "neuron" and stack is None):  # None: the SDK is refused above
        problems.append(
            f"model.attention nki_flash runs on backend neuron with torch-xla + NxD (cluster.neuron_sdk"
            f" {sdk_span(STACKS[XLA_NXD].sdks)}), not on backend {r.cluster.backend}; use model.attention sdpa"
        )
    if r.batch.seq_len % NKI_FLASH_SEQ_MULTIPLE:
        problems.append(
            f"model.attention nki_flash: batch.seq_len {r.batch.seq_len} must be a multiple of"
            f" {NKI_FLASH_SEQ_MULTIPLE} (NxD's flash attention), e.g."
            f" {_nearby_lengths(r.batch.seq_len, seq_len_multiple(r))}; use model.attention sdpa for other lengths"
        )
    if m.head_dim > NKI_FLASH_MAX_HEAD_DIM:
        problems.append(
            f"model.attention nki_flash: head_dim {m.head_dim} (model.hidden_size / num_heads) is above the kernel's"
            f" {NKI_FLASH_MAX_HEAD_DIM}; use model.attention sdpa"
        )
    return problems


def check_recipe(r: Recipe) -> list[str]:
    """Semantic checks the types cannot express. Layout divisibility needs the node count: trnrecipes.plan.layout."""
    problems: list[str] = []

    def need(ok: bool, message: str) -> None:
        if not ok:
            problems.append(message)

    m, b, o = r.model, r.batch, r.optim
    for key, bound in (model_bounds(m.family) | FIELD_BOUNDS).items():
        value = _field(r, key)
        items = value if isinstance(value, tuple) else (value,)
        need(all(v is None or bound.holds(v) for v in items), f"{key}: must be {bound}, got {shown(value)}")
    if problems:  # the checks below divide by these
        return problems
    model_problems = m.problems()
    problems += model_problems
    need(b.seq_len <= m.max_seq_len, f"batch.seq_len {b.seq_len} exceeds model.max_seq_len {m.max_seq_len}")
    tp = r.layout.tp
    if not model_problems:  # the TP rule reads derived sizes (heads, KV groups) that need a consistent model
        problems += m.tp_problems(tp)
    cp = r.layout.cp  # sequence parallelism splits each context-parallel rank's part of the sequence
    need(
        not r.layout.sequence_parallel or b.seq_len % (tp * cp) == 0,
        f"batch.seq_len {b.seq_len} must be divisible by layout.tp {tp}"
        + (f" x layout.cp {cp} = {tp * cp}" if cp > 1 else "")
        + f" with sequence parallelism; e.g. {_nearby_lengths(b.seq_len, seq_len_multiple(r))}",
    )
    experts = getattr(m, "num_experts", 0)
    need(  # under TP each rank routes 1/tp of a sequence's tokens (trnrecipes/parallel/expert.py)
        r.layout.sequence_parallel or not experts or tp == 1 or b.seq_len % tp == 0,
        f"batch.seq_len {b.seq_len} must be divisible by layout.tp {tp} with model.num_experts {experts} (each TP"
        f" rank routes 1/{tp} of a sequence's tokens); e.g. {_nearby_lengths(b.seq_len, seq_len_multiple(r))}",
    )
    lay = r.layout
    split = split_problem(m.num_layers, lay.pp, lay.pp_virtual_stages, lay.pp_stage_layers, lay.pp_schedule)
    need(split is None, split or "")
    stack = None  # the Neuron stack, once the instance x SDK is known to have one
    on_neuron_instance = r.cluster.instance in INSTANCES and "neuron" in INSTANCES[r.cluster.instance].backends
    if r.cluster.backend == "neuron" and on_neuron_instance:  # elsewhere the backend check below speaks
        problem = stack_problem(r.cluster.instance, r.cluster.neuron_sdk)
        need(problem is None, problem or "")
        stack = r.stack if problem is None else None
    nxd = stack == XLA_NXD
    native = STACKS[TORCHNEURON]
    native_hint = f" (on {', '.join(native.instances)}: cluster.neuron_sdk={sdk_span(native.sdks)})"
    need(
        stack != TORCHNEURON or r.compile.optlevel == 1,
        f"compile.optlevel {r.compile.optlevel}: TorchNeuron compiles at -O1 and documents no way to change it;"
        " use compile.optlevel 1 there",
    )
    need(
        not (nxd and lay.zero1 and r.optim.state_dtype == "bf16"),
        "optim.state_dtype bf16 with layout.zero1 on torch-xla + NxD: its ZeRO-1 optimizer (torch-xla's"
        " ZeroRedundancyOptimizer) keeps its own fp32 state; use optim.state_dtype fp32 there",
    )
    if nxd and lay.pp > 1:  # NxD's manual pipeline: its SDK and its one schedule
        pipeline = neuron_pipeline_problem(r.cluster.neuron_sdk, lay.pp_schedule, lay.pp_virtual_stages)
        need(pipeline is None, pipeline or "")
    need(not r.layout.sequence_parallel or r.layout.tp > 1, "layout.sequence_parallel needs layout.tp > 1")
    # Plain PyTorch (FSDP2, torch.compile): cpu, cuda, TorchNeuron. A neuron recipe whose stack is refused above is
    # not refused again here.
    on_torch = r.cluster.backend in ("cpu", "cuda") or (r.cluster.backend == "neuron" and not nxd)
    if lay.fsdp:
        need(not lay.zero1, "layout.fsdp and layout.zero1 are both true: FSDP already shards the optimizer states")
        need(
            on_torch,
            f"layout.fsdp true: {_backend_words(r, stack)} has no FSDP (torch's fully_shard runs on cpu, cuda and"
            f" TorchNeuron{native_hint if nxd else ''}); shard optimizer states with layout.zero1 instead",
        )
        need(lay.pp == 1, f"layout.fsdp with layout.pp {lay.pp}: FSDP over pipeline stages is not built; use zero1")
    need(
        not (r.train.compile and (r.cluster.backend == "xla" or nxd)),
        f"train.compile true: {_backend_words(r, stack)} compiles whole-step graphs through XLA already;"
        f" torch.compile runs on cpu, cuda and TorchNeuron{native_hint if nxd else ''}. Set train.compile false or"
        " leave it out",
    )
    problems += _monitor_problems(r)
    full_layers = getattr(m, "activation_checkpointing_full_layers", 0)
    need(
        full_layers <= m.num_layers,
        f"model.activation_checkpointing_full_layers {full_layers} is more than model.num_layers {m.num_layers}",
    )
    need(
        not (getattr(m, "activation_checkpointing", "none") == "elementwise" and (r.cluster.backend == "xla" or nxd)),
        f"model.activation_checkpointing elementwise: {_backend_words(r, stack)} is not built with it (its policy is"
        f" torch's selective checkpointing, for cpu, cuda and TorchNeuron{native_hint if nxd else ''}); use"
        " selective or full",
    )
    problems += kv_replication_problems(r)
    problems += attention_problems(r, stack)
    problems += _data_problems(r)
    if FAMILIES[m.family].objective == "classification":
        problems += _classification_problems(r, nxd)
    if hasattr(m, "layout_problems"):  # what a family does not run with yet (recipes/qwen3/spec.py)
        problems += m.layout_problems(lay, nxd)
    if lay.ep > 1:
        problems += expert_parallel_problems(r, on_torch, _backend_words(r, stack))
    if lay.cp > 1:
        problems += context_parallel_problems(r, on_torch, nxd, _backend_words(r, stack))
    need(
        r.train.init_optimizer == "reset" or r.train.init_from is not None,
        "train.init_optimizer 'keep' carries the optimizer state of train.init_from over; set train.init_from",
    )
    need(o.min_lr <= o.lr, f"optim.min_lr {o.min_lr} must be <= optim.lr {o.lr}")
    need(
        not r.precision.stochastic_rounding or r.precision.dtype == "bf16",
        f"precision.stochastic_rounding needs precision.dtype 'bf16', got {r.precision.dtype!r}",
    )
    known = ", ".join(INSTANCES)
    need(r.cluster.instance in INSTANCES, f"cluster.instance {shown(r.cluster.instance)}: known: {known}")
    if r.cluster.instance in INSTANCES:
        allowed = INSTANCES[r.cluster.instance].backends
        need(
            r.cluster.backend in allowed,
            f"cluster.backend {r.cluster.backend!r} does not run on {r.cluster.instance}; valid: {', '.join(allowed)}",
        )
    need(
        r.compile.cache_dir is None or (Path(r.compile.cache_dir).is_absolute() and is_plain_path(r.compile.cache_dir)),
        f"compile.cache_dir {shown(r.compile.cache_dir)} must be an absolute node-local path (e.g. /var/tmp/...),"
        " or null for one per user and job: a relative one would land on the shared file system the job is submitted"
        " from",
    )
    shared = r.compile.shared_cache_dir
    need(
        shared is None or (Path(shared).is_absolute() and is_plain_path(shared)),
        f"compile.shared_cache_dir {shown(shared)} must be an absolute path on the shared file system (letters,"
        " digits and . _ / + - only), or null for <job dir>/neff-cache",
    )
    need(
        shared is None or stack == TORCHNEURON,
        f"compile.shared_cache_dir is TorchNeuron's NEFF cache (cluster.neuron_sdk={sdk_span(native.sdks)} on"
        f" {', '.join(native.instances)}); {_backend_words(r, stack)} does not read it: leave it null"
        + (" (torch-xla + NxD's cache is compile.cache_dir)" if nxd else ""),
    )
    wpn = r.cluster.workers_per_node
    if on_neuron_instance and wpn is not None:  # one worker per (logical) NeuronCore; more have no core to run on
        most = INSTANCES[r.cluster.instance].workers_per_node
        need(
            wpn <= most,
            f"cluster.workers_per_node {wpn}: {r.cluster.instance} has {most} (logical) NeuronCores, one per worker;"
            f" use at most {most}",
        )
    for flag in r.compile.extra_flags:
        need(re.fullmatch(r"-[-A-Za-z0-9_=.,:/+]+", flag) is not None, f"compile.extra_flags: bad flag {shown(flag)}")
    for section, key in (("slurm", "job_name"), ("slurm", "partition"), ("slurm", "account"), ("eval", "partition"),
                         ("eval", "account")):  # fmt: skip
        value = getattr(getattr(r, section), key)
        need(
            value is None or bool(_SLURM_WORD.fullmatch(value)),
            f"{section}.{key} {shown(value)}: use letters, digits, '.', '_' and '-' only (it goes into an #SBATCH"
            " line)",
        )
    problems += _time_limit_problems("eval.time_limit", r.eval.time_limit)
    need(
        _SLURM_WORD.fullmatch(r.name) is not None,
        f"name {shown(r.name)}: use letters, digits, '.', '_' and '-' only (it names the job and its directories)",
    )
    t = r.slurm.time_limit
    problems += _time_limit_problems("slurm.time_limit", t)
    if t is not None and not problems:
        lead = signal_seconds(r)
        need(
            time_limit_seconds(t) > lead + 300,
            f"slurm.time_limit {t} leaves no time to train before the pre-timeout signal ({lead} s before the end"
            f"{'' if r.slurm.signal_seconds is not None else ', derived from the checkpoint size'});"
            f" use more than {lead + 300} s",
        )
    need(  # it acted only with resume false: alone it resumed the old run, without a word
        not (r.checkpoint.force_fresh and r.checkpoint.resume),
        "checkpoint.force_fresh true with checkpoint.resume true (the default) would resume the run dir's checkpoints:"
        " to archive them and start at step 0, set checkpoint.resume=false too",
    )
    return problems


def expert_parallel_problems(r: Recipe, on_torch: bool, backend_words: str) -> list[str]:
    """layout.ep > 1: a model with experts that split evenly, on the torch backends (the DP degree it must divide
    needs the node count: trnrecipes.plan.layout)."""
    ep, experts = r.layout.ep, getattr(r.model, "num_experts", 0)
    if not experts:
        why = f"model.num_experts is 0 (model.family {r.model.family}): no experts to share out"
        return [f"layout.ep {ep}: {why}; use layout.ep 1"]
    problems = []
    if experts % ep:
        dp = _data_parallel(r)
        both = math.gcd(experts, dp) if dp else experts  # ep must divide the DP degree too (plan.layout's check)
        valid = ", ".join(str(d) for d in range(1, both + 1) if both % d == 0)
        if r.layout.fsdp and dp and experts % dp:  # plan.layout's FSDP rule: no ep > 1 splits a rank's experts
            valid = f"1 (under layout.fsdp an ep above 1 needs model.num_experts {experts} divisible by DP {dp})"
        elif dp:
            valid += f" (dividing the data-parallel degree {dp} too)"
        problems.append(
            f"layout.ep {ep} must divide model.num_experts {experts} (each expert-parallel rank holds the same number);"
            f" valid ep: {valid}"
        )
    if not on_torch:
        problems.append(
            f"layout.ep {ep}: {backend_words} has no expert parallelism here (its all-to-all dispatch runs on"
            " torch.distributed: cpu, cuda and TorchNeuron; on torch-xla + NxD it would have to be"
            " neuronx-distributed's own MoE module, which this project does not build on); use layout.ep 1"
        )
    return problems


def _data_parallel(r: Recipe) -> int | None:
    """The recipe's data-parallel degree at its node count, or None where the world does not split (said elsewhere)."""
    try:
        world, replica = r.cluster.nodes * r.workers_per_node, r.layout.tp * r.layout.pp * r.layout.cp
    except (RecipeError, ValueError):  # an unknown instance: its own problem
        return None
    return world // replica if world % replica == 0 else None


def context_parallel_problems(r: Recipe, on_torch: bool, nxd: bool, backend_words: str) -> list[str]:
    """layout.cp > 1 (trnrecipes/parallel/context.py): a causal language model on the torch backends whose sequence
    cuts into 2 x cp equal chunks, without what it is not built with."""
    cp, seq = r.layout.cp, r.batch.seq_len
    problems = []
    if seq % (2 * cp):
        problems.append(
            f"batch.seq_len {seq} with layout.cp {cp}: each sequence is cut into 2 x cp = {2 * cp} equal chunks (two"
            f" a rank: the front and the back, for an even causal load); use a batch.seq_len divisible by {2 * cp},"
            f" e.g. {_nearby_lengths(seq, seq_len_multiple(r))}"
        )
    if FAMILIES[r.model.family].objective != "causal_lm":
        problems.append(
            f"layout.cp {cp}: model.family {r.model.family} is not a causal language model (its attention sees the"
            " whole padded sequence both ways); context parallelism is built for the causal families: use layout.cp 1"
        )
    if nxd:
        problems.append(
            f"layout.cp {cp}: {backend_words} runs the model through NxD, whose NxD Training has its own"
            " context_parallel_size that this adapter does not wire; use layout.cp 1, or TorchNeuron"
            " (cluster.neuron_sdk 2.33) on trn2/trn3"
        )
    elif not on_torch:
        problems.append(
            f"layout.cp {cp}: {backend_words} has no context parallelism (its all-gather of keys and values runs on"
            " torch.distributed: cpu, cuda and TorchNeuron); use layout.cp 1"
        )
    if r.layout.pp > 1:
        problems.append(
            f"layout.cp {cp} with layout.pp {r.layout.pp}: context parallelism over pipeline stages is not built;"
            " use layout.pp 1 (or layout.cp 1)"
        )
    if r.layout.ep > 1:
        problems.append(
            f"layout.cp {cp} with layout.ep {r.layout.ep}: expert parallelism with context parallelism is not built"
            " (torchtitan carves EP from the dp x cp ranks); use layout.ep 1 or layout.cp 1"
        )
    if getattr(r.model, "num_experts", 0):
        problems.append(
            f"layout.cp {cp} with model.num_experts {r.model.num_experts}: the load-balancing loss is taken over a"
            " micro-batch's whole sequences, which no rank holds under context parallelism; not built: use layout.cp 1"
        )
    return problems


def seq_len_multiple(r: Recipe) -> int:
    """What every batch.seq_len rule of this recipe's layout asks together: the least common multiple of tp x cp
    (sequence parallelism), tp (experts without it), 2 x cp (context parallelism's chunks) and the NKI flash
    kernel's block, so a length one message suggests is not refused by the next."""
    tp, cp, wants = r.layout.tp, r.layout.cp, [1]
    if r.layout.sequence_parallel:
        wants.append(tp * cp)
    elif getattr(r.model, "num_experts", 0):
        wants.append(tp)
    if cp > 1:
        wants.append(2 * cp)
    if getattr(r.model, "attention", "sdpa") == "nki_flash":
        wants.append(NKI_FLASH_SEQ_MULTIPLE)
    return math.lcm(*wants)


def _nearby_lengths(seq_len: int, multiple: int) -> str:
    """'96 or 104': the positive multiples of `multiple` on either side of `seq_len`, for messages."""
    below = seq_len // multiple * multiple
    return " or ".join(str(n) for n in (below, below + multiple) if n > 0)


def _backend_words(r: Recipe, stack: str | None) -> str:
    """'backend xla', or 'backend neuron on Neuron SDK 2.26 (torch-xla + neuronx-distributed)' for messages."""
    if stack != XLA_NXD:
        return f"backend {r.cluster.backend}"
    return f"backend neuron on Neuron SDK {r.cluster.neuron_sdk} (torch-xla + neuronx-distributed)"


def _time_limit_problems(key: str, value: str | None) -> list[str]:
    """A Slurm --time value in the one spelling recipes take, [D-]HH:MM:SS, and not zero: Slurm reads a zero limit
    (00:00:00, 0-00:00:00) as none at all, so the job would run unbounded, with no pre-timeout signal."""
    if value is None:
        return []
    if not _SLURM_TIME.fullmatch(value):
        return [f"{key} {shown(value)}: expected [D-]HH:MM:SS"]
    if time_limit_seconds(value) == 0:
        return [
            f"{key} {value} is zero, which Slurm reads as no time limit: give the limit as [D-]HH:MM:SS (e.g."
            f" 04:00:00), or leave {key} unset for the partition's"
        ]
    return []


def time_limit_seconds(time_limit: str) -> int:
    """A checked [D-]HH:MM:SS limit in seconds (the k8s eval Job's activeDeadlineSeconds takes eval.time_limit)."""
    days, _, clock = time_limit.rpartition("-")
    h, m, s = (int(x) for x in clock.split(":"))
    return (int(days) if days else 0) * 86400 + h * 3600 + m * 60 + s


def is_plain_path(text: str) -> bool:
    """Letters, digits and . _ / + - only: safe where no shell quoting applies (#SBATCH lines, NEURON flags)."""
    return re.fullmatch(r"[A-Za-z0-9._/+-]+", text) is not None


WANDB_PROJECT_CHARS = "/\\#?%:"  # what wandb 0.31's Settings.validate_project refuses in a project name
MAX_PROFILED_STEPS = 20


def launch_problems(r: Recipe) -> list[str]:
    """Settings refused where a recipe is loaded to launch or render a run, not where a checkpoint's saved recipe is
    read back (one saved before these checks existed still loads, for eval, convert, init_from and resume): values
    that would stop a launch after the model is built, or hurt it, with nothing wrong in the weights."""
    problems = []
    o, trackers = r.optim, r.monitor.trackers
    if o.schedule != "constant" and o.decay_steps <= o.warmup_steps:  # the rate fell to min_lr in one step
        problems.append(
            f"optim.decay_steps {o.decay_steps} must be > optim.warmup_steps {o.warmup_steps} (it counts from step 0,"
            " warmup included), or optim.schedule constant"
        )
    project = r.monitor.wandb_project or r.name  # as the trackers take it
    bad = sorted({c for c in project if c in WANDB_PROJECT_CHARS})
    if "wandb" in trackers and (bad or len(project) > 128):  # wandb.init's UsageError, after the build
        problems.append(
            f"monitor.wandb_project {project[:140]!r}: W&B takes at most 128 characters, none of"
            f" {' '.join(WANDB_PROJECT_CHARS)}{f' (it has {bad})' if bad else ''}"
        )
    experiment = r.monitor.mlflow_experiment or r.name
    if "mlflow" in trackers and len(experiment) > 500:  # MLflow's limit: the run logged nothing to it
        problems.append(f"monitor.mlflow_experiment: MLflow takes at most 500 characters, got {len(experiment)}")
    if (
        r.monitor.profile_steps is not None
        and (steps := r.monitor.profile_steps[1] - r.monitor.profile_steps[0] + 1) > MAX_PROFILED_STEPS
    ):
        problems.append(
            f"monitor.profile_steps {list(r.monitor.profile_steps)}: {steps} steps, at most {MAX_PROFILED_STEPS}: the"
            " profiler holds every op and kernel of the window in host memory until its end (~18 MB a step on a"
            " 4-layer tiny model, far more for a 7B), then writes one trace; profile a few steps"
        )
    if getattr(r.model, "num_experts", 0) and r.cluster.backend == "xla":
        # The tokens each expert gets change with every micro-batch: each step is a new graph for XLA to compile
        # (about 2 minutes a step for qwen3-moe-tiny on PJRT CPU, against milliseconds for the dense qwen3-tiny).
        problems.append(
            f"model.num_experts {r.model.num_experts} on cluster.backend xla: each micro-batch's tokens per expert are"
            " a new shape, so every step compiles a new graph; train a mixture of experts on cpu, cuda or"
            " TorchNeuron (cluster.backend neuron on trn2/trn3)"
        )
    # what a resume of this launch may change: a checkpoint saved with an entry refused since still loads
    problems += check_allow_changes(r.checkpoint.allow_changes, r.model.family)
    return problems


def _monitor_problems(r: Recipe) -> list[str]:
    """The monitor section: each tracker once, a profiled window inside the run."""
    problems = []
    trackers = r.monitor.trackers
    if len(set(trackers)) != len(trackers):
        problems.append(f"monitor.trackers: each tracker once, got {list(trackers)}")
    if r.monitor.profile_steps is not None:
        first, last = r.monitor.profile_steps
        if first > last:
            problems.append(
                f"monitor.profile_steps [{first}, {last}]: the first step comes after the last; give [first, last]"
            )
        elif last > r.train.max_steps:
            problems.append(
                f"monitor.profile_steps [{first}, {last}]: step {last} is past train.max_steps {r.train.max_steps};"
                " profile steps the run trains"
            )
    return problems
