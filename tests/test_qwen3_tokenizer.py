"""Qwen3's tokenizer.json through the project's loader. The stand-in has the structure of Qwen/Qwen3-8B-Base's
(Qwen2TokenizerFast): NFC normalisation, a Split on Qwen2's regex (single digits, unlike Llama 3's groups of three)
then ByteLevel without its own regex, a BPE model, ByteLevel decoding, no BOS, <|endoftext|> / <|im_start|> /
<|im_end|> added after the vocabulary, tokenizer_class Qwen2Tokenizer. Only the vocabulary is small (BPE trained here
on a few lines); the real one is a download this machine cannot make."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from llama3_tokenizer import TEXT

from trnrecipes.data.tokenizer import load_tokenizer

# pre_tokenizer.pretokenizers[0] of Qwen/Qwen3-8B-Base's tokenizer.json (Qwen2's)
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def write_qwen3_tokenizer(path: Path, eos: str) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(vocab_size=400, initial_alphabet=alphabet, special_tokens=[]))
    tok.add_special_tokens(SPECIALS)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": eos, "pad_token": "<|endoftext|>", "add_bos_token": False,
              "tokenizer_class": "Qwen2Tokenizer", "model_max_length": 131072}  # fmt: skip
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


# the base model's config ends documents with <|endoftext|>; the post-trained Qwen3-8B's names <|im_end|>
@pytest.mark.parametrize("eos", ["<|endoftext|>", "<|im_end|>"])
def test_the_qwen3_tokenizer_loads_with_its_special_ids_and_encodes_as_transformers_does(tmp_path, eos):
    path = write_qwen3_tokenizer(tmp_path / "tok", eos)
    ours = load_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(path)
    assert ours.bos_id is None and theirs.bos_token_id is None  # Qwen has no BOS
    assert ours.eos_id == theirs.eos_token_id == ours.backend.token_to_id(eos)
    text = "It's 2024: 1234567 tokens\n\n  and we'LL see Ω café"
    ids = ours.encode(text)
    assert ids == theirs(text)["input_ids"]  # no BOS on either side
    assert ours.decode(ids) == text and list(ours.encode_batch([text])[0]) == ids
    pieces = [p for p, _ in ours.backend.pre_tokenizer.pre_tokenize_str("1234567")]
    assert pieces == list("1234567")  # Qwen's regex: one digit a piece
    assert ours.vocab_size == ours.backend.get_vocab_size(with_added_tokens=True) > max(ids)
