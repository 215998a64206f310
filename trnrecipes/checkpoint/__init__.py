"""Checkpoints: one package for the format, the writer and the loader.

- format.py: the directory layout and file names (defined once), verification, and reading (ShardReader: any
  rectangle of a saved tensor, whatever layout saved it; consolidation for one-process readers).
- writer.py: what each training rank writes, and the background writer that finalizes a checkpoint.
- load.py: `load(path, ...) -> TrainState`, the one way a training rank gets its state back (weights, optimizer,
  RNG, data position), also used for a fresh start and for fine-tuning from train.init_from.

Only format.py is imported here: the writer and the loader pull in the training code (import them from their
modules).
"""

from trnrecipes.checkpoint.format import (
    DONE,
    FORMAT,
    LEGACY_MODEL_DEFAULTS,
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
    fsync_dir,
    fsync_file,
    hash_and_sync,
    load_tensors,
    read_json,
    read_model_checkpoint,
    read_model_checkpoint_recipe,
    read_shards,
    rng_file,
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
    "LEGACY_MODEL_DEFAULTS",
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
    "fsync_dir",
    "fsync_file",
    "hash_and_sync",
    "load_tensors",
    "read_json",
    "read_model_checkpoint",
    "read_model_checkpoint_recipe",
    "read_shards",
    "rng_file",
    "saved_recipe",
    "shard_file",
    "stage_shards_file",
    "verify",
    "verify_training",
    "write_common",
    "write_model_checkpoint",
]
