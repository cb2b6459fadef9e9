"""The benchmarks: programs that print JSON lines (and draw a PNG where a curve says more than a
table), run from the repository root as `python -m bench.<name>` or `python bench/<name>.py`.

The package is part of the development install (setup.py maps it beside `sssd`), so its
programs import each other as `bench.<name>` from anywhere in `.venv` and `.venv-vllm`. Shared
pieces: `bench.flags` (the command-line flags most programs take), `bench.stats`
(percentiles), `bench.prompt_sets` (the prompt sets by name), `bench.report` (the current
tables of docs/benchmarks.md and the README, generated from `bench/results/`).
"""
