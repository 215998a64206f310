"""BERT-style encoder + head (BERT-base classification, all-MiniLM-L6-v2, an encoder + MLP head) in plain PyTorch, and
its conversion to and from Hugging Face BertModel / BertForSequenceClassification."""
