"""sssd.cli: the commands (docs/cli.md): `sssd` (up, serve, generate, chat) and the tools beside
it; `sssd up` is assembled from components in stack.py."""
