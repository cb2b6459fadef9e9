"""Fixtures and helpers shared by the test packages (loaded by tests/conftest.py)."""
