"""The seed of a training step's random draws (dropout): a function of (train.seed, step, DP rank, pipeline stage).

torch seeds its default generator from the OS at start (torch.initial_seed() differs per process), so unseeded
dropout differs run to run. Seeding afresh before every step, rather than saving the generator's state, means a
resumed run draws what an uninterrupted one would with nothing in the checkpoint, whatever drew from the generator
in between (validation, a save) and whatever layout saved it. torch.compile's kernels take their seeds from the same
generator, and activation checkpointing (torch.utils.checkpoint, preserve_rng_state) replays the state it saw.
"""

from __future__ import annotations

import numpy as np

from trnrecipes.data.order import STEP_RNG, derive_key


def step_seed(seed: int, step: int, dp_rank: int, pp_rank: int) -> int:
    """The generator seed of optimizer step `step` (0-based) on a rank, below 2^63 (what torch.manual_seed and
    torch-xla's set_rng_state both take). DP ranks read other data and draw their own masks; pipeline stages hold
    other layers. TP ranks share the seed: dropout on the activations they replicate (the embedding, each
    row-parallel output, the head) must draw the same mask on every one of them, or the replicas drift apart."""
    return int(derive_key(seed, STEP_RNG, step, dp_rank, pp_rank)[0] >> np.uint64(1))
