"""vLLM as the verifier: `sssd.vllm.proposer.SssdProposer` drafts for vLLM's `custom_class`
speculative method through the SSSD drafter service."""
