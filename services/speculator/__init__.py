"""sssd.speculator: SSD / Saguaro, a draft model that drafts ahead for the likely outcomes of the
verification in progress (docs/services/speculator.md)."""
