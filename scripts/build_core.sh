#!/usr/bin/env bash
# Rebuilds the C++ drafter core (services/drafter/core) after a change to it: an incremental
# CMake build in build/, the module copied to services/ (sssd._core). Python edits need nothing:
# the install is editable. A lock keeps concurrent rebuilds from clobbering the build directory.
set -euo pipefail
cd "$(dirname "$0")/.."
exec flock /tmp/sssd-serve-install.lock .venv/bin/pip install --disable-pip-version-check \
  --no-build-isolation --no-deps -q -e .
