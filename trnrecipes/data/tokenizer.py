"""Tokenizers as Hugging Face tokenizer directories (tokenizer.json + tokenizer_config.json).

Every tokenizer we train on is one such directory, whatever it came from: GPT-2 BPE vocab/merges files
(`from_gpt2_files`), a sentencepiece model we train (`train_sentencepiece`), or an HF directory a user has. So the
training reader, checkpoints (tokenizer/ is copied in), HF export and lm-eval all load the very same file.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trnrecipes.config.sections import RecipeError
from trnrecipes.data import listed
from trnrecipes.files.durable import make_readable
from trnrecipes.schema import clipped, shown


class TokenizerError(RecipeError):  # a user error: the CLI prints it, exit 2
    pass


# GPT-2's pre-tokenization regex, which the HF ByteLevel pre-tokenizer (use_regex=True) applies too.
GPT2_PATTERN = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""


@dataclass
class TextTokenizer:
    path: Path
    backend: object  # tokenizers.Tokenizer: the reference, and the engine unless a faster exact one exists
    eos_id: int
    vocab_size: int  # every id the tokenizer can emit is < vocab_size
    fast: object | None = None  # tiktoken.Encoding giving the same ids (GPT-2-style byte-level BPE only)
    # BERT-style specials (None where the tokenizer has none): a classification sample is [CLS] text [SEP] [PAD]...
    cls_id: int | None = None
    sep_id: int | None = None
    pad_id: int | None = None
    bos_id: int | None = None  # tokenizer_config.json's bos_token (Llama 3: <|begin_of_text|>); not added by encode

    @property
    def engine(self) -> str:
        return "tiktoken" if self.fast is not None else "tokenizers"

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """Both engines are Rust, multi-threaded and release the GIL: the background prefetch thread calls this."""
        if self.fast is not None:
            return [np.asarray(ids, dtype=np.int64) for ids in self.fast.encode_batch(texts, allowed_special="all")]
        encodings = self.backend.encode_batch_fast(texts, add_special_tokens=False)
        return [np.asarray(e.ids, dtype=np.int64) for e in encodings]

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=False)


def load_tokenizer(path: str | Path) -> TextTokenizer:
    from tokenizers import Tokenizer

    path = Path(path)
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        hint = ""
        if path.name in ("gpt2", "demo-sp") and path.parent.name == "tokenizers":
            hint = " (the demo tokenizers are made by `make setup`, or `trnrecipes data prepare-demo`)"
        raise TokenizerError(f"no tokenizer at {path}: expected an HF tokenizer directory with tokenizer.json{hint}")
    try:
        backend = Tokenizer.from_file(str(tok_file))
    except Exception as err:  # tokenizers raises a bare Exception for every malformed file
        raise TokenizerError(
            f"{tok_file}: not a valid Hugging Face tokenizer.json ({clipped(err)}); corrupt or truncated?"
        ) from None
    # A tokenizer.json may carry padding and truncation (sentence-transformers' ship both at 128): they would apply
    # to every encode. Ours pad and cut where the caller says (packing, trnrecipes/data/classify.py).
    backend.no_padding()
    backend.no_truncation()
    # tokenizer_config.json names the special tokens; bert-base-uncased's (and others') leave them to
    # special_tokens_map.json, which transformers reads under it
    config = _read_json(path / "special_tokens_map.json") | _read_json(path / "tokenizer_config.json")
    specials = {
        key: _special_id(backend, config.get(key))
        for key in ("eos_token", "sep_token", "cls_token", "pad_token", "bos_token")
    }
    # BERT's tokenizers name no eos_token: [SEP], which ends every sequence, stands in for it.
    eos_id = specials["eos_token"] if specials["eos_token"] is not None else specials["sep_token"]
    if eos_id is None and not any((path / n).is_file() for n in ("tokenizer_config.json", "special_tokens_map.json")):
        raise TokenizerError(
            f"{path} has no tokenizer_config.json, which names the eos_token that ends each document; copy it from"
            " where the tokenizer.json came from (a Hugging Face model or tokenizer repository holds both)"
        )
    if eos_id is None:
        raise TokenizerError(
            f"{path}/tokenizer_config.json (or special_tokens_map.json) names no eos_token (or sep_token) in the"
            " vocabulary"
            f" (got {shown(config.get('eos_token'))})"
        )
    return TextTokenizer(
        path,
        backend,
        eos_id,
        # every id it can emit is below this: the largest + 1, which is more than the count where ids are sparse
        max(backend.get_vocab_size(with_added_tokens=True), max(backend.get_vocab(True).values(), default=-1) + 1),
        _tiktoken_equivalent(tok_file),
        cls_id=specials["cls_token"],
        sep_id=specials["sep_token"],
        pad_id=specials["pad_token"],
        bos_id=specials["bos_token"],
    )


def _special_id(backend, token) -> int | None:
    """The id of a special token as tokenizer_config.json names it (a string or an AddedToken dict), or None."""
    if isinstance(token, dict):
        token = token.get("content")
    return backend.token_to_id(token) if isinstance(token, str) else None


def _tiktoken_equivalent(tok_file: Path):
    """A tiktoken Encoding with exactly the ids of this tokenizer.json, or None if it is not GPT-2-style.

    tiktoken is ~7x faster than tokenizers on GPT-2 BPE (2 cores, the demo corpus) and gives the same ids when
    the model is byte-level BPE with GPT-2's regex and no normalizer, and each merge's result has id 256 + its
    merge rank (GPT-2's own files; tiktoken merges by that rank). Anything else stays on tokenizers.
    """
    spec = json.loads(tok_file.read_text(encoding="utf-8"))
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if (
        model.get("type") != "BPE"
        or spec.get("normalizer")
        or pre.get("type") != "ByteLevel"
        or not pre.get("use_regex", True)
        or pre.get("add_prefix_space")
        or model.get("dropout")
        or model.get("continuing_subword_prefix")
        or model.get("end_of_word_suffix")
    ):
        return None
    import tiktoken

    decode = {c: b for b, c in _bytes_to_unicode().items()}
    vocab: dict[str, int] = model["vocab"]
    try:
        ranks = {bytes(decode[c] for c in token): i for token, i in vocab.items()}
    except KeyError:
        return None
    if sorted(ranks.values())[:256] != list(range(256)) or any(len(b) != 1 for b, i in ranks.items() if i < 256):
        return None
    for rank, merge in enumerate(model.get("merges", [])):
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        if vocab.get(a + b) != 256 + rank:
            return None
    specials = {t["content"]: t["id"] for t in spec.get("added_tokens", [])}
    if any(t in vocab and vocab[t] != i for t, i in specials.items()):
        return None
    ranks = {b: i for b, i in ranks.items() if i not in specials.values()}
    return tiktoken.Encoding(tok_file.parent.name, pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used in byte-level BPE vocabularies."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    printable += list(range(ord("®"), ord("ÿ") + 1))
    mapping, extra = {}, 0
    for b in range(256):
        if b in printable:
            mapping[b] = chr(b)
        else:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        return {}
    except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
        raise TokenizerError(f"{path}: not valid JSON ({clipped(err)})") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def from_gpt2_files(vocab: Path, merges: Path, out: Path) -> Path:
    """GPT-2 byte-level BPE from its vocab (encoder.json / vocab.json) and merges (vocab.bpe / merges.txt)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

    for f in (vocab, merges):
        if not Path(f).is_file():
            raise TokenizerError(f"GPT-2 tokenizer file {f} does not exist")
    try:
        backend = Tokenizer(models.BPE.from_file(str(vocab), str(merges)))
    except Exception as err:  # tokenizers raises a bare Exception for malformed files
        raise TokenizerError(f"GPT-2 files {vocab} and {merges}: not readable ({clipped(err)})") from None
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    eos = "<|endoftext|>"
    if backend.token_to_id(eos) is None:
        raise TokenizerError(f"{vocab} has no {eos} token: not a GPT-2 vocabulary")
    backend.add_special_tokens([eos])
    config = {
        "tokenizer_class": "GPT2Tokenizer",
        "bos_token": eos,
        "eos_token": eos,
        "unk_token": eos,
        "add_prefix_space": False,
        "model_max_length": 1024,
    }
    return _save(backend, config, out)


def train_sentencepiece(texts: Iterator[str], vocab_size: int, out: Path, max_sentences: int = 2_000_000) -> Path:
    """Llama-style tokenizer: sentencepiece BPE with byte fallback (no unknown tokens), <unk>=0 <s>=1 </s>=2.

    Writes tokenizer.model and, converted by transformers, tokenizer.json, so it loads like any HF tokenizer.
    """
    import sentencepiece as spm
    from transformers import LlamaTokenizer

    if vocab_size < 300:  # 3 specials + 256 byte-fallback pieces, plus room for merges
        raise TokenizerError(f"--vocab-size {vocab_size} is too small for byte fallback; use at least 300")
    with tempfile.TemporaryDirectory() as tmp:
        prefix = Path(tmp) / "tokenizer"
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=(line for line in texts if line.strip()),
                model_prefix=str(prefix),
                vocab_size=vocab_size,
                model_type="bpe",
                byte_fallback=True,
                character_coverage=0.9995,
                split_digits=True,
                allow_whitespace_only_pieces=True,
                normalization_rule_name="identity",  # as Llama 2: no NFKC, and whitespace kept as is (code!)
                remove_extra_whitespaces=False,
                add_dummy_prefix=True,
                input_sentence_size=max_sentences,
                shuffle_input_sentence=True,
                unk_id=0,
                bos_id=1,
                eos_id=2,
                pad_id=-1,
                minloglevel=2,
            )
        except RuntimeError as err:  # e.g. vocab larger than the corpus can fill
            said = " ".join(str(err).split())
            if most := re.search(r"Vocabulary size too high \(\d+\)\. Please set it to a value <= (\d+)", said):
                at_most = int(most.group(1))
                fix = (
                    f"use at most {at_most}"
                    if at_most >= 300
                    else "give it more text: byte fallback needs at least 300 pieces"
                )
                raise TokenizerError(
                    f"--vocab-size {vocab_size}: these texts hold pieces for at most {at_most}; {fix}"
                ) from None
            raise TokenizerError(f"sentencepiece training failed: {said}") from None
        staging = Path(tmp) / "hf"
        staging.mkdir()
        shutil.copy(str(prefix) + ".model", staging / "tokenizer.model")
        # transformers converts the sentencepiece model (via protobuf) into an equivalent tokenizer.json.
        hf = LlamaTokenizer.from_pretrained(staging, legacy=False, add_bos_token=False)
        hf.save_pretrained(staging)
        return _publish(staging, out)


def _save(backend, config: dict, out: Path) -> Path:
    with tempfile.TemporaryDirectory(dir=_parent(out)) as tmp:
        staging = Path(tmp) / "tok"
        staging.mkdir()
        backend.save(str(staging / "tokenizer.json"))
        (staging / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        return _publish(staging, out)


def _parent(out: Path) -> Path:
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent


# What a tokenizer directory holds (transformers' save_pretrained: the sentencepiece trainer's writes the first four),
# and all a tokenizer written over it may replace.
TOKENIZER_DIR_FILES = frozenset(
    ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model", "added_tokens.json",
     "chat_template.jinja", "vocab.json", "merges.txt", "vocab.txt")
)  # fmt: skip


def check_replaceable(out: Path) -> None:
    """RecipeError unless `out` is new, empty, or a tokenizer directory (a tokenizer.json and nothing but tokenizer
    files): a tokenizer replaces its output directory whole, and anything else there would be lost (a Hugging Face
    model directory holds a tokenizer.json beside its weights). The CLI checks before any work."""
    out = Path(out)
    held = sorted(p.name for p in out.iterdir()) if out.is_dir() else ["a file"] if out.exists() else []
    if held and "tokenizer.json" not in held:
        raise RecipeError(
            f"{out} exists and is not a tokenizer directory (it holds {listed(held)}; no tokenizer.json): writing"
            " the tokenizer would replace it; choose a new --out"
        )
    if others := [name for name in held if name not in TOKENIZER_DIR_FILES]:
        raise RecipeError(
            f"{out} holds {listed(others)} besides its tokenizer files: writing the tokenizer replaces the directory"
            " whole and would delete them; choose a new --out"
        )


def _publish(staging: Path, out: Path) -> Path:
    """Replace `out` with the finished directory in one rename (never a half-written tokenizer dir). An existing
    `out` is replaced only if it is a tokenizer directory (check_replaceable)."""
    out = Path(out)
    check_replaceable(out)
    _parent(out)
    final = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}."))
    shutil.rmtree(final)
    shutil.copytree(staging, final)
    make_readable(final)  # copytree kept the staging dir's 0700 (a TemporaryDirectory's)
    if out.exists():
        old = out.with_name(f".{out.name}.old")
        shutil.rmtree(old, ignore_errors=True)
        out.rename(old)
        final.rename(out)
        shutil.rmtree(old)
    else:
        final.rename(out)
    return out
