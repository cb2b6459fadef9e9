"""Prompt sets and corpora: MT-Bench, ShareGPT, chat-template tokenization."""
