"""`trnrecipes convert from-hf / to-hf` through the real CLI, checked with transformers' from_pretrained offline."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import run_cli
from tokenizers import Tokenizer, models, pre_tokenizers

from trnrecipes.checkpoint import read_model_checkpoint
from trnrecipes.config.recipe import load_recipe
from trnrecipes.models import build_model

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def save_random(model, path) -> None:
    """Weights drawn N(0, 0.1) (transformers' init leaves norms at one and biases at zero), saved as HF saves them."""
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    model.save_pretrained(path)


def tiny_hf_dir(path, family: str):
    torch.manual_seed(0)
    if family == "neox":
        cfg = transformers.GPTNeoXConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            rotary_pct=0.25, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.GPTNeoXForCausalLM(cfg)
    else:
        cfg = transformers.LlamaConfig(
            vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=96, max_position_embeddings=64,
        )  # fmt: skip
        model = transformers.LlamaForCausalLM(cfg)
    save_random(model, path)
    # A real (word-level) tokenizer, so the tokenizer files travel through both conversions.
    vocab = {f"w{i}": i for i in range(63)} | {"[UNK]": 63}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(path)
    return model.eval()


@pytest.mark.parametrize("family", ["neox", "llama2"])
def test_hf_to_checkpoint_to_hf_keeps_logits_and_tokenizer(family, tmp_path):
    original = tiny_hf_dir(tmp_path / "hf", family)
    done = run_cli("convert", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), env=OFFLINE)
    assert done.returncode == 0, done.stderr
    recipe, state, tokenizer = read_model_checkpoint(tmp_path / "ckpt")
    assert set(state) == set(build_model(recipe.model, "meta").state_dict())
    assert recipe.model.family == family and recipe.model.hidden_size == 64 and tokenizer is not None
    assert recipe.name == f"{family}-tiny"  # training settings from the family's tiny recipe

    done = run_cli("convert", "to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), env=OFFLINE)
    assert done.returncode == 0, done.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, 64, (2, 20))
    with torch.no_grad():
        torch.testing.assert_close(loaded(tokens).logits, original(tokens).logits, rtol=1e-5, atol=1e-5)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("w3 w5 w7")["input_ids"] == [3, 5, 7]


def test_from_hf_takes_training_settings_from_a_recipe(tmp_path):
    tiny_hf_dir(tmp_path / "hf", "neox")  # max_position_embeddings 64
    args = ["convert", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"), "--recipe"]
    done = run_cli(*args, "pythia-tiny", env=OFFLINE)
    assert done.returncode == 2 and "batch.seq_len 128 exceeds model.max_seq_len 64" in done.stderr
    done = run_cli(*args, "neox-tiny", env=OFFLINE)
    assert done.returncode == 0, done.stderr
    recipe, _, _ = read_model_checkpoint(tmp_path / "ckpt")
    assert recipe.name == "neox-tiny" and recipe.model.num_heads == 4  # the model comes from config.json
    done = run_cli(*args[:-3], "--out", str(tmp_path / "c2"), "--recipe", "llama2-tiny", env=OFFLINE)
    assert done.returncode == 2 and "llama2-tiny is a llama2 recipe" in done.stderr


def test_clear_errors(tmp_path):
    done = run_cli("convert", "from-hf", "--hf", str(tmp_path), "--out", str(tmp_path / "c"))
    assert done.returncode == 2 and "config.json: not found" in done.stderr
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["T5ForConditionalGeneration"], "model_type": "t5"})
    )
    done = run_cli("convert", "from-hf", "--hf", str(tmp_path), "--out", str(tmp_path / "c"))
    assert (
        done.returncode == 2
        and "not a supported family; supported: GPTNeoXForCausalLM, LlamaForCausalLM, BertForSequenceClassification"
        in done.stderr
    )
    assert not (tmp_path / "c").exists()


def test_a_corrupt_checkpoint_is_refused_and_names_the_file(tmp_path):
    tiny_hf_dir(tmp_path / "hf", "neox")
    assert run_cli("convert", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")).returncode == 0
    weights = tmp_path / "ckpt" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-10] ^= 0xFF
    weights.write_bytes(bytes(data))
    done = run_cli("convert", "to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and f"{weights}: checksum mismatch" in done.stderr
    assert not (tmp_path / "out").exists()
    (tmp_path / "ckpt" / "done").unlink()
    done = run_cli("convert", "to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"))
    assert "no 'done' marker" in done.stderr
    done = run_cli("convert", "to-hf", "--ckpt", str(tmp_path / "nope"), "--out", str(tmp_path / "out"))
    assert done.returncode == 2 and f"{tmp_path / 'nope'}: does not exist" in done.stderr  # not "no 'done' marker"
    done = run_cli("convert", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt"))
    assert done.returncode == 2 and f"--out {tmp_path / 'ckpt'} would write into checkpoint" in done.stderr


def test_a_bad_config_or_a_tokenizer_without_tokenizer_json_is_refused_before_anything_is_written(tmp_path, capsys):
    from trnrecipes.cli import main

    hf = tmp_path / "hf"
    tiny_hf_dir(hf, "llama2")
    capsys.readouterr()  # transformers' progress bar
    config = json.loads((hf / "config.json").read_text())

    def convert(out: str) -> tuple[int, str]:
        code = main(["convert", "from-hf", "--hf", str(hf), "--out", str(tmp_path / out)])
        return code, capsys.readouterr().err

    text = config | {"hidden_size": "64"}  # was told 'head_dim 16 != hidden_size / num_attention_heads = 64/4'
    for bad, says in (([1, 2], "holds a JSON list, not a model config"),  # was an AttributeError traceback
                      (text, 'hidden_size is "64", text; write it as a JSON number')):  # fmt: skip
        (hf / "config.json").write_text(json.dumps(bad))
        code, err = convert("bad")
        assert code == 2 and says in err and err.count("\n") == 1, err
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "tokenizer.json").unlink()  # a BERT's vocab.txt or a GPT-2's vocab.json alone: the checkpoint could not
    code, err = convert("no-json")  # tokenize (predict, embed and eval failed on it later)
    assert code == 2 and "but no tokenizer.json, the one trnrecipes reads: write it with transformers first" in err
    assert not (tmp_path / "bad").exists() and not (tmp_path / "no-json").exists()
    for f in hf.glob("*.json"):
        if f.name != "config.json":
            f.unlink()
    code, err = convert("none")  # converted, and told whose tokenizer its users will get
    assert code == 0 and f"note: {hf} holds no tokenizer files, so neither does the checkpoint" in err
    assert f"its recipe's data.tokenizer {load_recipe('llama2-tiny').data.tokenizer}" in err
    for f in hf.glob("*.safetensors"):
        f.unlink()
    code, err = convert("no-weights")
    assert code == 2 and err.startswith(f"error: {hf}: no *.safetensors weights (found: "), err  # named twice


def test_to_hf_names_the_auto_class_that_loads_the_export_whole(tmp_path):
    from trnrecipes.cli import _auto_class

    for architecture, auto in (("BertForSequenceClassification", "AutoModelForSequenceClassification"),
                               ("BertModel", "AutoModel"), ("LlamaForCausalLM", "AutoModelForCausalLM")):  # fmt: skip
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
        assert _auto_class(tmp_path) == auto  # a classifier told AutoModelForCausalLM lost its trained head


def test_checkpoints_and_exports_are_readable_by_the_group_as_the_umask_allows(tmp_path):
    """mkdtemp (0700) and safetensors (0600) kept a team's shared storage from reading a checkpoint or an export."""
    import os
    import stat

    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.checkpoint.writer import write_files
    from trnrecipes.convert import to_hf

    recipe = load_recipe("llama2-tiny")
    old = os.umask(0o022)
    try:
        ckpt = write_model_checkpoint(tmp_path / "ckpt", build_model(recipe.model).state_dict(), recipe)
        to_hf(ckpt, tmp_path / "hf")
        (tmp_path / "rank").mkdir()
        write_files(tmp_path / "rank", {"optim-tp00-of-01.safetensors": {"m": torch.zeros(2)}})  # a training save's
    finally:
        os.umask(old)
    made = [ckpt, ckpt / "model.safetensors", tmp_path / "hf", tmp_path / "hf/model.safetensors",
            tmp_path / "rank/optim-tp00-of-01.safetensors"]  # fmt: skip
    modes = {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in made}
    assert all(stat.S_IMODE(p.stat().st_mode) & 0o044 == 0o044 for p in made), modes


def test_storage_that_refuses_modes_keeps_its_own_and_a_missing_file_is_still_an_error(tmp_path):
    """A FUSE object store or CIFS mount answers chmod with EPERM/ENOTSUP: the checkpoint stands as it wrote it.
    /proc's files refuse chmod with EPERM, even to root: a real refusal of the kernel's own."""
    import os

    from trnrecipes.files.durable import make_readable

    with pytest.raises(PermissionError):
        os.chmod("/proc/self/stat", 0o644)
    make_readable("/proc/self/stat")
    with pytest.raises(FileNotFoundError):  # not storage's refusal: a write that went missing
        make_readable(tmp_path / "gone.safetensors")


def test_a_round_trip_through_to_hf_keeps_the_recipe_and_its_length(tmp_path):
    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.checkpoint.format import checkpoint_recipe
    from trnrecipes.convert import from_hf, to_hf

    trained = load_recipe("pythia-tiny", overrides=["batch.seq_len=96"])  # not the template's (neox-tiny's) length
    ckpt = write_model_checkpoint(tmp_path / "ckpt", build_model(trained.model).state_dict(), trained)
    to_hf(ckpt, tmp_path / "hf")
    back = checkpoint_recipe(from_hf(tmp_path / "hf", tmp_path / "back"))
    assert (back.name, back.batch.seq_len) == ("pythia-tiny", 96)  # was neox-tiny's, and its 64 tokens
    assert back.data.tokenizer == trained.data.tokenizer and back.model == trained.model
    (tmp_path / "hf/added.safetensors").write_bytes((tmp_path / "hf/model.safetensors").read_bytes())  # changed since
    other = checkpoint_recipe(from_hf(tmp_path / "hf", tmp_path / "other"))
    assert other.name == "neox-tiny"  # its record no longer says what the directory holds: the family's template


def test_to_hf_takes_a_run_dir_as_eval_and_predict_do(tmp_path, capsys):
    from trnrecipes.checkpoint import write_model_checkpoint
    from trnrecipes.cli import main

    recipe = load_recipe("llama2-tiny")
    state = build_model(recipe.model).state_dict()
    for step in (2, 4):
        write_model_checkpoint(tmp_path / f"run/checkpoints/step_{step}", state, recipe, step=step)
    assert main(["convert", "to-hf", "--ckpt", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    assert f"exporting {tmp_path / 'run/checkpoints/step_4'}, the newest complete checkpoint" in capsys.readouterr().out
    assert json.loads((tmp_path / "hf/trnrecipes-source.json").read_text())["step"] == 4  # was: no 'done' marker
