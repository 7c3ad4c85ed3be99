"""TrainerSettings' checks of a device, shared with the commands that take one (expkit.predict)."""

from __future__ import annotations

import pytest
import torch

from expkit.core.errors import ConfigError
from expkit.core.settings import TrainerSettings, check_device


@pytest.mark.parametrize("device", ["gpu", "cuda:", "cuda:x", "CPU", 0])
def test_a_device_that_is_no_device_names_the_key_and_the_choices(device):
    with pytest.raises(ConfigError, match=r"trainer\.device must be auto, cpu, cuda or cuda:N"):
        TrainerSettings(device=device)
    with pytest.raises(ConfigError, match=r"^device must be auto, cpu, cuda or cuda:N"):
        check_device("device", device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is available here")
@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_without_cuda_says_so_and_what_to_type(device):
    with pytest.raises(
        ConfigError, match=rf"trainer\.device={device} but CUDA is not available here; use trainer\.device=auto"
    ):
        TrainerSettings(device=device)


def test_the_host_devices_pass():
    for device in ("auto", "cpu"):
        check_device("device", device)
        assert TrainerSettings(device=device).device == device
