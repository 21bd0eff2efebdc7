"""Run inside the llama.cpp venv (scripts/setup_llamacpp.sh), never imported by swiftlite:
llama.cpp's own converter with a few metadata values set, and llama.cpp's quantizer.

  python llamacpp_child.py convert CONVERTER.py METADATA.json [converter arguments...]
      runs llama.cpp's convert_hf_to_gguf.py / convert_lora_to_gguf.py as its own __main__;
      the keys of METADATA.json ({"key": [value, "STRING"|"UINT32"|...]}) replace what the
      converter wrote for them (or are added), just before the GGUF header is written. That is
      how the checkpoint's chat template (byte for byte, with its --system prelude) and its
      end-of-turn token (EOS and EOT) get into the file without a second pass over it.
      METADATA.json is read only then, so swiftlite may still be writing it while the
      converter starts (it reads the template meanwhile); the child waits for it there.
  python llamacpp_child.py quantize IN.gguf OUT.gguf TYPE THREADS
      llama_model_quantize from llama-cpp-python's build (TYPE: q4_k_m, q6_k, ...).
"""
import json
import os
import runpy
import sys
import time


def convert(script: str, metadata_path: str, argv: list) -> None:
    here = os.path.dirname(os.path.abspath(script))
    # The converter puts its own gguf-py first on sys.path; patch that very module.
    sys.path.insert(0, os.path.join(here, "gguf-py"))
    sys.path.insert(0, here)
    import gguf
    original = gguf.GGUFWriter.write_header_to_file

    def write_header_to_file(self, *args, **kwargs):
        for key, (value, vtype) in _metadata(metadata_path).items():
            self.kv_data[0][key] = gguf.GGUFValue(value=value, type=gguf.GGUFValueType[vtype])
        return original(self, *args, **kwargs)

    gguf.GGUFWriter.write_header_to_file = write_header_to_file
    sys.argv = [script, *argv]
    runpy.run_path(script, run_name="__main__")


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
        convert(rest[0], rest[1], rest[2:])
    elif command == "quantize":
        quantize(*rest)
    else:
        sys.exit(f"unknown command {command}")
