"""`swiftlite export`: a checkpoint or model -> a GGUF file and an Ollama Modelfile.

  llama.cpp's venv found (scripts/setup_llamacpp.sh) -> checkpoint described -> the
  architecture checked against llama.cpp's converter -> the output folder checked (only an
  earlier export's may be replaced, with --exist_ok) -> into a hidden temporary folder beside
  it: an adapter merged by the converter as it converts (export/converter_merge.py), or first
  into a folder (the streaming merge, f16) -> llama.cpp's converter, while the training template
  and end-of-turn token are read here (+ quantizer) -> <name>-<quant>.gguf + Modelfile -> renamed
  into place.

Nothing is written under the final name until everything worked; the source is never touched.
"""
from __future__ import annotations

import os
import shutil
import time

from swiftlite.config.export_args import ExportArguments
from swiftlite.config.parsing import build
from swiftlite.errors import UsageError
from swiftlite.log import info

COMMAND = "export"


def export(ckpt_dir: str | ExportArguments | None = None, **kwargs) -> str:
    """Python API: `swiftlite.export(ckpt_dir="output/.../checkpoint-50", quant="q4_k_m")` ->
    the path of the GGUF file (the Modelfile is beside it)."""
    if isinstance(ckpt_dir, ExportArguments):
        args = ckpt_dir
    else:
        values = {k: v for k, v in dict(ckpt_dir=ckpt_dir, **kwargs).items() if v is not None}
        args = build(ExportArguments, values, where="swiftlite.export")
    args.validate()
    return run(args)


def run(args: ExportArguments) -> str:
    from swiftlite.export import gguf
    from swiftlite.pipelines import export_template
    from swiftlite.inference.checkpoints import describe
    from swiftlite.runtime.output_folder import (finish, refuse_unless_replaceable,
                                                 write_marker, writing)
    t0 = time.time()
    lora = args.format == "gguf-lora"
    llama = gguf.find_llamacpp(args.llamacpp_venv, "f16" if lora else args.quant)
    ckpt = describe(args.ckpt_dir, args.model, template=args.template, system=args.system,
                    enable_thinking=args.enable_thinking)
    if lora and ckpt.kind != "adapter":
        raise UsageError(f"--format gguf-lora: {ckpt.path} is not a LoRA checkpoint (no "
                         "adapter_config.json); export it whole with --format gguf.")
    gguf.supported_architecture(llama, ckpt.model_dir)
    out = _output_dir(args, ckpt)
    refuse_unless_replaceable(out, COMMAND, args.exist_ok)
    name = args.name or gguf.model_name(args.ckpt_dir or args.model)
    file_name = gguf.file_name(name, args.quant, lora)
    with writing(out, COMMAND) as tmp:
        refuse_unless_replaceable(out, COMMAND, args.exist_ok)  # again, holding the lock
        work = os.path.join(tmp, ".work")
        os.makedirs(work)
        target = os.path.join(tmp, file_name)
        model_dir, lora_merge = ckpt.path, None
        if lora:
            model_dir, source, adapter = ckpt.base_dir, ckpt.base_dir, f"./{file_name}"
        else:
            if ckpt.kind == "adapter":
                model_dir, lora_merge = _merged(args, ckpt, os.path.join(work, name))
            source, adapter = f"./{file_name}", None
        # The GGUF metadata and the Modelfile come from the chat template, read by a process of
        # its own while the converter starts (export_template.py: the memory it takes is freed
        # before the converter's peak).
        worker = export_template.start(
            ckpt, args.trust_remote_code, None if lora else gguf.metadata_path(work),
            dict(path=os.path.join(tmp, "Modelfile"), source=source, model_dir=model_dir,
                 adapter=adapter, note=f" from {os.path.abspath(ckpt.path)}"), work)
        family = []
        try:
            if lora:
                gguf.convert_lora(llama, ckpt.path, ckpt.base_dir, target, args.quant, {}, work)
            else:
                gguf.write_gguf(llama, model_dir, args.quant, target, work,
                                lambda: family.append(export_template.finish(worker)),
                                lora_merge)
            if not family:
                family.append(export_template.finish(worker))
        finally:
            export_template.stop(worker)
        shutil.rmtree(work)
        write_marker(tmp, COMMAND, source=os.path.abspath(ckpt.path), format=args.format,
                     quant=args.quant, gguf=file_name)
        finish(tmp, out)
    info(f"Modelfile TEMPLATE: {family[0]}")
    info(f"exported in {time.time() - t0:.1f} s: {out}")
    path = os.path.join(out, file_name)
    print(gguf.how_to_run(out, path, name, lora, ckpt.base_dir or ""), end="", flush=True)
    return path


def _output_dir(args: ExportArguments, ckpt) -> str:
    if args.output_dir:
        out = os.path.abspath(args.output_dir)
    elif args.ckpt_dir or os.path.isdir(args.model or ""):
        out = os.path.abspath((args.ckpt_dir or args.model).rstrip("/\\")) + "-gguf"
    else:  # a hub id or alias: the model lives in a cache, the export goes here
        from swiftlite.export.gguf import model_name
        out = os.path.abspath(model_name(args.model) + "-gguf")
    for src in {os.path.abspath(ckpt.path), os.path.abspath(ckpt.model_dir)}:
        if out == src or src.startswith(out + os.sep) or out.startswith(src + os.sep):
            raise UsageError(f"--output_dir {out}: that is inside (or contains) {src}, the "
                             "checkpoint or its model; choose a folder beside them.")
    return out


def _merged(args: ExportArguments, ckpt, folder: str) -> tuple[str, dict | None]:
    """(the folder for llama.cpp's converter, the adapter merge it does as it converts). A
    LoRA on linear layers is merged by the converter (export/converter_merge.py: the base is
    read once); any other adapter by swiftlite's streaming merge into a 16-bit folder inside
    the export's temporary folder (memory: one tensor at a time). The folder's name is the
    GGUF's general.name."""
    from swiftlite.config.arguments import MergeArguments
    from swiftlite.export.converter_merge import model_view, plan
    from swiftlite.inference.checkpoints import warn_if_trained_without_end_of_turn
    from swiftlite.pipelines import merge
    dtype = "bfloat16" if args.quant == "bf16" else "float16"
    margs = MergeArguments(ckpt_dir=ckpt.path, output_dir=folder,
                           model=args.model, template=args.template, system=args.system,
                           enable_thinking=args.enable_thinking, torch_dtype=dtype, verify=False)
    lora_merge = plan(ckpt.path, ckpt.base_dir)
    if lora_merge is not None:
        merge.check_base(margs, ckpt)  # what merge-lora checks before it merges
        warn_if_trained_without_end_of_turn(ckpt.path)
        model_view(ckpt.base_dir, ckpt.tokenizer_dir(), folder)
        return folder, lora_merge
    info(f"merging the adapter into its base first ({dtype}, a temporary folder)")
    return merge.run(margs), None


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(ExportArguments, argv, "swiftlite export",
                      "Export a checkpoint or model to GGUF (llama.cpp, LM Studio, Ollama) with "
                      "llama.cpp's own converter and quantizer, plus an Ollama Modelfile.")
    args.validate()
    run(args)
