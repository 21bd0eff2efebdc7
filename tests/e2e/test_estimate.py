"""`swiftlite estimate`: exact parameter counts from config.json alone, model states equal to
DeepSpeed's own estimators, the recommendation, the CLI, and the whole estimate against the
measured peak memory of a real CPU training run."""
from __future__ import annotations

import io
import json
import os
import re
from contextlib import redirect_stdout

import pytest

from swiftlite.estimate import memory
from swiftlite.config import sizes
from swiftlite.models import meta
from swiftlite.errors import UsageError
from swiftlite.models.registry import MODELS

from helpers.cli import run_cli


@pytest.fixture(scope="module")
def qwen15():
    name, config = meta.read_config("Qwen2-1.5B-Instruct")
    return memory.model_spec(name, config, "full")


def test_counts_equal_the_real_model_and_peft(tiny_qwen2):
    """Counts from config.json (meta device) equal those of the loaded model, of peft's LoRA
    wrapper, and DeepSpeed's model_to_params (total and largest layer)."""
    import torch
    from deepspeed.runtime.zero.stage3 import model_to_params
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    name, config = meta.read_config(tiny_qwen2)
    model = AutoModelForCausalLM.from_pretrained(tiny_qwen2, dtype=torch.float32)
    full = memory.model_spec(name, config, "full")
    assert (full.total_params, full.largest_layer_params) == model_to_params(model)
    layer = model.model.layers[0]
    assert full.linear_outputs_per_layer == sum(
        m.out_features for m in layer.modules() if isinstance(m, torch.nn.Linear))
    assert full.trainable_params == full.total_params
    for targets in (["all-linear"], ["q_proj", "v_proj"], ["self_attn.q_proj", "down_proj"],
                    ["embed_tokens", "lm_head", "q_proj"]):
        spec = memory.model_spec(name, config, "lora", lora_rank=4, target_modules=targets)
        peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_qwen2),
                                    LoraConfig(r=4, target_modules=targets[0] if
                                               targets == ["all-linear"] else targets))
        trainable, _ = peft_model.get_nb_trainable_parameters()
        assert spec.trainable_params == trainable
        assert spec.total_params == full.total_params  # the base: adapters counted apart
    # A target no module has is an error (peft's own rule), not an adapter of 0 parameters.
    with pytest.raises(UsageError, match="--target_modules qproj: no such module.*q_proj"):
        memory.model_spec(name, config, "lora", target_modules=["q_proj", "qproj"])


@pytest.mark.parametrize("alias", [a for a, m in MODELS.items() if m.hub_id])
def test_shipped_configs_match_the_size_in_the_name(alias):
    name, config = meta.read_config(alias)
    spec = memory.model_spec(name, config, "lora")
    size = float(re.search(r"-([\d.]+)B", alias).group(1)) * 1e9
    assert abs(spec.total_params - size) / size < 0.1, (alias, spec.total_params)
    assert spec.trainable_params < spec.total_params / 100


MEASURED_ERROR_BOUND_PCT = 15  # the largest error in docs/estimate.md (-11.8%), with margin


def _ds_table(fn, **kw) -> list[tuple[float, float, str]]:
    """(per CPU GB, per GPU GB, options) rows that DeepSpeed's *_all_cold estimator prints."""
    out = io.StringIO()
    with redirect_stdout(out):
        fn(**kw)
    rows = re.findall(r"^\s*([\d.]+)GB \|\s*([\d.]+)GB \| (.+)$", out.getvalue(), re.M)
    assert rows, out.getvalue()
    return [(float(c), float(g), opts.strip()) for c, g, opts in rows]


def _gb(n) -> float:
    return round(n / 2**30, 2)


@pytest.mark.parametrize("gpus,nodes", [(1, 1), (2, 1), (8, 1), (8, 2)])
def test_model_states_equal_deepspeed_estimators(qwen15, gpus, nodes):
    """Full fine-tuning in 16-bit with DeepSpeed's assumptions (fp32 load): our per-component
    figures add up to DeepSpeed's totals for ZeRO-2, ZeRO-2 offload, ZeRO-3, ZeRO-3 offload."""
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs_all_cold
    from deepspeed.runtime.zero.stage_1_and_2 import \
        estimate_zero2_model_states_mem_needs_all_cold
    p, ll = qwen15.total_params, qwen15.largest_layer_params

    def ours(stage, zero_init=False):
        gpu, cpu = memory.model_states(stage, p, p, ll, gpus_per_node=gpus, nodes=nodes,
                                       weight_bytes=2, load_bytes=4, zero_init=zero_init)
        return _gb(cpu["total"]), _gb(gpu["params"] + gpu["grads"] + gpu["optim"])

    checked = 0
    for cpu_gb, gpu_gb, opts in _ds_table(estimate_zero2_model_states_mem_needs_all_cold,
                                          total_params=p, num_gpus_per_node=gpus,
                                          num_nodes=nodes):
        stage = "zero2" if "offload_optimizer=none" in opts else "zero2_offload"
        our_cpu, our_gpu = ours(stage)
        assert our_gpu == pytest.approx(gpu_gb, abs=0.011), (stage, opts)
        if nodes == 1:  # DeepSpeed sizes ZeRO-2 offload's CPU side by all GPUs of all nodes
            assert our_cpu == pytest.approx(cpu_gb, abs=0.011), (stage, opts)
        checked += 1
    for cpu_gb, gpu_gb, opts in _ds_table(estimate_zero3_model_states_mem_needs_all_cold,
                                          total_params=p, largest_layer_params=ll,
                                          num_gpus_per_node=gpus, num_nodes=nodes):
        param_off = "offload_param=none" not in opts
        optim_off = "offload_optimizer=none" not in opts
        if param_off and optim_off:
            stage = "zero3_offload"
        elif not param_off and not optim_off:
            stage = "zero3"
        else:
            continue  # optimizer-only offload under ZeRO-3 is not a preset
        our_cpu, our_gpu = ours(stage, zero_init="zero_init=1" in opts)
        assert (our_cpu, our_gpu) == pytest.approx((cpu_gb, gpu_gb), abs=0.011), (stage, opts)
        checked += 1
    assert checked == 6


def test_lora_needs_less_and_more_gpus_need_less_per_gpu(qwen15):
    name, config = meta.read_config("Qwen2-1.5B-Instruct")
    lora = memory.model_spec(name, config, "lora")
    by = {r.stage: r for r in memory.estimate(qwen15, train_type="full")}
    lo = {r.stage: r for r in memory.estimate(lora, train_type="lora")}
    for stage in memory.STAGES:
        # offloaded optimizer: the same 16-bit weights on the GPU either way
        assert lo[stage].gpu_total <= by[stage].gpu_total
        assert lo[stage].cpu_total <= by[stage].cpu_total
        assert lo[stage].gpu["activations"] < lo[stage].gpu["activations_no_ckpt"]
    assert lo["none"].gpu_total < by["none"].gpu_total
    one = {r.stage: r for r in memory.estimate(qwen15, train_type="full", gpus_per_node=1)}
    four = {r.stage: r for r in memory.estimate(qwen15, train_type="full", gpus_per_node=4)}
    for stage in ("zero1", "zero2", "zero3"):
        assert four[stage].gpu_total < one[stage].gpu_total


def test_recommendation_is_the_first_configuration_that_fits(qwen15):
    rows = memory.estimate(qwen15, train_type="full", gpus_per_node=2)
    gpu_memory = sizes.parse_memory("24GB", "gpu_memory")
    choice = memory.recommend(rows, gpu_memory, gpus=2)
    usable = gpu_memory * memory.USABLE_FRACTION
    order = [(r, ckpt) for r in rows for ckpt in (False, True)]
    stage = choice.deepspeed or "none"
    idx = next(i for i, (r, c) in enumerate(order)
               if r.stage == stage and c == choice.gradient_checkpointing)
    assert choice.fits and choice.gpu_bytes <= usable
    for r, ckpt in order[:idx]:
        assert (r.gpu_total if ckpt else r.gpu_total_no_ckpt) > usable
    tight = memory.recommend(rows, sizes.parse_memory("1GB", "m"), gpus=2)
    assert not tight.fits and "Lower --max_length" in tight.reason
    # CPU memory too small for offloading: offload rows are skipped
    offload = memory.recommend(rows, sizes.parse_memory("8GB", "m"), gpus=2)
    assert offload.fits and offload.deepspeed.endswith("_offload")
    small_cpu = max(r.cpu_total for r in rows if not r.stage.endswith("_offload"))
    no_cpu = memory.recommend(rows, sizes.parse_memory("8GB", "m"), cpu_memory=small_cpu,
                              gpus=2)
    assert not no_cpu.deepspeed or not no_cpu.deepspeed.endswith("_offload")


def test_loss_chunk_matches_the_loss_module():
    from swiftlite.training.speedups import chunked_loss as loss
    assert memory.LOSS_CHUNK == loss.CHUNK


@pytest.mark.slow
def test_cli_table_and_json_offline():
    r = run_cli("estimate", "--model", "Qwen2-1.5B-Instruct", "--gpus", "2", "--gpu_memory",
                "24GB", "--train_type", "full", "--json", env={"HF_HUB_OFFLINE": "1"})
    result = json.loads(r.stdout)
    assert [row["stage"] for row in result["rows"]] == list(memory.STAGES)
    assert result["setup"]["gpus_per_node"] == 2 and result["trainable_params"] == \
        result["total_params"]
    assert set(result["rows"][0]["gpu"]) >= {"params", "grads", "optim", "activations",
                                             "activations_no_ckpt"}
    r = run_cli("estimate", "--model", "Qwen2-1.5B-Instruct", "--gpus", "2", "--gpu_memory",
                "24GB", env={"HF_HUB_OFFLINE": "1"})
    lines = r.stdout.splitlines()
    header = next(line for line in lines if line.startswith("config"))
    assert header.split() == ["config", "params", "grads", "optim", "act", "act(no)", "GPU",
                              "GPU(no)", "CPU", "fits"]
    assert sum(line.split()[0] in memory.STAGES for line in lines if line.strip()) == 7
    assert any(line.startswith("Recommended:") for line in lines)


def test_cli_refuses_bad_input_with_what_to_do():
    r = run_cli("estimate", "--model", "Qwen2-1.5B-Instruct", "--gpu_memory", "lots",
                check=False)
    assert r.returncode == 2 and "expected a size such as 24GB" in r.stderr
    r = run_cli("estimate", "--model", "/no/such/model", check=False)
    assert r.returncode == 2 and "not a folder, a config.json" in r.stderr
    r = run_cli("estimate", "--model", "Qwen2-1.5B-Instruct", "--gpus", "0", check=False)
    assert r.returncode == 2 and "--gpus must be a positive number" in r.stderr
    with pytest.raises(UsageError, match="no model_type"):
        memory.model_spec("x", {"hidden_size": 8})


@pytest.mark.slow
def test_estimate_against_a_measured_cpu_run():
    """The whole estimate (weights, optimizer states, activations, loss) against the peak
    memory of a real tiny-qwen2 LoRA run in its own process (benchmarks/estimate_vs_measured.py
    measures it; docs/estimate.md lists larger runs). The bound is the documented error."""
    import importlib.util
    from helpers.cli import REPO
    path = os.path.join(REPO, "benchmarks", "estimate_vs_measured.py")
    spec = importlib.util.spec_from_file_location("estimate_vs_measured", path)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    m = script.measure("tiny-qwen2:lora:ckpt", max_length=512, batch=2, steps=2)
    assert m["measured"] > m["weights"] > 0
    assert abs(m["error_pct"]) <= MEASURED_ERROR_BOUND_PCT, m


def test_selective_checkpointing_adds_the_frozen_matmul_outputs(tiny_qwen2):
    """--selective_checkpointing keeps every frozen matmul output of each checkpointed layer
    (torch's policy on GPUs): for LoRA, tokens x layers x the layer's summed out_features in
    the activation dtype on top of plain checkpointing; full fine-tuning has no frozen matmuls.
    On SmolLM2-135M in fp32 that is 0.59 MB per token; CPU fused LoRA layers, which keep all
    but the last, measured 0.48 MB (docs/performance.md)."""
    name, config = meta.read_config(tiny_qwen2)
    tokens = 1024
    for train_type, dtype in (("lora", "bfloat16"), ("lora", "float32"), ("full", "bfloat16")):
        spec = memory.model_spec(name, config, train_type)
        plain, selective = (memory.activations(spec, tokens, dtype, train_type, True,
                                               selective=sel) for sel in (False, True))
        kept = 0 if train_type == "full" else (
            tokens * spec.num_layers * memory.DTYPE_BYTES[dtype] * spec.linear_outputs_per_layer)
        assert selective - plain == kept
        rows = memory.estimate(spec, dtype=dtype, train_type=train_type, max_length=tokens,
                               selective_checkpointing=True)
        base = memory.estimate(spec, dtype=dtype, train_type=train_type, max_length=tokens)
        assert [r.gpu_total - b.gpu_total for r, b in zip(rows, base)] == [kept] * len(rows)
        assert [r.gpu_total_no_ckpt for r in rows] == [b.gpu_total_no_ckpt for b in base]
    smol = memory.model_spec(*meta.read_config("SmolLM2-135M-Instruct"), "lora")
    per_token = smol.num_layers * 4 * smol.linear_outputs_per_layer
    assert round(per_token / 2**20, 2) == 0.59
