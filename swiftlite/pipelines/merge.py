"""`swiftlite merge-lora`: a LoRA checkpoint -> a plain transformers model folder.

  checkpoint (adapter + args.json) -> base model files -> merged shards (tensor by tensor, see
  export/streaming_merge) + config + generation config + tokenizer carrying the training chat template
  and system prompt + swiftlite.json -> logit check against the adapter -> rename into place.

Everything is written into a hidden temporary folder next to the output and renamed at the
end, so an interrupted or refused merge never leaves a folder that looks finished; an existing
output folder is replaced (--exist_ok) only if an earlier merge wrote it and it holds nothing
else (runtime.output_folder: the rule `swiftlite export` follows too).
"""
from __future__ import annotations

import json
import os
import time

from swiftlite.config.arguments import MergeArguments
from swiftlite.config.sizes import parse_size
from swiftlite.config.parsing import build
from swiftlite.inference.checkpoints import describe, warn_if_trained_without_end_of_turn
from swiftlite.errors import UsageError
from swiftlite.log import info, warn

# A few fixed conversations for the logit check: short, and covering system, user and reply.
CHECK_CONVERSATIONS = [
    [{"role": "user", "content": "Who are you?"}],
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "The capital of France is Paris."}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "Name a colour of the sky. 你好"}],
]


def merge_lora(ckpt_dir: str | MergeArguments | None = None, output_dir: str | None = None,
               **kwargs) -> str:
    """Python API: `swiftlite.merge_lora("output/.../checkpoint-50")` -> the merged folder."""
    if isinstance(ckpt_dir, MergeArguments):
        args = ckpt_dir
    else:
        values = {k: v for k, v in dict(ckpt_dir=ckpt_dir, output_dir=output_dir, **kwargs).items()
                  if v is not None}
        args = build(MergeArguments, values, where="swiftlite.merge_lora")
    args.validate()
    return run(args)


def run(args: MergeArguments) -> str:
    t0 = time.time()
    ckpt = describe(args.ckpt_dir, args.model, template=args.template, system=args.system,
                    enable_thinking=args.enable_thinking)
    if ckpt.kind != "adapter":
        train_type = ckpt.run_args.get("train_type")
        what = "a full fine-tuning checkpoint" if train_type == "full" else "a complete model"
        info(f"{args.ckpt_dir} is {what} (config.json and weights, no LoRA adapter): there is "
             f"nothing to merge. Use it as it is: swiftlite infer --ckpt_dir {args.ckpt_dir}")
        return args.ckpt_dir
    check_base(args, ckpt)
    warn_if_trained_without_end_of_turn(ckpt.path)
    out = os.path.abspath(args.output_dir or args.ckpt_dir.rstrip("/\\") + "-merged")
    _check_output(out, args, ckpt)
    from swiftlite.runtime.output_folder import refuse_unless_replaceable, writing
    refuse_unless_replaceable(out, COMMAND, args.exist_ok)  # an earlier merge's, or nothing
    with writing(out, COMMAND) as tmp:  # one merge at a time into `out`
        refuse_unless_replaceable(out, COMMAND, args.exist_ok)  # one may have finished it
        return _merge(args, ckpt, out, tmp, t0)


COMMAND = "merge-lora"  # the writer named in the output folder's marker (runtime.output_folder)


def check_base(args, ckpt) -> None:
    """UsageError when the base to merge into is not the one the adapter was trained on (its
    architecture differs from the one recorded), unless --allow_base_mismatch true."""
    from swiftlite.models.base_check import differences, fingerprint, recorded_base
    name, trained = recorded_base(args.ckpt_dir, ckpt.run_args)
    given = args.model or ckpt.base_dir
    if trained is None:
        if args.model:
            warn(f"cannot check that --model {args.model} is the base {args.ckpt_dir} was "
                 f"trained on ({name or 'not recorded'}): the checkpoint records no base config "
                 "and that base is not here")
        return
    diffs = differences(trained, fingerprint(ckpt.base_dir))
    if not diffs:
        return
    what = (f"--model {given} is not the base {args.ckpt_dir} was trained on ({name}): "
            f"{'; '.join(diffs)}")
    if not args.allow_base_mismatch:
        raise UsageError(f"{what}. The adapter would be added to weights it never saw and "
                         "answer differently. Pass the base it was trained on, or "
                         "--allow_base_mismatch true if you mean it.")
    warn(f"{what}; merging anyway (--allow_base_mismatch true).")


def _merge(args: MergeArguments, ckpt, out: str, tmp: str, t0: float) -> str:
    from swiftlite.export import streaming_merge as ms
    from swiftlite.models.safetensors_files import base_index, tensor_meta
    from swiftlite.models.loader import load_tokenizer, save_tokenizer, torch_dtype
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(ckpt.base_dir)
    # The training dtype; for an adapter without args.json, the base model's own dtype.
    base_dtype = str(getattr(config, "dtype", None) or "float32").removeprefix("torch.")
    dtype_name = args.torch_dtype if args.torch_dtype != "auto" else (
        ckpt.torch_dtype or (base_dtype if base_dtype in ("float32", "bfloat16", "float16")
                             else "float32"))
    out_dtype = torch_dtype(dtype_name)
    tokenizer = load_tokenizer(ckpt.tokenizer_dir())
    template = ckpt.template_for(tokenizer)

    # Check everything before writing anything.
    index = base_index(ckpt.base_dir)
    meta = tensor_meta(index)
    adapter_cfg, adapter = ms.read_adapter(args.ckpt_dir)
    try:
        plan = ms.plan_merge(adapter_cfg, adapter, meta, config, _embedding_names(config))
    except ms.Unsupported as e:
        plan = None
        info(f"the adapter uses {e}, which the tensor-by-tensor merge does not implement; "
             "merging with peft's merge_and_unload instead (needs the whole model in memory).")

    info(f"merging {args.ckpt_dir} into {ckpt.base_dir} (fp32), saving {dtype_name} to {out}")
    if plan is not None:
        stats = ms.write_merged(tmp, plan, index, meta, out_dtype,
                                parse_size(args.max_shard_size))
        if plan.untie:
            config.tie_word_embeddings = False
            info(f"the adapter changes {plan.untie[0]} and {plan.untie[1]} differently: the "
                 "merged model stores them as two weights (tie_word_embeddings false)")
    else:
        stats = naive_merge(ckpt.base_dir, args.ckpt_dir, tmp, out_dtype, args.max_shard_size)
        config.tie_word_embeddings = getattr(
            AutoConfig.from_pretrained(tmp), "tie_word_embeddings", False)
    config.dtype = dtype_name
    config.use_cache = True
    config.save_pretrained(tmp)
    _save_generation_config(ckpt.base_dir, config, template, tokenizer, tmp)
    tokenizer.chat_template = template.to_jinja()
    save_tokenizer(tokenizer, tmp)
    with open(os.path.join(tmp, "swiftlite.json"), "w", encoding="utf-8") as f:
        json.dump({"template": template.name, "system": template.saved_system,
                   "enable_thinking": template.enable_thinking,
                   "is_chat": True, "torch_dtype": dtype_name,
                   "merged_from": os.path.abspath(args.ckpt_dir),
                   "base_model": ckpt.base_dir}, f, indent=2, ensure_ascii=False)
    from swiftlite.runtime.output_folder import finish, write_marker
    write_marker(tmp, COMMAND, merged_from=os.path.abspath(args.ckpt_dir))
    finish(tmp, out)  # fsynced, then renamed into place
    info(f"merged {stats['merged']} LoRA weights into {stats['tensors']} tensors "
         f"({stats['bytes'] / 2**20:.0f} MiB, {len(stats['files'])} file(s)) in "
         f"{time.time() - t0:.1f} s: {out}")
    if args.verify:  # after the merge is in place: nothing the check does can lose it
        _verify(args, ckpt, out, template, dtype_name, out_dtype)
    return out


def _verify(args: MergeArguments, ckpt, out: str, template, dtype_name: str, out_dtype) -> None:
    """Print how far the merged model's logits are from the adapter's (and, for scale, what
    16-bit rounding or the quantized base costs); warn when it is more than rounding."""
    from swiftlite.export.verify import max_logit_difference
    from swiftlite.models.loader import quantization_config
    info("checking the merged model against the adapter, one layer at a time (the merged "
         "model is saved: stopping here loses nothing; --verify false skips this)")
    run = ckpt.run_args or {}
    quant = quantization_config(run, "float32")
    diff, other = max_logit_difference(ckpt.base_dir, args.ckpt_dir, out, template,
                                       check_samples(template),
                                       None if dtype_name == "float32" else out_dtype, quant)
    note = "" if other is None or quant is not None else (
        f" ({dtype_name} weights; for scale, the unmerged adapter model in {dtype_name} "
        f"differs from fp32 by {other:.3g})")
    print(f"max |logit difference| adapter vs merged: {diff:.3g}{note}", flush=True)
    if quant is not None:
        print(f"max |logit difference| adapter on the {run['quant_bits']}-bit base it "
              f"was trained on vs merged: {other:.3g}. The merged model is the adapter "
              "on the full-precision base (the first figure); the second is what "
              "quantizing the base costs, not a merge error. Serve the merged model, "
              f"or the adapter with --quant_bits {run['quant_bits']} to answer exactly "
              "as in training.", flush=True)
    if dtype_name == "float32" and diff > 1e-2:
        warn("the merged model's logits differ from the adapter's by more than 1e-2; "
             "please report this with the checkpoint's adapter_config.json.")


def check_samples(template) -> list[list[int]]:
    """CHECK_CONVERSATIONS as token ids."""
    return [template.tokenizer(template.render(c, add_generation_prompt=c[-1]["role"] == "user")
                               [0], add_special_tokens=False)["input_ids"]
            for c in CHECK_CONVERSATIONS]


def _check_output(out: str, args: MergeArguments, ckpt) -> None:
    """Never into the checkpoint or the base model. A folder that exists already is
    runtime.output_folder's question: only an earlier merge's is replaced (--exist_ok)."""
    ck, base = os.path.abspath(args.ckpt_dir), os.path.abspath(ckpt.base_dir)
    if out in (ck, base) or ck.startswith(out + os.sep) or base.startswith(out + os.sep):
        raise UsageError(f"--output_dir {out}: that would overwrite the checkpoint or the base "
                         "model; choose another folder.")


def _embedding_names(config) -> tuple[str, str] | None:
    """(input embedding weight, output embedding weight) names, from a weightless model."""
    import torch
    from transformers import AutoModelForCausalLM
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # an architecture transformers cannot build: no tie handling needed
        return None
    names = {id(m): n for n, m in model.named_modules()}
    emb_in, emb_out = model.get_input_embeddings(), model.get_output_embeddings()
    if emb_in is None or emb_out is None:
        return None
    return names[id(emb_in)] + ".weight", names[id(emb_out)] + ".weight"


def _save_generation_config(base_dir, config, template, tokenizer, out_dir) -> None:
    """The base generation config, stopping on the template's end-of-turn tokens too, so plain
    transformers `generate` stops where swiftlite does."""
    from transformers import GenerationConfig
    try:
        gen = GenerationConfig.from_pretrained(base_dir)
    except OSError:
        gen = GenerationConfig.from_model_config(config)
    eos = gen.eos_token_id
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    for t in template.stop_token_ids():
        if t not in eos:
            eos.append(t)
    gen.eos_token_id = eos[0] if len(eos) == 1 else eos
    if gen.pad_token_id is None:
        gen.pad_token_id = tokenizer.pad_token_id
    gen.save_pretrained(out_dir)


def naive_merge(base_dir: str, ckpt_dir: str, out_dir: str, dtype, max_shard_size="5GB") -> dict:
    """peft's merge: the whole base model in fp32, merge_and_unload, save_pretrained.
    The fallback for adapters the tensor-by-tensor merge does not handle, and the baseline
    of benchmarks/bench_infer.py."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(model, ckpt_dir).merge_and_unload()
    model.to(dtype).save_pretrained(out_dir, max_shard_size=max_shard_size)
    files = sorted(f for f in os.listdir(out_dir) if f.endswith(".safetensors"))
    return {"files": files, "tensors": len(model.state_dict()), "merged": -1,
            "bytes": sum(os.path.getsize(os.path.join(out_dir, f)) for f in files),
            "untied": False}


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(MergeArguments, argv, "swiftlite merge-lora",
                      "Merge a LoRA checkpoint into its base model and save a plain transformers "
                      "model (safetensors) with the training chat template.")
    args.validate()
    print(run(args))
