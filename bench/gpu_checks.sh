#!/usr/bin/env bash
# The GPU checks of "Less memory than transformers + torch.compile" (docs/benchmarks.md, "Memory and speed against
# transformers + torch.compile"), as one prepared run for a lent GPU machine (~8 minutes on an H200): the default
# shape (1.07B) and the 32-layer Llama-2-7B, ours (train.compile, bf16 moments, elementwise checkpointing) beside
# transformers + torch.compile in each, then the 7B with its first 10 blocks checkpointed whole and the default shape
# with its first one (the estimate for <= 0.90x memory: docs/benchmarks.md), and the default shape with fp32
# moments. The most wanted numbers come first, so a run cut short still has them. From a copy of the repository:      bash bench/gpu_checks.sh OUT_DIR      (one JSON per command and one log of them all in
# OUT_DIR: the device tool returns at most 8 files, and a log per command cost the first command's JSON once)
set -uo pipefail
out=$(realpath -m "${1:?usage: bash bench/gpu_checks.sh OUT_DIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
run() {  # NAME ARGS...: one bench_gpu run; its table rows and ratios printed
  local name=$1
  shift
  echo "== $name: bench_gpu.py $*" >>"$out/all.log"
  "$py" bench/bench_gpu.py --json "$out/$name.json" "$@" >"$out/$name.tmp" 2>&1
  grep -E "^\| (ours|hf)|/hf-compile|^error|^warning" "$out/$name.tmp"
  cat "$out/$name.tmp" >>"$out/all.log" && rm "$out/$name.tmp"
}
run default --rows ours-compile-bf16-state,hf-compile --warmup 2 --steps 6
run 7b --preset 7b --rows hf-compile,ours-compile-bf16-state --warmup 2 --steps 3
run 7b-full10 --preset 7b --rows ours-compile-bf16-state --full-layers 10 --warmup 2 --steps 3
run default-full1 --rows ours-compile-bf16-state --full-layers 1 --warmup 2 --steps 6
run default-fp32-state --rows ours-compile --warmup 2 --steps 6
