"""How a single-device model is spread over ranks, applied from outside the model code: the rank layout and its
process groups (dims.py), tensor/sequence parallelism on DTensor (tensor.py), FSDP2 (fsdp.py), pipeline stages
(pipeline.py), row sharding (sharding.py), activation checkpointing, torch.compile of blocks (compile.py), and the
neuronx-distributed adapters for Trainium's torch-xla stack (nxd.py, nxd_pipeline.py, import-guarded).

Torch. Imports config/, plan/ and recipes/common; never backends/, train/ or checkpoint/ (dims.py names what it
needs of a backend as a Protocol).
"""

_MIXED: dict[tuple[type, type], type] = {}


def with_mixin(mixin: type, cls: type) -> type:
    """`cls` with `mixin`'s methods first (a module's class swapped in place for it, as FSDP2's fully_shard does):
    one class per (mixin, class), made once, named <Mixin><Class>."""
    if (mixin, cls) not in _MIXED:
        _MIXED[mixin, cls] = type(f"{mixin.__name__}{cls.__name__}", (mixin, cls), {})
    return _MIXED[mixin, cls]
