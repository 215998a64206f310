"""GPT-NeoX (NeoX-20B and every Pythia size): model code, HF conversion."""
