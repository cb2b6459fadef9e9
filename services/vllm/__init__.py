"""vLLM as the verifier: `sssd.vllm.proposer.VllmDrafterProposer` drafts for vLLM's `custom_class`
speculative method through the SSSD drafter service."""
