"""The names of a run dir's files (run_files.py) and the guard every writing command runs on its output before any
work (outputs.py): never an input, a checkpoint, or through a link.

Torch-free: `sbatch` and `plan` use it. Imports config/ and trnrecipes.schema only.
"""
