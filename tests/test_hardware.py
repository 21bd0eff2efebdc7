"""Hardware decisions: device, dtype, attention implementation, distributed backend.

There is no GPU and no Ascend NPU on the CI machines, so CUDA and NPU are MOCKED here: the
CUDA tests patch torch.cuda's query functions, the NPU tests put a stand-in `torch_npu`
module and `torch.npu` namespace in place. Everything after detection is a pure function
of the Hardware value and is tested directly. The CPU case is the real machine.
"""
from __future__ import annotations

import sys
import types

import pytest

from swiftlite.runtime import hardware
from swiftlite.errors import UsageError
from swiftlite.runtime.hardware import Hardware

# (name, compute capability) of real GPUs; Ampere (8.x) and newer have bf16 units.
GPUS = [("Tesla V100-SXM2-32GB", (7, 0), "float16"), ("Tesla T4", (7, 5), "float16"),
        ("NVIDIA A100-SXM4-80GB", (8, 0), "bfloat16"), ("NVIDIA A10", (8, 6), "bfloat16"),
        ("NVIDIA GeForce RTX 3090", (8, 6), "bfloat16"), ("NVIDIA H100 80GB HBM3", (9, 0),
                                                           "bfloat16")]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Makes torch report one CUDA device with the given name and capability (mocked)."""
    import torch

    def install(name, capability, count=2, memory=24 * 2**30):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: name)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda i=0: capability)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda i=0: types.SimpleNamespace(total_memory=memory))
    return install


@pytest.mark.parametrize("name,capability,expected", GPUS)
def test_cuda_dtype_follows_compute_capability(fake_cuda, name, capability, expected):
    fake_cuda(name, capability)
    hw = hardware.detect()
    assert (hw.device, hw.name, hw.capability, hw.count) == ("cuda", name, capability, 2)
    assert hw.memory_bytes == 24 * 2**30
    assert hardware.default_dtype(hw) == hardware.resolve_dtype("auto", hw) == expected
    assert hardware.backend(hw) == "nccl"
    assert hardware.visible_devices_env(hw) == "CUDA_VISIBLE_DEVICES"
    # fp16 turns on the Trainer's loss scaling; bf16 needs none.
    flags = hardware.amp_flags(expected, hw)
    assert flags == {"bf16": expected == "bfloat16", "fp16": expected == "float16"}


@pytest.mark.parametrize("name,capability,_", GPUS)
@pytest.mark.parametrize("installed", [True, False])
def test_flash_attention_only_on_ampere_with_the_package(monkeypatch, name, capability, _,
                                                         installed):
    monkeypatch.setattr(hardware, "flash_attn_installed", lambda: installed)
    hw = Hardware("cuda", name, capability)
    ampere = capability >= (8, 0)
    expected = "flash_attention_2" if ampere and installed else "sdpa"
    assert hardware.attn_implementation(hw, hardware.default_dtype(hw)) == expected
    # flash-attention 2 has no fp32 kernels
    assert hardware.attn_implementation(hw, "float32") == "sdpa"


def test_bf16_refused_on_pre_ampere_with_what_to_do():
    with pytest.raises(UsageError, match=r"Tesla T4 \(compute capability 7.5\).*float16"):
        hardware.resolve_dtype("bfloat16", Hardware("cuda", "Tesla T4", (7, 5)))
    assert hardware.resolve_dtype("float32", Hardware("cuda", "Tesla T4", (7, 5))) == "float32"


def test_fp16_full_fine_tuning_keeps_fp32_master_weights():
    # torch's GradScaler refuses to unscale fp16 gradients; LoRA adapters are fp32 in peft.
    assert hardware.weights_dtype("float16", "full") == "float32"
    assert hardware.weights_dtype("float16", "lora") == "float16"
    assert hardware.weights_dtype("bfloat16", "full") == "bfloat16"


def test_ascend_npu(monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake_npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8,
                                     get_device_name=lambda i=0: "Ascend910B2")
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    hw = hardware.detect()
    assert (hw.device, hw.name, hw.count) == ("npu", "Ascend910B2", 8)
    assert hardware.default_dtype(hw) == "bfloat16"
    assert hardware.backend(hw) == "hccl"
    assert hardware.attn_implementation(hw, "bfloat16") == "sdpa"
    assert hardware.visible_devices_env(hw) == "ASCEND_RT_VISIBLE_DEVICES"


def test_this_cpu_is_detected_for_real():
    hw = hardware.detect()
    assert hw.device == "cpu" and hw.capability is None
    flags = open("/proc/cpuinfo").read().split()
    assert hw.cpu_bf16 == ("amx_bf16" in flags or "avx512_bf16" in flags)
    assert hardware.backend(hw) == "gloo"
    assert hardware.attn_implementation(hw, hardware.default_dtype(hw)) == "sdpa"
    assert hardware.amp_flags("float32", hw) == {"bf16": False, "fp16": False}
    assert hardware.visible_devices_env(hw) is None
    assert "gloo" in hardware.describe(hw)


def test_cpu_bf16_default_is_for_lora_training(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16 amx_bf16\n")
    assert hardware.cpu_has_bf16(str(info))
    info.write_text("processor : 0\nflags : fpu sse avx2\n")
    assert not hardware.cpu_has_bf16(str(info))
    with_bf16, without = Hardware("cpu", "cpu", cpu_bf16=True), Hardware("cpu", "cpu")
    assert hardware.default_dtype(with_bf16) == hardware.default_dtype(without) == "float32"
    assert hardware.training_dtype("auto", with_bf16, "lora") == "bfloat16"
    assert hardware.training_dtype(None, with_bf16, "lora") == "bfloat16"
    assert hardware.training_dtype("auto", without, "lora") == "float32"
    assert hardware.training_dtype("auto", with_bf16, "full") == "float32"  # fp32 master weights
    assert hardware.training_dtype("auto", with_bf16, "lora", "zero2") == "float32"
    assert hardware.training_dtype("float32", with_bf16, "lora") == "float32"  # asked: kept
    gpu = Hardware("cuda", "A10", (8, 6))
    assert hardware.training_dtype("auto", gpu, "full") == "bfloat16"


def test_explicit_dtype_wins_and_bad_values_are_refused():
    cpu = Hardware("cpu", "cpu")
    assert hardware.resolve_dtype("bfloat16", cpu) == "bfloat16"
    with pytest.raises(UsageError, match="choose one of"):
        hardware.resolve_dtype("fp8", cpu)


def test_sft_uses_the_hardware_attention_choice(monkeypatch, tmp_path):
    """With no --attn_impl, sft loads the model with hardware.attn_implementation's choice.
    Here the decision is patched to "eager" (transformers' own default would be sdpa) and a
    real one-step tiny-qwen2 run shows the loaded model uses it."""
    from swiftlite.pipelines import sft as sft_module
    real_load, loaded = sft_module.load_model, []

    def recording_load(*a, **kw):  # the real loader; only remembers what it returned
        model = real_load(*a, **kw)
        loaded.append(model.config._attn_implementation)
        return model

    monkeypatch.setattr(sft_module, "load_model", recording_load)
    monkeypatch.setattr(hardware, "attn_implementation", lambda hw, dtype=None: "eager")
    sft_module.sft(model="tiny-qwen2", dataset=["self-cognition#4"], max_steps=1,
                   output_dir=str(tmp_path), report_to="none", save_steps=100)
    assert loaded == ["eager"]
