"""`trainer.attention_kernel`: what each setting leaves to SDPA's choice, and that the config checks it."""

from __future__ import annotations

import pydantic
import pytest
import torch

from relax.backends.training.loading import set_attention_kernel
from relax.config import TrainerConfig


@pytest.fixture
def cudnn_flag():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    yield
    torch.backends.cuda.enable_cudnn_sdp(before)


@pytest.mark.parametrize(("kind", "cudnn"), [("flash", False), ("cudnn", True), ("auto", False)])
def test_each_setting_leaves_cudnn_in_or_out(cudnn_flag, kind, cudnn):
    torch.backends.cuda.enable_cudnn_sdp(not cudnn)
    set_attention_kernel(kind)
    assert torch.backends.cuda.cudnn_sdp_enabled() is cudnn
    assert torch.backends.cuda.flash_sdp_enabled()  # flash stays the fallback for shapes cuDNN refuses


def test_the_config_defaults_to_auto_and_refuses_other_kernels():
    assert TrainerConfig().attention_kernel == "auto"
    with pytest.raises(pydantic.ValidationError, match="attention_kernel"):
        TrainerConfig(attention_kernel="xformers")
