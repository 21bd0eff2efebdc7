"""The backend group (deploy, eval): transformers in this process, or vLLM's server."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg


@dataclass
class BackendArguments:
    infer_backend: str = arg("pt", "pt: transformers in this process; vllm: vLLM's OpenAI "
                             "server, set up with this checkpoint's template, end-of-turn "
                             "tokens, adapters and tool-call parser", choices=("pt", "vllm"),
                             group="backend")
    vllm_python: Optional[str] = arg(None, "the Python that has vLLM, when it lives in its own "
                                     "venv (also SWIFTLITE_VLLM_PYTHON; default: this one)",
                                     group="vllm")
    tensor_parallel_size: int = arg(1, "GPUs one vLLM model is split over", group="vllm")
    max_model_len: Optional[int] = arg(None, "longest prompt + answer vLLM plans its KV cache "
                                       "for (default: the model's)", group="vllm")
    vllm_args: Optional[str] = arg(None, "more vLLM server flags, as one string, e.g. "
                                   "'--enforce-eager --gpu-memory-utilization 0.8'", group="vllm")

    def backend_problems(self) -> list[str]:
        """The vLLM settings against the backend, and the pt-only settings against vLLM."""
        problems = []
        if self.quant_bits is not None and self.infer_backend == "vllm":
            problems.append("--quant_bits loads the base in bitsandbytes for the pt backend; "
                            "for vLLM, serve the merged model (vLLM has its own quantization, "
                            "e.g. --vllm_args '--quantization bitsandbytes')")
        if self.infer_backend == "pt":
            problems += [f"--{k} is a vLLM setting; add --infer_backend vllm" for k in (
                "vllm_python", "max_model_len", "vllm_args") if getattr(self, k) is not None]
            if self.tensor_parallel_size != 1:
                problems.append("--tensor_parallel_size needs --infer_backend vllm")
        elif self.device_map != "none":
            problems.append("--device_map is the pt backend's; vLLM splits a model over GPUs "
                            "with --tensor_parallel_size")
        if self.tensor_parallel_size <= 0:
            problems.append(f"--tensor_parallel_size must be a positive number, got "
                            f"{self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len <= 0:
            problems.append(f"--max_model_len must be a positive number, got {self.max_model_len}")
        return problems
