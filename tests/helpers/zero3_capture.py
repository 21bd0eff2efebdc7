"""Worker for tests/test_deepspeed.py: `swiftlite.sft(...)` under torchrun, plus a callback that
records what the adapter weights are IN MEMORY at every checkpoint save (gathered from all
ZeRO-3 partitions), so the test can compare them with what was written to disk.

    torchrun --nproc_per_node 2 tests/helpers/zero3_capture.py CAPTURE_DIR sft --flag value ...
"""
import json
import os
import sys

from transformers import TrainerCallback


class CaptureGathered(TrainerCallback):
    def __init__(self, out_dir):
        self.out_dir = out_dir

    def on_save(self, args, state, control, model=None, **kwargs):
        import deepspeed
        from peft import get_peft_model_state_dict
        from safetensors.torch import save_file
        params = [p for p in model.parameters() if p.requires_grad]
        # A collective: every rank enters, each contributes its partition.
        with deepspeed.zero.GatheredParameters(params, modifier_rank=None):
            sd = {k: v.detach().clone().contiguous()
                  for k, v in get_peft_model_state_dict(model).items()}
        if int(os.environ.get("RANK", "0")) == 0:
            os.makedirs(self.out_dir, exist_ok=True)
            save_file(sd, os.path.join(self.out_dir, f"step{state.global_step}.safetensors"))


def main():
    out_dir, argv = sys.argv[1], sys.argv[2:]
    import swiftlite.training.trainer as trainer_module
    build = trainer_module.build_trainer

    def build_and_capture(model, *a, **kw):
        # Before the Trainer exists: was the model loaded already partitioned (zero.Init)?
        params = list(model.parameters())
        if int(os.environ.get("RANK", "0")) == 0:
            os.makedirs(out_dir, exist_ok=True)
            with open(os.path.join(out_dir, "at_load.json"), "w") as f:
                base = [p for p in params if not p.requires_grad]  # LoRA joins at engine init
                json.dump({"base_params": len(base),
                           "base_zero_params": sum(hasattr(p, "ds_id") for p in base),
                           "base_local_numel": sum(p.numel() for p in base),
                           "base_full_numel": sum(getattr(p, "ds_numel", 0) for p in base)}, f)
        trainer = build(model, *a, **kw)
        trainer.add_callback(CaptureGathered(out_dir))
        return trainer

    trainer_module.build_trainer = build_and_capture
    # Through the Python API (not the CLI), so that its run-folder agreement is tested too.
    import swiftlite
    from swiftlite.config.arguments import SftArguments
    from swiftlite.config.argv import parse_argv
    assert argv[0] == "sft"
    swiftlite.sft(parse_argv(SftArguments, argv[1:], "swiftlite sft", ""))
    # The group stays for later runs in this process, and the exit handlers end it before the
    # interpreter's teardown, where a live gloo group can abort the rank.
    import atexit
    import torch.distributed as dist
    after_run = dist.is_initialized()
    atexit._run_exitfuncs()  # what a normal exit runs first
    with open(os.path.join(out_dir, f"at_end_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"after_run": after_run, "after_exit_handlers": dist.is_initialized()}, f)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # the handlers ran; as the CLI's ranks leave


if __name__ == "__main__":
    main()
