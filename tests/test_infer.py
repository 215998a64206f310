"""`trnrecipes predict` and `trnrecipes embed` (trnrecipes/infer.py) on tiny BERT checkpoints made from random
transformers models with `convert from-hf`: outputs against transformers and model.encode, accuracy on labelled
files, the kill-and-resume of embed (bitwise equal to an uninterrupted run), refusals, and no training-stack import.
"""

from __future__ import annotations

import json
import random
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pytest
import torch
import transformers
import yaml
from conftest import REPO
from safetensors.torch import load_file, save_file
from tokenizers import BertWordPieceTokenizer

import trnrecipes.infer
from trnrecipes.cli import main
from trnrecipes.data.classify import encode_texts
from trnrecipes.data.tokenizer import load_tokenizer
from trnrecipes.infer import load_classifier, open_checkpoint, predictions_path

WORDS = "the a cat dog sat ran on under mat log red blue big small quickly slowly and then it was not".split()
SEQ_LEN, NUM_LABELS, HIDDEN = 32, 3, 32
ROWS = 10_000
# The training stack and the Neuron SDK's modules (absent here: listed so the check would catch them on Trainium).
FORBIDDEN = ("trnrecipes.backends", "trnrecipes.parallel.nxd", "trnrecipes.optim", "trnrecipes.train", "torch_xla",
             "torch_neuronx", "neuronx_distributed", "libneuronxla", "torch_neuron")  # fmt: skip


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40))) for _ in range(n)]


def write_arrow(path, columns: dict) -> None:
    table = pa.table(columns)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def read_arrow_table(path) -> pa.Table:
    return pa.ipc.open_stream(pa.memory_map(str(path))).read_all()


def hf_dir(path, model, tokenizer: BertWordPieceTokenizer) -> None:
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    specials = {"cls_token": "[CLS]", "sep_token": "[SEP]", "pad_token": "[PAD]", "unk_token": "[UNK]"}
    (path / "tokenizer_config.json").write_text(json.dumps(specials | {"tokenizer_class": "BertTokenizer"}))


def randomised(model):
    torch.manual_seed(0)
    with torch.no_grad():  # large random weights, zero biases: the classes predicted vary with the text
        for name, p in model.named_parameters():
            if "bias" not in name and "LayerNorm" not in name:
                p.normal_(0.0, 0.5)
    return model.eval()


def recipe_file(path) -> str:
    """A bert recipe for the training settings from-hf needs (the model section comes from config.json)."""
    recipe = {
        "name": "bert-infer-test",
        "description": "tiny bert for tests/test_infer.py",
        "model": {"family": "bert", "vocab_size": 64, "hidden_size": HIDDEN, "num_layers": 2, "num_heads": 4,
                  "ffn_hidden_size": 64, "max_seq_len": 64},
        "batch": {"global_batch": 8, "micro_batch": 2, "seq_len": SEQ_LEN},
        "optim": {"lr": 1e-3, "min_lr": 1e-4, "warmup_steps": 1, "decay_steps": 10},
        "train": {"max_steps": 10},
        "precision": {"dtype": "fp32"},
        "data": {"format": "arrow", "path": "data/none.arrow", "tokenizer": "data/tokenizers/none"},
        "cluster": {"instance": "local-cpu", "backend": "cpu"},
    }  # fmt: skip
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    return str(path)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """Checkpoints (classification head; "mlp" head with mean pooling) and inputs, made once."""
    root = tmp_path_factory.mktemp("infer")
    tokenizer = BertWordPieceTokenizer(lowercase=True)
    tokenizer.train_from_iterator(
        sentences(500, seed=1), vocab_size=60, special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    )
    vocab = tokenizer.get_vocab_size()
    config = dict(vocab_size=vocab, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=64, max_position_embeddings=64, pad_token_id=0)  # fmt: skip
    recipe = recipe_file(root / "bert-infer-test.yaml")

    cls_hf = root / "hf-cls"
    classifier = randomised(transformers.BertForSequenceClassification(transformers.BertConfig(**config, num_labels=3)))
    hf_dir(cls_hf, classifier, tokenizer)
    assert main(["convert", "from-hf", "--hf", str(cls_hf), "--out", str(root / "ckpt-cls"), "--recipe", recipe]) == 0

    # The "mlp" head as `convert to-hf` exports it: a BertModel, the head's linears as mlp_head.<i> tensors.
    mlp_hf = root / "hf-mlp"
    encoder = randomised(transformers.BertModel(transformers.BertConfig(**config)))
    hf_dir(mlp_hf, encoder, tokenizer)
    cfg = json.loads((mlp_hf / "config.json").read_text())
    cfg["trnrecipes_head"] = {"kind": "mlp", "pooling": "mean", "hidden_sizes": [16]}
    (mlp_hf / "config.json").write_text(json.dumps(cfg))
    weights = load_file(mlp_hf / "model.safetensors")
    for i, (a, b) in enumerate([(HIDDEN, 16), (16, 2)]):
        weights |= {f"mlp_head.{i}.weight": torch.randn(b, a), f"mlp_head.{i}.bias": torch.randn(b)}
    save_file(weights, mlp_hf / "model.safetensors", metadata={"format": "pt"})
    assert main(["convert", "from-hf", "--hf", str(mlp_hf), "--out", str(root / "ckpt-mlp"), "--recipe", recipe]) == 0

    texts = sentences(ROWS)
    labels = np.random.default_rng(0).choice(NUM_LABELS, size=ROWS, p=[0.5, 0.3, 0.2])
    write_arrow(root / "big.arrow", {"text": pa.array(texts, pa.large_string()), "label": labels})
    n = 300  # not a multiple of any batch size used: the last batch is partial
    write_arrow(root / "small.arrow", {"text": pa.array(texts[:n], pa.large_string()), "label": labels[:n]})
    rows = [json.dumps({"text": t, "label": int(label)}) for t, label in zip(texts[:n], labels[:n], strict=True)]
    (root / "small.jsonl").write_text("\n".join(rows) + "\n")
    (root / "small.txt").write_text("\n".join(texts[:n]) + "\n")
    return {
        "root": root, "cls": root / "ckpt-cls", "mlp": root / "ckpt-mlp", "classifier": classifier,
        "encoder": encoder, "texts": texts, "labels": labels, "n": n,
    }  # fmt: skip


@pytest.fixture(autouse=True)
def keep_torch_threads():
    """--threads sets torch's thread count for the process: give the other tests theirs back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tokens_of(ckpt, texts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
    tokenizer = load_tokenizer(ckpt / "tokenizer")
    tokens = torch.from_numpy(encode_texts(tokenizer, texts, SEQ_LEN, 0))
    return tokens, (tokens != 0).long()


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_predict_equals_transformers_and_scores_labelled_files(tiny, tmp_path, capsys):
    n, labels = tiny["n"], tiny["labels"][: tiny["n"]]
    tokens, mask = tokens_of(tiny["cls"], tiny["texts"][:n])
    with torch.no_grad():
        expected = torch.softmax(tiny["classifier"](tokens, attention_mask=mask).logits, dim=-1)

    out = tmp_path / "p.jsonl"
    assert main(["predict", "--ckpt", str(tiny["cls"]), "--in", str(tiny["root"] / "small.arrow"), "--out", str(out),
                 "--batch-size", "32", "--threads", "2"]) == 0  # fmt: skip
    rows = read_jsonl(out)
    assert [r["row"] for r in rows] == list(range(n))
    torch.testing.assert_close(torch.tensor([r["probs"] for r in rows]), expected, rtol=1e-5, atol=1e-5)
    predicted = np.array([r["label"] for r in rows])
    assert (predicted == expected.argmax(-1).numpy()).all() and len(set(predicted)) > 1

    summary = json.loads((tmp_path / "p.summary.json").read_text())
    accuracy, majority = (predicted == labels).mean(), np.bincount(labels).max() / n
    assert summary["rows"] == n and summary["label_field"] == "label"
    assert summary["accuracy"] == pytest.approx(accuracy)
    assert summary["majority_class_accuracy"] == pytest.approx(majority)
    assert summary["majority_class"] == 0 and summary["checkpoint"]["step"] == 0
    assert summary["checkpoint"]["path"] == str(tiny["cls"].resolve())
    for c in range(NUM_LABELS):
        assert summary["classes"][str(c)] == {
            "true": int((labels == c).sum()), "predicted": int((predicted == c).sum()),
            "correct": int(((labels == c) & (predicted == c)).sum()),
        }  # fmt: skip
    assert f"accuracy {accuracy:.3f} on {n} rows (majority class {majority:.3f})" in capsys.readouterr().out

    # jsonl (labels from its field) and txt (no labels) give the same predictions; default output beside the input
    assert main(["predict", "--ckpt", str(tiny["cls"]), "--in", str(tiny["root"] / "small.jsonl")]) == 0
    assert read_jsonl(tiny["root"] / "small.predictions.jsonl") == rows
    assert json.loads((tiny["root"] / "small.predictions.summary.json").read_text())["accuracy"] == summary["accuracy"]
    assert main(["predict", "--ckpt", str(tiny["cls"]), "--in", str(tiny["root"] / "small.txt"), "--out",
                 str(tmp_path / "t.jsonl"), "--batch-size", "7"]) == 0  # fmt: skip
    assert [r["label"] for r in read_jsonl(tmp_path / "t.jsonl")] == predicted.tolist()
    no_labels = json.loads((tmp_path / "t.summary.json").read_text())
    assert "accuracy" not in no_labels and no_labels["classes"]["0"] == {"predicted": int((predicted == 0).sum())}
    assert "no labels in the input" in capsys.readouterr().out


def test_predict_on_a_run_dir_takes_its_newest_complete_checkpoint(tiny, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(tiny["cls"], run / "checkpoints" / "step_10")
    shutil.copytree(tiny["mlp"], run / "checkpoints" / "step_20")
    (run / "checkpoints" / "step_20" / "done").unlink()  # a save that never finished
    assert main(["predict", "--ckpt", str(run), "--in", str(tiny["root"] / "small.txt"), "--out",
                 str(tmp_path / "p.jsonl")]) == 0  # fmt: skip
    summary = json.loads((tmp_path / "p.summary.json").read_text())
    assert summary["checkpoint"]["path"] == str(run / "checkpoints" / "step_10")
    out = capsys.readouterr().out
    assert "step_20 is unusable" in out and "newest complete checkpoint" in out


def test_predictions_of_another_checkpoint_or_input_are_moved_aside_not_replaced(tiny, tmp_path, capsys):
    """eval.sbatch writes RUN_DIR/eval/predictions.jsonl for each newest checkpoint, and the docs run two checkpoints'
    predict on one input: the second replaced the first's predictions and accuracy without a word."""
    small, out = tiny["root"] / "small.txt", tmp_path / "p.jsonl"

    def predict(ckpt: str) -> str:
        assert main(["predict", "--ckpt", str(tiny[ckpt]), "--in", str(small), "--out", str(out)]) == 0
        return capsys.readouterr().out

    predict("cls")
    first = out.read_text()
    assert "moved" not in predict("cls") and not (tmp_path / "p.earlier").exists()  # a rerun: replaced
    said = predict("mlp")
    (aside,) = (tmp_path / "p.earlier").iterdir()
    assert f"{out} held predictions of {tiny['cls'].resolve()} on {small}: moved with its summary to {aside}" in said
    assert (aside / "p.jsonl").read_text() == first and (aside / "p.summary.json").is_file()
    assert json.loads((tmp_path / "p.summary.json").read_text())["checkpoint"]["path"] == str(tiny["mlp"].resolve())


def test_embed_equals_encode_row_by_row_and_transformers(tiny, tmp_path):
    """The "mlp" head, mean pooling: embed == Bert.encode of each row alone == HF BertModel's masked mean."""
    n, out = tiny["n"], tmp_path / "e.arrow"
    assert main(["embed", "--ckpt", str(tiny["mlp"]), "--in", str(tiny["root"] / "small.arrow"), "--out", str(out),
                 "--batch-size", "64", "--chunk-rows", "128"]) == 0  # fmt: skip
    table = read_arrow_table(out)
    assert table.schema.field("row").type == pa.int64()
    assert table.schema.field("embedding").type == pa.list_(pa.float32(), HIDDEN)
    assert table.column("row").to_pylist() == list(range(n))
    assert not (tmp_path / "e.arrow.parts").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["e.arrow"]
    got = torch.from_numpy(np.stack(table.column("embedding").to_numpy(zero_copy_only=False)))

    model = load_classifier(*open_checkpoint(tiny["mlp"])).model
    tokens, mask = tokens_of(tiny["mlp"], tiny["texts"][:n])
    with torch.no_grad():
        alone = torch.cat([model.encode(tokens[i : i + 1], mask[i : i + 1]) for i in range(n)])
        hidden = tiny["encoder"](tokens, attention_mask=mask).last_hidden_state
    m = mask.unsqueeze(-1).float()
    torch.testing.assert_close(got, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, (hidden * m).sum(1) / m.sum(1), rtol=1e-5, atol=1e-5)


# The CLI, its chunk renames slowed so that a kill lands halfway (a temp file is often left behind, as a kill
# during a write would leave it).
SLOW_CLI = """
import sys, time
import trnrecipes.infer as infer
publish = infer._publish
def slow(tmp, path):
    time.sleep(0.05)
    publish(tmp, path)
infer._publish = slow
import trnrecipes.infer
from trnrecipes.cli import main
raise SystemExit(main(sys.argv[1:]))
"""


def test_embed_killed_halfway_resumes_to_the_uninterrupted_result(tiny, tmp_path, capsys):
    args = ["--in", str(tiny["root"] / "big.arrow"), "--batch-size", "64", "--threads", "1"]
    cls = ["--ckpt", str(tiny["cls"])]
    reference = tmp_path / "reference.arrow"
    assert main(["embed", *cls, *args, "--chunk-rows", "256", "--out", str(reference)]) == 0

    out = tmp_path / "e.arrow"
    parts, chunks = tmp_path / "e.arrow.parts", -(-ROWS // 256)
    cmd = [sys.executable, "-c", SLOW_CLI, "embed", *cls, *args, "--chunk-rows", "256", "--out", str(out)]
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(list(parts.glob("chunk_*.arrow"))) < chunks // 2:
        assert proc.poll() is None, f"embed ended before it was killed: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no progress in 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done = len(list(parts.glob("chunk_*.arrow")))
    assert chunks // 2 <= done < chunks and not out.exists()

    # Another chunk size or checkpoint would mix results: refused, naming what differs, nothing touched.
    capsys.readouterr()
    assert main(["embed", *cls, *args, "--chunk-rows", "512", "--out", str(out)]) == 2
    assert "chunk_rows 256 -> 512" in capsys.readouterr().err
    assert main(["embed", "--ckpt", str(tiny["mlp"]), *args, "--chunk-rows", "256", "--out", str(out)]) == 2
    assert "ckpt-cls (step 0) -> " in capsys.readouterr().err
    assert len(list(parts.glob("chunk_*.arrow"))) == done

    assert main(["embed", *cls, *args, "--chunk-rows", "256", "--out", str(out)]) == 0
    assert f"{done} of {chunks} chunks already done" in capsys.readouterr().out
    assert not parts.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["e.arrow", "reference.arrow"]
    resumed, uninterrupted = read_arrow_table(out), read_arrow_table(reference)
    assert resumed.column("row").to_pylist() == list(range(ROWS))  # every row once, in order
    assert resumed.equals(uninterrupted)  # bitwise: same fixed-shape batches, whichever process computed them
    assert len(resumed.column("embedding").to_numpy(zero_copy_only=False)[0]) == HIDDEN


def test_a_sigterm_ends_predict_without_leaving_its_temp_output(tiny, tmp_path):
    held = SLOW_CLI.replace("time.sleep(0.05)", "time.sleep(60)")  # held with its output written under a temp name
    out = tmp_path / "p.jsonl"
    cmd = [sys.executable, "-c", held, "predict", "--ckpt", str(tiny["cls"]), "--in", str(tiny["root"] / "small.arrow"),
           "--out", str(out)]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".p.jsonl.*.tmp")):
        assert proc.poll() is None, f"predict ended before it was stopped: {proc.stderr.read()}"
        assert time.monotonic() < deadline, "no temp output in 60 s"
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)  # a time limit, scancel: it died at once and left the temp file for good
    assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    assert "error: terminated (SIGTERM)" in proc.stderr.read()
    assert list(tmp_path.iterdir()) == []


def test_predict_reads_no_labels_where_told_to(tiny, tmp_path, capsys):
    stars = tmp_path / "stars.jsonl"  # a label column of another kind: 1-5 stars for a 2-class model
    stars.write_text("".join(json.dumps({"text": f"row {i}", "label": 5}) + "\n" for i in range(3)))
    argv = ["predict", "--ckpt", str(tiny["cls"]), "--in", str(stars), "--out", str(tmp_path / "p.jsonl")]
    assert main(argv) == 2
    assert "(read for accuracy, the recipe's label: --no-labels predicts without)" in capsys.readouterr().err
    assert main([*argv, "--no-labels"]) == 0
    summary = json.loads((tmp_path / "p.summary.json").read_text())
    assert summary["rows"] == 3 and summary["label_field"] is None and "accuracy" not in summary


def files_under(root) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()}


def test_embed_never_removes_a_parts_dir_it_did_not_make(tiny, tmp_path, capsys):
    """OUT.parts/ that embed did not create (no embed.json: a checkpoint copied there, or just an empty dir) is
    refused in one line naming it, and every byte in it stays (was: filled, then removed whole with the rest)."""
    out, parts = tmp_path / "e.arrow", tmp_path / "e.arrow.parts"
    shutil.copytree(tiny["cls"], parts / "step_7")
    argv = ["embed", "--ckpt", str(tiny["cls"]), "--in", str(tiny["root"] / "small.arrow"), "--out", str(out)]
    for holds in ("a checkpoint", "nothing"):
        before = files_under(tmp_path)
        capsys.readouterr()
        assert main(argv) == 2, holds
        assert capsys.readouterr().err == (
            f"error: {parts} exists and was not made by `trnrecipes embed` (no embed.json in it): embed removes its"
            " work dir when done, so it uses none it did not make; move it away or choose another --out\n"
        )
        assert files_under(tmp_path) == before and parts.is_dir() and not out.exists()
        shutil.rmtree(parts / "step_7", ignore_errors=True)


def test_embed_refuses_its_parts_dir_holding_a_foreign_file_and_never_removes_one(tiny, tmp_path, monkeypatch, capsys):
    """A killed embed's OUT.parts/ with a file someone put there is refused, its chunks and the file kept (they resume
    once the file is moved out); a file put there while embed runs survives the end, only embed's files go."""
    out, parts = tmp_path / "e.arrow", tmp_path / "e.arrow.parts"
    argv = ["embed", "--ckpt", str(tiny["cls"]), "--in", str(tiny["root"] / "small.arrow"), "--out", str(out),
            "--batch-size", "64", "--chunk-rows", "128"]  # fmt: skip
    join = trnrecipes.infer._join

    class Killed(Exception):
        pass

    def killed(*args):
        raise Killed

    with monkeypatch.context() as patch:  # killed just before the join, every chunk done
        patch.setattr(trnrecipes.infer, "_join", killed)
        with pytest.raises(Killed):
            main(argv)
    assert sorted(p.name for p in parts.iterdir()) == [".lock", *(f"chunk_00000{k}.arrow" for k in range(3)),
                                                       "embed.json"]  # fmt: skip
    (parts / "notes.txt").write_text("mine\n")
    before = files_under(tmp_path)
    capsys.readouterr()
    assert main(argv) == 2
    assert capsys.readouterr().err == (
        f"error: {parts} holds files `trnrecipes embed` did not write (notes.txt): embed removes that dir when done;"
        " move them out of it (its chunks then resume) or choose another --out\n"
    )
    assert files_under(tmp_path) == before and not out.exists()

    (parts / "notes.txt").rename(tmp_path / "notes.txt")
    dropped = []

    def join_after_a_drop(parts_dir, *args):  # someone's file lands in OUT.parts/ while embed runs
        (parts_dir / "later.txt").write_text("mine too\n")
        dropped.append(parts_dir)
        join(parts_dir, *args)

    monkeypatch.setattr(trnrecipes.infer, "_join", join_after_a_drop)
    assert main(argv) == 0 and dropped
    said = capsys.readouterr().out
    assert "3 of 3 chunks already done" in said
    assert f"left {parts} in place: it holds files embed did not write (later.txt)" in said
    assert sorted(p.name for p in parts.iterdir()) == ["later.txt"] and read_arrow_table(out).num_rows == tiny["n"]


def test_refuses_language_models_and_bad_input(tiny, tmp_path, capsys):
    llama = tmp_path / "hf-llama"
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )  # fmt: skip
    transformers.LlamaForCausalLM(config).save_pretrained(llama)
    assert main(["convert", "from-hf", "--hf", str(llama), "--out", str(tmp_path / "ckpt-llama")]) == 0
    capsys.readouterr()
    small, cls = str(tiny["root"] / "small.arrow"), str(tiny["cls"])
    out = ["--out", str(tmp_path / "o.arrow")]
    (tmp_path / "exists.arrow").write_text("")
    cases = [
        (["predict", "--ckpt", str(tmp_path / "ckpt-llama"), "--in", small], "need a classification family (bert)"),
        (["predict", "--ckpt", str(tmp_path), "--in", small], "neither a checkpoint (no manifest.json) nor a run dir"),
        (["predict", "--ckpt", str(tmp_path / "nope"), "--in", small], "is not a directory"),
        (["predict", "--ckpt", cls, "--in", str(tmp_path / "missing.arrow")], "missing.arrow does not exist"),
        (["predict", "--ckpt", cls, "--in", small, "--text-field", "body"], "has no column 'body'"),
        (["predict", "--ckpt", cls, "--in", str(tiny["root"] / "small.jsonl"), "--text-field", "body"],
         "no field 'body'"),
        (["predict", "--ckpt", cls, "--in", small, "--label-field", "gold"], "has no label 'gold'"),
        (["predict", "--ckpt", cls, "--in", small, "--batch-size", "0"], "--batch-size must be a positive integer"),
        (["embed", "--ckpt", cls, "--in", small, *out, "--chunk-rows", "100"], "must be a multiple of --batch-size"),
        (["embed", "--ckpt", cls, "--in", small, "--out", str(tmp_path / "exists.arrow")], "already exists"),
        (["embed", "--ckpt", cls, "--in", str(tmp_path / "missing.txt"), *out], "missing.txt does not exist"),
        # a name of another kind than what is written: read back by it, it failed
        (["predict", "--ckpt", cls, "--in", small, "--out", str(tmp_path / "p.jsonl.gz")],
         "writes plain JSON lines, but the name says another kind; name it .jsonl (e.g."),
        (["embed", "--ckpt", cls, "--in", small, "--out", str(tmp_path / "e.jsonl")],
         "writes an Arrow stream, but the name says another kind; name it .arrow (e.g."),
    ]  # fmt: skip
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and err.count("\n") == 1, (argv, err)
    assert not (tmp_path / "o.arrow").exists() and not (tmp_path / "o.arrow.parts").exists()
    assert not list(tmp_path.glob("p.*")) and not list(tmp_path.glob("e.*"))
    assert predictions_path(tmp_path / "big.jsonl.zst") == tmp_path / "big.predictions.jsonl"  # was big.jsonl.pred..


def test_no_training_stack_is_imported(tiny, tmp_path):
    code = f"""
import sys
import trnrecipes.infer
from trnrecipes.cli import main
assert main(["predict", "--ckpt", {str(tiny["cls"])!r}, "--in", {str(tiny["root"] / "small.txt")!r},
             "--out", {str(tmp_path / "p.jsonl")!r}]) == 0
assert main(["embed", "--ckpt", {str(tiny["mlp"])!r}, "--in", {str(tiny["root"] / "small.arrow")!r},
             "--out", {str(tmp_path / "e.arrow")!r}]) == 0
print("IMPORTED", sorted(m for m in sys.modules if m.startswith({FORBIDDEN!r})))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "IMPORTED []" in done.stdout, done.stdout
