"""The drafting contract: how every drafting source meets the verifier engine."""
