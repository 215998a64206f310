#!/usr/bin/env bash
# The GPU checks of "Less memory than transformers + torch.compile" (docs/benchmarks.md, "Memory and speed against
# transformers + torch.compile"), as one prepared run for a lent GPU machine (~8 minutes on an H200): the default
# shape (1.07B) and the 32-layer Llama-2-7B, ours (train.compile, bf16 moments, elementwise checkpointing) beside
# transformers + torch.compile in each, then the 7B with its first 8 and 12 blocks checkpointed whole, and the
# default shape with fp32 moments. The most wanted numbers come first, so a run cut short still has them. From a copy
# of the repository:      bash bench/gpu_checks.sh OUT_DIR      (one JSON and one log per command in OUT_DIR)
set -uo pipefail
out=$(realpath -m "${1:?usage: bash bench/gpu_checks.sh OUT_DIR}")
mkdir -p "$out"
cd "$(dirname "$0")/.." || exit 1
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
run() {  # NAME ARGS...: one bench_gpu run; its table rows and ratios printed
  local name=$1
  shift
  "$py" bench/bench_gpu.py --json "$out/$name.json" "$@" >"$out/$name.log" 2>&1
  grep -E "^\| (ours|hf)|/hf-compile|^error|^warning" "$out/$name.log"
}
run default --rows ours-compile-bf16-state,hf-compile --warmup 2 --steps 6
run 7b --preset 7b --rows hf-compile,ours-compile-bf16-state --warmup 2 --steps 3
run 7b-full8 --preset 7b --rows ours-compile-bf16-state --full-layers 8 --warmup 2 --steps 3
run default-fp32-state --rows ours-compile --warmup 2 --steps 6
run 7b-full12 --preset 7b --rows ours-compile-bf16-state --full-layers 12 --warmup 2 --steps 3
