"""Evaluation of trained checkpoints with lm-eval on offline data (issue #8)."""
