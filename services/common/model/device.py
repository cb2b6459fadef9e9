"""Where a model runs: the `device` setting of the verifier engine and the speculator.

Settings are `cpu`, `cuda`, `cuda:N` and `auto` (CUDA when this process sees a CUDA device, else
the CPU). `check_device` validates the spelling without importing torch, so configurations are
checked before anything heavy loads; `resolve_device` turns a setting into a torch device in the
process that runs the model, with a clear error where the device is missing.

The development machines have no GPU: the CUDA path is exercised by the tests parametrized by
device wherever `torch.cuda.is_available()`, and skipped with the reason elsewhere.
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

DEVICE_HELP = "cpu, cuda, cuda:N, or auto (cuda when this process sees a CUDA device, else cpu)"
_SPELLING = re.compile(r"cpu|auto|cuda(:[0-9]+)?")


def check_device(setting: str) -> str:
    """`setting` when it names a device this project runs on; ValueError otherwise."""
    if not isinstance(setting, str) or not _SPELLING.fullmatch(setting):
        raise ValueError(f"device must be {DEVICE_HELP}; got {setting!r}")
    return setting


def is_gpu_setting(setting: str) -> bool:
    """True for `cuda` and `cuda:N` (not for `auto`, which depends on the machine)."""
    return check_device(setting).startswith("cuda")


def resolve_device(setting: str) -> torch.device:
    """The torch device of `setting` in this process. Raises ValueError when it asks for a CUDA
    device that this process does not have (a CPU-only torch, no GPU, or an index past the
    devices it sees), naming what there is."""
    import torch  # only where a model runs

    check_device(setting)
    if setting == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(setting)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {setting!r}: this process sees no CUDA device (torch "
                             f"{torch.__version__}, built with CUDA {torch.version.cuda}); use "
                             "--device cpu or auto")
        count = torch.cuda.device_count()
        if device.index is not None and device.index >= count:
            raise ValueError(f"device {setting!r}: this process sees {count} CUDA device(s), "
                             f"cuda:0 to cuda:{count - 1}")
    return device


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (timing a CUDA forward pass); nothing on the CPU."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def cpu_model_name() -> str:
    """The CPU's model name from /proc/cpuinfo, or "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def processor_name(device: torch.device) -> str:
    """What runs the model, as the machine names it: a CUDA device's name, or the CPU's model
    name. A forward-pass profile is this processor's: one measured on another (a shared var/
    directory, a volume that moved to another node) says nothing here."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model_name()
