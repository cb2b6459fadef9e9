"""The names of the forward passes a model can run through (`model_impl` of the verifier and
the speculator), apart from the forward pass itself so that configurations load no torch:
- sssd: the project's own (decoder.py), for the Llama and Qwen2 families;
- transformers: the transformers model's forward over the same KV cache, for every other
  architecture and as the reference the tests hold the first one to;
- auto: sssd where the architecture is implemented, else transformers."""

MODEL_IMPLS = ("auto", "sssd", "transformers")
