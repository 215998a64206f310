"""The training engine: `trnrecipes train --config recipe.yaml` (what run.sbatch launches under torchrun): the step
loop (loop.py), building the model shard (build.py), restoring a checkpoint into it (restore.py), the run dir, the
resume rules, metrics and plots.

The top of the engine: imports backends/, parallel/, optim/, checkpoint/, data/, files/, plan/, config/.
"""
