"""Arguments of `swiftlite export`: a checkpoint, merged folder or model -> GGUF + Modelfile."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from swiftlite.config.fields import arg, check_choices, raise_if, same_as
from swiftlite.config.merge_args import MergeArguments
from swiftlite.config.model_args import ModelArguments, checkpoint_or_model_problems

# llama.cpp's types: the converter writes the first three itself (--outtype), the others are
# llama_model_quantize's, made from an f16 file.
CONVERTER_QUANTS = ("f16", "bf16", "q8_0")
QUANTIZER_QUANTS = ("q6_k", "q5_k_m", "q4_k_m", "q4_0")
QUANTS = CONVERTER_QUANTS + QUANTIZER_QUANTS
LORA_QUANTS = ("f16", "bf16", "q8_0")  # convert_lora_to_gguf.py's --outtype
FORMATS = ("gguf", "gguf-lora")


@dataclass
class ExportArguments:
    """Arguments of `swiftlite export`."""
    ckpt_dir: Optional[str] = arg(None, "a LoRA checkpoint (merged first, into a temporary "
                                  "folder) or a merged model folder to export", group="model")
    model: Optional[str] = same_as(ModelArguments, "model")
    template: Optional[str] = same_as(MergeArguments, "template", help="chat template to put "
                                      "into the GGUF and the Modelfile (default: the training "
                                      "one)")
    system: Optional[str] = same_as(MergeArguments, "system", help="system prompt to put into "
                                    "the GGUF's template and the Modelfile's SYSTEM (default: "
                                    "the training one)")
    enable_thinking: Optional[bool] = same_as(MergeArguments, "enable_thinking", help="Qwen3's "
                                              "thinking mode: the GGUF template's default and "
                                              "the Modelfile's (default: the training one)")
    format: str = arg("gguf", "gguf: the whole model as one GGUF (llama.cpp, LM Studio, "
                      "Ollama); gguf-lora: the adapter alone (llama.cpp's --lora, Ollama's "
                      "ADAPTER), for a GGUF of its base model", choices=FORMATS, group="export")
    quant: Optional[str] = arg(None, "GGUF type: f16, bf16, q8_0 (the converter's own), or "
                               "q6_k, q5_k_m, q4_k_m, q4_0 (llama.cpp's quantizer, from f16); "
                               "gguf-lora: f16, bf16 or q8_0 (default: q4_k_m; gguf-lora: f16)",
                               group="export")
    output_dir: Optional[str] = arg(None, "where the .gguf and the Modelfile go (default: "
                                    "<ckpt_dir or model folder>-gguf)", group="export")
    name: Optional[str] = arg(None, "file and Ollama model name (default: from the folder, "
                              "e.g. run-checkpoint-50)", group="export")
    exist_ok: bool = arg(False, "replace an output folder that an earlier swiftlite export "
                         "wrote (any other folder is never replaced)", group="export")
    llamacpp_venv: Optional[str] = arg(None, "the venv scripts/setup_llamacpp.sh made (also "
                                       "SWIFTLITE_LLAMACPP_VENV; default: .venv-llamacpp here "
                                       "or beside swiftlite's source)", group="export")
    trust_remote_code: bool = same_as(ModelArguments, "trust_remote_code")

    def validate(self) -> "ExportArguments":
        if self.quant is None:
            self.quant = "f16" if self.format == "gguf-lora" else "q4_k_m"
        problems = checkpoint_or_model_problems(self) + check_choices(self)
        if self.quant not in QUANTS:
            problems.append(f"--quant {self.quant}: choose one of {', '.join(QUANTS)}")
        if self.format == "gguf-lora":
            if self.quant in QUANTS and self.quant not in LORA_QUANTS:
                problems.append(f"--quant {self.quant}: a GGUF LoRA adapter is written by "
                                "convert_lora_to_gguf.py, which writes "
                                f"{', '.join(LORA_QUANTS)} (pass --quant f16)")
            if not self.ckpt_dir:
                problems.append("--format gguf-lora exports an adapter: give --ckpt_dir (a "
                                "LoRA checkpoint)")
        if self.name is not None and (not self.name.strip() or "/" in self.name
                                      or self.name.startswith(".")):
            problems.append(f"--name {self.name!r}: a file name (no '/', not hidden)")
        raise_if(problems)
        return self
