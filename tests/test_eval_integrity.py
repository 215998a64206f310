"""`eval run` scores the weights it says it scores, and never runs code from a model directory.

- The HF export in OUT/hf records the checkpoint it came from (the sha256 of its manifest.json); a run for another
  checkpoint into the same --out exports again, atomically, and results.json names the checkpoint, step and hash.
- Every model and tokenizer load passes trust_remote_code=False: a model directory whose config asks to run its own
  code is refused, even with "y" waiting on stdin for transformers' "run the custom code?" prompt.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO
from safetensors.torch import load_file

from eval.run import run
from trnrecipes.checkpoint import CheckpointError, write_model_checkpoint
from trnrecipes.config.recipe import load_recipe
from trnrecipes.convert import to_hf
from trnrecipes.models import build_model

SMALL = ["model.vocab_size=64", "model.hidden_size=32", "model.num_layers=1", "model.num_heads=2",
         "model.ffn_hidden_size=64"]  # fmt: skip


def checkpoint(path: Path, step: int, seed: int) -> Path:
    recipe = load_recipe("pythia-tiny", overrides=SMALL)
    torch.manual_seed(seed)
    return write_model_checkpoint(path / f"step_{step}", build_model(recipe.model).state_dict(), recipe, step=step)


def manifest_sha256(ckpt: Path) -> str:
    return hashlib.sha256((ckpt / "manifest.json").read_bytes()).hexdigest()


def scored(out: Path) -> dict:
    return json.loads((out / "results.json").read_text())["checkpoint"]


def ended_early(out: Path) -> None:
    """An eval killed before its results were written (in lm-eval, hours in): its export stays, and another
    checkpoint's eval into the same dir replaces it (a dir with results is refused: eval/run.py earlier_rows)."""
    for name in ("results.json", "results.md"):
        (out / name).unlink()


def test_a_second_checkpoint_into_the_same_out_is_exported_again_and_named(tmp_path):
    one, two = checkpoint(tmp_path / "ckpts", 1, seed=1), checkpoint(tmp_path / "ckpts", 2, seed=2)
    out = tmp_path / "eval"
    run(one, out, [], tmp_path)  # no tasks: the export and results.json alone
    assert scored(out) == {"path": str(one), "step": 1, "manifest_sha256": manifest_sha256(one),
                           "trnrecipes_checkpoint": True}  # fmt: skip
    with pytest.raises(ValueError, match="holds the results of other weights"):  # they would be replaced
        run(two, out, [], tmp_path)
    ended_early(out)

    run(two, out, [], tmp_path)
    assert scored(out) == {"path": str(two), "step": 2, "manifest_sha256": manifest_sha256(two),
                           "trnrecipes_checkpoint": True}  # fmt: skip
    reference = load_file(to_hf(two, tmp_path / "reference") / "model.safetensors")
    exported = load_file(out / "hf/model.safetensors")
    assert exported.keys() == reference.keys() and all(torch.equal(exported[k], reference[k]) for k in reference)
    assert sorted(p.name for p in out.iterdir()) == ["hf", "results.json", "results.md"]  # no staging dirs left

    weights = (out / "hf/model.safetensors").stat()
    run(two, out, [], tmp_path)  # the same checkpoint again: the export is reused
    assert (out / "hf/model.safetensors").stat().st_ino == weights.st_ino


def test_an_export_without_its_record_is_redone(tmp_path):
    one = checkpoint(tmp_path / "ckpts", 1, seed=1)
    out = tmp_path / "eval"
    run(one, out, [], tmp_path)
    (out / "hf/trnrecipes-source.json").unlink()  # as an export made before the record existed
    weights = (out / "hf/model.safetensors").stat()
    run(one, out, [], tmp_path)
    assert (out / "hf/model.safetensors").stat().st_ino != weights.st_ino
    assert json.loads((out / "hf/trnrecipes-source.json").read_text())["manifest_sha256"] == manifest_sha256(one)


def test_a_failed_export_leaves_the_previous_one_whole_and_nothing_half_done(tmp_path):
    one, two = checkpoint(tmp_path / "ckpts", 1, seed=1), checkpoint(tmp_path / "ckpts", 2, seed=2)
    out = tmp_path / "eval"
    run(one, out, [], tmp_path)
    ended_early(out)
    with (two / "model.safetensors").open("r+b") as f:  # corrupt: the export of two must fail
        f.truncate(100)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        run(two, out, [], tmp_path)
    assert sorted(p.name for p in out.iterdir()) == ["hf"]
    record = json.loads((out / "hf/trnrecipes-source.json").read_text())
    assert record["manifest_sha256"] == manifest_sha256(one)  # still one's export, and it says so


def test_an_hf_directory_is_named_as_not_a_checkpoint(tmp_path):
    one = checkpoint(tmp_path / "ckpts", 1, seed=1)
    hf = to_hf(one, tmp_path / "hf")
    run(hf, tmp_path / "eval", [], tmp_path)
    seq_len = load_recipe("pythia-tiny", overrides=SMALL).batch.seq_len
    source = {"path": str(one), "step": 1, "manifest_sha256": manifest_sha256(one), "recipe": "pythia-tiny"}
    assert scored(tmp_path / "eval") == {
        "path": str(hf.resolve()),
        "trnrecipes_checkpoint": False,
        "exported_from": source | {"seq_len": seq_len},
    }


def remote_code_dir(path: Path, tokenizer: bool) -> Path:
    """A model directory whose config names its own code for the config, model and tokenizer; importing that code
    creates `ran`. With `tokenizer`, also a plain tokenizer, so that loading gets as far as the model."""
    path.mkdir()
    auto_map = {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel",
                "AutoTokenizer": ["evil.EvilTokenizer", None]}  # fmt: skip
    if tokenizer:
        from tokenizers import Tokenizer, models
        from transformers import PreTrainedTokenizerFast

        plain = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
        PreTrainedTokenizerFast(tokenizer_object=plain, unk_token="[UNK]").save_pretrained(path)
    (path / "config.json").write_text(json.dumps({"model_type": "trn_remote_code_test", "auto_map": auto_map}))
    (path / "evil.py").write_text(f"open({str(path / 'ran')!r}, 'w').close()\n")
    return path


HUMANEVAL_LOAD = "from eval.run import load_model; load_model(sys.argv[1], 'cpu')"
LM_EVAL_LOAD = (  # as simple_evaluate loads model="hf" with our model_args
    "from lm_eval.api.registry import get_model; from eval.run import model_args;"
    " get_model('hf').create_from_arg_string(model_args(sys.argv[1], 64, 'cpu'))"
)


@pytest.mark.parametrize(
    ("load", "tokenizer", "refusal"),
    [
        (HUMANEVAL_LOAD, False, "Couldn't instantiate the backend tokenizer"),  # its own tokenizer code: not run
        (HUMANEVAL_LOAD, True, "trust_remote_code=True"),  # the tokenizer loads; its own model code: refused
        (LM_EVAL_LOAD, True, "trust_remote_code=True"),
    ],
)
def test_code_in_a_model_directory_never_runs(tmp_path, load, tokenizer, refusal):
    model = remote_code_dir(tmp_path / "model", tokenizer)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home")}
    # "y" on stdin: what transformers' "Do you wish to run the custom code? [y/N]" prompt would read
    done = subprocess.run([sys.executable, "-c", f"import sys; {load}", str(model)], input="y\n", cwd=REPO,
                          capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert done.returncode != 0 and refusal in done.stderr, done.stderr[-2000:]
    assert "Do you wish to run the custom code" not in done.stdout + done.stderr
    assert not (model / "ran").exists()
