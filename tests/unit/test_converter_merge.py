"""Which adapters llama.cpp's converter merges as it converts (export/converter_merge.py), and
with which scale; every other adapter is left to the folder merge (plan() is None). The merged
GGUF itself is checked against the folder merge, tensor for tensor, in tests/e2e/test_export.py.
"""
import json
import math

import numpy as np
import pytest
from safetensors.numpy import save_file

from swiftlite.errors import UsageError
from swiftlite.export.converter_merge import model_view, plan
from swiftlite.models.safetensors_files import read_header

P = "base_model.model."
Q = "model.layers.0.self_attn.q_proj"
V = "model.layers.0.self_attn.v_proj"


@pytest.fixture
def base(tmp_path):
    d = tmp_path / "base"
    d.mkdir()
    save_file({f"{Q}.weight": np.zeros((8, 4), np.float32),
               f"{V}.weight": np.zeros((2, 4), np.float32),
               "model.embed_tokens.weight": np.zeros((10, 4), np.float32)},
              str(d / "model.safetensors"))
    (d / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    return d


def adapter(tmp_path, tensors=None, **cfg):
    d = tmp_path / "ckpt"
    d.mkdir(exist_ok=True)
    r = 2
    tensors = tensors if tensors is not None else {
        f"{P}{Q}.lora_A.weight": np.ones((r, 4), np.float32),
        f"{P}{Q}.lora_B.weight": np.ones((8, r), np.float32),
        f"{P}{V}.lora_A.weight": np.ones((r, 4), np.float32),
        f"{P}{V}.lora_B.weight": np.ones((2, r), np.float32)}
    save_file(tensors, str(d / "adapter_model.safetensors"))
    (d / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": r, "lora_alpha": 8, **cfg}))
    return str(d)


def test_plain_lora_is_merged_by_the_converter_with_peft_scales(tmp_path, base):
    job = plan(adapter(tmp_path), str(base))
    assert job["adapter"].endswith("ckpt/adapter_model.safetensors")
    assert job["deltas"] == {f"{Q}.weight": {"A": f"{P}{Q}.lora_A.weight",
                                             "B": f"{P}{Q}.lora_B.weight", "scale": 4.0},
                             f"{V}.weight": {"A": f"{P}{V}.lora_A.weight",
                                             "B": f"{P}{V}.lora_B.weight", "scale": 4.0}}
    job = plan(adapter(tmp_path, use_rslora=True, alpha_pattern={"v_proj": 2}), str(base))
    assert job["deltas"][f"{Q}.weight"]["scale"] == 8 / math.sqrt(2)
    assert job["deltas"][f"{V}.weight"]["scale"] == 2 / math.sqrt(2)


@pytest.mark.parametrize("case", ["dora", "modules_to_save", "not LoRA", "embedding",
                                  "shape", "missing weight", "only A"])
def test_anything_else_is_left_to_the_folder_merge(tmp_path, base, case):
    cfg, tensors = {}, None
    if case == "dora":
        cfg = {"use_dora": True}
    elif case == "modules_to_save":
        cfg = {"modules_to_save": ["lm_head"]}
    elif case == "not LoRA":
        cfg = {"peft_type": "LOHA"}
    elif case == "embedding":  # peft's names for LoRA on an embedding layer
        tensors = {f"{P}model.embed_tokens.lora_embedding_A": np.ones((2, 10), np.float32),
                   f"{P}model.embed_tokens.lora_embedding_B": np.ones((4, 2), np.float32)}
    elif case == "shape":  # an adapter of another model
        tensors = {f"{P}{Q}.lora_A.weight": np.ones((2, 5), np.float32),
                   f"{P}{Q}.lora_B.weight": np.ones((8, 2), np.float32)}
    elif case == "missing weight":  # lm_head of a tied model: no weight of its own in the files
        tensors = {f"{P}lm_head.lora_A.weight": np.ones((2, 4), np.float32),
                   f"{P}lm_head.lora_B.weight": np.ones((10, 2), np.float32)}
    elif case == "only A":
        tensors = {f"{P}{Q}.lora_A.weight": np.ones((2, 4), np.float32)}
    assert plan(adapter(tmp_path, tensors, **cfg), str(base)) is None


def test_the_view_links_the_base_and_the_checkpoint_tokenizer(tmp_path, base):
    """The converter's folder: the base's weights and config, the checkpoint's tokenizer."""
    ckpt = adapter(tmp_path)
    (tmp_path / "ckpt" / "tokenizer.json").write_text("{}")
    (base / "tokenizer.json").write_text("{}")
    (base / "README.md").write_text("")
    model_view(str(base), ckpt, str(tmp_path / "view"))
    links = {p.name: p.resolve() for p in (tmp_path / "view").iterdir()}
    assert links == {"model.safetensors": base / "model.safetensors",
                     "config.json": base / "config.json",
                     "tokenizer.json": tmp_path / "ckpt" / "tokenizer.json"}


def test_safetensors_headers_are_read_without_torch_and_checked(tmp_path, base):
    assert read_header(str(base / "model.safetensors"))[f"{Q}.weight"] == ("F32", [8, 4])
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\xff" * 7)
    with pytest.raises(UsageError, match="bad.safetensors: not a readable safetensors file"):
        read_header(str(bad))
    data = (base / "model.safetensors").read_bytes()
    bad.write_bytes(data[:-4])  # the header is whole, the tensor data is not
    with pytest.raises(UsageError, match="describes 320 bytes of tensor data, it holds 316"):
        read_header(str(bad), "download it again")
