"""The training engine: `trnrecipes train --config recipe.yaml` (what run.sbatch launches under torchrun)."""
