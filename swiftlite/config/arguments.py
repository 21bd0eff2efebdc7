"""One dataclass per command. CLI flags, YAML/JSON config files, Web-UI forms and Python
keyword arguments all build these same objects, with the same names.

`SftArguments` also accepts every Hugging Face `TrainingArguments` field (e.g. `report_to`,
`eval_strategy`, `dataloader_num_workers`) as a flag of the same name; those land in
`training_args` and go to the Trainer unchanged. Everything is validated once, and all
problems are reported together. swiftlite.config.parsing turns names and values into these objects.
"""
from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Optional, Union

from swiftlite.config.constants import DEFAULT_TOTAL_BATCH
from swiftlite.config.sizes import parse_size
from swiftlite.errors import UsageError


def arg(default=None, help: str = "", *, choices=None, group: str = "", factory=None):
    meta = {"help": help, "choices": choices, "group": group}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ModelArguments:
    model: Optional[str] = arg(None, "local model folder, hub id (Qwen/Qwen2-1.5B-Instruct) or "
                               "alias (Qwen2-1.5B-Instruct, SmolLM2-135M-Instruct, tiny-qwen2)",
                               group="model")
    template: Optional[str] = arg(None, "chat template: a name from templates/ or a JSON file "
                                  "(an override); default (or 'model'): the model's own chat "
                                  "template, else 'default'", group="model")
    system: Optional[str] = arg(None, "default system prompt (replaces the template's)",
                                group="model")
    torch_dtype: str = arg("auto", "weights dtype; auto: bf16 on Ampere+ GPUs and Ascend, fp16 "
                           "on T4/V100; on CPU fp32, but LoRA training on AMX/AVX-512-BF16 CPUs gets a "
                           "bf16 base with fp32 activations (faster: docs/performance.md)",
                           choices=("auto", "bfloat16", "float16", "float32"), group="model")
    trust_remote_code: bool = arg(False, "run code shipped with the model (off: safer)",
                                  group="model")
    attn_impl: Optional[str] = arg(None, "attention implementation (sdpa, eager, "
                                   "flash_attention_2); default: the fastest available",
                                   group="model")
    quant_bits: Optional[int] = arg(None, "QLoRA: load the frozen base model in 4 or 8 bits "
                                    "(bitsandbytes); LoRA only (docs/qlora.md)", group="model")
    quant_method: Optional[str] = arg(None, "the quantization library for --quant_bits: bnb "
                                      "(bitsandbytes, the only one and the default)",
                                      group="model")
    bnb_4bit_quant_type: str = arg("nf4", "4-bit number format: nf4 (QLoRA's normal float) or "
                                   "fp4", choices=("nf4", "fp4"), group="model")
    bnb_4bit_use_double_quant: bool = arg(True, "also quantize the 4-bit blocks' scales (about "
                                          "0.4 bits per weight less)", group="model")

    def quant_problems(self) -> list[str]:
        """--quant_bits and its companions, checked before anything loads."""
        if self.quant_bits is None:
            return [f"--quant_method {self.quant_method} needs --quant_bits 4 or 8"] \
                if self.quant_method else []
        problems = []
        if self.quant_bits not in (4, 8):
            problems.append(f"--quant_bits {self.quant_bits}: bitsandbytes loads 4 or 8 bits")
        if (self.quant_method or "bnb") != "bnb":
            problems.append(f"--quant_method {self.quant_method}: only bnb (bitsandbytes)")
        import importlib.util
        if importlib.util.find_spec("bitsandbytes") is None:
            problems.append("--quant_bits needs bitsandbytes: pip install bitsandbytes")
        return problems


@dataclass
class DataArguments:
    dataset: list[str] = arg(help="files (.jsonl/.json/.csv/.parquet) or built-ins "
                             "(self-cognition), each optionally NAME#N to sample N rows",
                             factory=list, group="data")
    val_dataset: list[str] = arg(help="validation files or built-ins (same syntax)",
                                 factory=list, group="data")
    split_dataset_ratio: float = arg(0.0, "share of --dataset held out for validation",
                                     group="data")
    max_length: int = arg(2048, "longest sample in tokens (see --truncation_strategy)",
                          group="data")
    truncation_strategy: str = arg("delete", "over-long samples: delete them, or cut from the "
                                   "left/right (counts are always printed)",
                                   choices=("delete", "left", "right"), group="data")
    skip_bad_rows: bool = arg(False, "skip malformed rows (counted per reason) instead of "
                              "stopping", group="data")
    dataset_num_proc: Optional[int] = arg(None, "processes that tokenise (default: the CPU "
                                          "cores this process may use)", group="data")
    loss_scale: str = arg("default", "what is trained: default every assistant reply (tool "
                          "calls included), last_round only the last one, all every token "
                          "(prompt too); a message's own \"loss\": true|false decides for it",
                          choices=("default", "last_round", "all"), group="data")
    model_name: list[str] = arg(help="name for self-cognition: English [Chinese]",
                                factory=list, group="data")
    model_author: list[str] = arg(help="author for self-cognition: English [Chinese]",
                                  factory=list, group="data")
    data_seed: int = arg(42, "seed for dataset sampling (#N) and splitting", group="data")
    load_from_cache_file: bool = arg(True, "reuse tokenised data cached on disk", group="data")
    streaming: bool = arg(False, "read and tokenise rows as training consumes them, nothing "
                          "upfront (data larger than memory; needs --max_steps)", group="data")
    shuffle_buffer_size: int = arg(1000, "--streaming: samples in the shuffle buffer",
                                   group="data")
    packing: bool = arg(False, "pack samples into rows of up to --max_length tokens (fewer, "
                        "fuller steps; attention stays inside each sample)", group="data")


@dataclass
class LoraArguments:
    train_type: str = arg("lora", "lora: train adapters on a frozen model; full: all weights",
                          choices=("lora", "full"), group="tuner")
    lora_rank: int = arg(8, "LoRA rank r", group="tuner")
    lora_alpha: int = arg(32, "LoRA alpha (scale = alpha / rank)", group="tuner")
    lora_dropout: float = arg(0.05, "dropout on the LoRA input", group="tuner")
    target_modules: list[str] = arg(help="modules to adapt: all-linear, or names such as "
                                    "q_proj v_proj", factory=lambda: ["all-linear"],
                                    group="tuner")


@dataclass
class TrainArguments:
    output_dir: Optional[str] = arg(None, "output root; the run goes to "
                                    "<output_dir>/v<N>-<timestamp> (default output/<model>)",
                                    group="train")
    add_version: bool = arg(True, "add the v<N>-<timestamp> run folder under --output_dir",
                            group="train")
    num_train_epochs: float = arg(3.0, "epochs (ignored when --max_steps > 0)", group="train")
    max_steps: int = arg(-1, "optimizer steps; -1: use --num_train_epochs", group="train")
    per_device_train_batch_size: int = arg(1, "samples per device per step", group="train")
    per_device_eval_batch_size: int = arg(1, "samples per device per eval step", group="train")
    gradient_accumulation_steps: Optional[int] = arg(
        None, f"micro-batches per optimizer step; default: a total batch of "
        f"{DEFAULT_TOTAL_BATCH}", group="train")
    learning_rate: float = arg(1e-4, "peak learning rate", group="train")
    lr_scheduler_type: str = arg("cosine", "learning rate schedule", group="train")
    warmup_ratio: float = arg(0.05, "share of steps for linear warmup", group="train")
    weight_decay: float = arg(0.1, "AdamW weight decay", group="train")
    max_grad_norm: float = arg(1.0, "gradient clipping", group="train")
    logging_steps: int = arg(5, "log every N steps", group="train")
    save_steps: int = arg(500, "save a checkpoint every N steps", group="train")
    eval_steps: Optional[int] = arg(None, "evaluate every N steps (default: --save_steps)",
                                    group="train")
    save_total_limit: Optional[int] = arg(None, "keep only the last N checkpoints",
                                          group="train")
    seed: int = arg(42, "random seed", group="train")
    gradient_checkpointing: bool = arg(True, "recompute activations in backward to save "
                                       "memory", group="train")
    selective_checkpointing: bool = arg(False, "LoRA with --gradient_checkpointing: keep the "
                                        "outputs of frozen matmuls instead of recomputing them "
                                        "(faster for a little memory per token: "
                                        "docs/performance.md)", group="train")
    keep_attention: bool = arg(True, "on a CPU with --gradient_checkpointing and "
                               "--padding_free: keep each layer's attention output from the "
                               "forward pass for the recompute instead of running attention "
                               "again (the same numbers, for memory per token: "
                               "docs/performance.md)", group="train")
    onednn_fp32: bool = arg(True, "on a CPU with an fp32 base: its matmuls (frozen layers in "
                            "--fused_lora, LM head in --chunked_loss) through oneDNN when it is "
                            "at least 1.2x torch's BLAS here, measured at start (on AVX-512 CPUs "
                            "whose BLAS runs AVX2 code); false: torch's BLAS", group="train")
    deepspeed: Optional[Union[str, dict]] = arg(None, "DeepSpeed: zero0/zero1/zero2/zero3/zero2_offload/"
                                   "zero3_offload, auto (the fastest that fits, per swiftlite "
                                   "estimate), a JSON file or inline JSON", group="train")
    resume_from_checkpoint: Optional[str] = arg(None, "continue from this checkpoint folder, "
                                                "or a run folder's last complete checkpoint",
                                                group="train")
    padding_free: bool = arg(True, "pack each batch into one row without padding (attention "
                             "stays inside each sample); false: pad to the longest",
                             group="train")
    chunked_loss: bool = arg(True, "LM head and loss only at trained positions, in chunks (less "
                             "time, no length x vocab logits in memory); false: the model's own "
                             "loss", group="train")
    fast_dropout: bool = arg(True, "on a CPU, LoRA dropout draws only the positions it drops "
                             "(about p x the elements) instead of a random mask over all of "
                             "them; false: nn.Dropout", group="train")
    fused_lora: bool = arg(True, "on a CPU, each LoRA layer's adapter branch as one autograd "
                           "function with its gradients in fast matmul layouts, and checkpointing "
                           "no longer recomputes the last matmul of a layer; false: peft's modules",
                           group="train")
    fp32_activations: bool = arg(True, "with --torch_dtype bfloat16 on a CPU: bf16 matmuls but "
                                 "fp32 activations, so small LoRA updates are not rounded away; "
                                 "false: all-bf16 activations", group="train")
    bf16_lora_matmuls: bool = arg(True, "with --fp32_activations and --fused_lora: the LoRA "
                                  "adapters' matmuls take bf16 inputs too, their results rounded "
                                  "to bf16 once (sums, weights and optimizer state stay fp32); "
                                  "false: fp32 adapter matmuls", group="train")


@dataclass
class SftArguments(ModelArguments, DataArguments, LoraArguments, TrainArguments):
    """Arguments of `swiftlite sft`."""
    training_args: dict = arg(help="other transformers TrainingArguments fields",
                              factory=dict, group="hidden")

    def accumulation_steps(self, world_size: int) -> int:
        """--gradient_accumulation_steps, or as many as make the default total batch."""
        return self.gradient_accumulation_steps or max(
            1, DEFAULT_TOTAL_BATCH // (self.per_device_train_batch_size * world_size))

    def validate(self) -> "SftArguments":
        problems = []
        if not self.model:
            problems.append("--model is required (an alias such as SmolLM2-135M-Instruct, a hub "
                            "id, or a local folder)")
        if not self.dataset:
            problems.append("--dataset is required (a file, or a built-in such as "
                            "self-cognition#500)")
        problems += _check_choices(self) + _not_finite(self)
        if self.dataset_num_proc is not None and self.dataset_num_proc < 1:
            problems.append(f"--dataset_num_proc must be at least 1, got {self.dataset_num_proc}")
        problems += _not_positive(self, ("lora_rank", "lora_alpha", "max_length",
                                         "per_device_train_batch_size",
                                         "per_device_eval_batch_size", "logging_steps",
                                         "save_steps"))
        for name in ("seed", "data_seed"):  # numpy's seeding takes 0 .. 2**32 - 1
            if not 0 <= getattr(self, name) < 2 ** 32:
                problems.append(f"--{name} must be in 0 .. 4294967295, got {getattr(self, name)}")
        if self.gradient_accumulation_steps is not None and self.gradient_accumulation_steps < 1:
            problems.append("--gradient_accumulation_steps must be at least 1")
        if not 0 <= self.split_dataset_ratio < 1:
            problems.append(f"--split_dataset_ratio must be in [0, 1), got "
                            f"{self.split_dataset_ratio}")
        if self.split_dataset_ratio and self.val_dataset:
            problems.append("give --val_dataset or --split_dataset_ratio, not both")
        evaluate = self.training_args.get("eval_strategy", "no")
        evaluate = "no" if evaluate is False else str(evaluate).lower()  # YAML reads no as False
        if evaluate not in ("no", "intervalstrategy.no") and not (
                self.val_dataset or self.split_dataset_ratio):
            problems.append(f"--eval_strategy {self.training_args['eval_strategy']} needs data "
                            "to evaluate on: add --val_dataset FILE or --split_dataset_ratio 0.05")
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if self.learning_rate <= 0:
            problems.append(f"--learning_rate must be positive, got {self.learning_rate}")
        if self.max_steps <= 0 and self.num_train_epochs <= 0:
            problems.append("set --max_steps or --num_train_epochs to a positive number")
        problems += self._data_mode_problems()
        if self.resume_from_checkpoint and not os.path.isdir(self.resume_from_checkpoint):
            problems.append(f"--resume_from_checkpoint {self.resume_from_checkpoint}: no such "
                            "folder")
        problems += self.quant_problems()
        if self.quant_bits is not None and self.train_type != "lora":
            problems.append(f"--quant_bits {self.quant_bits} with --train_type "
                            f"{self.train_type}: a quantized base cannot be trained itself; "
                            "train LoRA adapters on it (--train_type lora)")
        if self.quant_bits is not None and "zero3" in str(self.deepspeed or ""):
            # a preset, caught here for the Web-UI's form; any ZeRO-3 config: sft's preflight
            problems.append(f"--quant_bits with --deepspeed {self.deepspeed}: {QUANT_ZERO3}")
        _raise_if(problems)
        return self

    def _data_mode_problems(self) -> list[str]:
        problems = []
        if self.streaming and self.max_steps <= 0:
            problems.append("--streaming true needs --max_steps N: a stream has no length to "
                            "count epochs in")
        if self.streaming and self.split_dataset_ratio:
            problems.append("--split_dataset_ratio with --streaming true: a held-out share "
                            "needs every row first; give --val_dataset FILE instead")
        if self.streaming and self.packing:
            problems.append("--packing with --streaming true: packing is planned over every "
                            "sample's length; use one of them")
        if self.packing and not self.padding_free:
            problems.append("--packing true keeps samples apart the way padding-free batches "
                            "do (position ids): drop --padding_free false")
        if self.shuffle_buffer_size < 1:
            problems.append(f"--shuffle_buffer_size must be at least 1, got "
                            f"{self.shuffle_buffer_size}")
        return problems


def _not_positive(obj, names) -> list[str]:
    return [f"--{n} must be a positive number, got {getattr(obj, n)}" for n in names
            if getattr(obj, n) <= 0]


def _not_finite(obj) -> list[str]:
    """nan or inf in a float field (parsing refuses them; this catches dataclasses built
    directly in Python)."""
    return [f"--{f.name} must be a finite number, got {getattr(obj, f.name)}"
            for f in dataclasses.fields(obj) if isinstance(getattr(obj, f.name), float)
            and not math.isfinite(getattr(obj, f.name))]


def _raise_if(problems: list[str]) -> None:
    """One UsageError listing every problem found, so a user fixes them all at once."""
    if problems:
        raise UsageError("invalid arguments:\n  - " + "\n  - ".join(problems))


def _check_choices(obj) -> list[str]:
    out = []
    for f in dataclasses.fields(obj):
        choices = f.metadata.get("choices")
        if choices and getattr(obj, f.name) not in choices:
            out.append(f"--{f.name} {getattr(obj, f.name)}: choose one of {', '.join(choices)}")
    return out


# -- infer and merge-lora -----------------------------------------------------------------------
@dataclass
class GenerationArguments:
    max_new_tokens: int = arg(512, "longest answer in tokens", group="generation")
    temperature: float = arg(0.0, "sampling temperature; 0: greedy (deterministic)",
                             group="generation")
    top_p: float = arg(1.0, "nucleus sampling: keep the smallest set of tokens whose "
                       "probability reaches top_p", group="generation")
    top_k: int = arg(50, "sample only among the k likeliest tokens (0: all)", group="generation")
    repetition_penalty: float = arg(1.0, "above 1 discourages repeating tokens",
                                    group="generation")
    do_sample: Optional[bool] = arg(None, "sample instead of greedy decoding; default: sample "
                                    "when --temperature > 0", group="generation")
    seed: Optional[int] = arg(None, "random seed for sampling", group="generation")


@dataclass
class PlacementArguments:
    device_map: str = arg("none", "auto: spread a model too large for one GPU over the visible "
                          "GPUs (then CPU memory), by accelerate; none: the whole model on one "
                          "device", choices=("none", "auto"), group="model")


@dataclass
class InferArguments(ModelArguments, PlacementArguments, GenerationArguments):
    """Arguments of `swiftlite infer`. With --ckpt_dir the model, template, system prompt and
    dtype come from the run's args.json; flags override them."""
    ckpt_dir: Optional[str] = arg(None, "a LoRA checkpoint (loaded as base + adapter) or a merged "
                                  "model folder", group="model")
    query: Optional[str] = arg(None, "answer this one question, print the answer and exit",
                               group="infer")
    tools: Optional[str] = arg(None, "functions the model may call: a JSON file or JSON text "
                               "with a list of OpenAI function schemas; tool calls in the answer "
                               "are printed as JSON (batch mode: a row's own tools win)",
                               group="infer")
    val_dataset: list[str] = arg(help="batch mode: answer every conversation of these files "
                                 "(any --dataset format) and write JSONL to --result_path",
                                 factory=list, group="infer")
    skip_bad_rows: bool = arg(False, "batch mode: skip malformed rows (counted per reason) "
                              "instead of stopping", group="infer")
    result_path: Optional[str] = arg(None, "batch mode output JSONL (default: "
                                     "<ckpt_dir or output>/infer_result/<timestamp>.jsonl)",
                                     group="infer")
    max_batch_size: int = arg(8, "batch mode: conversations generated together", group="infer")
    stream: bool = arg(True, "interactive mode: print the answer token by token", group="infer")

    def validate(self) -> "InferArguments":
        problems = []
        if not self.ckpt_dir and not self.model:
            problems.append("give --ckpt_dir (a checkpoint or merged folder) or --model (a model "
                            "folder, hub id or alias)")
        if self.ckpt_dir and not os.path.isdir(self.ckpt_dir):
            problems.append(f"--ckpt_dir {self.ckpt_dir}: no such folder")
        if self.query is not None and not self.query.strip():
            problems.append("--query is empty")
        if self.query is not None and self.val_dataset:
            problems.append("give --query or --val_dataset, not both")
        problems += self.quant_problems()

        problems += _check_choices(self)
        problems += _not_positive(self, ("max_new_tokens", "max_batch_size"))
        if self.temperature < 0:
            problems.append(f"--temperature must be 0 or more, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            problems.append(f"--top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            problems.append(f"--top_k must be 0 or more, got {self.top_k}")
        if self.repetition_penalty <= 0:
            problems.append(f"--repetition_penalty must be positive, got "
                            f"{self.repetition_penalty}")
        _raise_if(problems)
        return self

    def generation_kwargs(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GenerationArguments)}


QUANT_ZERO3 = ("ZeRO-3 partitions the base weights, and bitsandbytes' packed 4/8-bit weights "
               "cannot be partitioned; use zero2 (or zero2_offload), which shards only the LoRA "
               "weights' optimizer state")
DEPLOY_PT_BATCH = 32  # the pt server's batch; measured in README's serving table


@dataclass
class DeployArguments(ModelArguments, PlacementArguments):
    """Arguments of `swiftlite deploy`."""
    ckpt_dir: Optional[str] = arg(None, "a LoRA checkpoint (served over its base model) or a "
                                  "merged model folder", group="model")
    adapters: list[str] = arg(help="more LoRA adapters over the same base, as name=path; a "
                              "request's model picks one (the base model by its own name)",
                              factory=list, group="model")
    served_model_name: Optional[str] = arg(None, "the model name clients use for --ckpt_dir / "
                                           "--model (default: the folder's or alias's name)",
                                           group="deploy")
    host: str = arg("127.0.0.1", "address to listen on (loopback by default)", group="deploy")
    port: int = arg(8000, "port to listen on", group="deploy")
    api_key: Optional[str] = arg(None, "require Authorization: Bearer KEY (also from the "
                                 "SWIFTLITE_API_KEY environment variable; never logged or "
                                 "saved)", group="deploy")
    allow_remote_without_key: bool = arg(False, "serve a non-loopback --host without an API key "
                                         "(anyone who reaches the port can use the model)",
                                         group="deploy")
    allowed_hosts: list[str] = arg(help="pt: Host header values to answer (DNS-rebinding "
                                   "protection; default: loopback names, --host and this "
                                   "machine's names; * for any)", factory=list, group="deploy")
    max_batch_size: Optional[int] = arg(None, "requests generated together (default: "
                                        f"{DEPLOY_PT_BATCH} with pt; vLLM's own with vllm)",
                                        group="deploy")
    max_queue_size: int = arg(64, "pt: requests waiting at most; more are answered 429",
                              group="deploy")
    infer_backend: str = arg("pt", "pt: transformers in this process; vllm: vLLM's OpenAI "
                             "server, set up with this checkpoint's template, names and "
                             "tool-call parser", choices=("pt", "vllm"), group="deploy")
    vllm_python: Optional[str] = arg(None, "the Python that has vLLM, when it lives in its own "
                                     "venv (also SWIFTLITE_VLLM_PYTHON; default: this one)",
                                     group="vllm")
    tensor_parallel_size: int = arg(1, "GPUs one vLLM model is split over", group="vllm")
    max_model_len: Optional[int] = arg(None, "longest prompt + answer vLLM plans its KV cache "
                                       "for (default: the model's)", group="vllm")
    vllm_args: Optional[str] = arg(None, "more vLLM server flags, as one string, e.g. "
                                   "'--enforce-eager --gpu-memory-utilization 0.8'", group="vllm")

    def validate(self) -> "DeployArguments":
        problems = []
        if not self.ckpt_dir and not self.model:
            problems.append("give --ckpt_dir (a checkpoint or merged folder) or --model")
        if self.ckpt_dir and not os.path.isdir(self.ckpt_dir):
            problems.append(f"--ckpt_dir {self.ckpt_dir}: no such folder")
        for a in self.adapters:
            name, sep, path = a.partition("=")
            if not sep or not name or not path:
                problems.append(f"--adapters {a}: write name=path")
            elif not os.path.isfile(os.path.join(path, "adapter_config.json")):
                problems.append(f"--adapters {a}: {path} is not a LoRA checkpoint (no "
                                "adapter_config.json)")
        problems += _check_choices(self)
        problems += _not_positive(self, ("max_queue_size", "port", "tensor_parallel_size"))
        problems += _not_positive(self, [k for k in ("max_model_len", "max_batch_size")
                                         if getattr(self, k) is not None])
        problems += self.quant_problems()
        if self.quant_bits is not None and self.infer_backend == "vllm":
            problems.append("--quant_bits loads the base in bitsandbytes for the pt backend; "
                            "for vLLM serve the merged model (vLLM has its own quantization, "
                            "e.g. --vllm_args '--quantization bitsandbytes')")
        if self.infer_backend == "pt":
            problems += [f"--{k} is a vLLM setting; add --infer_backend vllm" for k in (
                "vllm_python", "max_model_len", "vllm_args") if getattr(self, k) is not None]
            if self.tensor_parallel_size != 1:
                problems.append("--tensor_parallel_size needs --infer_backend vllm")
        elif self.device_map != "none":
            problems.append("--device_map is the pt backend's; vLLM splits a model over GPUs "
                            "with --tensor_parallel_size")
        elif self.allowed_hosts:
            problems.append("--allowed_hosts is checked by the pt server only; vLLM's server "
                            "does not check Host headers (keep it on loopback or behind a "
                            "proxy that does)")
        _raise_if(problems)
        return self


@dataclass
class MergeArguments:
    """Arguments of `swiftlite merge-lora`."""
    ckpt_dir: Optional[str] = arg(None, "the LoRA checkpoint folder to merge", group="model")
    output_dir: Optional[str] = arg(None, "where to write the merged model (default: "
                                    "<ckpt_dir>-merged)", group="model")
    model: Optional[str] = arg(None, "base model folder, hub id or alias (default: the one the "
                               "run trained, from args.json)", group="model")
    template: Optional[str] = arg(None, "chat template to write into the merged tokenizer "
                                  "(default: the training one)", group="model")
    system: Optional[str] = arg(None, "default system prompt to write (default: the training "
                                "one)", group="model")
    torch_dtype: str = arg("auto", "dtype of the saved weights; auto: the training dtype (the "
                           "merge itself is always fp32)", choices=("auto", "bfloat16", "float16",
                                                                    "float32"), group="model")
    max_shard_size: str = arg("5GB", "largest safetensors file, e.g. 2GB or 500MB",
                              group="model")
    exist_ok: bool = arg(False, "replace an existing output folder", group="model")
    verify: bool = arg(True, "compare merged and adapter logits on a few samples (loads the "
                       "model twice, one after the other)", group="model")
    quant_bits: Optional[int] = arg(None, "not accepted (the merge writes full-precision "
                                    "weights); a field only to say why", group="hidden")

    def validate(self) -> "MergeArguments":
        problems = []
        if self.quant_bits is not None:
            problems.append(f"--quant_bits {self.quant_bits}: merge-lora adds the adapter to the "
                            "full-precision base (read from its safetensors files); merging into "
                            f"{self.quant_bits}-bit weights would round the small LoRA updates "
                            "away (one quantization step is far larger). Merge without it, then "
                            "load the merged model quantized where it is served (swiftlite "
                            f"infer/deploy --model MERGED --quant_bits {self.quant_bits})")
        if not self.ckpt_dir:
            problems.append("--ckpt_dir is required (a checkpoint folder written by swiftlite "
                            "sft, e.g. output/<model>/v0-.../checkpoint-50)")
        elif not os.path.isdir(self.ckpt_dir):
            problems.append(f"--ckpt_dir {self.ckpt_dir}: no such folder")
        problems += _check_choices(self)
        try:
            parse_size(self.max_shard_size)
        except ValueError as e:
            problems.append(f"--max_shard_size: {e}")
        _raise_if(problems)
        return self


# -- estimate ------------------------------------------------------------------------------------
@dataclass
class EstimateArguments:
    """Arguments of `swiftlite estimate`: training memory from the model's config.json alone."""
    model: Optional[str] = arg(None, "model folder, config.json, alias (Qwen2-1.5B-Instruct) or "
                               "hub id; only its config is read", group="model")
    torch_dtype: str = arg("bfloat16", "training dtype (float16: T4/V100)",
                           choices=("bfloat16", "float16", "float32"), group="model")
    gpus: int = arg(1, "GPUs (training processes) per node", group="hardware")
    nodes: int = arg(1, "nodes", group="hardware")
    gpu_memory: str = arg("24GB", "memory of one GPU, e.g. 24GB, 80GB (GB read as GiB)",
                          group="hardware")
    cpu_memory: Optional[str] = arg(None, "CPU memory per node, e.g. 256GB; offload options "
                                    "needing more are not recommended (default: not checked)",
                                    group="hardware")
    train_type: str = arg("lora", "lora or full", choices=("lora", "full"), group="tuner")
    lora_rank: int = arg(8, "LoRA rank r", group="tuner")
    lora_dropout: float = arg(0.05, "dropout on the LoRA input", group="tuner")
    target_modules: list[str] = arg(help="modules to adapt: all-linear, or names such as q_proj "
                                    "v_proj", factory=lambda: ["all-linear"], group="tuner")
    max_length: int = arg(2048, "tokens per sample (the worst case: every sample this long)",
                          group="train")
    batch_size: int = arg(1, "per-device batch size (sft's --per_device_train_batch_size)",
                          group="train")
    chunked_loss: bool = arg(True, "as sft's --chunked_loss: LM head and loss in chunks (not "
                             "possible under ZeRO-3, which uses the model's own loss)",
                             group="train")
    selective_checkpointing: bool = arg(False, "as sft's --selective_checkpointing (LoRA): the "
                                        "output of every frozen matmul kept with each "
                                        "checkpointed layer input", group="train")
    quant_bits: Optional[int] = arg(None, "as sft's --quant_bits (QLoRA): the frozen linear "
                                    "layers in 4 or 8 bits, with their quantization scales",
                                    group="tuner")
    bnb_4bit_use_double_quant: bool = arg(True, "as sft's: 4-bit scales quantized too",
                                          group="tuner")
    json: bool = arg(False, "print JSON instead of the table", group="train")

    def validate(self) -> "EstimateArguments":
        problems = []
        if self.quant_bits not in (None, 4, 8):
            problems.append(f"--quant_bits {self.quant_bits}: 4 or 8")
        if self.quant_bits is not None and self.train_type != "lora":
            problems.append("--quant_bits: LoRA only (a quantized base is not trained itself)")
        if not self.model:
            problems.append("--model is required (an alias such as Qwen2-1.5B-Instruct, a model "
                            "folder or a config.json)")
        problems += _check_choices(self)
        problems += _not_positive(self, ("gpus", "nodes", "lora_rank", "max_length", "batch_size"))
        if not 0 <= self.lora_dropout < 1:
            problems.append(f"--lora_dropout must be in [0, 1), got {self.lora_dropout}")
        _raise_if(problems)
        return self
