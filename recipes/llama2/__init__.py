"""Llama 2 model code (plain PyTorch) and its conversion to and from Hugging Face LlamaForCausalLM."""
