import pytest
import torch

from mfsdp_launch.core.fp8 import min_capability
from mfsdp_launch.core.errors import ConfigError
from mfsdp_launch.components.precision import apply_fp8_skip, torch_dtype


def test_dtype_names():
    assert torch_dtype("bf16") is torch.bfloat16
    assert torch_dtype("fp64") is torch.float64 and torch_dtype(None) is None
    with pytest.raises(ValueError):
        torch_dtype("int8")


def test_fp8_capabilities():
    assert min_capability("current") == (8, 9)  # Ada/Hopper
    assert min_capability("mxfp8") == (10, 0)  # Blackwell


def test_fp8_skip_wraps_matching_modules_only():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model.add_module("lm_head", torch.nn.Linear(4, 4))
    before = {name: m.forward for name, m in model.named_modules()}
    assert apply_fp8_skip(model, ["lm_head", "0"]) == ["0", "lm_head"]
    assert "forward" in vars(model.lm_head) and model.lm_head.forward != before["lm_head"]  # wrapped per instance
    assert model[1].forward == before["1"]


def test_fp8_skip_glob_matching_nothing_is_an_error():
    with pytest.raises(ConfigError) as e:
        apply_fp8_skip(torch.nn.Sequential(torch.nn.Linear(2, 2)), ["head"])
    assert e.value.key == "fp8.skip"
