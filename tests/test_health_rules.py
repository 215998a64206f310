"""The health check's rules without processes: who is named for what, how precise a device's fp32 matmul must be,
and the bad-nodes file. Real torchrun launches: tests/test_health.py."""

from __future__ import annotations

import pytest

from trnrecipes.ops.health import KINDS, blame, matmul_precision, record_bad_nodes


def counts(world: int, found: dict[str, dict[int, int]] | None = None) -> dict[str, list[int]]:
    """Agreed counts from found[kind] = {rank: how many ranks found it}."""
    table = {kind: [0] * world for kind in KINDS}
    for kind, ranks in (found or {}).items():
        for r, k in ranks.items():
            table[kind][r] = k
    return table


def test_a_sender_of_wrong_data_is_named_and_explains_the_wrong_sums():
    # rank 1 of 4 sends wrong data: every rank sees its slot wrong (one slot each) and every sum wrong
    every = dict.fromkeys(range(4), 1)
    found = {"all_gather": {1: 4}, "all_gather received": every, "all_reduce": every, "reduce_scatter": every}
    named, loose = blame(counts(4, found), 4)
    assert named == {1: ["its all_gather data came back wrong on 4 of 4 ranks"]} and loose == []


def test_a_rank_receiving_wrong_data_is_named_not_its_senders():
    # rank 2 of 4 receives garbage: it sees the three other slots wrong, nobody else sees anything
    found = {"all_gather": {0: 1, 1: 1, 3: 1}, "all_gather received": {2: 3}, "all_reduce": {2: 1}}
    named, loose = blame(counts(4, found), 4)
    assert list(named) == [2] and loose == []
    assert named[2] == ["all_gather: received 3 wrong slot(s) here", "all_reduce: result wrong here (1 of 4 ranks)"]


def test_a_wrong_matmul_or_a_raising_device_names_its_rank():
    named, _ = blame(counts(3, {"matmul": {0: 1}, "device error": {2: 1}}), 3)
    assert named == {0: ["matmul result wrong"], 2: ["the device raised during the matmul"]}


def test_what_cannot_be_told_apart_fails_without_naming_a_node():
    # two ranks, one received garbage: sender or receiver? Neither is named, and the check still fails
    found = {"all_gather": {0: 1}, "all_gather received": {1: 1}, "all_reduce": {1: 1}}
    named, loose = blame(counts(2, found), 2)
    assert named == {}
    assert loose == [
        "all_gather: 1 of 2 ranks received wrong data from ranks not named here",
        "all_reduce: results wrong on 1 of 2 ranks, no rank sent bad all_gather data",
    ]
    assert blame(counts(2), 2) == ({}, [])


@pytest.mark.parametrize(
    ("device", "env", "want"),
    [
        ("cpu", {}, "fp32"),
        ("xla", {"PJRT_DEVICE": "CPU"}, "fp32"),
        ("xla", {"PJRT_DEVICE": "CUDA"}, "bf16"),
        # torch-xla + neuronx-cc (trn1 stack): fp32 matmuls are cast to bf16 unless --auto-cast=none
        ("xla", {"PJRT_DEVICE": "NEURON", "NEURON_CC_FLAGS": "--model-type transformer -O1"}, "bf16"),
        ("xla", {"PJRT_DEVICE": "NEURON", "NEURON_CC_FLAGS": "--auto-cast=none"}, "fp32"),
        # TorchNeuron passes --auto-cast=none itself, then NEURON_CC_FLAGS, whose last --auto-cast wins
        ("neuron", {}, "fp32"),
        ("neuron", {"NEURON_CC_FLAGS": "--auto-cast matmult"}, "bf16"),
    ],
)
def test_the_matmul_tolerance_follows_the_precision_the_device_multiplies_in(device, env, want):
    assert matmul_precision(device, env) == want


def test_bad_nodes_are_appended_one_per_line(tmp_path):
    path = tmp_path / "new" / "dir" / "bad-nodes"
    env = {"TRNRECIPES_BAD_NODES_FILE": str(path)}
    assert record_bad_nodes(["node2"], env) == path
    record_bad_nodes(["node3", "node5"], env)
    record_bad_nodes([], env)  # nothing failed: nothing written
    assert path.read_text() == "node2\nnode3\nnode5\n"
    assert record_bad_nodes(["node2"], {}) is None  # not asked for
