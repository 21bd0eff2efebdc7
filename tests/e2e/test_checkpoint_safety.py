"""Checkpoints that are poisoned, damaged or cut short by a full disk are never used, and the
run says so in a sentence: each test is named for the failure it prevents (issue #41) and
trains or resumes a real tiny-qwen2 run."""
import os

import pytest

import swiftlite
from swiftlite.errors import RunError
from swiftlite.runtime.output import checkpoints, is_complete, last_checkpoint


def _non_finite(ckpt) -> int:
    import torch
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(ckpt, "adapter_model.safetensors"))
    return sum(int((~torch.isfinite(t)).sum()) for t in tensors.values())


# -- a diverging run ---------------------------------------------------------------------------
@pytest.mark.parametrize("lr,save_steps", [
    (1e30, 3),  # the loss turns nan at step 2, between logging steps (the case)
    (1e39, 1),  # inf in fp32: the first update makes the weights non-finite, its loss was finite
])
def test_a_diverging_run_never_marks_a_non_finite_checkpoint_complete(tmp_path, chat_jsonl,
                                                                      tiny_qwen2, lr, save_steps):
    """Before: checkpoint-3 held 16,384 nan adapter values, was marked complete and was the
    run's last checkpoint (the loss was checked only at logging steps)."""
    out = tmp_path / "out"
    with pytest.raises(RunError, match="stopped") as e:
        swiftlite.sft(model="tiny-qwen2", dataset=[chat_jsonl + "#32"], max_steps=5,
                      per_device_train_batch_size=2, gradient_accumulation_steps=1,
                      learning_rate=lr, warmup_ratio=0.0, lr_scheduler_type="constant",
                      save_steps=save_steps, logging_steps=5,
                      torch_dtype="float32", report_to="none", output_dir=str(out))
    (run,) = out.iterdir()
    for _, ckpt in checkpoints(run):
        assert not is_complete(ckpt) or _non_finite(ckpt) == 0, ckpt
    assert last_checkpoint(str(run)) is None
    assert "no complete checkpoint" in str(e.value), str(e.value)
