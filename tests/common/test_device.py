"""The device setting: its spelling checked without torch, resolved where the model runs, and a
device the machine lacks refused with a message that says what there is."""

import pytest
import torch

from sssd.common.model.device import check_device, is_gpu_setting, resolve_device
from sssd.speculator.config import SpeculatorConfig
from sssd.verifier.engine.config import EngineConfig

from support.devices import HAS_CUDA


@pytest.mark.parametrize("setting", ["cpu", "cuda", "cuda:0", "cuda:12", "auto"])
def test_every_documented_setting_is_accepted(setting):
    assert check_device(setting) == setting
    assert EngineConfig(device=setting).device == setting
    assert SpeculatorConfig(device=setting).device == setting


@pytest.mark.parametrize("setting", ["gpu", "CUDA", "cuda:", "cuda:x", "cuda:-1", "mps", "",
                                     " cpu"])
def test_other_settings_are_refused_naming_the_allowed_ones(setting):
    for build in (check_device, lambda s: EngineConfig(device=s),
                  lambda s: SpeculatorConfig(device=s)):
        with pytest.raises(ValueError, match="cpu, cuda, cuda:N, or auto"):
            build(setting)


def test_gpu_settings_are_the_cuda_ones():
    assert is_gpu_setting("cuda") and is_gpu_setting("cuda:1")
    assert not is_gpu_setting("cpu") and not is_gpu_setting("auto")


def test_auto_is_cuda_exactly_when_this_process_sees_a_gpu():
    assert resolve_device("auto").type == ("cuda" if HAS_CUDA else "cpu")
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(HAS_CUDA, reason="this machine has a CUDA device")
@pytest.mark.parametrize("setting", ["cuda", "cuda:0"])
def test_cuda_without_a_gpu_is_refused_clearly(setting):
    with pytest.raises(ValueError, match="sees no CUDA device.*--device cpu or auto"):
        resolve_device(setting)


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
def test_a_cuda_index_past_the_devices_is_refused():
    count = torch.cuda.device_count()
    assert resolve_device(f"cuda:{count - 1}").index == count - 1
    with pytest.raises(ValueError, match=f"sees {count} CUDA device"):
        resolve_device(f"cuda:{count}")
