"""Configuration: command-line flags derived from config dataclasses, logging set-up."""
