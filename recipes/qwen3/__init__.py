"""Qwen3 model code (plain PyTorch) and its conversion to and from Hugging Face Qwen3ForCausalLM."""
