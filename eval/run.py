"""`trnrecipes eval run --ckpt PATH` (`make eval ckpt=PATH`): the 128-node Llama 2 post's table for one of our
checkpoints, offline.

The checkpoint is exported to an HF directory (trnrecipes convert to-hf; an HF directory is taken as is), lm-eval's
simple_evaluate runs the registry's local tasks (eval/registry.py, eval/tasks.py), HumanEval completions are
sampled with transformers and scored in the sandbox (eval/sandbox.py, only with --allow-code-execution), and
results.json + results.md (the 128-node Llama 2 post's table: each group's average, its tasks below it, a baseline
column) are written to the output directory. results.json names the weights it scored (path, step, manifest sha256),
and credits a checkpoint with an HF directory only while its files are the ones exported from it (their sha256). Models
and tokenizers load with trust_remote_code=False: code in a model directory never runs, and transformers never asks.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
from pathlib import Path

from eval.data import write_atomic

HUMANEVAL_STOP = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")


def _offline() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def export(ckpt: Path, out: Path) -> tuple[Path, dict]:
    """An HF directory for `ckpt` and the weights it holds (results.json's "checkpoint"): `ckpt` itself if it is
    an HF directory, else `out/hf`, reused only if its record names this checkpoint's manifest and its every file
    still has the sha256 recorded when it was exported, else exported anew."""
    from trnrecipes.convert import checkpoint_source, export_changes, export_source, to_hf

    if (ckpt / "config.json").exists():
        return ckpt, {"path": str(ckpt.resolve()), "trnrecipes_checkpoint": False} | _export_credit(ckpt)
    source = checkpoint_source(ckpt) | {"trnrecipes_checkpoint": True}
    hf = out / "hf"
    recorded = export_source(hf) or {}
    # Replaced only where it is ours: our record in it, or an earlier eval's results beside it (an export made
    # before the record existed). Anything else is a model of the user's own.
    if (hf.exists() or hf.is_symlink()) and not recorded and not (out / "results.json").is_file():
        raise ValueError(
            f"{hf} exists and is not an export of ours (no readable trnrecipes-source.json, no results.json beside"
            " it): eval would replace it; choose another --out"
        )
    if recorded.get("manifest_sha256") == source["manifest_sha256"]:
        changes = export_changes(hf, recorded)
        if changes == []:
            return hf, source
        why = _some(changes) if changes else "its record has no sha256 of its files (an older export)"
        print(f"[eval] {hf} is not as exported ({why}): exporting {ckpt} again", flush=True)
    # Exported beside it (to_hf: whole or absent), then swapped in; a directory cannot be renamed onto a non-empty
    # one, so the old export moves aside first. A crash between the two renames leaves no hf/ at all.
    tag = secrets.token_hex(4)
    fresh, stale = out / f".hf-new-{tag}", out / f".hf-old-{tag}"
    try:
        to_hf(ckpt, fresh)
        if hf.exists():
            os.replace(hf, stale)
        os.replace(fresh, hf)
    finally:
        shutil.rmtree(fresh, ignore_errors=True)
        shutil.rmtree(stale, ignore_errors=True)
    return hf, source


def _export_credit(hf: Path) -> dict:
    """results.json's word on where an HF directory came from: "exported_from" (to_hf's record) only while every file
    is as exported; otherwise the record under "unverified_export_record", with what differs, and a warning. Edited
    weights scored under a checkpoint's name would credit it with results it never gave."""
    from trnrecipes.convert import export_changes, export_source

    record = export_source(hf)
    if record is None:
        return {}
    changes = export_changes(hf, record)
    credit = {key: value for key, value in record.items() if key != "files"}
    if changes == []:
        return {"exported_from": credit}
    differs = changes or ["its record has no sha256 of its files (an older export): unverifiable"]
    print(
        f"[eval] warning: {hf} is not as exported from {credit.get('path')} (step {credit.get('step')}):"
        f" {_some(differs)}; results.json does not credit that checkpoint",
        flush=True,
    )
    return {"unverified_export_record": credit | {"differs": differs}}


def _some(changes: list[str], shown: int = 5) -> str:
    """Changes for a one-line message: a directory with thousands of added files still gets one short line."""
    more = f"; and {len(changes) - shown} more" if len(changes) > shown else ""
    return "; ".join(changes[:shown]) + more


def lm_eval_tasks(
    hf: Path, task_dir: Path, names: list[str], limit: int | None, max_length: int, max_gen_toks: int | None = None
) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    manager = TaskManager(include_path=str(task_dir), include_defaults=False)
    device = _device()
    return lm_eval.simple_evaluate(
        model="hf",
        model_args=model_args(hf, max_length, device),
        tasks=names,
        task_manager=manager,
        limit=limit,
        device=device,
        batch_size=1,
        log_samples=True,  # written to samples/: what the model was asked and answered, item by item
        # a cap on every generated answer (BBH's own is 1024 tokens): for quick checks of tiny models
        gen_kwargs=f"max_gen_toks={max_gen_toks}" if max_gen_toks else None,
    )


def model_args(hf: Path, max_length: int, device: str) -> str:
    """lm-eval's hf model arguments. On CPU fp32 (bf16 matmuls are slow on most CPUs, and the parity tests compare
    fp32 numbers). On CUDA bf16, the precision the recipes train in, split over the node's GPUs (accelerate's
    device_map): NeoX-20B in fp32 is 82 GB, more than one 80 GB GPU holds."""
    no_code = "trust_remote_code=False"  # never run code from the model directory (and never ask on stdin)
    if device == "cuda":
        return f"pretrained={hf},dtype=bfloat16,parallelize=True,max_length={max_length},{no_code}"
    return f"pretrained={hf},dtype=float32,max_length={max_length},{no_code}"


def default_max_length(hf: Path) -> int:
    """lm-eval's window (prompt + generated tokens): the model's context, at least 2048. lm-eval cuts prompts from the
    left to fit max_length - max_gen_toks, and BBH's CoT prompts (~1-2k tokens) with its 1024 new tokens need a
    4096 window (Llama 2's); tiny models (context 64-128) still get 2048, as rotary runs past its training length."""
    config = json.loads((Path(hf) / "config.json").read_text())
    return max(2048, int(config.get("max_position_embeddings") or 0))


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model(hf: Path, device: str):
    """(tokenizer, model) as model_args loads them: CPU fp32, or CUDA bf16 spread over the node's GPUs. Explicit
    trust_remote_code=False: with None, transformers asks on stdin whether to run a model directory's own code."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(hf, trust_remote_code=False)
    if device == "cuda":
        model = AutoModelForCausalLM.from_pretrained(
            hf, dtype=torch.bfloat16, device_map="auto", trust_remote_code=False
        ).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, trust_remote_code=False).to(device).eval()
    return tok, model


def humaneval(
    hf: Path,
    problems_path: Path,
    limit: int | None,
    n: int,
    allow: bool,
    max_new_tokens: int = 256,
    temperature: float | None = None,
    workers: int = 2,
) -> dict:
    """n samples per problem, pass@1/10/100 for k <= n. Greedy when n == 1; else sampled at `temperature` (default
    0.8, top-p 0.95: the Codex paper's best for pass@100; it reports pass@1 at 0.2)."""
    import torch
    from tqdm import tqdm

    from eval.code import load_problems, score

    problems = load_problems(problems_path)
    chosen = dict(list(problems.items())[:limit] if limit else problems.items())
    device = _device()
    tok, model = load_model(hf, device)
    torch.manual_seed(0)
    sample = n > 1 or temperature is not None
    samples = []
    for task_id, p in tqdm(chosen.items(), desc=f"HumanEval: {n} sample(s) per problem", unit="problem"):
        ids = tok(p["prompt"], return_tensors="pt").input_ids.to(device)
        with torch.no_grad():
            out = model.generate(
                ids.repeat(n, 1),
                max_new_tokens=max_new_tokens,
                do_sample=sample,
                temperature=(temperature or 0.8) if sample else None,
                top_p=0.95 if sample else None,
                pad_token_id=tok.eos_token_id,
            )
        for row in out:
            text = tok.decode(row[ids.shape[1] :], skip_special_tokens=True)
            cut = min([text.find(s) for s in HUMANEVAL_STOP if s in text] or [len(text)])
            samples.append({"task_id": task_id, "completion": text[:cut]})
    ks = tuple(k for k in (1, 10, 100) if k <= n)
    return score(samples, chosen, ks, workers, allow_code_execution=allow) | {"n": n}


def load_baseline(path: Path) -> dict:
    """A baseline file (eval/baselines/*.json): {"model", "source", "results": {"task/metric": value}}."""
    try:
        spec = json.loads(Path(path).read_text())
        results = spec["results"]
        if not isinstance(spec.get("model"), str) or not all(
            isinstance(k, str) and "/" in k and isinstance(v, int | float) for k, v in results.items()
        ):
            raise TypeError
    except FileNotFoundError:
        raise ValueError(f"baseline file {path} does not exist (see eval/baselines/)") from None
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
        raise ValueError(
            f'baseline file {path}: expected {{"model": NAME, "source": TEXT, "results": {{"task/metric": number}}}}'
            " (see eval/baselines/openllama2-7b.json)"
        ) from None
    valid = baseline_keys()
    unknown = [k for k in results if k not in valid]
    if unknown:
        raise ValueError(f"baseline file {path}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(valid)}")
    return spec


def baseline_keys() -> list[str]:
    """What a baseline file may hold: "<group>/<metric>" for each group's rows, "<task>/<metric>" for each task's."""
    from eval.registry import GROUPS, TASKS

    keys = [f"{g.name}/{m}" for g in GROUPS.values() for m in g.metrics]
    return keys + [f"{t.name}/{m}" for t in TASKS.values() for m in t.metric_names if f"{t.name}/{m}" not in keys]


def write_samples(out: Path, samples: dict[str, list[dict]], names: list[str]) -> None:
    """samples/<lm-eval task>.jsonl: per item its doc_id, the requests' arguments (prompts), the model's responses
    and the target, in the layout lm-eval's own --log_samples writes (arguments as gen_args_i/arg_j, responses as
    strings), so its tools read them and they compare with its CLI's files directly. Those of `names` (the lm-eval
    tasks this eval ran) an earlier eval wrote are replaced; the others' are kept with their rows."""
    from lm_eval.utils import handle_non_serializable, sanitize_list

    (out / "samples").mkdir(exist_ok=True)
    for name in names:
        (out / "samples" / f"{name}.jsonl").unlink(missing_ok=True)
    for task, items in samples.items():
        lines = []
        for item in items:
            arguments = {
                f"gen_args_{i}": {f"arg_{j}": x for j, x in enumerate(arg)} for i, arg in enumerate(item["arguments"])
            }
            record = {
                "doc_id": item["doc_id"],
                "arguments": arguments,
                "resps": sanitize_list(item["resps"]),
                "filtered_resps": sanitize_list(item["filtered_resps"]),
                "filter": item.get("filter"),
                "target": str(item["target"]),
            }
            lines.append(json.dumps(record, default=handle_non_serializable, ensure_ascii=False) + "\n")
        write_atomic(out / "samples" / f"{task}.jsonl", "".join(lines).encode())


def _combined_stderr(errors: list[float | None]) -> float | None:
    """The stderr of a mean of independent estimates, if every one has a stderr."""
    if not errors or any(e is None for e in errors):
        return None
    return math.sqrt(sum(e * e for e in errors)) / len(errors)


def group_rows(rows: list[dict]) -> list[dict]:
    """Each group of the registry whose every task was evaluated: its metrics averaged over its tasks, plain means as
    Llama 2 and HLAT report them (a task without the metric, e.g. SIQA's acc_norm, contributes its first metric, its
    accuracy). Single-task groups need none: their task's row is the group's."""
    from eval.registry import GROUPS, TASKS

    out = []
    for group in GROUPS.values():
        if len(group.tasks) < 2 or not all(any(r["task"] == t for r in rows) for t in group.tasks):
            continue
        for metric in group.metrics:
            picked = []
            for name in group.tasks:
                own = {r["metric"]: r for r in rows if r["task"] == name}
                picked.append(own.get(metric) or own[TASKS[name].metric_names[0]])
            value = sum(r["value"] for r in picked) / len(picked)
            stderr = _combined_stderr([r["stderr"] for r in picked])
            out.append({"task": group.name, "kind": "group", "shots": group.shots, "metric": metric, "value": value,
                        "stderr": stderr, "of": list(group.tasks)})  # fmt: skip
    return out


def table(rows: list[dict], baseline: dict | None = None, limit: int | None = None) -> str:
    """The 128-node Llama 2 post's table: one block per group (registry order), its heading row(s) first, then its
    tasks' rows for a group of several tasks. A single task's group shows that task under the group's heading."""
    from eval.registry import GROUPS, TASKS

    base_values = (baseline or {}).get("results", {})
    lines = ["| row | shots | metric | value (stderr) | baseline |", "|---|---|---|---|---|"]

    def line(label: str, r: dict, *keys: str) -> None:
        err = f" ({r['stderr']:.4f})" if r.get("stderr") is not None else ""
        base = next((f"{base_values[k]:.4f}" for k in keys if k in base_values), "")
        lines.append(f"| {label} | {r['shots']} | {r['metric']} | {r['value']:.4f}{err} | {base} |")

    notes = []
    for group in GROUPS.values():
        task_rows = [r for r in rows if r.get("kind") == "task" and TASKS[r["task"]].group == group.name]
        if not task_rows:
            continue
        if len(group.tasks) == 1:
            for r in task_rows:
                same = group.title.lower().replace(" ", "") == r["task"].replace("_", "")
                label = group.title if same else f"{group.title}: {r['task']}"
                line(label, r, f"{group.name}/{r['metric']}", f"{r['task']}/{r['metric']}")
        else:
            for r in rows:
                if r.get("kind") == "group" and r["task"] == group.name:
                    line(f"{group.title} (average of {len(r['of'])})", r, f"{group.name}/{r['metric']}")
            for r in task_rows:
                line(f"· {r['task']}", r, f"{r['task']}/{r['metric']}")
        notes += [n for t in dict.fromkeys(r["task"] for r in task_rows) for n in TASKS[t].notes]
    if limit:
        notes.append(
            f"--limit {limit}: the first {limit} items of each task and subtask; a smoke check, not comparable"
        )
    if baseline:
        notes.append(f"baseline: {baseline['model']}; {baseline.get('source', '')}".rstrip("; "))
    notes_md = "".join(f"- {n}\n" for n in dict.fromkeys(notes))
    return "\n".join(lines) + "\n" + (f"\n{notes_md}" if notes else "")


def run(
    ckpt: Path,
    out: Path,
    tasks: list[str],
    data: Path,
    limit: int | None = None,
    allow_code_execution: bool = False,
    humaneval_n: int = 1,
    baseline: dict | None = None,
    max_length: int | None = None,
    max_gen_toks: int | None = None,
    humaneval_temperature: float | None = None,
) -> list[dict]:
    """Evaluate `tasks` (registry task names, eval.registry.resolve) and write results.json / results.md: a row per
    (task, metric), {"kind": "task", "lm_eval": [lm-eval task, metric key]} for those lm-eval scored, plus the group
    averages ({"kind": "group"})."""
    from eval.registry import TASKS, write_task_dir

    _offline()
    settings = {"limit": limit, "max_gen_toks": max_gen_toks, "max_length": max_length}  # scores differ with each
    kept, carried = earlier_rows(out, Path(ckpt), tasks, settings)  # before anything in `out` is replaced
    out.mkdir(parents=True, exist_ok=True)
    hf, checkpoint = export(Path(ckpt), out)
    rows: list[dict] = list(kept)
    harness = [t for t in tasks if TASKS[t].lm_eval_name]
    if harness:
        names = write_task_dir(out / "tasks", data, harness)
        window = max_length or default_max_length(hf)
        print(f"[eval] lm-eval: {', '.join(harness)}{f' (first {limit} items each)' if limit else ''}", flush=True)
        try:
            evaluated = lm_eval_tasks(hf, out / "tasks", names, limit, window, max_gen_toks)
        except AssertionError as err:  # lm-eval's checks of a window too short for a prompt or an answer
            said = f": {err}" if str(err) else ""
            raise ValueError(
                f"lm-eval refused a request at --max-length {window}{said}; the window must hold an item's prompt and"
                " answer (and exceed --max-gen-toks): a larger --max-length, or the default (the model's)"
            ) from None
        results = evaluated["results"]
        write_samples(out, evaluated.get("samples") or {}, [TASKS[t].lm_eval_name for t in harness])
        for name in harness:
            task = TASKS[name]
            r = results[task.lm_eval_name]
            for key in task.metrics:
                stderr = r.get(key.replace(",", "_stderr,"))
                rows.append(
                    {
                        "task": name,
                        "kind": "task",
                        "shots": task.shots,
                        "metric": key.split(",")[0],
                        "value": r[key],
                        "stderr": stderr if isinstance(stderr, float) else None,
                        "lm_eval": [task.lm_eval_name, key],
                    }
                )
    meta = {"checkpoint": checkpoint, "model": str(hf), **settings, **carried}
    if "humaneval" in tasks:
        if rows:  # kept if the sampling or the sandbox fails: lm-eval's part can take hours
            incomplete = {"incomplete": "HumanEval was running or failed: its rows are missing"}
            write_results(out, meta | incomplete, rows + group_rows(rows), baseline, limit)
        problems = data / "humaneval/HumanEval.jsonl.gz"
        new_tokens = min(256, max_gen_toks or 256)
        report = humaneval(hf, problems, limit, humaneval_n, allow_code_execution, new_tokens, humaneval_temperature)
        for key in TASKS["humaneval"].metrics:
            if key in report:
                rows.append({"task": "humaneval", "kind": "task", "shots": TASKS["humaneval"].shots, "metric": key,
                             "value": report[key], "stderr": None})  # fmt: skip
    rows = sorted(rows, key=lambda r: list(TASKS).index(r["task"]))  # kept and new: the registry's order
    rows += group_rows(rows)
    write_results(out, meta, rows, baseline, limit)
    return rows


def earlier_rows(out: Path, ckpt: Path, tasks: list[str], settings: dict) -> tuple[list[dict], dict]:
    """(The task rows an earlier eval of the same weights, at the same `settings` (--limit, --max-gen-toks,
    --max-length), wrote to `out` for the tasks this one does not score, and its "incomplete" note while HumanEval
    is still missing): a second `make eval ckpt=RUN tasks=humaneval` adds its rows to the hours of MMLU and BBH
    before it instead of replacing them. ValueError where `out` holds results this eval would replace otherwise
    (another checkpoint's, other settings', an unreadable results.json): nothing is written."""
    from eval.registry import TASKS

    path = out / "results.json"
    if not path.is_file():
        return [], {}
    try:
        earlier = json.loads(path.read_text())
        scored, rows = earlier["checkpoint"], earlier["results"]
        before = _weights(scored) if isinstance(scored, dict) else None
        task_rows = [r for r in rows if r["kind"] == "task"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not readable results of an eval ({err}); choose another --out") from None
    if before != _weights_of(ckpt):
        raise ValueError(
            f"{out} holds the results of other weights ({scored.get('path')}, step {scored.get('step')}), which this"
            f" eval of {ckpt} would replace; choose another --out (or move {out} aside)"
        )
    for key, value in settings.items():
        if earlier.get(key) != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{out} holds results of the same weights with {flag} {earlier.get(key)}, not {value}: the table would"
                " mix them; choose another --out (or the same setting)"
            )
    kept = [r for r in task_rows if r["task"] not in tasks and r["task"] in TASKS]  # a task since dropped: gone
    if kept:
        print(f"[eval] keeping {out}'s earlier rows of {', '.join(dict.fromkeys(r['task'] for r in kept))}", flush=True)
    still_missing = "incomplete" in earlier and "humaneval" not in tasks
    return kept, ({"incomplete": earlier["incomplete"]} if still_missing else {})


def _weights(scored: dict) -> tuple[str, str]:
    """Which weights results.json's "checkpoint" names: a checkpoint's manifest sha256, or an HF dir's path."""
    if scored.get("trnrecipes_checkpoint"):
        return "checkpoint", str(scored["manifest_sha256"])
    return "hf", str(scored["path"])


def _weights_of(ckpt: Path) -> tuple[str, str]:
    from trnrecipes.convert import checkpoint_source

    if (ckpt / "config.json").exists():
        return "hf", str(ckpt.resolve())
    return "checkpoint", checkpoint_source(ckpt)["manifest_sha256"]


def write_results(out: Path, meta: dict, rows: list[dict], baseline: dict | None, limit: int | None) -> None:
    write_atomic(out / "results.json", json.dumps(meta | {"results": rows}, indent=1).encode())
    note = f"\n**incomplete:** {meta['incomplete']}\n" if "incomplete" in meta else ""
    write_atomic(out / "results.md", (table(rows, baseline, limit) + note).encode())
