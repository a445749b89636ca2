"""Device and AMP choice, and unwrapping compiled or DDP models for clean checkpoint keys."""

import pytest
import torch
import torch.distributed as dist
from torch import nn

import runtime
from configs import UserError


def test_unwrap_strips_compile_and_ddp_prefixes(tmp_path):
    model = nn.Sequential(nn.Linear(2, 2))
    compiled = torch.compile(model)  # lazy: nothing is compiled until it is called
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    assert runtime.unwrap(compiled) is model
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        wrapped = nn.parallel.DistributedDataParallel(compiled)
        assert runtime.unwrap(wrapped) is model
        assert list(runtime.unwrap(wrapped).state_dict()) == ["0.weight", "0.bias"]
        assert runtime.ranks_agree(model)
    finally:
        dist.destroy_process_group()


def test_amp_choices_on_cpu():
    cpu = torch.device("cpu")
    assert runtime.amp_setup(cpu, "auto") == (None, None)
    assert runtime.amp_setup(cpu, "off") == (None, None)
    assert runtime.amp_setup(cpu, "bf16") == (torch.bfloat16, None)
    dtype, scaler = runtime.amp_setup(cpu, "fp16")
    assert dtype == torch.float16 and isinstance(scaler, torch.amp.GradScaler)


def test_device_errors_are_one_line():
    assert runtime.pick_device("cpu") == torch.device("cpu")
    with pytest.raises(UserError, match="unknown device"):
        runtime.pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(UserError, match="no CUDA GPU"):
            runtime.pick_device("cuda")
