"""What is reused is checked first, by the sha256 of what it was made from.

- `eval run` reuses OUT/hf only while every file has the sha256 to_hf recorded in trnrecipes-source.json (an added,
  missing or changed file, or a record without file hashes, means a new export, said in one line), and credits an
  HF directory to the checkpoint it was exported from only while its files are as exported.
- `embed` resumes a chunk only if the sha256 of its rows' text (in the chunk's schema metadata) is that of the
  input's rows now: a changed row is embedded again; chunks of which none matches are another input's (refused).
"""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from test_eval_integrity import SMALL, checkpoint, manifest_sha256
from test_infer import keep_torch_threads, read_arrow_table, write_arrow  # noqa: F401 (a fixture)
from test_infer import tiny as tiny  # the fixture: its checkpoints and texts

import trnrecipes.infer
from eval.run import run
from trnrecipes.cli import main
from trnrecipes.config.recipe import load_recipe
from trnrecipes.convert import to_hf


class Killed(Exception):
    pass


def add_a_file(weights) -> None:
    weights.with_name("model-extra.safetensors").write_bytes(b"{}")


def flip_a_byte(path) -> None:
    """The same size, other content: what a size or mtime check would not notice."""
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF
    path.write_bytes(bytes(data))


def results_checkpoint(out) -> dict:
    return json.loads((out / "results.json").read_text())["checkpoint"]


@pytest.mark.parametrize(
    ("change", "said"),
    [
        (flip_a_byte, "model.safetensors changed"),
        (add_a_file, "model-extra.safetensors added"),
        (lambda weights: weights.unlink(), "model.safetensors missing"),
    ],
)
def test_a_modified_export_is_exported_again(tmp_path, capsys, change, said):
    one = checkpoint(tmp_path / "ckpts", 1, seed=1)
    out = tmp_path / "eval"
    run(one, out, [], tmp_path)  # no tasks: the export and results.json alone
    change(out / "hf/model.safetensors")
    capsys.readouterr()
    run(one, out, [], tmp_path)

    reference = to_hf(one, tmp_path / "reference")
    assert sorted(p.name for p in (out / "hf").iterdir()) == sorted(p.name for p in reference.iterdir())
    assert (out / "hf/model.safetensors").read_bytes() == (reference / "model.safetensors").read_bytes()
    assert f"{out / 'hf'} is not as exported ({said}): exporting {one} again" in capsys.readouterr().out
    assert results_checkpoint(out)["manifest_sha256"] == manifest_sha256(one)
    record = json.loads((out / "hf/trnrecipes-source.json").read_text())
    assert sorted(record["files"]) == sorted(p.name for p in reference.iterdir() if p.name != "trnrecipes-source.json")


def test_an_export_without_file_hashes_is_exported_again(tmp_path, capsys):
    one = checkpoint(tmp_path / "ckpts", 1, seed=1)
    out = tmp_path / "eval"
    run(one, out, [], tmp_path)
    source = out / "hf/trnrecipes-source.json"
    record = json.loads(source.read_text())
    source.write_text(json.dumps({k: v for k, v in record.items() if k != "files"}))  # as an older export wrote it
    weights = (out / "hf/model.safetensors").stat()
    capsys.readouterr()
    run(one, out, [], tmp_path)
    assert (out / "hf/model.safetensors").stat().st_ino != weights.st_ino
    assert "its record has no sha256 of its files (an older export)" in capsys.readouterr().out
    assert json.loads(source.read_text())["files"] == record["files"]


def test_a_modified_hf_directory_is_not_credited_to_its_checkpoint(tmp_path, capsys):
    one = checkpoint(tmp_path / "ckpts", 1, seed=1)
    hf = to_hf(one, tmp_path / "hf")
    seq_len = load_recipe("pythia-tiny", overrides=SMALL).batch.seq_len  # to-hf records its recipe and length
    credit = {"path": str(one), "step": 1, "manifest_sha256": manifest_sha256(one), "recipe": "pythia-tiny",
              "seq_len": seq_len}  # fmt: skip
    run(hf, tmp_path / "eval", [], tmp_path)
    assert results_checkpoint(tmp_path / "eval")["exported_from"] == credit  # as exported: credited

    flip_a_byte(hf / "model.safetensors")
    capsys.readouterr()
    run(hf, tmp_path / "eval", [], tmp_path)
    assert results_checkpoint(tmp_path / "eval") == {
        "path": str(hf.resolve()),
        "trnrecipes_checkpoint": False,
        "unverified_export_record": credit | {"differs": ["model.safetensors changed"]},
    }
    warning = capsys.readouterr().out
    assert f"warning: {hf} is not as exported from {one} (step 1): model.safetensors changed" in warning


def embed_args(tiny, inputs, out) -> list[str]:
    return ["embed", "--ckpt", str(tiny["cls"]), "--in", str(inputs), "--out", str(out), "--batch-size", "32",
            "--chunk-rows", "64", "--threads", "1"]  # fmt: skip


def killed_after_every_chunk(tiny, inputs, out, monkeypatch) -> list:
    """The chunk files of an embed killed just before the join (as a kill after the last chunk would leave them)."""

    def killed(*args):
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(trnrecipes.infer, "_join", killed)
        with pytest.raises(Killed):
            main(embed_args(tiny, inputs, out))
    assert not out.exists()
    return sorted(out.with_name(out.name + ".parts").glob("chunk_*.arrow"))


def test_embed_recomputes_a_chunk_whose_row_changed_and_refuses_other_text(tiny, tmp_path, monkeypatch, capsys):
    n, texts = 1000, tiny["texts"][:1000]
    inputs, out = tmp_path / "in.arrow", tmp_path / "e.arrow"
    write_arrow(inputs, {"text": pa.array(texts, pa.large_string())})
    assert len(killed_after_every_chunk(tiny, inputs, out, monkeypatch)) == 16

    # Row 130, between the rows a sample of 256 would read, reversed: same length, same file size, other text.
    size = inputs.stat().st_size
    texts[130] = texts[130][::-1]
    write_arrow(inputs, {"text": pa.array(texts, pa.large_string())})
    assert inputs.stat().st_size == size
    capsys.readouterr()
    assert main(embed_args(tiny, inputs, out)) == 0
    fresh = tmp_path / "fresh.arrow"
    assert main(embed_args(tiny, inputs, fresh)) == 0
    resumed, uninterrupted = read_arrow_table(out), read_arrow_table(fresh)
    assert resumed.column("row").to_pylist() == list(range(n))
    assert resumed.column("embedding").equals(uninterrupted.column("embedding"))
    said = capsys.readouterr().out
    assert "the text of rows [128, 192) changed since embedded: computing 1 chunk(s) again" in said
    assert "15 of 16 chunks already done" in said

    # Other text with as many rows: refused, not a chunk removed (the right --in resumes them); another row count too.
    out = tmp_path / "e2.arrow"
    chunks = killed_after_every_chunk(tiny, inputs, out, monkeypatch)
    other = tmp_path / "other.arrow"
    write_arrow(other, {"text": pa.array(tiny["texts"][n : 2 * n], pa.large_string())})
    capsys.readouterr()
    assert main(embed_args(tiny, other, out)) == 2
    err = capsys.readouterr().err
    assert f"in all 16 chunk(s) done, the rows' text differs from --in {other}; they were made from {inputs}" in err
    write_arrow(other, {"text": pa.array(tiny["texts"][: n + 1], pa.large_string())})
    assert main(embed_args(tiny, other, out)) == 2
    assert "rows 1000 -> 1001" in capsys.readouterr().err
    assert sorted(out.with_name("e2.arrow.parts").glob("chunk_*.arrow")) == chunks

    # The same file, every row edited in place: its chunks are computed again, not refused.
    write_arrow(inputs, {"text": pa.array(tiny["texts"][n : 2 * n], pa.large_string())})
    assert main(embed_args(tiny, inputs, out)) == 0
    assert "computing 16 chunk(s) again" in capsys.readouterr().out
