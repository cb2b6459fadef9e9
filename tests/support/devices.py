"""The devices the device-parametrized tests run on: the CPU always, CUDA where this machine
has it (skipped with the reason otherwise, so a run on a GPU machine covers the CUDA path)."""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
NO_CUDA = f"no CUDA device here (torch {torch.__version__}, CUDA {torch.version.cuda})"

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not HAS_CUDA, reason=NO_CUDA))]
