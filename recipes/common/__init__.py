"""Code shared by the model families (plain PyTorch, like the families themselves)."""
