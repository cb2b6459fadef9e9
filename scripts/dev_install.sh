#!/usr/bin/env bash
# Re-installs the project into .venv after a change (incremental C++ build in build/).
# A lock keeps concurrent re-installs from clobbering each other's build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/sssd-serve-install.lock .venv/bin/pip install --no-build-isolation --no-deps -q .
