"""The model stack: loading models and tokenizers, model files, the slot KV cache."""
