"""TP=2 over two gloo processes equals TP=1 (logits and every gradient), for each decoder family, with and without
sequence parallelism. Real gloo processes, real DTensor; see tests/tp_worker.py."""

from __future__ import annotations

import json
import subprocess

import pytest
from conftest import REPO, rank_launcher

pytestmark = pytest.mark.slow


def test_tp2_equals_tp1_for_each_decoder_family(tmp_path):
    out = tmp_path / "tp.json"
    cmd = [*rank_launcher(2), str(REPO / "tests" / "tp_worker.py"), str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    # column weights (+ biases), row weights, embedding, head; qwen3's q/k norms are replicated
    expected_sharded = {"neox": 14, "llama2": 10, "qwen3": 10}
    for family, sharded in expected_sharded.items():
        for sp in (0, 1):
            r = results[f"{family}-sp{sp}"]
            assert r["logits"] < 1e-5 and r["grads"] < 1e-5, (family, sp, r)
            assert r["sharded_params"] == sharded
        assert results[f"{family}-odd-seq"] == "sequence parallel over 2 ranks needs a sequence length divisible by 2"
