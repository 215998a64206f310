"""Evaluation of trained checkpoints with lm-eval on offline data: the task registry (registry.py), lm-eval task
configs (tasks.py), offline data (data.py, bbh.py), the code sandbox, and `eval run` (run.py).

Above trnrecipes' engine: imports trnrecipes.convert (the HF export), trnrecipes.data and trnrecipes.schema.
"""
