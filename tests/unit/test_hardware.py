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


def test_16_bit_full_fine_tuning_keeps_fp32_master_weights():
    # torch's GradScaler refuses to unscale fp16 gradients; bf16 rounds AdamW's steps away
    # (tests/e2e/test_full_fine_tuning.py); LoRA adapters are fp32 in peft.
    assert hardware.weights_dtype("float16", "full") == "float32"
    assert hardware.weights_dtype("float16", "lora") == "float16"
    assert hardware.weights_dtype("bfloat16", "full") == "float32"
    assert hardware.weights_dtype("bfloat16", "lora") == "bfloat16"
    # DeepSpeed keeps fp32 masters of its own under bf16
    assert hardware.weights_dtype("bfloat16", "full", deepspeed=True) == "bfloat16"
    # on a CPU, bf16 autocast only over fp32 masters (LoRA: fp32 activations instead)
    cpu = Hardware("cpu", "cpu", None)
    assert hardware.amp_flags("bfloat16", cpu, "float32") == {"bf16": True, "fp16": False}
    assert hardware.amp_flags("bfloat16", cpu, "bfloat16") == {"bf16": False, "fp16": False}


def test_full_fine_tuning_with_deepspeed_on_a_cpu_trains_fp32(capfd):
    """swiftlite's DeepSpeed configs keep bf16 off on a CPU (no fp32 masters from DeepSpeed
    there), and ZeRO-0 would step bf16 weights: an explicit bf16 falls back to fp32, said."""
    cpu = Hardware("cpu", "cpu", None, cpu_bf16=True)
    assert hardware.training_dtype("bfloat16", cpu, "full", "zero0") == "float32"
    assert "full fine-tuning with --deepspeed on a CPU trains in float32" in capfd.readouterr().err
    assert hardware.training_dtype("bfloat16", cpu, "full") == "bfloat16"  # autocast, masters
    assert hardware.training_dtype("bfloat16", cpu, "lora", "zero2") == "bfloat16"


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


def test_this_cpu_is_detected_for_real():
    hw = hardware.detect()
    assert hw.device == "cpu" and hw.capability is None
    flags = open("/proc/cpuinfo").read().split()
    assert hw.cpu_bf16 == ("amx_bf16" in flags or "avx512_bf16" in flags)
    assert hardware.backend(hw) == "gloo"
    assert hardware.attn_implementation(hw, hardware.default_dtype(hw)) == "sdpa"
    assert hardware.amp_flags("float32", hw) == {"bf16": False, "fp16": False}
    assert hardware.accelerator() is None
    assert "gloo" in hardware.describe(hw)


def test_cpu_bf16_default_is_for_lora_training(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor : 0\nflags : fpu sse avx512f avx512_bf16 amx_bf16\n")
    assert hardware.cpu_has_bf16(str(info))
    info.write_text("processor : 0\nflags : fpu sse avx2\n")
    assert not hardware.cpu_has_bf16(str(info))
    # The run log names the CPU and the flags that decided (read at run time, not the vendor)
    info.write_text("processor : 0\nmodel name : AMD EPYC 9R14\nflags : fpu avx2 avx512f "
                    "avx512_bf16\n")
    assert hardware.cpu_flags(str(info)) == ("avx512_bf16", "avx512f", "avx2")
    line = hardware.describe_cpu(str(info))
    assert line.startswith("AMD EPYC 9R14, ") and line.endswith(": avx512_bf16 avx512f avx2, no amx_bf16")
    info.write_text("processor : 0\nflags : fpu sse\n")
    assert hardware.describe_cpu(str(info)).endswith("none of amx_bf16 avx512_bf16 avx512f avx2")
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


def test_bf16_asked_for_on_a_cpu_without_bf16_units_is_warned_about(capsys):
    """A CPU with AVX2 only (AMD EPYC family 25 here) runs a bf16 matmul about a hundred times
    slower than fp32 (docs/performance.md): a run asked to do that says why it will crawl."""
    hardware.warn_if_emulated_bf16("bfloat16", Hardware("cpu", "cpu", cpu_bf16=False))
    err = capsys.readouterr().err
    assert "WARNING: --torch_dtype bfloat16 on " in err and "no bf16 units" in err
    assert "--torch_dtype auto or float32" in err
    for dtype, hw in (("bfloat16", Hardware("cpu", "cpu", cpu_bf16=True)),
                      ("float32", Hardware("cpu", "cpu")),
                      ("bfloat16", Hardware("cuda", "A10", (8, 6)))):
        hardware.warn_if_emulated_bf16(dtype, hw)
        assert capsys.readouterr().err == ""


def test_explicit_dtype_wins_and_bad_values_are_refused():
    cpu = Hardware("cpu", "cpu")
    assert hardware.resolve_dtype("bfloat16", cpu) == "bfloat16"
    with pytest.raises(UsageError, match="choose one of"):
        hardware.resolve_dtype("fp8", cpu)


def test_sft_uses_the_hardware_attention_choice(monkeypatch, tmp_path):
    """With no --attn_impl, sft loads the model with hardware.attn_implementation's choice.
    Here the decision is patched to "eager" (transformers' own default would be sdpa) and a
    real one-step tiny-qwen2 run shows the loaded model uses it."""
    from swiftlite.models import loader as loader_module
    from swiftlite.pipelines import sft as sft_module
    real_load, loaded = loader_module.load_model, []

    def recording_load(*a, **kw):  # the real loader; only remembers what it returned
        model = real_load(*a, **kw)
        loaded.append(model.config._attn_implementation)
        return model

    monkeypatch.setattr(loader_module, "load_model", recording_load)
    monkeypatch.setattr(hardware, "attn_implementation", lambda hw, dtype=None: "eager")
    sft_module.sft(model="tiny-qwen2", dataset=["self-cognition#4"], max_steps=1,
                   output_dir=str(tmp_path), report_to="none", save_steps=100)
    assert loaded == ["eager"]


def test_ascend_910a_has_no_bf16_and_gets_fp16(monkeypatch):
    """MOCKED NPU: torch_npu reports no bf16 (the 910A); training takes fp16 with loss
    scaling, and bf16 asked for is refused with what to use."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    fake_npu = types.SimpleNamespace(is_available=lambda: True, device_count=lambda: 8,
                                     get_device_name=lambda i=0: "Ascend910A",
                                     is_bf16_supported=lambda: False,
                                     max_memory_allocated=lambda: 3 * 2**30)
    monkeypatch.setitem(sys.modules, "torch_npu", types.ModuleType("torch_npu"))
    monkeypatch.setattr(torch, "npu", fake_npu, raising=False)
    hw = hardware.detect()
    assert not hw.npu_bf16
    assert hardware.training_dtype("auto", hw) == "float16"
    with pytest.raises(UsageError, match="Ascend910A has no bfloat16 units; use --torch_dtype float16"):
        hardware.resolve_dtype("bfloat16", hw)
    # memory figures come from the NPU as they would from a GPU
    assert hardware.accelerator() is fake_npu
    from swiftlite.training.callbacks import peak_memory_mb
    assert peak_memory_mb()["peak_gpu_mb"] == 3072


def test_a_flash_attn_that_does_not_import_falls_back_to_sdpa(tmp_path, monkeypatch, capsys):
    """A flash_attn package built for another torch is found but fails to import (here a
    package whose import raises as a mismatched wheel does); the choice is SDPA, said once."""
    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ImportError('flash_attn_2_cuda.so: undefined "
                                     "symbol: _ZN3c104cuda9SetDeviceEi')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    a100 = Hardware("cuda", "NVIDIA A100-SXM4-80GB", (8, 0))
    assert hardware.attn_implementation(a100, "bfloat16") == "sdpa"
    err = capsys.readouterr().err
    assert "flash-attn is installed but does not import (ImportError" in err
    assert "undefined symbol" in err and "using PyTorch SDPA" in err


def test_one_process_seeing_two_gpus_never_uses_data_parallel(tmp_path, capsys):
    """MOCKED: transformers sets n_gpu = torch.cuda.device_count() in a process that is not
    distributed; on 2 visible GPUs the Trainer would wrap the model in nn.DataParallel."""
    import torch
    from transformers import Trainer, TrainingArguments

    from swiftlite.training.trainer import one_device
    ta = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    object.__setattr__(ta, "_n_gpu", 2)  # what a host with 2 visible GPUs gives
    model = torch.nn.Linear(2, 2)
    wrapped = Trainer(model=model, args=ta)._wrap_model(model, training=True)
    assert isinstance(wrapped, torch.nn.DataParallel)  # why one_device exists
    one_device(ta, world=1)
    assert ta.n_gpu == 1
    assert not isinstance(Trainer(model=model, args=ta)._wrap_model(model, training=True),
                          torch.nn.DataParallel)
    err = capsys.readouterr().err
    assert "2 GPUs are visible to one process: training on one" in err
    assert "Set NPROC_PER_NODE=2 to train on all of them" in err


@pytest.mark.parametrize("hw, requested, trained, expected", [
    (Hardware("cuda", "Tesla T4", (7, 5)), None, "bfloat16", "float16"),  # no bf16 units
    (Hardware("cuda", "NVIDIA A100", (8, 0)), None, "float32", "bfloat16"),  # a CPU-trained one
    (Hardware("cuda", "NVIDIA A100", (8, 0)), "float32", "bfloat16", "float32"),  # asked for
    (Hardware("npu", "Ascend910A", npu_bf16=False), "auto", "bfloat16", "float16"),
    (Hardware("cpu", "cpu"), None, "float16", "float32"),  # trained on a T4
    (Hardware("cpu", "cpu"), None, "bfloat16", "float32"),  # no bf16 units
    (Hardware("cpu", "cpu", cpu_bf16=True), None, "bfloat16", "bfloat16"),
    (Hardware("cpu", "cpu"), "float16", "float32", "float16"),
])
def test_inference_runs_in_the_devices_dtype(hw, requested, trained, expected):
    assert hardware.inference_dtype(requested, trained, hw) == expected


def test_inference_refuses_bf16_on_a_t4():
    with pytest.raises(UsageError, match="Tesla T4 .*has no bfloat16 units"):
        hardware.inference_dtype("bfloat16", None, Hardware("cuda", "Tesla T4", (7, 5)))
