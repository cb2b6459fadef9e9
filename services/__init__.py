"""sssd-serve: lossless speculative decoding services (SSSD drafter, verifier, speculator, indexer)."""
