"""Run inside the llama.cpp venv (scripts/setup_llamacpp.sh), never imported by swiftlite:
llama.cpp's own converter with a few metadata values set, and llama.cpp's quantizer.

  python llamacpp_child.py convert CONVERTER.py METADATA.json MERGE.json|- [converter args...]
      runs llama.cpp's convert_hf_to_gguf.py / convert_lora_to_gguf.py as its own __main__;
      the keys of METADATA.json ({"key": [value, "STRING"|"UINT32"|...]}) replace what the
      converter wrote for them (or are added), just before the GGUF header is written. That is
      how the checkpoint's chat template (byte for byte, with its --system prelude) and its
      end-of-turn token (EOS and EOT) get into the file without a second pass over it.
      METADATA.json is read only then, so swiftlite may still be writing it while the
      converter starts (it reads the template meanwhile); the child waits for it there.
      MERGE.json (export/converter_merge.py) names a LoRA adapter and, per base weight, its
      lora_A and lora_B tensors and scale: the converter then writes W + scale * B @ A,
      computed in fp32 when that tensor is written (the converter's lazy tensors), instead of W.
      Either way fp32 -> f16 casts are done by torch (the same bits as numpy's, faster), and
      at --outtype f16 the 2-D weights of Llama and Qwen models are cast as they load.
  python llamacpp_child.py quantize IN.gguf OUT.gguf TYPE THREADS
      llama_model_quantize from llama-cpp-python's build (TYPE: q4_k_m, q6_k, ...).
"""
import json
import os
import runpy
import sys
import time


def convert(script: str, metadata_path: str, merge_path: str, argv: list) -> None:
    here = os.path.dirname(os.path.abspath(script))
    # The converter puts its own gguf-py first on sys.path; patch that very module.
    sys.path.insert(0, os.path.join(here, "gguf-py"))
    sys.path.insert(0, here)
    import gguf
    _fast_f16(gguf)
    _wrap_tensors(None if merge_path == "-" else merge_path,
                  "--outtype" in argv and argv[argv.index("--outtype") + 1] == "f16")
    original = gguf.GGUFWriter.write_header_to_file

    def write_header_to_file(self, *args, **kwargs):
        for key, (value, vtype) in _metadata(metadata_path).items():
            self.kv_data[0][key] = gguf.GGUFValue(value=value, type=gguf.GGUFValueType[vtype])
        return original(self, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = write_header_to_file
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


def _fast_f16(gguf) -> None:
    """The converter casts fp32 data to f16 with numpy's astype; torch's cast gives the same
    bits (IEEE round to nearest even) several times faster (benchmarks/bench_export.py)."""
    import numpy as np
    import torch
    original = gguf.quants.quantize

    def to_f16(a):
        return torch.from_numpy(np.ascontiguousarray(a)).to(torch.float16).numpy()

    def quantize(data, qtype):
        if qtype != gguf.GGMLQuantizationType.F16 or data.dtype != np.float32:
            return original(data, qtype)
        if isinstance(data, gguf.LazyNumpyTensor):
            meta = gguf.LazyNumpyTensor.meta_with_dtype_and_shape(np.float16, data.shape)
            return gguf.LazyNumpyTensor(meta=meta, args=(data,), func=to_f16)
        return to_f16(data)

    gguf.quants.quantize = quantize


# Architectures whose every 2-D ".weight" the converter writes as F16 at --outtype f16 (it keeps
# 1-D tensors and norms in F32): the families swiftlite trains.
_F16_WEIGHTS = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"}


def _wrap_tensors(merge_path: str | None, f16: bool) -> None:
    """Every model the converter builds gets its table of tensor loaders (model_tensors)
    wrapped once it is made:
      - the adapted weights of MERGE.json become W + scale * B @ A, in fp32;
      - with --outtype f16, for the families above, each 2-D bf16/fp32 weight is cast to f16
        as it loads. The converter would cast it to fp32 first and to f16 when writing: the
        same bits, but an fp32 copy of the tensor (for a 151k-token embedding, twice its f16
        size) and a second pass.
    The converter stays lazy: each tensor is computed when it is written, one at a time."""
    import torch
    from conversion.base import LazyTorchTensor, ModelBase
    deltas, adapter = {}, {}
    if merge_path:
        from safetensors.torch import load_file
        with open(merge_path, encoding="utf-8") as f:
            job = json.load(f)
        deltas, adapter = job["deltas"], load_file(job["adapter"])
    if not deltas and not f16:
        return
    original = ModelBase.__init__

    def wrapped(load, delta, cast):
        def weight():
            w = load()
            to_f16 = cast and w.ndim == 2 and w.dtype in (torch.bfloat16, torch.float32)
            if delta is None and not to_f16:
                return w

            def compute(t):
                if delta is not None:
                    t = torch.addmm(t.float(), delta[0], delta[1], alpha=delta[2])
                return t.to(torch.float16) if to_f16 else t
            if not isinstance(w, LazyTorchTensor):  # the converter's --no-lazy
                return compute(w)
            dtype = torch.float16 if to_f16 else torch.float32
            meta = LazyTorchTensor.meta_with_dtype_and_shape(dtype, w.shape)
            return LazyTorchTensor(meta=meta, args=(w,), func=compute)
        return weight

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        missing = sorted(set(deltas) - set(self.model_tensors))
        if missing:
            sys.exit(f"the converter found no {missing[0]} (and {len(missing) - 1} more adapted "
                     "weights) in the base model; cannot merge the adapter")
        cast = f16 and set(self.hparams.get("architectures") or ["?"]) <= _F16_WEIGHTS
        for name, load in list(self.model_tensors.items()):
            d = deltas.get(name)
            delta = None if d is None else (adapter[d["B"]].float(), adapter[d["A"]].float(),
                                            d["scale"])
            to_f16 = cast and name.endswith(".weight") and "norm" not in name
            if delta is not None or to_f16:
                self.model_tensors[name] = wrapped(load, delta, to_f16)

    ModelBase.__init__ = __init__


def _metadata(path: str) -> dict:
    """METADATA.json once swiftlite has put it in place (it renames it there whole)."""
    parent = os.getppid()
    while not os.path.exists(path):
        if os.getppid() != parent:
            sys.exit("swiftlite export ended before it wrote the metadata; nothing to finish")
        time.sleep(0.02)
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def quantize(src: str, dst: str, kind: str, threads: str) -> None:
    import ctypes

    import llama_cpp
    name = "LLAMA_FTYPE_MOSTLY_" + kind.upper()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, name)
    params.nthread = int(threads)
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize returned {rc} for {name}")


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "convert":
        convert(rest[0], rest[1], rest[2], rest[3:])
    elif command == "quantize":
        quantize(*rest)
    else:
        sys.exit(f"unknown command {command}")
