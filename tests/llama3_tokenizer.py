"""A stand-in for Llama 3's tokenizer with its structure (Meta's is gated: no download here): byte-level BPE with
ignore_merges, tiktoken-style pre-tokenization (Llama 3's split regex, then ByteLevel without its own regex),
ByteLevel decoding, <|begin_of_text|> / <|end_of_text|> special tokens named in tokenizer_config.json, and
transformers' TemplateProcessing that prefixes BOS (which our loader never applies: it encodes without specials).
Only the vocabulary is small: BPE trained here on a few lines."""

from __future__ import annotations

import json
from pathlib import Path

# Llama 3's pre-tokenization regex (tokenizer.json of Meta-Llama-3.1-8B, pre_tokenizer.pretokenizers[0]).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
    r"\s+(?!\S)|\s+"
)
BOS, EOS = "<|begin_of_text|>", "<|end_of_text|>"
TEXT = [
    "The quick brown fox jumps over the lazy dog. It's 2024, and 12345 tokens later we'll see.",
    "def main():\n    return 42  # the answer\n",
    "Trainium trains Llama 3.1 8B on 32 trn1.32xlarge nodes with TP 32.",
] * 20


def write_llama3_tokenizer(path: Path, vocab_size: int = 400) -> Path:
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=[]
    )
    tok.train_from_iterator(TEXT, trainer)
    tok.add_special_tokens([BOS, EOS])
    bos = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos)]
    )
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": BOS,
        "eos_token": EOS,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
