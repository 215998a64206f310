"""Print the project's pins and its .[train] pins minus torch and what needs torch 2.13 (for .venv-xla)."""

import sys

import tomllib

SKIP = ("torch==", "megatron-core==")  # torch comes as 2.9.0 with torch-xla; megatron-core is not used on xla

with open(sys.argv[1], "rb") as f:
    project = tomllib.load(f)["project"]
extras = project["optional-dependencies"]
# .[train] is .[train-deps] + torch: expand the project's references to its own extras.
train = [d for d in extras["train"] if not d.startswith("trnrecipes[")] + extras["train-deps"]
deps = project["dependencies"] + train
print(" ".join(d for d in deps if not d.startswith(SKIP)))
