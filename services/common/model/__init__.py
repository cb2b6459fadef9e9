"""The model stack: loading models and tokenizers, model files, the slot KV cache, and the
project's own forward pass over that cache (decoder.py, for the verifier's target model and the
speculator's draft model), with its C++ operations in kernels/ (the module sssd._kernels)."""
