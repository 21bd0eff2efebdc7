"""GGUF files for llama.cpp, LM Studio and Ollama, written by llama.cpp's own tools.

  a model folder (a merged checkpoint, or any transformers model)
    -> llama.cpp's convert_hf_to_gguf.py, --outtype f16 | bf16 | q8_0 (the converter writes
       those itself), with the checkpoint's chat template and end-of-turn token set in the
       file's metadata (llamacpp_child.py)
    -> for the k-quants and q4_0: llama_model_quantize (llama-cpp-python's build) from the
       f16 file, which is removed afterwards
  a LoRA adapter -> convert_lora_to_gguf.py (--format gguf-lora): llama.cpp's --lora, Ollama's
  ADAPTER, applied to a GGUF of its base model.

llama.cpp changes its tensor names, tokenizer metadata and quant formats; its own converter,
pinned with its runtime (scripts/setup_llamacpp.sh), is the one that stays right. swiftlite
writes no GGUF itself: it chooses the inputs, sets the few metadata values that carry what the
checkpoint knows, and runs llama.cpp's tools in their own venv as child processes.
"""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

from swiftlite.config.export_args import CONVERTER_QUANTS, QUANTIZER_QUANTS
from swiftlite.errors import RunError, UsageError
from swiftlite.log import info
from swiftlite.runtime.atomic import write_json

SETUP = "bash scripts/setup_llamacpp.sh"
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "llamacpp_child.py")


@dataclass
class Llamacpp:
    """The venv that scripts/setup_llamacpp.sh makes: its Python and llama.cpp's converters."""
    venv: str

    @property
    def python(self) -> str:
        return os.path.join(self.venv, "bin", "python")

    @property
    def share(self) -> str:
        return os.path.join(self.venv, "share", "llama.cpp")

    def has_quantizer(self) -> bool:
        """llama-cpp-python and the llama.cpp library it loads are installed. Looked up as
        files: importing llama_cpp in a child process to check would delay every export."""
        packages = glob.glob(os.path.join(self.venv, "lib", "python3*", "site-packages",
                                          "llama_cpp"))
        return any(os.path.exists(os.path.join(p, "__init__.py"))
                   and glob.glob(os.path.join(p, "lib", "libllama.*")) for p in packages)


def find_llamacpp(explicit: str | None = None, quant: str = "f16") -> Llamacpp:
    """The llama.cpp venv: --llamacpp_venv, $SWIFTLITE_LLAMACPP_VENV, ./.venv-llamacpp, or the
    one beside swiftlite's source (an editable install). UsageError saying how to get one."""
    explicit = explicit or os.environ.get("SWIFTLITE_LLAMACPP_VENV")
    source_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    candidates = [explicit] if explicit else [os.path.abspath(".venv-llamacpp"),
                                              os.path.join(source_root, ".venv-llamacpp")]
    for venv in candidates:
        found = Llamacpp(venv)
        if os.path.exists(found.python) and os.path.exists(
                os.path.join(found.share, "convert_hf_to_gguf.py")):
            break
    else:
        where = (f"--llamacpp_venv {explicit} is not such a venv (no bin/python or no "
                 "share/llama.cpp/convert_hf_to_gguf.py in it)" if explicit else
                 "llama.cpp is not installed (no .venv-llamacpp here or beside swiftlite)")
        raise UsageError(f"{where}. swiftlite export runs llama.cpp's own converter and "
                         f"quantizer in a venv of their own: run `{SETUP}` in swiftlite's "
                         "source folder (a few minutes: it builds llama.cpp), then pass "
                         "--llamacpp_venv /path/to/.venv-llamacpp or run from that folder.")
    if quant in QUANTIZER_QUANTS and not found.has_quantizer():
        raise UsageError(f"--quant {quant} needs llama.cpp's quantizer (llama-cpp-python, built "
                         f"by `{SETUP}`), which does not import in {found.venv}. Run the "
                         f"script again, or use --quant {' / '.join(CONVERTER_QUANTS)} (the "
                         "converter alone).")
    return found


def supported_architecture(llama: Llamacpp, model_dir: str) -> str:
    """The model's architecture, if llama.cpp's converter knows it; UsageError otherwise."""
    with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as f:
        archs = json.load(f).get("architectures") or []
    registry = ""
    for name in ("conversion/__init__.py", "convert_hf_to_gguf.py"):
        path = os.path.join(llama.share, name)
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                registry += f.read()
    known = [a for a in archs if f'"{a}"' in registry]
    if not known:
        raise UsageError(f"{model_dir}: architecture {', '.join(archs) or '(none in config.json)'}"
                         " is not one that llama.cpp's converter (in "
                         f"{llama.share}) can convert to GGUF. Export a transformers folder "
                         "instead (swiftlite merge-lora) and serve it with swiftlite deploy or "
                         "vLLM.")
    return known[0]


def template_metadata(template) -> dict:
    """GGUF metadata that makes llama.cpp answer as `swiftlite infer` does: the training chat
    template (with its --system prelude) and the end-of-turn token as EOS and EOT, so
    llama.cpp, LM Studio and Ollama stop where swiftlite stops."""
    meta = {"tokenizer.chat_template": [template.to_jinja(), "STRING"]}
    stops = template.stop_token_ids()
    if stops:
        meta["tokenizer.ggml.eos_token_id"] = [stops[0], "UINT32"]
        meta["tokenizer.ggml.eot_token_id"] = [stops[0], "UINT32"]
    return meta


# How a child's OSError says that the output could not grow (ENOSPC, EDQUOT, EFBIG).
_DISK_FULL = {"No space left on device": "the disk is full",
              "Disk quota exceeded": "the disk quota of this user is used up",
              "File too large": "a file would grow past the file size limit (ulimit -f)"}


def _run(cmd: list[str], what: str, meanwhile=None) -> None:
    """A llama.cpp tool as a child process; its log is shown only when it fails. `meanwhile`
    runs here while the child starts (if it raises, the child is killed)."""
    env = {**os.environ, "PYTHONNOUSERSITE": "1"}
    env.pop("PYTHONPATH", None)  # swiftlite's venv is not the converter's
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    try:
        if meanwhile is not None:
            meanwhile()
        out = proc.communicate()[0]
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = "\n".join(out.strip().splitlines()[-25:])
        for words, meaning in _DISK_FULL.items():
            if words in out:
                raise RunError(f"{what}: {meaning} ({tail.splitlines()[-1].strip()}). Free "
                               "some space or choose another --output_dir; nothing was "
                               "written under the final name.")
        raise RunError(f"{what} failed (exit code {proc.returncode}):\n{tail}")


def metadata_path(workdir: str) -> str:
    """Where convert() has the converter read the metadata to set (write_metadata)."""
    return os.path.join(workdir, "metadata.json")


def write_metadata(metadata: dict, path: str) -> None:
    """Whole or not at all: the converter waits for the file to exist, then reads it."""
    write_json(path, metadata)


def convert(llama: Llamacpp, model_dir: str, out_file: str, outtype: str, workdir: str,
            metadata_ready, lora_merge: dict | None = None) -> None:
    """convert_hf_to_gguf.py MODEL --outtype OUTTYPE --outfile OUT, with the metadata at
    metadata_path(workdir) set. metadata_ready() returns once that file is written (by the
    worker of pipelines/export_template.py, which reads the checkpoint's template while the
    converter imports its libraries; the converter needs it only when it writes the header).
    lora_merge: an adapter to add to the weights as they are converted (converter_merge)."""
    meta_path = metadata_path(workdir)
    merge_path = "-"
    if lora_merge:
        merge_path = os.path.join(workdir, "lora_merge.json")
        write_metadata(lora_merge, merge_path)
    t0 = time.time()
    what = " with the adapter merged as it goes" if lora_merge else ""
    info(f"converting {model_dir} to GGUF ({outtype}) with llama.cpp's convert_hf_to_gguf.py"
         + what)
    _run([llama.python, _CHILD, "convert", os.path.join(llama.share, "convert_hf_to_gguf.py"),
          meta_path, merge_path, model_dir, "--outtype", outtype, "--outfile", out_file],
         "llama.cpp's convert_hf_to_gguf.py", metadata_ready)
    info(f"converted in {time.time() - t0:.1f} s: {_size(out_file)}")


def quantize(llama: Llamacpp, src: str, dst: str, quant: str) -> None:
    """llama_model_quantize SRC -> DST (a k-quant or q4_0)."""
    t0 = time.time()
    info(f"quantizing to {quant} with llama.cpp's llama_model_quantize")
    _run([llama.python, _CHILD, "quantize", src, dst, quant, str(os.cpu_count() or 1)],
         "llama.cpp's llama_model_quantize")
    info(f"quantized in {time.time() - t0:.1f} s: {_size(dst)}")


def convert_lora(llama: Llamacpp, adapter_dir: str, base_dir: str, out_file: str, outtype: str,
                 metadata: dict, workdir: str) -> None:
    """convert_lora_to_gguf.py ADAPTER --base BASE --outtype OUTTYPE --outfile OUT."""
    meta_path = metadata_path(workdir)
    write_metadata(metadata, meta_path)
    info(f"converting the adapter {adapter_dir} to a GGUF LoRA ({outtype}) with llama.cpp's "
         "convert_lora_to_gguf.py")
    _run([llama.python, _CHILD, "convert", os.path.join(llama.share, "convert_lora_to_gguf.py"),
          meta_path, "-", adapter_dir, "--base", base_dir, "--outtype", outtype,
          "--outfile", out_file], "llama.cpp's convert_lora_to_gguf.py")
    info(f"converted: {_size(out_file)}")


def write_gguf(llama: Llamacpp, model_dir: str, quant: str, out_file: str, workdir: str,
               metadata_ready, lora_merge: dict | None = None) -> None:
    """The model folder (with lora_merge's adapter added, if given) as one GGUF of type `quant`
    at out_file (a temporary folder's file); metadata_ready as for convert()."""
    if quant in CONVERTER_QUANTS:
        convert(llama, model_dir, out_file, quant, workdir, metadata_ready, lora_merge)
        return
    f16 = os.path.join(workdir, "intermediate-f16.gguf")
    convert(llama, model_dir, f16, "f16", workdir, metadata_ready, lora_merge)
    try:
        quantize(llama, f16, out_file, quant)
    finally:
        if os.path.exists(f16):
            os.remove(f16)


def file_name(name: str, quant: str, lora: bool = False) -> str:
    return f"{name}{'-lora' if lora else ''}-{quant}.gguf"


def model_name(path: str) -> str:
    """A name for files and Ollama from a folder: `run-x/checkpoint-50` -> run-x-checkpoint-50."""
    parts = os.path.normpath(os.path.abspath(path)).split(os.sep)
    name = parts[-1]
    if name.startswith("checkpoint-") and len(parts) > 1:
        name = f"{parts[-2]}-{name}"
    safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-.")
    return safe.lower() or "model"


def _size(path: str) -> str:
    return f"{os.path.getsize(path) / 2**20:.1f} MiB" if os.path.exists(path) else "?"


def _has_links(folder: str) -> bool:
    """Whether a model folder's files are symbolic links (Hugging Face's cache: snapshots link
    to blobs), which `ollama create` refuses in a FROM folder."""
    try:
        return any(os.path.islink(os.path.join(folder, f)) for f in os.listdir(folder))
    except OSError:
        return False


def how_to_run(out_dir: str, gguf_file: str, name: str, lora: bool, base_hint: str = "") -> str:
    """What the user runs next, printed at the end."""
    modelfile = os.path.join(out_dir, "Modelfile")
    if lora:
        ollama = f"  Ollama:     ollama create {name} -f {modelfile}\n"
        if _has_links(base_hint):
            ollama += (f"              (its FROM, {base_hint}, is a folder of links, as in Hugging "
                       "Face's cache, which Ollama refuses as an insecure path: make the base "
                       f"GGUF with swiftlite export --model {base_hint} --quant f16 and put that "
                       "file in FROM)\n")
        return (f"GGUF LoRA adapter: {gguf_file}\n"
                f"  llama.cpp:  llama-cli -m BASE.gguf --lora {gguf_file}   (BASE.gguf: the base "
                f"model as GGUF, e.g. swiftlite export --model {base_hint} --format gguf)\n"
                + ollama)
    return (f"GGUF: {gguf_file}\n"
            f"  Ollama:     ollama create {name} -f {modelfile} && ollama run {name}\n"
            f"  llama.cpp:  llama-cli -m {gguf_file} -cnv   (or llama-server -m {gguf_file} "
            "--jinja)\n"
            f"  LM Studio:  lms import {gguf_file}\n"
            f"  Python:     {os.path.basename(sys.executable)} -c \"from llama_cpp import Llama; "
            f"print(Llama('{gguf_file}').create_chat_completion([{{'role': 'user', 'content': "
            "'Hello'}])['choices'][0]['message']['content'])\"\n")
