"""trnrecipes: typed LLM training recipes for AWS Trainium and the Slurm jobs, training and evaluation around them."""

from pathlib import Path

__version__ = "0.1.0"

# The checkout is the install: recipes/ and templates/ are read from beside the package.
REPO_ROOT = Path(__file__).resolve().parent.parent
