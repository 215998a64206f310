"""Checkpoints: the format and the writer. Imports config/, files/ and parallel/ (row sharding, local tensors); never
train/ (the trainer's restore, trnrecipes.train.restore, reads through format.py).

- format.py: the directory layout and file names (defined once), verification, and reading (ShardReader: any
  rectangle of a saved tensor, whatever layout saved it; consolidation for one-process readers).
- writer.py: what each training rank writes, the background writer that finalizes a checkpoint, and pruning to
  checkpoint.keep_last.
The one way a training rank gets its state back (weights, optimizer, data position) is
trnrecipes.train.restore.load, also used for a fresh start and for fine-tuning from train.init_from.

Only format.py is imported here: the writer pulls in torch's distributed side (import it from its module).
"""

from trnrecipes.checkpoint.format import (
    DONE,
    FORMAT,
    MANIFEST,
    SHARDS,
    WEIGHTS,
    CheckpointError,
    CheckpointReadError,
    ShardReader,
    Shards,
    consolidate,
    data_file,
    finalize,
    hash_and_sync,
    load_tensors,
    read_json,
    read_model_checkpoint,
    read_model_checkpoint_recipe,
    read_shards,
    saved_recipe,
    shard_file,
    stage_shards_file,
    verify,
    verify_training,
    write_common,
    write_model_checkpoint,
)

__all__ = [
    "DONE",
    "FORMAT",
    "MANIFEST",
    "SHARDS",
    "WEIGHTS",
    "CheckpointError",
    "CheckpointReadError",
    "ShardReader",
    "Shards",
    "consolidate",
    "data_file",
    "finalize",
    "hash_and_sync",
    "load_tensors",
    "read_json",
    "read_model_checkpoint",
    "read_model_checkpoint_recipe",
    "read_shards",
    "saved_recipe",
    "shard_file",
    "stage_shards_file",
    "verify",
    "verify_training",
    "write_common",
    "write_model_checkpoint",
]
