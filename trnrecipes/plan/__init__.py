"""What a recipe costs on a cluster: the layout (pp x dp x cp x tp, batch math, parameters, FLOPs, tokens/$: layout.py)
and the printed plan (report.py).

Torch-free, on the rendering path. Imports config/ and trnrecipes.schema only.
"""
