"""The model stack: loading models and tokenizers (loader.py, tokenizer.py, files.py), the KV
cache (kv_cache.py) and the tree batches that a step writes into it (tree_batch.py), and the
project's own forward pass over that cache (decoder.py, for the verifier's target model and the
speculator's draft model): its products (linear.py), its PyTorch operations (torch_ops.py), the
greedy argmax (argmax.py), its C++ operations in kernels/ (the module sssd._kernels) and the
one choice of their paths for this CPU (kernel_paths.py)."""
