"""Llama 3.1 as users download it: a config.json with rope_type llama3 and a 128,256-token vocabulary, safetensors,
and a tokenizer.json of Llama 3's structure (tests/llama3_tokenizer.py builds a small stand-in: Meta's is gated),
through our tokenizer loader and `convert from-hf` / `to-hf` (bit-exact both ways, through the real CLI)."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from conftest import run_cli
from llama3_tokenizer import BOS, EOS, write_llama3_tokenizer
from safetensors.torch import load_file
from test_convert import save_random

from trnrecipes.checkpoint import read_model_checkpoint
from trnrecipes.data.tokenizer import load_tokenizer

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}  # fmt: skip


def test_the_llama3_tokenizer_loads_with_its_special_ids_and_encodes_as_transformers_does(tmp_path):
    path = write_llama3_tokenizer(tmp_path / "tok")
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    assert (ours.bos_id, ours.eos_id) == (theirs.bos_token_id, theirs.eos_token_id)
    assert ours.backend.id_to_token(ours.bos_id) == BOS and ours.backend.id_to_token(ours.eos_id) == EOS
    assert ours.engine == "tokenizers"  # not GPT-2's regex: tiktoken's fast path does not apply
    text = "It's 2024: 1234567 tokens\n\n  and we'LL see"
    ids = ours.encode(text)
    assert [theirs.bos_token_id, *ids] == theirs(text)["input_ids"]  # theirs adds BOS; a packed corpus does not
    assert ours.decode(ids) == text and len(ours.encode_batch([text])[0]) == len(ids)
    pieces = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == ["123", "456", "7"]  # Llama 3's regex: numbers in groups of at most three digits
    assert ours.vocab_size == ours.backend.get_vocab_size(with_added_tokens=True) > max(ids)


def llama3_hf_dir(path, vocab: int):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
        intermediate_size=96, max_position_embeddings=131072, rope_parameters={**ROPE, "rope_theta": 500000.0},
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(cfg)
    save_random(model, path)
    write_llama3_tokenizer(path)
    return model.eval()


def test_a_llama3_directory_converts_bit_exact_both_ways_with_its_rope_scaling_and_special_ids(tmp_path):
    tok = load_tokenizer(write_llama3_tokenizer(tmp_path / "probe"))
    original = llama3_hf_dir(tmp_path / "hf", tok.vocab_size)
    args = ["convert", "from-hf", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ckpt")]
    done = run_cli(*args, "--recipe", "llama3.1-tiny", env=OFFLINE)
    assert done.returncode == 0, done.stderr
    recipe, _, tokenizer = read_model_checkpoint(tmp_path / "ckpt")
    scaling = recipe.model.rope_scaling
    assert (recipe.model.rotary_base, scaling.factor, scaling.original_max_seq_len) == (500000.0, 8.0, 32)
    assert recipe.model.num_kv_heads == 2 and tokenizer is not None

    done = run_cli("convert", "to-hf", "--ckpt", str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), env=OFFLINE)
    assert done.returncode == 0, done.stderr
    before, after = load_file(tmp_path / "hf/model.safetensors"), load_file(tmp_path / "out/model.safetensors")
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)  # bit-exact through our layout and back
    config = json.loads((tmp_path / "out/config.json").read_text())
    assert config["rope_scaling"]["rope_type"] == "llama3" and config["rope_parameters"]["rope_theta"] == 500000.0
    assert (config["bos_token_id"], config["eos_token_id"]) == (tok.bos_id, tok.eos_id)  # its tokenizer's ids
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    tokens = torch.randint(0, tok.vocab_size, (2, 48))
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, original(tokens).logits)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "out").bos_token == BOS


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_tiny_recipe_renders_at_tp_up_to_4_over_its_one_kv_head(tp):
    from trnrecipes.config.recipe import load_recipe

    recipe = load_recipe("llama3.1-tiny", overrides=[f"layout.tp={tp}", f"cluster.workers_per_node={tp}"])
    assert recipe.model.num_kv_heads == 1 and recipe.model.rope_scaling.type == "llama3"


def test_plan_shows_aws_published_throughput_with_its_source_and_sbatch_renders_aws_layout(tmp_path):
    for name, seq_s, layout in (
        ("llama3.1-8b", "47.95 seq/s", "TP 32 x PP 1 x DP 32"),
        ("llama3.1-70b", "7.941 seq/s", "TP 32 x PP 8 x DP 4"),
    ):
        done = run_cli("plan", "--recipe", name, "--nodes", "32", "--no-data-check")
        assert done.returncode == 0, done.stderr
        assert f"throughput   {seq_s}" in done.stdout and f"parallelism  {layout}" in done.stdout
        assert "source       AWS trn1 training benchmarks (SDK 2.24): Llama-3.1-" in done.stdout
    out = tmp_path / "job"
    done = run_cli("sbatch", "--recipe", "llama3.1-8b", "--nodes", "32", "--out", str(out), "--no-data-check",
                   env={"TRNRECIPES_RUNS": str(tmp_path / "runs")})  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "# Layout:   32 node(s) x 32 workers = 1024; TP 32 x PP 1 x DP 32" in (out / "run.sbatch").read_text()
    resolved = (out / "recipe.yaml").read_text()
    assert "tp: 32" in resolved and "zero1: true" in resolved and "num_kv_heads: 8" in resolved
