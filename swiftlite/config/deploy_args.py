"""Arguments of `swiftlite deploy`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, not_positive, raise_if
from swiftlite.config.model_args import ModelArguments, PlacementArguments

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
        problems += check_choices(self)
        problems += not_positive(self, ("max_queue_size", "port", "tensor_parallel_size"))
        problems += not_positive(self, [k for k in ("max_model_len", "max_batch_size")
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
        raise_if(problems)
        return self
