"""Data: raw text -> one Arrow file (memory-mapped) or Megatron .bin/.idx -> tokens -> fixed-length packed samples.

Imports numpy, pyarrow and tokenizers, never torch: the training loop turns samples into tensors itself.
"""
