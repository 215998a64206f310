"""train.compile under DTensor tensor parallelism, composed as torchtitan composes them (the TP plan, activation
checkpointing, compile per block, FSDP2 last): compiled TP 2 trains as eager TP 2 does, with sequence parallelism
and under FSDP over 2 more ranks, never recompiles after its warm-up and resumes bitwise. Real gloo ranks and
DTensor through the real Trainer (tests/compiled_tp_worker.py). The backend is aot_eager: dynamo and AOTAutograd,
where compiled TP broke on torch 2.13 (an AsyncCollectiveTensor as a block's input lost its DTensor gradient), run
as they do for inductor; inductor's own kernels under TP are not what is checked (tests/test_torch_compile.py runs
inductor without TP)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO, rank_launcher

pytestmark = pytest.mark.slow

SMALL = ["batch.seq_len=32", "batch.global_batch=8", "batch.micro_batch=2", "model.activation_checkpointing=selective"]
LAYOUTS = {
    "llama2-tp2-sp": (2, "llama2-tiny", ["layout.tp=2", "layout.sequence_parallel=true"]),
    "neox-tp2-fsdp2": (4, "neox-tiny", ["layout.tp=2", "layout.fsdp=true", "layout.sequence_parallel=false"]),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_compiled_tp_trains_as_eager_never_recompiles_and_resumes_bitwise(tmp_path: Path, layout: str):
    workers, name, over = LAYOUTS[layout]
    out = tmp_path / "runs.pt"
    cmd = [*rank_launcher(workers), str(REPO / "tests/compiled_tp_worker.py"), str(out), str(tmp_path), name,
           f"cluster.workers_per_node={workers}", *SMALL, *over]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "COMPILE_BACKEND": "aot_eager"}
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = torch.load(out, weights_only=True)
    (eager_losses, eager_val, eager_weights, eager_compiled) = runs["eager"]
    (losses, val, weights, compiled) = runs["compiled"]
    assert compiled and not eager_compiled
    torch.testing.assert_close(losses, eager_losses, rtol=1e-6, atol=0)
    torch.testing.assert_close(list(val.values()), list(eager_val.values()), rtol=1e-6, atol=0)
    assert weights.keys() == eager_weights.keys()
    for n, w in weights.items():
        torch.testing.assert_close(w, eager_weights[n], rtol=1e-6, atol=1e-7, msg=n)
    # From its step_2, under fail_on_recompile (in the worker): the straight compiled run's steps 3 and 4, bitwise.
    first, resumed = runs["first_half"], runs["resumed"]
    assert first[0] + resumed[0] == losses and resumed[1] == {4: val[4]}
    for n, w in weights.items():
        assert torch.equal(resumed[2][n], w), n
