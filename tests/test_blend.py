"""data.sources end to end: the trainer blends corpora by weight and resumes a blend bitwise; a checkpoint from the
old document order restarts at its next epoch saying why; sbatch refuses a bad blend before writing anything; plan
prints each source's share and epochs."""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pytest
import yaml
from conftest import REPO
from test_resume import assert_bitwise_equal, config, final_weights, finish, start

from trnrecipes.config.recipe import load_recipe
from trnrecipes.config.sections import RecipeError
from trnrecipes.data.arrow import read_arrow, write_table
from trnrecipes.jobs.data_check import data_problems
from trnrecipes.jobs.data_plan import data_plan, format_data_plan

DEMO = REPO / "data/demo/pythondocs.arrow"


def second_corpus(path: Path, column: str = "text") -> Path:
    """Another corpus: the demo's documents reversed line by line, in 7-row record batches."""
    texts = ["\n".join(reversed(t.splitlines())) for t in read_arrow(DEMO).to_pylist()[:300]]
    schema = pa.schema([pa.field(column, pa.large_string())])
    batches = [pa.record_batch([pa.array(texts[i : i + 7], pa.large_string())], schema=schema)
               for i in range(0, len(texts), 7)]  # fmt: skip
    write_table(pa.Table.from_batches(batches, schema), path)
    return path


def blend_overrides(other: Path | str, weights=(3, 1)) -> list[str]:
    sources = [{"path": str(DEMO), "weight": weights[0]}, {"path": str(other), "weight": weights[1]}]
    return ["data.path=null", f"data.sources={json.dumps(sources)}"]


@pytest.mark.slow
def test_training_on_a_blend_resumes_bitwise_and_a_checkpoint_of_the_old_order_restarts_its_epoch(tmp_path):
    other = second_corpus(tmp_path / "other.arrow")
    blend = blend_overrides(other)
    straight, stopped, old = (tmp_path / name for name in ("straight", "stopped", "old"))
    for d in (straight, stopped, old):
        d.mkdir()
    finish(start(config(straight, *blend, "train.max_steps=6", "checkpoint.every_steps=3")))
    finish(start(config(stopped, *blend, "train.max_steps=3", "checkpoint.every_steps=3")))
    position = json.loads((stopped / "run/checkpoints/step_3/data-dp0000.json").read_text())
    counts = [p["samples"] for p in position["sources"]]
    assert position["samples"] == sum(counts) == 3 * 4 and counts == [9, 3]  # 3 steps x global batch 4, by 3:1
    out = finish(start(config(stopped, *blend, "train.max_steps=6", "checkpoint.every_steps=3")))
    assert "resuming from" in out and "positions do not carry over" not in out
    assert_bitwise_equal(final_weights(stopped / "run", 6), final_weights(straight / "run", 6))

    # The same checkpoint as a trnrecipes before order.py wrote it: no data_order in state.json and no data.sources
    # in its recipe.yaml (the manifest updated to match).
    finish(start(config(old, "train.max_steps=3", "checkpoint.every_steps=3")))
    step = old / "run/checkpoints/step_3"
    state = json.loads((step / "state.json").read_text())
    assert state.pop("data_order") == 2
    (step / "state.json").write_text(json.dumps(state))
    saved = yaml.safe_load((step / "recipe.yaml").read_text())
    assert saved["data"].pop("sources") == []
    (step / "recipe.yaml").write_text(yaml.safe_dump(saved, sort_keys=False))
    manifest = json.loads((step / "manifest.json").read_text())
    for name in ("state.json", "recipe.yaml"):
        manifest["files"][name] = hashlib.sha256((step / name).read_bytes()).hexdigest()
    (step / "manifest.json").write_text(json.dumps(manifest))
    out = finish(start(config(old, "train.max_steps=4", "checkpoint.every_steps=3")))
    said = [line for line in out.splitlines() if "document order version 1" in line]
    assert len(said) == 1 and re.search(r"the data stream restarts at epoch 1$", said[0]), out


def test_sbatch_refuses_a_bad_blend_and_writes_nothing(cli, tmp_path):
    other = second_corpus(tmp_path / "other.arrow")
    out = tmp_path / "job"

    def sbatch(*overrides: str):
        quoted = " ".join(f"'{o}'" for o in overrides)
        return cli("sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(out), "--overrides", quoted)

    cases = {
        "weight 0": (blend_overrides(other, (1, 0)), "data.sources[1].weight: must be a positive number"),
        "weight -1": (blend_overrides(other, (-1, 1)), "data.sources[0].weight: must be a positive number"),
        "missing": (blend_overrides(tmp_path / "gone.arrow"), f"data.sources[1].path {tmp_path / 'gone.arrow'}:"),
        "not text": (blend_overrides(second_corpus(tmp_path / "ints.arrow", "body")), "has no column 'text'"),
        "twice": (blend_overrides(DEMO), "is listed twice"),
        "twice, spelt two ways": (blend_overrides(f"{DEMO.parent}/./{DEMO.name}"), "is listed twice"),
        "weights overflow": (blend_overrides(other, (1.7e308, 1.7e308)), "the weights' sum is not a finite number"),
        "both": (["data.sources=" + json.dumps([{"path": str(other), "weight": 1}])], "are both set: give one"),
    }
    for name, (overrides, says) in cases.items():
        done = sbatch(*overrides)
        assert done.returncode == 2 and not out.exists(), (name, done.stderr)
        assert says in done.stderr and "Traceback" not in done.stderr, (name, done.stderr)
    with pytest.raises(RecipeError, match="expected a number, got nan"):
        load_recipe("llama2-tiny", overrides=[*blend_overrides(other)[:1], "data.sources=[{path: a, weight: .nan}]"])
    done = sbatch(*blend_overrides(other))
    assert done.returncode == 0 and (out / "run.sbatch").is_file(), done.stderr


def test_a_megatron_source_made_by_another_tokenizer_is_refused(cli, tmp_path):
    texts = tmp_path / "docs.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in read_arrow(DEMO).to_pylist()[:20]))
    prefix = tmp_path / "gpt2_docs"
    done = cli("data", "preprocess", "--in", str(texts), "--tokenizer", "data/tokenizers/gpt2", "--out", str(prefix))
    assert done.returncode == 0, done.stderr
    assert json.loads(Path(f"{prefix}.tokenizer.json").read_text())["tokenizer"] == "data/tokenizers/gpt2"
    sources = [{"path": str(DEMO), "weight": 1}, {"path": str(prefix), "weight": 1, "format": "megatron"}]
    overrides = ["data.path=null", f"data.sources={json.dumps(sources)}"]
    demo_sp = load_recipe("llama2-tiny", overrides=overrides)  # its tokenizer: demo-sp
    (problem,) = data_problems(demo_sp, REPO)
    assert problem.startswith(f"data.sources[1].path {prefix}: tokenized with data/tokenizers/gpt2, not data.tokenizer")
    gpt2 = load_recipe("llama2-tiny", overrides=[*overrides, "data.tokenizer=data/tokenizers/gpt2",
                                                 "model.vocab_size=50304"])  # fmt: skip
    assert data_problems(gpt2, REPO) == []


def megatron_pair(prefix: Path, documents: list[list[int]]) -> None:
    import warnings

    import numpy as np

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # megatron-core's import-time notices
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    builder = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for doc in documents:
        builder.add_document(np.array(doc, dtype=np.uint16), [len(doc)])
    builder.finalize(f"{prefix}.idx")


def test_a_tokenizer_record_left_beside_a_replaced_pair_is_not_trusted(cli, tmp_path):
    """Another tokenizer's .bin/.idx copied over a pair (or Megatron's preprocess_data.py run again with its prefix)
    leaves the old PREFIX.tokenizer.json: its sizes no longer match, so the ids are scanned, not taken from it."""
    texts = tmp_path / "docs.jsonl"
    texts.write_text("".join(json.dumps({"text": t}) + "\n" for t in read_arrow(DEMO).to_pylist()[:20]))
    done = cli("data", "preprocess", "--in", str(texts), "--tokenizer", "data/tokenizers/demo-sp", "--out",
               str(tmp_path / "ours"))  # fmt: skip
    assert done.returncode == 0, done.stderr
    megatron_pair(tmp_path / "gpt2", [[464 + i, 257, 50256] for i in range(30)])  # GPT-2's: ids past 4,096
    job = ["sbatch", "--recipe", "llama2-tiny", "--nodes", "1", "--out", str(tmp_path / "job"), "--overrides"]
    overrides = f"data.format=megatron data.path={tmp_path / 'ours'} run_dir={tmp_path / 'run'}"
    assert cli(*job, overrides).returncode == 0
    shutil.rmtree(tmp_path / "job")
    for suffix in (".bin", ".idx"):
        shutil.copy(tmp_path / f"gpt2{suffix}", tmp_path / f"ours{suffix}")
    done = cli(*job, overrides)
    assert done.returncode == 2 and not (tmp_path / "job").exists(), done.stderr
    (problem,) = done.stderr.splitlines()[1:]
    assert problem.endswith(
        "token id 50,256 (found in it) is at or above model.vocab_size 4,096: made by another"
        " tokenizer than this model's? Re-make it with `trnrecipes data preprocess --tokenizer"
        " <this model's tokenizer>` or set model.vocab_size above 50,256"
    ), done.stderr


def test_plan_prints_each_sources_share_tokens_and_epochs(tmp_path):
    other = second_corpus(tmp_path / "other.arrow")
    recipe = load_recipe("llama2-tiny", overrides=[*blend_overrides(other), "train.max_steps=1000"])
    plans = data_plan(recipe, REPO)
    samples = 1000 * recipe.batch.global_batch
    assert [p.share for p in plans] == [0.75, 0.25]
    assert [p.samples for p in plans] == [samples * 3 // 4, samples // 4]
    assert [p.tokens for p in plans] == [p.samples * (recipe.batch.seq_len + 1) for p in plans]
    # the second corpus holds 300 of the demo's documents reversed: about their share of its tokens
    demo, small = plans[0].corpus_tokens, plans[1].corpus_tokens
    assert 300 / len(read_arrow(DEMO)) * 0.7 < small / demo < 300 / len(read_arrow(DEMO)) * 1.3
    lines = format_data_plan(plans, 1000)
    assert lines[0].split() == ["data", "2", "sources", "blended", "by", "weight", "over", "1,000", "steps"]
    assert re.search(rf"75\.0% +{plans[0].tokens:,} tokens +~{plans[0].epochs:,.2f} epochs of ~[0-9.]+M tokens +{DEMO}",
                     lines[1]), lines[1]  # fmt: skip
    assert lines[2].split()[0] == "25.0%" and lines[2].endswith(str(other))
    assert all(p.epochs is None for p in data_plan(recipe, REPO, look=False))
