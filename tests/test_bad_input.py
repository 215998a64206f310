"""Nothing lost, nothing run that should not run: every bad input is refused at render time or on reading, with one
short line naming the key or file, the value given and what is valid; never a traceback, never a hang."""

from __future__ import annotations

import dataclasses
import gzip
import json
import resource
import subprocess
import sys
import time
import types
import typing
from pathlib import Path

import pytest
from conftest import REPO, run_cli

from trnrecipes.config.families import FAMILIES
from trnrecipes.config.recipe import load_recipe, model_bounds
from trnrecipes.config.sections import Recipe, RecipeError

RECIPE = "pythia-tiny"
BOMB_LEVELS = 9  # 9**9 = 387,420,489 leaves: printed in full, several GB


def numeric_fields(cls: type = Recipe, prefix: str = "") -> dict[str, type]:
    """Dotted key -> int or float, for every numeric field of the recipe schema (tuple fields: their item type),
    the model section's of every family included."""
    found: dict[str, type] = {}
    for f in dataclasses.fields(cls):
        tp, key = typing.get_type_hints(cls)[f.name], prefix + f.name
        if f.name == "model":
            for spec in FAMILIES.values():
                found |= numeric_fields(spec.config, key + ".")
            continue
        if typing.get_origin(tp) in (typing.Union, types.UnionType):
            tp = next(a for a in typing.get_args(tp) if a is not type(None))
        if typing.get_origin(tp) is tuple:
            tp = typing.get_args(tp)[0]
        if dataclasses.is_dataclass(tp):
            found |= numeric_fields(tp, key + ".")
        elif tp in (int, float):
            found[key] = tp
    return found


def override(key: str, text: str) -> str:
    return f"{key}=[{text},0.95]" if key == "optim.betas" else f"{key}={text}"


def refused(overrides: list[str] | str, nodes: int | None = None, recipe: str = RECIPE) -> str:
    with pytest.raises(RecipeError) as err:
        load_recipe(recipe, nodes=nodes, overrides=overrides)
    return str(err.value)


def recipe_with(key: str) -> str:
    """RECIPE, or for a model key its family lacks, the tiny recipe of a family that has it."""
    field = key.removeprefix("model.")
    if field.startswith("rope_scaling."):  # a nested section, set in the Llama 3.1 recipes only
        return "llama3.1-tiny"
    if field == key or field in {f.name for f in dataclasses.fields(load_recipe(RECIPE).model)}:
        return RECIPE
    return next(f"{n}-tiny" for n, s in FAMILIES.items() if field in {f.name for f in dataclasses.fields(s.config)})


# ---------------------------------------------------------------- 1. every numeric field has a range


@pytest.mark.parametrize("key", sorted(numeric_fields()))
def test_every_numeric_field_refuses_negative_and_non_finite_values(key):
    """-1 is outside every field's range; nan and inf outside every float's; 2**63 outside every int's (torch,
    numpy and bash read 64 bits)."""
    bad = ["-1", ".nan", ".inf", "-.inf"] if numeric_fields()[key] is float else ["-1", str(2**63)]
    for text in bad:
        message = refused([override(key, text)], recipe=recipe_with(key))
        assert key in message and len(message) < 300, (text, message)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("train.val_every", "0", "train.val_every: must be > 0, got 0"),  # was a ZeroDivisionError in the loop
        ("train.val_batches", "0", "train.val_batches: must be > 0, got 0"),
        ("data.val_fraction", "1", "data.val_fraction: must be in [0, 1), got 1.0"),
        ("model.init_std", "0", "model.init_std: must be > 0, got 0.0"),
        ("model.norm_eps", "0", "model.norm_eps: must be > 0, got 0.0"),
        ("model.rotary_base", "0", "model.rotary_base: must be > 0, got 0.0"),
        ("model.rotary_pct", "1.5", "model.rotary_pct: must be in (0, 1], got 1.5"),
        ("optim.lr", "0", "optim.lr: must be > 0, got 0.0"),
        ("optim.eps", "0", "optim.eps: must be > 0, got 0.0"),
        ("optim.weight_decay", "-0.1", "optim.weight_decay: must be >= 0, got -0.1"),
        ("optim.clip_grad_norm", "-1", "optim.clip_grad_norm: must be >= 0, got -1.0"),
        ("checkpoint.every_minutes", "0", "checkpoint.every_minutes: must be > 0, got 0.0"),
        ("train.seed", "-3", "train.seed: must be >= 0, got -3"),
        ("slurm.signal_seconds", "65536", "slurm.signal_seconds: must be in [60, 65535], got 65536"),
        ("optim.betas", "[0.9,1]", "optim.betas: must be in [0, 1), got (0.9, 1.0)"),
    ],
)
def test_out_of_range_values_are_refused_at_render_time(key, value, message):
    assert message in refused([f"{key}={value}"])


def test_range_edges_that_mean_something_stay_valid():
    r = load_recipe(
        RECIPE,
        overrides="optim.clip_grad_norm=0 optim.weight_decay=0 optim.min_lr=0 data.val_fraction=0 train.seed=0"
        " slurm.signal_seconds=60 model.rotary_pct=1 checkpoint.every_minutes=null",
    )
    assert (r.optim.clip_grad_norm, r.data.val_fraction, r.checkpoint.every_minutes) == (0.0, 0.0, None)


def test_the_bounds_table_covers_every_numeric_field():
    from trnrecipes.config.recipe import FIELD_BOUNDS

    every_family = {key: bound for name in FAMILIES for key, bound in model_bounds(name).items()}
    assert sorted(FIELD_BOUNDS | every_family) == sorted(numeric_fields())


def test_plan_refuses_non_finite_throughput_and_price():
    for flag, value in (("--price", "nan"), ("--price", "inf"), ("--seq-per-s", "nan"), ("--seq-per-s", "inf")):
        done = run_cli("plan", "--recipe", RECIPE, "--nodes", "1", flag, value)
        assert done.returncode == 2 and f"{flag} must be a finite number" in done.stderr, (flag, value, done.stdout)


# ---------------------------------------------------------------- 2. messages stay short, alias bombs fail fast


@pytest.mark.parametrize(
    "overrides",
    [
        ["slurm.partition=" + "x" * 100_000],
        ["compile.cache_dir=" + "y" * 100_000],
        ["name=" + "z" * 100_000],
        ["optim.lr" + "w" * 100_000],  # no '=': not an override at all
        ["optim.betas=[" + ",".join(["0.5"] * 50_000) + "]"],
    ],
)
def test_error_messages_never_echo_an_unbounded_value(overrides):
    message = refused(overrides)
    assert len(message) < 300 and "..." in message, message[:500]


def test_unknown_recipe_name_is_capped():
    from trnrecipes.config.recipe import known_recipes

    with pytest.raises(RecipeError) as err:
        load_recipe("n" * 100_000)
    known = ", ".join(known_recipes())  # the message lists them: it grows with the recipes, not with the name
    assert known in str(err.value) and len(str(err.value)) < 300 + len(known)


def _bomb() -> str:
    """A YAML 'billion laughs': each level is 9 references to the one before."""
    lines = ["&l0 [" + ", ".join(["lol"] * 9) + "]"]
    lines += [f"&l{i} [" + ", ".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, BOMB_LEVELS)]
    return "[" + ", ".join(lines) + "]"


def _limited_cli(*args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """The CLI under a 2 GiB address-space cap and a timeout, so a bomb that does go off cannot take the box."""

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "trnrecipes", *args], cwd=REPO, capture_output=True, text=True, timeout=120,
        preexec_fn=cap,
    )  # fmt: skip
    return done, time.monotonic() - start


def test_an_alias_bomb_in_a_recipe_file_fails_fast_with_a_short_message(tmp_path):
    text = (REPO / "recipes/pythia/pythia-tiny.yaml").read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("description:"))
    path = tmp_path / "bomb.yaml"
    path.write_text(f"{text}\nlaughs: {_bomb()}\ndescription: *l{BOMB_LEVELS - 1}\n")
    done, seconds = _limited_cli("show", "--recipe", str(path), "--nodes", "1")
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    assert "YAML aliases are not allowed" in done.stderr and str(path) in done.stderr
    assert len(done.stderr) < 300 and "Traceback" not in done.stderr


def test_an_alias_bomb_in_an_override_fails_fast_with_a_short_message():
    bomb = _bomb()[:-1] + f", *l{BOMB_LEVELS - 1}]"  # the last item references the biggest level
    done, seconds = _limited_cli("show", "--recipe", RECIPE, "--nodes", "1", "--overrides", f"'optim.betas={bomb}'")
    assert done.returncode == 2 and seconds < 30, done.stderr[-2000:]
    assert "override optim.betas: YAML aliases are not allowed" in done.stderr
    assert len(done.stderr) < 300 and "Traceback" not in done.stderr


# ---------------------------------------------------------------- 3. recipe file size


def test_a_recipe_file_over_the_size_limit_is_refused(tmp_path):
    path = tmp_path / "huge.yaml"
    text = (REPO / "recipes/pythia/pythia-tiny.yaml").read_text()
    path.write_text(text + "#" * 80 + "\n" + ("# padding\n" * 200_000))  # valid YAML, ~2 MB
    with pytest.raises(RecipeError) as err:
        load_recipe(str(path))
    size = path.stat().st_size
    assert f"{path}: {size:,} bytes is too big for a recipe; the limit is 1,048,576 bytes" in str(err.value)


# ---------------------------------------------------------------- 4. node count given twice


def test_a_node_count_in_the_overrides_must_agree_with_nodes():
    message = refused("cluster.nodes=4", nodes=2)
    assert "cluster.nodes=4" in message and "nodes is 2" in message
    assert "cluster.nodes='four'" in refused("cluster.nodes=four", nodes=2)
    assert load_recipe(RECIPE, nodes=2, overrides="cluster.nodes=2").cluster.nodes == 2
    assert load_recipe(RECIPE, overrides="cluster.nodes=3").cluster.nodes == 3  # no nodes=: the override counts
    done = run_cli("sbatch", "--recipe", RECIPE, "--nodes", "1", "--overrides", "cluster.nodes=2", "--out", "/nonexist")
    assert done.returncode == 2 and "cluster.nodes=2" in done.stderr and "nodes is 1" in done.stderr


# ---------------------------------------------------------------- 6. corrupt data files, metrics


def _clean(done: subprocess.CompletedProcess[str], path: Path, what: str) -> None:
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and done.stderr.startswith(f"error: {path}: {what}"), done.stderr[-2000:]
    assert len(done.stderr.splitlines()) == 1


def test_corrupt_arrow_and_gzip_inputs_are_one_line_errors_naming_the_file(tmp_path):
    arrow = tmp_path / "bad.arrow"
    arrow.write_bytes(b"\xff\x00garbage" * 300)
    _clean(run_cli("data", "to-arrow", "--in", str(arrow), "--out", str(tmp_path / "o.arrow")), arrow, "not a readable")
    truncated = tmp_path / "cut.jsonl.gz"
    truncated.write_bytes(gzip.compress(b'{"text": "hello"}\n' * 1000)[:60])
    done = run_cli("data", "to-arrow", "--in", str(truncated), "--out", str(tmp_path / "o.arrow"))
    _clean(done, truncated, "not a readable gzip file")
    garbage = tmp_path / "garbage.jsonl.gz"
    garbage.write_bytes(b"this was never gzip\n")
    _clean(run_cli("data", "to-arrow", "--in", str(garbage), "--out", str(tmp_path / "o.arrow")), garbage, "not a")
    assert not (tmp_path / "o.arrow").exists()


def test_a_corrupt_arrow_corpus_is_a_data_error_naming_it(tmp_path):
    from trnrecipes.data.arrow import DataError, read_arrow

    good = tmp_path / "good.arrow"
    run_cli("data", "to-arrow", "--in", str(REPO / "README.md"), "--out", str(good))
    cut = tmp_path / "cut.arrow"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(DataError, match=f"{cut}: not a readable Arrow"):
        read_arrow(cut)


def test_a_corrupt_tokenizer_json_is_one_line_naming_the_file(tmp_path):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer.json").write_text((REPO / "data/tokenizers/gpt2/tokenizer.json").read_text()[:5000])
    (tok / "tokenizer_config.json").write_text((REPO / "data/tokenizers/gpt2/tokenizer_config.json").read_text())
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "hello"}) + "\n")
    done = run_cli("data", "preprocess", "--in", str(docs), "--tokenizer", str(tok), "--out", str(tmp_path / "o"))
    _clean(done, tok / "tokenizer.json", "not a valid Hugging Face tokenizer.json")
    (tok / "tokenizer.json").write_text((REPO / "data/tokenizers/gpt2/tokenizer.json").read_text())
    (tok / "tokenizer_config.json").write_text('{"eos_token": ')
    done = run_cli("data", "preprocess", "--in", str(docs), "--tokenizer", str(tok), "--out", str(tmp_path / "o"))
    _clean(done, tok / "tokenizer_config.json", "not valid JSON")


def test_a_corpus_too_small_to_split_names_the_corpus(tmp_path):
    from trnrecipes.data.arrow import DataError
    from trnrecipes.data.pack import PackedStream, split_documents

    corpus = tmp_path / "one.arrow"
    with pytest.raises(DataError, match=f"{corpus} has 1 document\\(s\\): too few to hold out 1 for validation"):
        split_documents(1, 0.01, seed=0, source=corpus)
    with pytest.raises(DataError, match=f"{corpus} has no documents"):
        split_documents(0, 0.01, seed=0, source=corpus)

    class OneDocument:
        path, num_docs = corpus, 1

    with pytest.raises(DataError, match=f"{corpus}: 1 document\\(s\\) to read cannot be shared by 2 data-parallel"):
        PackedStream(OneDocument(), split_documents(1, 0.0, seed=0)[0], seq_len=8, dp_size=2)


def test_training_on_a_one_document_corpus_is_an_error_not_a_traceback(tmp_path):
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps({"text": "the only document"}) + "\n")
    assert run_cli("data", "to-arrow", "--in", str(one), "--out", str(tmp_path / "one.arrow")).returncode == 0
    args = ["cluster.workers_per_node=1", "batch.seq_len=64", "batch.global_batch=2", "batch.micro_batch=2",
            "train.max_steps=1", f"run_dir={tmp_path / 'run'}", f"data.path={tmp_path / 'one.arrow'}"]  # fmt: skip
    done = run_cli("train", "--config", RECIPE, *args)
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    assert "1 document(s): too few to hold out 1 for validation" in done.stderr


def test_corrupt_megatron_files_are_a_data_error_without_noise(tmp_path):
    """megatron-core's reader asserts or fails to unpack, then its __del__ prints a traceback of its own."""
    (tmp_path / "c.idx").write_bytes(b"MMIDIDX\x00\x00" + b"\x01")  # the magic, then a cut-off version field
    (tmp_path / "c.bin").write_bytes(b"\x00" * 64)
    code = "from trnrecipes.data.indexed import IndexedDocuments; IndexedDocuments(__import__('sys').argv[1])"
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "c")], capture_output=True, text=True)
    assert "DataError: " + f"Megatron data {tmp_path / 'c'}.bin/.idx: not readable" in done.stderr
    assert done.stderr.count("Traceback") == 1  # ours, from the uncaught DataError; none from megatron's __del__


def test_plot_skips_a_truncated_last_metrics_line_with_a_warning(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    records = [{"step": s, "loss": 5.0 - s, "grad_norm": 1.0, "param_norm": 2.0} for s in range(1, 4)]
    text = "".join(json.dumps(r) + "\n" for r in records)
    (run / "metrics.jsonl").write_text(text + '{"step": 4, "lo')  # the run was killed mid-write
    done = run_cli("plot", str(run))
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert f"warning: {run / 'metrics.jsonl'}: skipped 1 line(s) that are not step records (line 4)" in done.stderr
    assert (run / "plots" / "loss.png").stat().st_size > 0
    (run / "metrics.jsonl").write_bytes(b"\x00\xffgarbage\n[1, 2]\n")
    done = run_cli("plot", str(run))
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert done.stderr.splitlines()[-1] == f"error: {run / 'metrics.jsonl'}: no step records to plot" + (
        " (JSON lines with a numeric 'step')"
    )


# ---------------------------------------------------------------- recipes as users edit and name them


def test_a_key_given_twice_in_a_recipe_file_is_refused_naming_both_lines(tmp_path):
    """A section appended to a copied recipe replaced the whole section with its defaults: llama2-7b trained in fp32
    (its `precision: dtype: bf16` thrown away) with exit 0."""
    text = (REPO / "recipes/llama2/llama2-7b.yaml").read_text()
    path = tmp_path / "my-llama2-7b.yaml"
    path.write_text(text + "precision:\n  stochastic_rounding: false\n")
    first = 1 + text.splitlines().index("precision:")
    with pytest.raises(RecipeError, match=rf"line {len(text.splitlines()) + 1}: key 'precision' appears twice \(first"
                                          rf" at line {first}\); give each once"):  # fmt: skip
        load_recipe(str(path), 16)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            "  max_steps: [100\n",
            "not valid YAML at line {next}, column 12: while parsing a flow sequence (from line"
            " {line}, column 14), expected ',' or ']', but got ':'",
        ),  # unclosed: read on into the next line
        (
            "\tmax_steps: 100\n",
            "not valid YAML at line {line}, column 1: while scanning for the next token, found"
            " character '\\t' that cannot start any token",
        ),
        ("  max_steps: 100\n  seedd: 1\n", "recipe mine.yaml: train.seedd: unknown key; valid keys here: max_steps,"),
    ],
    ids=["unclosed bracket", "tab", "one unknown key"],
)
def test_a_recipe_files_one_mistake_is_one_line_naming_where(tmp_path, edit, message):
    """PyYAML's own message ran to four to six lines with an excerpt of the file; one problem in a recipe was two
    lines. The edit replaces train.max_steps' line."""
    text = (REPO / "recipes/pythia/pythia-tiny.yaml").read_text()
    assert "  max_steps: 100\n" in text
    path = tmp_path / "mine.yaml"
    path.write_text(text.replace("  max_steps: 100\n", edit))
    line_no = 1 + text.splitlines().index("  max_steps: 100")
    done = run_cli("show", "--recipe", str(path), "--nodes", "1")
    assert done.returncode == 2
    (line,) = done.stderr.splitlines()
    expected = message.format(line=line_no, next=line_no + 1)
    assert line == f"error: {path}: {expected}" if "YAML" in message else line.startswith(f"error: {expected}"), line


def test_numbers_read_as_written_and_times_stay_text(tmp_path):
    """YAML 1.1's rules made train.seed=0777 the number 511 and checkpoint.every_steps=1:00 sixty, and refused
    slurm.time_limit 48:00:00 (the docs' own value) as 172800."""
    r = load_recipe("pythia-tiny", 1, "train.seed=0777 train.max_steps=010 slurm.time_limit=48:00:00")
    assert (r.train.seed, r.train.max_steps, r.slurm.time_limit) == (777, 10, "48:00:00")
    path = tmp_path / "limits.yaml"
    path.write_text((REPO / "recipes/pythia/pythia-tiny.yaml").read_text() + "slurm:\n  time_limit: 12:00:00\n")
    assert load_recipe(str(path), 1).slurm.time_limit == "12:00:00"
    with pytest.raises(RecipeError, match=r"checkpoint\.every_steps: expected"):  # text now, not sixty
        load_recipe("pythia-tiny", 1, "checkpoint.every_steps=1:00")


def test_overrides_given_twice_are_both_applied_in_order(cli, tmp_path):
    """sbatch's own advice (`--overrides run_dir=...`) after a first --overrides dropped the first set."""
    out = tmp_path / "job"
    second = f"train.max_steps=20 run_dir={tmp_path / 'run'}"
    done = cli("sbatch", "--recipe", "pythia-tiny", "--nodes", "1", "--out", str(out), "--overrides",
               "optim.lr=1e-2 train.max_steps=7", "--overrides", second)  # fmt: skip
    assert done.returncode == 0, done.stderr
    r = load_recipe(str(out / "recipe.yaml"))
    assert (r.optim.lr, r.train.max_steps, r.run_dir) == (1e-2, 20, str(tmp_path / "run"))
    assert (
        "--overrides 'optim.lr=1e-2 train.max_steps=7 train.max_steps=20 run_dir="
        in json.loads((out / "provenance.json").read_text())["command"]
    )


def test_two_recipes_of_one_name_are_refused_naming_both(monkeypatch, tmp_path):
    from trnrecipes.config import recipe as recipes

    for folder in ("mine", "pythia"):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "pythia-tiny.yaml").write_text((REPO / "recipes/pythia/pythia-tiny.yaml").read_text())
    monkeypatch.setattr(recipes, "RECIPES_DIR", tmp_path)
    monkeypatch.setattr(recipes, "REPO_ROOT", tmp_path.parent)
    with pytest.raises(RecipeError, match=r"recipe 'pythia-tiny' is ambiguous: .*mine/pythia-tiny.yaml, .*pythia/py"):
        recipes.find_recipe("pythia-tiny")
