"""What `trnrecipes sbatch` says around the job dir it writes: a multi-node job's checkout, job dir or run dir on a
file system the other nodes do not mount (found from /proc/self/mountinfo)."""

from __future__ import annotations

from pathlib import Path

import pytest

from trnrecipes.config.recipe import load_recipe
from trnrecipes.jobs.mounts import mount_of
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
