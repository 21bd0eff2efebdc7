"""Arguments of `swiftlite deploy`."""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, not_positive, raise_if
from swiftlite.config.model_args import ModelArguments, PlacementArguments
from swiftlite.config.sizes import parse_size
from swiftlite.config.vllm_args import BackendArguments

DEPLOY_PT_BATCH = 32  # the pt server's batch; measured in README's serving table


@dataclass
class DeployArguments(ModelArguments, PlacementArguments, BackendArguments):
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
    max_request_size: str = arg("4MiB", "pt: largest request body (e.g. 4MiB, 16MB); larger "
                                "ones are answered 413 without being read", group="deploy")

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
        try:
            parse_size(self.max_request_size)
        except ValueError as e:
            problems.append(f"--max_request_size: {e}")
        problems += not_positive(self, ("max_queue_size", "port"))
        if self.max_batch_size is not None:
            problems += not_positive(self, ("max_batch_size",))
        problems += self.quant_problems() + self.backend_problems()
        if self.infer_backend == "vllm" and self.allowed_hosts:
            problems.append("--allowed_hosts is checked by the pt server only; vLLM's server "
                            "does not check Host headers (keep it on loopback or behind a "
                            "proxy that does)")
        raise_if(problems)
        return self
