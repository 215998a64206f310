"""The optimizer the backends build: AdamW with ZeRO-1 rows and stochastic rounding (adamw.py), and the
learning-rate schedule (schedule.py).

Torch. Imports config/ and parallel/ only.
"""
