"""sssd-serve: lossless speculative decoding as services (drafter, verifier, speculator, indexer).

services/<name>/ is the package sssd.<name>; see docs/architecture.md."""
