"""Benchmark: a whole training step of trnrecipes on one GPU vs transformers' LlamaForCausalLM, eager and compiled.

What it measures, per row, each row in a process of its own (so its peak memory is its own), one row at a time:
  ours           trnrecipes' own train step as a user runs it: the Trainer built from recipes/llama2/llama2-tiny.yaml
                 with the shape, batch and precision overridden (cluster.backend cuda, one worker), so the model is
                 built, parallelized (activation checkpointing, torch.compile per block where train.compile asks)
                 and materialized by the trainer's own code, and each step is Trainer.train_step: micro-batch x
                 accumulation forward/backward, gradient clipping (global norm 1.0), our AdamW (bf16 weights with no
                 fp32 master copy, updates rounded to nearest; --stochastic-rounding for the recipe's software
                 stochastic rounding). train.compile=false.
  ours-compile   the same with train.compile=true (the blocks and, since it compiles, the optimizer step).
  ours-compile-bf16-state
                 the same with optim.state_dtype=bf16: AdamW's moments in bf16 (4 bytes a parameter less), as
                 torch's AdamW keeps them for bf16 parameters.
  hf             transformers LlamaForCausalLM with the same config and the same weights (converted by
                 recipes/llama2/hf.py), SDPA attention, use_cache off, weights in the same dtype, torch.optim.AdamW
                 (fused=True on cuda, foreach elsewhere), torch.nn.utils.clip_grad_norm_ (1.0, as ours), eager.
  hf-compile     the same with model = torch.compile(model).
  optimizer      the optimizer step alone over the model's parameters (bf16 weights, the same random gradients every
                 step, the lr set every step as the trainer does): ours eager, ours compiled (as under
                 train.compile), ours compiled with bf16 moments, and torch.optim.AdamW fused (its fastest; the
                 hf rows' optimizer). Printed as milliseconds and as ours-compiled / torch-fused (target <= 1.5x).
Not quite like for like, in transformers' favour: torch's AdamW keeps its moments in the parameters' dtype (bf16 here),
ours in fp32 (8 bytes more per parameter, and more optimizer traffic).
No row checkpoints activations except ours (`--activation-checkpointing`, default elementwise). train.compile left
unset is on for cuda, so a recipe as shipped trains like the ours-compile row there.
The rows run one after another, not in lockstep as bench/bench_model.py's sides do: a dedicated GPU has no
neighbouring load to cancel out, and four processes holding a 1B-parameter training state each would compete for
its memory. The median over the timed steps keeps one slow step from moving a row.

A step = --micro-batch x --accum forward/backward + the optimizer step; --warmup steps (the backward's compilation
happens in the first; the forward's, in the loss check before them), then --steps timed steps, each timed alone
between torch.cuda.synchronize() calls; tokens/s = micro-batch x accum x seq / the median step time. MFU = FLOPs/token
(trnrecipes.plan.layout.flops_per_token, 6N + 12 L H Q T) x tokens/s / the GPU's dense bf16 peak (--peak-tflops; default
from the device name). Peak memory: torch.cuda.max_memory_allocated on cuda, peak RSS (VmHWM) on cpu, counted from
the end of setup (weights, optimizer states, gradients, activations; not the reference model of the loss check).

Before anything is timed, each row's model is checked against the other implementation, built in the same process
from the same weights (ours against transformers eager, transformers' rows against ours eager), on the first
micro-batch: the mean loss over the same b x (s - 1) targets must agree within a relative 1e-3 in bf16 and 1e-4 in
fp32, and the logits within a relative L2 error of 0.2 in bf16 and 1e-3 in fp32. The logits are the discriminating
part: at initialisation, on random tokens, the loss hardly depends on what the layers compute. Measured on CPU at
the default shape (seq 256): the same model in bf16 instead of fp32 (weights rounded too, so more than two bf16
implementations of one set of weights differ by) moves the logits by 2.6e-2 and the loss by 1.5e-4, while swapping
gate and up in every MLP moves the logits by 1.19 and the loss by only 2.9e-3. At hidden 1024, permuting the q heads
or transposing o_proj moves the logits by 0.44 and 1.24; at a toy width (--tiny) layers add little to the logits at
init and a swap moves them by 2e-2 only, caught by the fp32 tolerance but not the bf16 one. A row that fails is not
timed and the run stops. The ratios printed are ours / transformers eager and ours / transformers + torch.compile
tokens/s (target: a row of ours >= 1.05x transformers + torch.compile, peak memory not above its).

The H100 table (Llama-2-7B width, 4 layers = 1.07B parameters, seq 4096, micro-batch 2 x accumulation 4, bf16):

    .venv/bin/python bench/bench_gpu.py --json runs/bench_gpu.json

(or `python3 bench/bench_gpu.py ...` from a copy of the repository on a machine whose python3 has torch,
transformers and PyYAML: see REPO below), which is, spelled out: --device cuda --hidden 4096 --layers 4 --heads 32
--ffn 11008 --vocab 32000 --seq 4096 --micro-batch 2 --accum 4 --dtype bf16 --warmup 3 --steps 10
--rows ours,ours-compile,ours-compile-bf16-state,hf,hf-compile,optimizer --activation-checkpointing elementwise (and
--peak-tflops 989 on an H100 SXM, read from the device name). The whole 7B (32 layers, micro-batch 1 x accum 4):
    .venv/bin/python bench/bench_gpu.py --preset 7b --json runs/bench_gpu_7b.json
CPU smoke test, under a minute (tests/test_bench_gpu.py runs it with --rows ours,ours-compile,hf); aot_eager spares
the compiled rows inductor's C++ build:
    .venv/bin/python bench/bench_gpu.py --tiny --compile-backend aot_eager
CI never runs this on a GPU: it has none. The GPU numbers come from running the command above by hand.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace

from bench_model import rss_mib  # bench/ is on sys.path: this script runs from it

# The project's packages from this checkout, so that a GPU machine's own python3 (torch and transformers installed,
# trnrecipes not) runs the bench as it is: `python3 bench/bench_gpu.py` from a copy of the repository.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(1, REPO)

ROWS = {
    "ours": "trnrecipes Trainer.train_step, train.compile=false",
    "ours-compile": "trnrecipes Trainer.train_step, train.compile=true",
    "ours-compile-bf16-state": "the same, optim.state_dtype=bf16",
    "hf": "transformers LlamaForCausalLM + torch AdamW, eager",
    "hf-compile": "transformers + torch.compile(model)",
    "optimizer": "the optimizer step alone: ours eager / compiled / compiled bf16 state, torch fused",
}
OURS_ROWS = ("ours", "ours-compile", "ours-compile-bf16-state")  # the Trainer's rows
# The optimizer row's variants: (name, our AdamW's compile, our state dtype); torch's fused AdamW is timed after them.
OPTIMIZERS = (
    ("ours-eager", False, "fp32"),
    ("ours-compiled", True, "fp32"),
    ("ours-compiled-bf16-state", True, "bf16"),
)
BASE_RECIPE = "llama2-tiny"  # everything the shape arguments do not set (optimizer, seed) comes from it
# Dense bf16 tensor-core peak per GPU, TFLOP/s (NVIDIA's data sheets; the sparse figures are twice these). The first
# name that is a substring of torch.cuda.get_device_name() wins, so the more specific names come first.
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
# The loss check (see the module docstring): relative first-loss and relative L2 logits error allowed.
LOSS_TOLERANCE = {"bf16": 1e-3, "fp32": 1e-4}
LOGITS_TOLERANCE = {"bf16": 0.2, "fp32": 1e-3}
# Llama-2-7B's width and depth 4: 1.07B parameters, the shape of the hand-measured H100 table.
DEFAULTS = dict(
    hidden=4096, layers=4, heads=32, kv_heads=None, ffn=11008, vocab=32000, seq=4096,
    micro_batch=2, accum=4, steps=10, warmup=3, dtype="bf16", device="cuda",
)  # fmt: skip
# --preset 7b: Llama-2-7B whole (32 layers, 6.74B parameters) at the batch an 80 GB GPU holds (the table).
PRESETS = {"default": {}, "7b": dict(layers=32, micro_batch=1, accum=4)}
# --tiny: a CPU smoke test in seconds (explicit arguments still win).
TINY = dict(
    hidden=64, layers=2, heads=4, kv_heads=None, ffn=172, vocab=512, seq=64,
    micro_batch=2, accum=2, steps=3, warmup=1, dtype="fp32", device="cpu",
)  # fmt: skip
MARK = "BENCH_GPU_JSON "  # a worker's results on stdout, one line each, after this prefix


def recipe_overrides(args, row: str | None) -> list[str]:
    """The overrides turning BASE_RECIPE into this benchmark's single-device recipe for a row (None: validation)."""
    cuda = args.device == "cuda"
    # transformers' rows never checkpoint; the weights their process builds ours from do not depend on it.
    checkpointing = args.activation_checkpointing if row is None or row in OURS_ROWS else "none"
    over = [
        f"model.vocab_size={args.vocab}",
        f"model.hidden_size={args.hidden}",
        f"model.num_layers={args.layers}",
        f"model.num_heads={args.heads}",
        f"model.num_kv_heads={args.kv_heads}",
        f"model.ffn_hidden_size={args.ffn}",
        f"model.max_seq_len={args.seq}",
        f"model.activation_checkpointing={checkpointing}",
        f"model.activation_checkpointing_full_layers={args.full_layers if checkpointing != 'none' else 0}",
        f"batch.micro_batch={args.micro_batch}",
        f"batch.global_batch={args.micro_batch * args.accum}",
        f"batch.seq_len={args.seq}",
        f"precision.dtype={args.dtype}",
        f"precision.stochastic_rounding={'true' if args.stochastic_rounding else 'false'}",
        f"train.max_steps={args.warmup + args.steps}",
        "layout.tp=1",
        "layout.pp=1",
        "layout.sequence_parallel=false",
        "layout.zero1=false",
        f"cluster.instance={'p5.48xlarge' if cuda else 'local-cpu'}",  # the backend must run on it; else unused
        f"cluster.backend={args.device}",
        "cluster.workers_per_node=1",  # one process, one device: grad accumulation = global batch / micro-batch
        "cluster.nodes=1",
    ]
    if row is not None:
        over.append(f"train.compile={'true' if row.startswith('ours-compile') else 'false'}")
    if row == "ours-compile-bf16-state":
        over.append("optim.state_dtype=bf16")
    return over


def make_recipe(args, row: str | None):
    from trnrecipes.config.recipe import load_recipe

    return load_recipe(BASE_RECIPE, overrides=recipe_overrides(args, row))


# ---------------------------------------------------------------------------------------------------------- worker
def emit(kind: str, payload: dict) -> None:
    print(MARK + json.dumps({"kind": kind, **payload}), flush=True)


def strip_compile_prefix(name: str) -> str:
    """A parameter name without torch.compile's wrapper segment (an OptimizedModule adds `_orig_mod.`)."""
    return name.replace("_orig_mod.", "")


def hf_from_ours(ours, cfg, device, dtype):
    """transformers' LlamaForCausalLM with our model's weights (recipes/<family>/hf.py converts them)."""
    import torch
    import transformers

    from trnrecipes.models import FAMILIES

    hf_mod = FAMILIES[cfg.family].hf
    config = {**hf_mod.hf_config_from_args(cfg), "dtype": str(dtype).removeprefix("torch."), "use_cache": False}
    hf_cfg = transformers.AutoConfig.for_model(**config, attn_implementation="sdpa")
    with torch.device(device):
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, dtype=dtype)
    sd = {strip_compile_prefix(k): v for k, v in ours.state_dict().items()}
    hf.load_state_dict(hf_mod.state_dict_to_hf(sd, cfg))
    del sd
    return hf


def ours_check_loss(model, tokens):
    """Our mean loss on a [b, s + 1] batch over the b x (s - 1) targets transformers' shift gives (the last input
    position has no target there)."""
    labels = tokens[:, 1:].clone()
    labels[:, -1] = -100
    return model(tokens[:, :-1], labels=labels)


def hf_loss(model, tokens):
    """transformers' loss as its users compute it: labels = input_ids, shifted inside the model."""
    inputs = tokens[:, :-1]
    return model(input_ids=inputs, labels=inputs, use_cache=False).loss


def relative_error(x, reference) -> float:
    """||x - reference|| / ||reference|| over all elements, in fp32."""
    x, reference = x.float(), reference.float()
    return float((x - reference).norm() / reference.norm())


def loss_check(
    row: str, loss: float, reference: float, reference_name: str, dtype: str, logits_rel: float = 0.0
) -> dict:
    """Whether a row computes the same function as the other implementation on the same weights and batch: its
    first loss and its logits (relative L2 error) within the dtype's tolerances (LOSS_TOLERANCE, LOGITS_TOLERANCE)."""
    rel = abs(loss - reference) / abs(reference) if reference else float("inf")
    tolerance, logits_tolerance = LOSS_TOLERANCE[dtype], LOGITS_TOLERANCE[dtype]
    ok = all(map(_finite, (loss, reference, logits_rel))) and rel <= tolerance and logits_rel <= logits_tolerance
    return {"row": row, "loss": loss, "reference": reference, "reference_name": reference_name, "rel": rel,
            "tolerance": tolerance, "logits_rel": logits_rel, "logits_tolerance": logits_tolerance,
            "ok": ok}  # fmt: skip


def compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover
        return 0
    return int(counters["stats"]["unique_graphs"])


def worker(args, row: str) -> None:
    setup_s = time.perf_counter()
    import torch

    if args.compile_backend != "inductor":  # smoke tests: every torch.compile in this process, ours included
        compile_ = torch.compile

        def compile_with_backend(*a, **k):
            k.pop("mode", None), k.pop("options", None)
            return compile_(*a, **{**k, "backend": args.compile_backend})

        torch.compile = compile_with_backend

    from trnrecipes.backends import make_backend
    from trnrecipes.optim.schedule import lr_at
    from trnrecipes.parallel.dims import ParallelDims
    from trnrecipes.train.build import build_model_shard
    from trnrecipes.train.loop import Trainer

    if args.loss_chunk:  # rows of logits per chunk of the fused head + loss (recipes/common/loss.py)
        import recipes.common.loss as loss_module

        loss_module.CHUNK_SIZES[args.device] = args.loss_chunk
    recipe = make_recipe(args, row)
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    # The same batches in every process: [micro-batch, seq + 1] tokens, as the trainer's loader yields them.
    gen = torch.Generator().manual_seed(0)
    shape = (args.micro_batch, args.seq + 1)
    pool = [torch.randint(0, args.vocab, shape, generator=gen).to(device) for _ in range(args.accum)]

    def sync():
        if cuda:
            torch.cuda.synchronize()

    if row == "optimizer":
        optimizer_worker(args, recipe, device, sync)
        return
    if row.startswith("ours"):

        class BenchTrainer(Trainer):
            """The real Trainer without a corpus: the bench feeds train_step its own batches, so the recipe's data
            files need not exist on the GPU machine. compile_only=True: no run-dir lock, nothing written."""

            def _open_data(self) -> None:
                from types import SimpleNamespace

                self.sources, self.num_docs = [], 0
                self.tokenizer = SimpleNamespace(path=None, vocab_size=self.recipe.model.vocab_size)
                self.val_batches = []

        def log(*a, **k):
            k.pop("file", None)
            print(*a, file=sys.stderr, **k)

        trainer = BenchTrainer(recipe, compile_only=True, log=log)
        model = trainer.model
        reference_name = "transformers eager"
        reference = hf_from_ours(model, recipe.model, device, dtype).eval()
        with torch.no_grad():
            ref_loss = float(hf_loss(reference, pool[0]))
            ref_logits = reference(input_ids=pool[0][:, :-1], use_cache=False).logits
        del reference
        # Grad enabled, train mode: the training graph (compiled blocks compile here, and only once).
        model.train()
        loss = ours_check_loss(model, pool[0])
        first_loss = float(loss.detach())
        del loss
        logits = model(pool[0][:, :-1]).detach()  # the same blocks' graph; only the head differs, eager
        loader = _cycle(pool)

        def step(i: int):
            loss, _grad_norm = trainer.train_step(i, loader, trainer.layout.grad_accum)
            return loss

    else:
        backend = make_backend(recipe.cluster.backend, 0)
        dims = ParallelDims(recipe, backend)
        ours = build_model_shard(recipe, dims=dims, backend=backend).eval()  # the weights ours trains from
        hf = hf_from_ours(ours, recipe.model, device, dtype)
        reference_name = "trnrecipes eager"
        with torch.no_grad():
            ref_loss = float(ours_check_loss(ours, pool[0]))
            ref_logits = ours(pool[0][:, :-1])
            del ours
            logits = hf.eval()(input_ids=pool[0][:, :-1], use_cache=False).logits  # the weights, eager
        hf.train()
        model = torch.compile(hf) if row == "hf-compile" else hf
        o = recipe.optim
        params = [p for p in hf.parameters() if p.requires_grad]
        fast = {"fused": True} if cuda else {"foreach": True}
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **fast)
        loss = hf_loss(model, pool[0])  # grad enabled, the training graph (torch.compile compiles here)
        first_loss = float(loss.detach())
        del loss

        def step(i: int):
            loss_sum = torch.zeros((), dtype=torch.float32, device=device)
            for tokens in pool:
                loss = hf_loss(model, tokens)
                (loss / args.accum).backward()
                loss_sum += loss.detach().float()
            if o.clip_grad_norm > 0:
                torch.nn.utils.clip_grad_norm_(params, o.clip_grad_norm, foreach=True)
            for group in optimizer.param_groups:  # ours' schedule, warm-up included: the same work as ours' rows
                group["lr"] = lr_at(i, o)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss_sum / args.accum

    rel_logits = relative_error(logits, ref_logits)
    del logits, ref_logits
    check = loss_check(row, first_loss, ref_loss, reference_name, args.dtype, rel_logits)
    emit("check", check)
    if not check["ok"]:
        raise SystemExit(
            f"{row}: on the same weights and batch as {reference_name}, first loss {first_loss:.6f} vs"
            f" {ref_loss:.6f} (rel {check['rel']:.2e}, tolerance {check['tolerance']:.0e}), logits rel"
            f" {rel_logits:.2e} (tolerance {check['logits_tolerance']:.0e}): not the same model; nothing timed"
        )

    setup_s = time.perf_counter() - setup_s
    # Peak memory from here: what training needs, not the reference model built for the check.
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    start_gib = torch.cuda.memory_allocated() / 2**30 if cuda else None  # weights (and states made at build)
    if not cuda:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        except OSError:
            pass
    warm_s = time.perf_counter()
    losses = []
    for i in range(args.warmup):
        losses.append(float(step(i)))
    sync()
    warm_s = time.perf_counter() - warm_s
    graphs_after_warmup = compiled_graphs()
    times = []
    for i in range(args.warmup, args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        loss = step(i)
        sync()
        times.append(time.perf_counter() - start)
        losses.append(float(loss))
    if not all(map(_finite, losses)):
        raise SystemExit(f"{row}: non-finite loss during the steps: {losses}")
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else rss_mib("VmHWM") / 1024
    step_index = args.warmup + args.steps
    if args.memory_snapshot and cuda:  # one more step, recorded: where its peak goes (bench/gpu_memory.py)
        diagnose_memory(args, row, lambda: step(step_index), sync)
        step_index += 1
    if args.profile and cuda:  # one more step under the profiler: its kernels by GPU time
        profile_kernels(args, row, lambda: step(step_index), sync)
    emit(
        "result",
        {
            "row": row,
            "step_s": times,
            "setup_s": setup_s,
            "warmup_s": warm_s,
            "losses": losses,
            "peak_gib": peak_gib,
            "peak_kind": "max_memory_allocated" if cuda else "peak RSS",
            "allocated_at_start_gib": start_gib,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
            "graphs": compiled_graphs(),
            "graphs_during_timing": compiled_graphs() - graphs_after_warmup,
        },
    )


def _row_file(directory: str, row: str, suffix: str) -> str:
    os.makedirs(directory, exist_ok=True)
    return os.path.join(directory, f"{row}{suffix}")


def diagnose_memory(args, row: str, one_step, sync) -> None:
    """One step with torch.cuda.memory's history recorded; writes <dir>/<row>-memory.txt: what is alive at the
    step's peak, grouped by where it was made (bench/gpu_memory.py)."""
    import torch
    from gpu_memory import report

    sync()
    torch.cuda.reset_peak_memory_stats()
    baseline = torch.cuda.memory_allocated()
    try:
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python", compile_context=True)
    except TypeError:  # an older torch: no compile_context
        torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    one_step()
    sync()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    text = report(snapshot, baseline, top=40)
    peak = torch.cuda.max_memory_allocated() / 2**30
    with open(_row_file(args.memory_snapshot, row, "-memory.txt"), "w") as f:
        f.write(f"{row}: max_memory_allocated during the recorded step {peak:.2f} GiB\n{text}\n")
    print(f"{row}: memory at the peak of a recorded step (max allocated {peak:.2f} GiB):\n{text}", file=sys.stderr)


def profile_kernels(args, row: str, one_step, sync) -> None:
    """One step under torch.profiler; writes <dir>/<row>-kernels.txt: the ops and kernels by GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        one_step()
        sync()
    table = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=45, max_name_column_width=70)
    with open(_row_file(args.profile, row, "-kernels.txt"), "w") as f:
        f.write(table)
    print(f"{row}: one step's kernels by GPU time:\n{table}", file=sys.stderr)
    del torch


def optimizer_worker(args, recipe, device, sync) -> None:
    """The optimizer row: each optimizer of OPTIMIZERS, then torch's fused AdamW, over the same parameters (the
    model's, built by the trainer's code and materialized on the device) and gradients, timed like the steps of the
    other rows (--warmup untimed steps, compilation included, then the median of --steps)."""
    import torch

    from trnrecipes.backends import make_backend
    from trnrecipes.optim.adamw import AdamW
    from trnrecipes.optim.schedule import lr_at
    from trnrecipes.parallel.dims import ParallelDims
    from trnrecipes.train.build import build_model_shard

    backend = make_backend(recipe.cluster.backend, 0)
    model = build_model_shard(recipe, dims=ParallelDims(recipe, backend), backend=backend)
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator(device=device).manual_seed(0)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen, device=device, dtype=torch.float32).mul_(1e-3).to(p.dtype)
    o = recipe.optim
    made = [
        (
            name,
            lambda c=compiled, d=dtype: AdamW(
                params,
                replace(o, state_dtype=d),
                stochastic_rounding=args.stochastic_rounding,
                compile_backend=args.compile_backend if c else None,
            ),
        )
        for name, compiled, dtype in OPTIMIZERS
    ]
    fused = {"fused": True} if args.device == "cuda" else {"foreach": True}
    torch_name = "torch-fused" if args.device == "cuda" else "torch-foreach"
    made.append(
        (
            torch_name,
            lambda: torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, **fused),
        )
    )
    timings = {}
    for name, make in made:
        opt = make()
        times = []
        for i in range(args.warmup + args.steps):
            sync()
            start = time.perf_counter()
            if isinstance(opt, AdamW):
                opt.set_lr(lr_at(i, o))
            else:
                opt.param_groups[0]["lr"] = lr_at(i, o)
            opt.step()
            sync()
            times.append(time.perf_counter() - start)
        timings[name] = statistics.median(times[args.warmup :])
        del opt
        gc.collect()
        if args.device == "cuda":
            torch.cuda.empty_cache()
    emit(
        "optimizer",
        {"row": "optimizer", "median_s": timings, "params": sum(p.numel() for p in params), "reference": torch_name},
    )


def _cycle(items):
    while True:
        yield from items


def _finite(x: float) -> bool:
    return x == x and abs(x) != float("inf")


def probe() -> None:
    """Print the GPU's name (a process of its own, so the parent never holds a CUDA context)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--device cuda: this torch sees no CUDA device (torch.cuda.is_available() is False)")
    print(torch.cuda.get_device_name(0))


# ---------------------------------------------------------------------------------------------------------- parent
def peak_for(name: str) -> float | None:
    for key, tflops in PEAK_TFLOPS:
        if key.lower() in name.lower():
            return tflops
    return None


KNOWN_PEAKS = "known: " + ", ".join(f"{k} {v:g}" for k, v in PEAK_TFLOPS)


def fmt_tok(x: float) -> str:
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"


def fmt_params(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def worker_argv(args, row: str) -> list[str]:
    argv = [sys.executable, os.path.abspath(__file__), "--worker", row]
    for name in (*DEFAULTS, "activation_checkpointing", "full_layers", "compile_backend"):
        argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    for name in ("loss_chunk", "memory_snapshot", "profile"):
        if getattr(args, name):
            argv += [f"--{name.replace('_', '-')}", str(getattr(args, name))]
    argv.append("--stochastic-rounding" if args.stochastic_rounding else "--no-stochastic-rounding")
    return argv


def run_row(args, row: str) -> dict | None:
    """One row's results, from a process of its own; None if it failed (its stderr says why, e.g. out of memory).
    A failed loss check stops the whole run: the rows would not be timing the same model."""
    env = {**os.environ, "WORLD_SIZE": "1", "RANK": "0", "LOCAL_RANK": "0"}  # one process: the trainer's dims
    done = subprocess.run(worker_argv(args, row), stdout=subprocess.PIPE, text=True, env=env)
    found: dict[str, dict] = {}
    for line in done.stdout.splitlines():
        if line.startswith(MARK):
            payload = json.loads(line[len(MARK) :])
            found[payload.pop("kind")] = payload
        else:
            print(line, file=sys.stderr)  # whatever else the worker printed
    check = found.get("check")
    if check is not None:
        print(
            f"loss check {row}: {check['loss']:.6f} vs {check['reference_name']} {check['reference']:.6f}"
            f" (rel {check['rel']:.1e}, tolerance {check['tolerance']:.0e}); logits rel {check['logits_rel']:.1e}"
            f" (tolerance {check['logits_tolerance']:.0e}): {'ok' if check['ok'] else 'FAILED'}",
            flush=True,
        )
    if check is not None and not check["ok"]:
        raise SystemExit(f"{row}: the loss check failed; stopping (its message is above)")
    result = found.get("result", found.get("optimizer"))
    if done.returncode != 0 or result is None:
        print(f"error: {row}: the worker failed (exit {done.returncode}); its stderr is above", flush=True)
        return None
    return {**result, "check": check}


def print_optimizer(r: dict) -> dict[str, float]:
    """The optimizer row's line: each optimizer's median step, and each of ours against torch's (target: compiled
    <= 1.5x torch's fused AdamW)."""
    times, reference = r["median_s"], r["reference"]
    print(
        f"optimizer step over {fmt_params(r['params'])} parameters (median): "
        + ", ".join(f"{name} {t * 1e3:.2f} ms" for name, t in times.items())
    )
    ratios = {name: t / times[reference] for name, t in times.items() if name != reference}
    for name, ratio in ratios.items():
        line = f"optimizer {name}/{reference}: {ratio:.2f}x step time"
        if name.startswith("ours-compiled"):
            line += f" (target <= 1.5x: {'met' if ratio <= 1.5 else 'not met'})"
        print(line)
    return ratios


LOSS_AGREEMENT = 0.02  # relative: each row's first losses against the reference row's at the same step
COMPARED_STEPS = 3
REFERENCE_ROWS = ("hf-compile", "hf", "ours-compile", "ours")  # the first of these present is the reference


def disagreeing_rows(results: dict[str, dict]) -> list[str]:
    """The rows whose first COMPARED_STEPS losses differ from the reference row's (REFERENCE_ROWS) by more than
    LOSS_AGREEMENT (relative), each said on a line: such a row did not do the same work (another schedule, another
    model, a broken step), so its speed is not comparable. Both sides train on the same learning-rate schedule, so
    the losses part from step 2 on where the work differs (step 1 is the loss check's, before any update)."""
    reference = next((r for r in REFERENCE_ROWS if r in results), None)
    if reference is None or len(results) < 2:
        return []
    want = results[reference]["losses"]
    bad = []
    for row, r in results.items():
        steps = min(COMPARED_STEPS, len(r["losses"]), len(want))
        worst = max(abs(r["losses"][i] - want[i]) / abs(want[i]) for i in range(steps))
        if worst > LOSS_AGREEMENT:
            got = ", ".join(f"{x:.4f}" for x in r["losses"][:steps])
            print(
                f"error: {row}: first {steps} losses {got} differ from {reference}'s"
                f" {', '.join(f'{x:.4f}' for x in want[:steps])} by {worst:.1%} (> {LOSS_AGREEMENT:.0%}): not the"
                " same work; not ranked",
                flush=True,
            )
            bad.append(row)
    return bad


def parse_args(argv=None):
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cuda", "cpu"), help="default cuda (cpu: smoke tests)")
    parser.add_argument("--hidden", type=int, help="model.hidden_size (default 4096)")
    parser.add_argument("--layers", type=int, help="model.num_layers (default 4)")
    parser.add_argument("--heads", type=int, help="model.num_heads (default 32)")
    parser.add_argument("--kv-heads", type=int, help="model.num_kv_heads (default: --heads, as Llama-2-7B)")
    parser.add_argument("--ffn", type=int, help="model.ffn_hidden_size (default 11008)")
    parser.add_argument("--vocab", type=int, help="model.vocab_size (default 32000)")
    parser.add_argument("--seq", type=int, help="sequence length (default 4096)")
    parser.add_argument("--micro-batch", type=int, help="sequences per forward/backward (default 2)")
    parser.add_argument("--accum", type=int, help="gradient-accumulation micro-batches per step (default 4)")
    parser.add_argument("--steps", type=int, help="timed optimizer steps per row (default 10)")
    parser.add_argument("--warmup", type=int, help="untimed optimizer steps first, compilation included (default 3)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), help="weights of every row (default bf16)")
    parser.add_argument(
        "--rows",
        default=",".join(ROWS),
        help=f"comma-separated, run in this order (default: all): {', '.join(ROWS)}",
    )
    parser.add_argument("--peak-tflops", type=float, help="dense bf16 peak of the device (default: by GPU name)")
    parser.add_argument(
        "--activation-checkpointing",
        choices=("none", "selective", "elementwise", "full"),
        default="elementwise",
        help="ours' model.activation_checkpointing (default elementwise: matmul and attention outputs kept, the rest"
        " recomputed; what cuda recipes should use)",
    )
    parser.add_argument(
        "--full-layers",
        type=int,
        default=0,
        help="ours' model.activation_checkpointing_full_layers: the first N blocks checkpointed whole (default 0)",
    )
    parser.add_argument(
        "--stochastic-rounding",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="ours' precision.stochastic_rounding (bf16 only; default off)",
    )
    parser.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend for every compiled row (default inductor; e.g. aot_eager for fast smoke tests)",
    )
    parser.add_argument(
        "--preset",
        choices=tuple(PRESETS),
        default="default",
        help="default: Llama-2-7B width, 4 layers, micro-batch 2 x accum 4; 7b: all 32 layers, micro-batch 1 x"
        " accum 4 (explicit arguments win)",
    )
    parser.add_argument("--tiny", action="store_true", help="a CPU smoke-test preset (explicit arguments win)")
    parser.add_argument(
        "--loss-chunk", type=int, help="ours: rows of logits per chunk of the fused head + loss (default: the device's)"
    )
    parser.add_argument(
        "--memory-snapshot",
        metavar="DIR",
        help="cuda: after the timed steps, one more step with torch.cuda.memory's history recorded;"
        " DIR/<row>-memory.txt"
        " says what is alive at its peak and where it was made (bench/gpu_memory.py)",
    )
    parser.add_argument(
        "--profile", metavar="DIR", help="cuda: one more step under torch.profiler; DIR/<row>-kernels.txt"
    )
    parser.add_argument("--json", metavar="PATH", help="also write the results here")
    parser.add_argument("--worker", choices=list(ROWS), help=argparse.SUPPRESS)
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    preset = TINY if args.tiny else {**DEFAULTS, **PRESETS[args.preset]}
    for name, value in preset.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if args.kv_heads is None:
        args.kv_heads = args.heads
    for name in ("hidden", "layers", "heads", "kv_heads", "ffn", "vocab", "micro_batch", "accum", "steps", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, not {getattr(args, name)}")
    if args.seq < 2:
        parser.error(f"--seq must be >= 2 (the loss needs a next token), not {args.seq}")
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        parser.error(f"--peak-tflops must be > 0, not {args.peak_tflops}")
    if args.stochastic_rounding and args.dtype != "bf16":
        parser.error("--stochastic-rounding needs --dtype bf16")
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown or not rows:
        parser.error(f"--rows: unknown row(s) {unknown or args.rows!r}; valid: {', '.join(ROWS)}")
    if len(set(rows)) != len(rows):
        parser.error(f"--rows names a row twice: {args.rows}")
    args.rows = rows
    if args.worker is None and not args.probe:
        from trnrecipes.config.sections import RecipeError

        try:  # the recipe's own checks: heads divide hidden, even head_dim, kv heads divide heads, ...
            make_recipe(args, None)
        except RecipeError as err:
            parser.error(f"this shape is not a valid recipe: {err}")
    args.parser = parser
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.probe:
        probe()
        return 0
    if args.worker:
        worker(args, args.worker)
        return 0

    from trnrecipes.plan.layout import flops_per_token, param_count

    if args.device == "cuda":  # asked in a process of its own: this one never holds a CUDA context
        probe_argv = [sys.executable, os.path.abspath(__file__), "--probe", "--device", args.device]
        name = subprocess.run(probe_argv, stdout=subprocess.PIPE, text=True)
        if name.returncode != 0:
            raise SystemExit(f"cannot use --device {args.device} (its error is above)")
        device_name = name.stdout.strip()
    else:
        import platform

        device_name = platform.processor() or platform.machine() or "cpu"
    peak = args.peak_tflops
    if peak is None and args.device == "cuda":
        peak = peak_for(device_name)
        if peak is None:
            args.parser.error(f"no dense bf16 peak known for {device_name!r} ({KNOWN_PEAKS}); give --peak-tflops")
    recipe = make_recipe(args, None)
    fpt = flops_per_token(recipe.model, args.seq)
    params = param_count(recipe.model)
    tokens_per_step = args.micro_batch * args.accum * args.seq
    print(
        f"bench_gpu on {args.device} ({device_name}), peak {f'{peak:g} TFLOP/s' if peak else 'unknown (no MFU)'}:"
        f" llama2 hidden {args.hidden} x {args.layers} layers (heads {args.heads}, kv {args.kv_heads}, ffn"
        f" {args.ffn}, vocab {args.vocab}) = {fmt_params(params)} params, seq {args.seq}, micro-batch"
        f" {args.micro_batch} x accum {args.accum} = {tokens_per_step} tokens/step, {args.dtype} weights,"
        f" {fpt / 1e9:.3f} GFLOP/token; {args.warmup} warm-up + {args.steps} timed steps per row; ours:"
        f" activation checkpointing {args.activation_checkpointing}, stochastic rounding"
        f" {'on' if args.stochastic_rounding else 'off'}",
        flush=True,
    )
    results: dict[str, dict] = {}
    optimizer: dict | None = None
    failed: list[str] = []
    for row in args.rows:
        r = run_row(args, row)
        if r is None:
            failed.append(row)
            continue
        if row == "optimizer":
            optimizer = r
            continue
        median_s = statistics.median(r["step_s"])
        r["tokens_per_s"] = tokens_per_step / median_s
        r["median_step_s"] = median_s
        r["mfu"] = fpt * r["tokens_per_s"] / (peak * 1e12) if peak else None
        results[row] = r
        if row.endswith("compile") and r["graphs"] == 0:
            print(f"warning: {row} compiled no graph: it ran eagerly", flush=True)
        if r["graphs_during_timing"]:
            print(f"warning: {row} compiled {r['graphs_during_timing']} graph(s) during the timed steps", flush=True)

    for row in disagreeing_rows(results):
        failed.append(row)
        results.pop(row)

    print()
    print("| row | what | tokens/s | MFU | step s (median) | setup s | warm-up s | peak memory GiB | first-step loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for row, r in results.items():
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        print(
            f"| {row} | {ROWS[row]} | {fmt_tok(r['tokens_per_s'])} | {mfu} | {r['median_step_s']:.4f}"
            f" | {r['setup_s']:.1f} | {r['warmup_s']:.1f} | {r['peak_gib']:.2f} | {r['losses'][0]:.4f} |"
        )
    if results:
        kind = next(iter(results.values()))["peak_kind"]
        print(
            f"(peak memory: {kind} from the end of setup; setup s: imports, building, the loss check and the"
            f" forward's compilation; warm-up s: all {args.warmup} warm-up steps, the backward's compilation included;"
            " first-step loss: ours averages over b x s targets, transformers over b x (s - 1))"
        )
    ratios = {}
    for ours in OURS_ROWS:
        for hf in ("hf", "hf-compile"):
            if ours in results and hf in results:
                o, h = results[ours], results[hf]
                key = f"{ours}/{hf}"
                ratios[key] = {
                    "tokens_per_s": o["tokens_per_s"] / h["tokens_per_s"],
                    "peak": o["peak_gib"] / h["peak_gib"],
                }
                line = f"{key}: {ratios[key]['tokens_per_s']:.2f}x tokens/s, {ratios[key]['peak']:.2f}x peak memory"
                if hf == "hf-compile":
                    met = ratios[key]["tokens_per_s"] >= 1.05 and ratios[key]["peak"] <= 0.90
                    line += f" (target >= 1.05x tokens/s at <= 0.90x memory: {'met' if met else 'not met'})"
                print(line)
    if optimizer is not None:
        ratios["optimizer"] = print_optimizer(optimizer)
    if args.json:
        out = {
            "device": args.device,
            "device_name": device_name,
            "peak_tflops": peak,
            "shape": {k: getattr(args, k) for k in DEFAULTS},
            "activation_checkpointing": args.activation_checkpointing,
            "stochastic_rounding": args.stochastic_rounding,
            "params": params,
            "flops_per_token": fpt,
            "tokens_per_step": tokens_per_step,
            "rows": results,
            "optimizer": optimizer,
            "failed": failed,
            "ratios": ratios,
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    if failed:
        print(f"error: row(s) failed: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
