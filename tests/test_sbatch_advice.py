"""What `trnrecipes sbatch` says around the job dir it writes: a multi-node job's checkout, job dir or run dir on a
file system the other nodes do not mount (found from /proc/self/mountinfo), the unset time limit once per job dir
(not for local recipes), and what a re-render changes in recipe.yaml."""

from __future__ import annotations

import os
import shlex
from pathlib import Path

import pytest

from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.mounts import SHARED_TYPES, mount_of, read_mountinfo
from trnrecipes.jobs.render import recipe_changes, render_warnings
from trnrecipes.jobs.storage import node_local_warnings

# A login node: its own disk at /, FSx for Lustre at /fsx with a local disk mounted inside it, EFS at a mount point
# with a space (mountinfo writes it as \040), and /home over NFS mounted by autofs on top of its trigger.
MOUNTINFO = r"""22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 259:1 / / rw,relatime shared:1 - ext4 /dev/nvme0n1p1 rw,discard
80 27 0:50 / /fsx rw,relatime shared:40 - lustre 172.31.0.5@tcp:/abcdefgh /fsx rw,flock
81 80 259:3 / /fsx/node-scratch rw,relatime - xfs /dev/nvme1n1 rw
90 27 0:60 / /mnt/team\040share rw,relatime shared:50 - nfs4 fs-12.efs.us-east-1.amazonaws.com:/ /mnt/team\040share rw
95 27 0:61 / /home rw,relatime shared:51 - autofs systemd-1 rw,fd=40
96 95 0:62 / /home rw,relatime shared:52 - nfs nas:/home /home rw,vers=3
not a mount line
"""


@pytest.mark.parametrize(
    ("path", "mount"),
    [
        ("/", ("/", "ext4")),
        ("/fsx", ("/fsx", "lustre")),
        ("/fsx/runs/llama2-7b-16n", ("/fsx", "lustre")),
        ("/fsxdata/runs", ("/", "ext4")),  # a name that starts like a mount point is not under it
        ("/fsx/node-scratch/jobs", ("/fsx/node-scratch", "xfs")),  # a local disk inside the shared one
        ("/mnt/team share/jobs", ("/mnt/team share", "nfs4")),
        ("/home/me/trnrecipes", ("/home", "nfs")),  # the NFS mount autofs made, not the trigger under it
    ],
)
def test_the_longest_mount_point_above_a_path_gives_its_file_system(path, mount):
    assert mount_of(path, MOUNTINFO) == mount


def test_a_multi_node_cluster_job_is_warned_of_each_local_file_system_it_uses(tmp_path):
    root = tmp_path.resolve()
    (root / "fsx").mkdir()
    (root / "scratch").mkdir()
    mounts = f"27 1 259:1 / / rw - ext4 /dev/root rw\n80 27 0:50 / {root}/fsx rw - lustre fs@tcp:/x rw\n"
    mounts += f"81 27 259:3 / {root}/scratch rw - xfs /dev/nvme1n1 rw\n"
    recipe = load_recipe("llama2-7b", nodes=16)
    fsx = root / "fsx"
    # none of them exist yet: each is judged by its nearest existing directory, /fsx
    assert node_local_warnings(recipe, fsx / "trnrecipes", fsx / "jobs/x", fsx / "runs/x", mounts) == []
    ext4, xfs = node_local_warnings(recipe, root / "trnrecipes", root / "jobs/x", root / "scratch/runs/x", mounts)
    assert ext4.startswith(
        f"the checkout {root / 'trnrecipes'} (each node runs the job from it) and job dir {root / 'jobs/x'} (Slurm"
        " writes its logs/ there from the job's first node) are on ext4 (mounted at /), not a network or parallel"
        " file system (nfs, lustre, ...) that all 16 nodes of the job mount: put them on the cluster's shared storage"
    )
    assert xfs.startswith(f"run dir {root / 'scratch/runs/x'} (every node writes checkpoints there and resumes")
    assert f"is on xfs (mounted at {root}/scratch)" in xfs
    # a run dir whose top directory is not on this host (the cluster's /fsx) is not judged by the host's /
    assert node_local_warnings(recipe, fsx, fsx, Path("/no-such-top-dir-here/runs/x"), mounts) == []
    # a 1-node job (its node may be this host) and a local recipe (a loopback Slurm) are not judged
    for quiet in (load_recipe("llama2-7b", nodes=1), load_recipe("llama2-tiny", nodes=2)):
        assert node_local_warnings(quiet, root, root, root, mounts) == []


def test_the_time_limit_warning_is_for_cluster_recipes_and_names_the_command_that_shows_the_partitions():
    (trn1,) = render_warnings(load_recipe("llama2-smoke-trn1", overrides="slurm.partition=train"))
    assert "to the partition's MaxTime or less (scontrol show partition train prints it as MaxTime=)" in trn1
    (default,) = render_warnings(load_recipe("llama2-smoke-trn1"))
    assert "(sinfo -o '%P %l' lists every partition's, the default one marked *)" in default
    assert render_warnings(load_recipe("llama2-tiny")) == []  # runs here: no partition, no limit to set


def test_recipe_changes_name_each_key_old_and_new_and_stop_after_ten():
    old = "# Resolved recipe: x\nname: x\noptim: {lr: 0.001, betas: [0.9, 0.95]}\nslurm: {partition: null}\n"
    new = "# Resolved recipe: y\nname: x\noptim: {lr: 0.0001, betas: [0.9, 0.99]}\nslurm: {partition: trn1}\n"
    new += "run_dir: /fsx\n"
    assert recipe_changes(old, new) == [
        "optim.lr: 0.001 -> 0.0001",
        "optim.betas: [0.9, 0.95] -> [0.9, 0.99]",
        "slurm.partition: null -> 'trn1'",
        "run_dir: (absent) -> '/fsx'",
    ]
    many = recipe_changes("".join(f"k{i}: 1\n" for i in range(13)), "".join(f"k{i}: 2\n" for i in range(13)))
    assert many[:2] == ["k0: 1 -> 2", "k1: 1 -> 2"] and len(many) == 11 and many[-1] == "... and 3 more"


def test_rerendering_a_job_dir_says_what_changed_and_warns_of_the_time_limit_once(cli, tmp_path):
    out, run = tmp_path / "job", tmp_path / "run"
    args = ["sbatch", "--recipe", "llama2-smoke-trn1", "--nodes", "2", "--out", str(out), "--overrides"]
    first = cli(*args, shlex.quote(f"run_dir={run}") + " slurm.partition=trn1")
    assert first.returncode == 0, first.stderr
    assert "warning: slurm.time_limit is not set" in first.stderr and "scontrol show partition trn1" in first.stderr
    mount = mount_of(os.path.realpath(tmp_path), read_mountinfo() or "")
    if mount and mount[1] not in SHARED_TYPES:  # a test machine's /tmp: its own disk (ext4, overlay, tmpfs)
        assert f"job dir {out} (Slurm writes its logs/ there" in first.stderr
        assert f"run dir {run} (every node writes checkpoints" in first.stderr
        assert f" are on {mount[1]} (mounted at {mount[0]}), not a network or parallel file system" in first.stderr
    changed = shlex.quote(f"run_dir={run}") + " slurm.partition=trn1 optim.lr=1e-4 train.max_steps=300"
    refused = cli(*args, changed, "--no-data-check")  # make ... sbatch over the job dir, without force=1
    assert refused.returncode == 2 and "already holds a different recipe.yaml" in refused.stderr
    assert "It would change:\n  optim.lr: 0.001 -> 0.0001\n  train.max_steps: 200 -> 300\n" in refused.stderr
    assert "slurm.time_limit" not in refused.stderr  # said when the job dir was written
    forced = cli(*args, changed, "--force", "--no-data-check")
    assert forced.returncode == 0, forced.stderr
    assert "replaced its recipe.yaml; what changed:\n  optim.lr: 0.001 -> 0.0001\n  train.max_steps: 200 -> 300\n" in (
        forced.stdout
    )
    assert "slurm.time_limit" not in forced.stderr
    again = cli(*args, changed, "--no-data-check")
    assert again.returncode == 0 and "what changed" not in again.stdout  # the same recipe: nothing to say
