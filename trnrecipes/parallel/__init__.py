"""How a single-device model is spread over ranks, applied from outside the model code: the rank layout and its
process groups (dims.py), tensor/sequence parallelism on DTensor (tensor.py), FSDP2 (fsdp.py), pipeline stages
(pipeline.py), row sharding (sharding.py), activation checkpointing, torch.compile of blocks (compile.py), and the
neuronx-distributed adapters for Trainium's torch-xla stack (nxd.py, nxd_pipeline.py, import-guarded).

Torch. Imports config/, plan/ and recipes/common; never backends/, train/ or checkpoint/ (dims.py names what it
needs of a backend as a Protocol).
"""
