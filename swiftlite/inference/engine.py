"""The inference engine: a model (base + LoRA adapter, or a merged/plain model), its tokenizer
and chat template, and generation that stops where the template ends a turn.

Shared by `swiftlite infer` (one-shot, interactive, batch), the Python API and the Web-UI:

    engine = InferEngine.load(ckpt_dir="output/.../checkpoint-50")   # or model="..."
    for delta in engine.stream([{"role": "user", "content": "Hi"}], max_new_tokens=64): ...
    engine.chat(messages) -> str;  engine.generate_batch([messages, ...]) -> [str, ...]

Generation is transformers' `generate`; this module adds the template (prompt rendering, stop
tokens and stop words), left-padded batching, streaming with a cancel switch (Ctrl-C stops one
answer, not the session) and checks of the inputs.
"""
from __future__ import annotations

import threading
from typing import Iterator

from swiftlite.errors import UsageError
from swiftlite.log import info

import dataclasses

from swiftlite.config.arguments import GenerationArguments

# The defaults of `swiftlite infer`'s generation flags, for every caller of the engine.
GEN_DEFAULTS = dataclasses.asdict(GenerationArguments())


QUANT_FIELDS = ("quant_bits", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant")


# The model and placement arguments (infer's and deploy's) that InferEngine.load takes
ENGINE_FIELDS = ("template", "system", "enable_thinking", "torch_dtype", "trust_remote_code",
                 "attn_impl",
                 "quant_bits", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant", "device_map")


def engine_overrides(args) -> dict:
    """InferEngine.load's overrides from infer's or deploy's arguments (those set)."""
    return {k: getattr(args, k) for k in ENGINE_FIELDS if getattr(args, k, None) is not None}


class InferEngine:
    def __init__(self, model, tokenizer, template, device: str, ckpt=None, dtype: str = "float32"):
        self.model = model
        self.tokenizer = tokenizer
        self.template = template  # swiftlite.data.template.Template (.name, .render, ...)
        self.device = device
        self.ckpt = ckpt  # CheckpointInfo: where the model came from
        self.dtype = dtype
        self._eos = _eos_ids(model, template)
        # Stop words that are not one special token need a string check while generating.
        self._stop_strings = [w for w in template.stop_words
                              if len(tokenizer(w, add_special_tokens=False)["input_ids"]) > 1]

    # -- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, ckpt_dir: str | None = None, model: str | None = None, **overrides
             ) -> "InferEngine":
        """Base + adapter for a LoRA checkpoint, else the model folder itself.

        overrides: template, system, torch_dtype, trust_remote_code, attn_impl, device,
        device_map ("auto": spread over the visible GPUs, then CPU memory), and quant_bits
        (+ bnb_4bit_quant_type, bnb_4bit_use_double_quant) to load the base model quantized
        (a QLoRA adapter then answers exactly as on its training base).
        """
        from swiftlite.inference.checkpoints import _UNSET, describe
        from swiftlite.runtime.hardware import (Hardware, cpu_has_bf16, detect, inference_dtype,
                                                 warn_if_emulated_bf16)
        from swiftlite.models.loader import load_model, load_tokenizer
        unknown = set(overrides) - {*ENGINE_FIELDS, "device"}
        if unknown:
            raise UsageError(f"InferEngine.load: unknown argument(s) {', '.join(sorted(unknown))}.")
        trust = bool(overrides.get("trust_remote_code"))
        system = overrides.get("system", _UNSET)
        ckpt = describe(ckpt_dir, model, template=overrides.get("template"), system=system,
                        torch_dtype=overrides.get("torch_dtype"),
                        enable_thinking=overrides.get("enable_thinking"))
        hw = detect()
        device = overrides.get("device") or hw.device
        if device == "cpu" and hw.device != "cpu":  # --device cpu on a GPU host
            hw = Hardware("cpu", "cpu", cpu_bf16=cpu_has_bf16())
        dtype = inference_dtype(overrides.get("torch_dtype"), ckpt.torch_dtype, hw)
        warn_if_emulated_bf16(dtype, hw)
        tokenizer = load_tokenizer(ckpt.tokenizer_dir(), trust)
        template = ckpt.template_for(tokenizer)
        what = f"{ckpt.base_dir} + adapter {ckpt.path}" if ckpt.kind == "adapter" else ckpt.path
        info(f"loading {what} ({dtype}, {device}, template {template.name})")
        from swiftlite.models.loader import quantization_config
        quant = quantization_config(overrides, dtype)
        if quant is not None:
            info(f"the base model in {overrides['quant_bits']} bits (bitsandbytes)")
        spread = overrides.get("device_map") == "auto"
        placed = "auto" if spread else (None if quant is None else {"": device})
        net = load_model(ckpt.model_dir, dtype, trust_remote_code=trust,
                         attn_impl=overrides.get("attn_impl"), quantization=quant,
                         device_map=placed)
        if ckpt.kind == "adapter":
            from peft import PeftModel
            net = PeftModel.from_pretrained(net, ckpt.path)  # each adapter beside its layer
        if placed is None:
            net.to(device)
        if spread:  # prompts go where the embeddings are; accelerate moves them on from there
            device = str(net.get_input_embeddings().weight.device)
            # (transformers records a map only when the model is split; peft passes it on)
            info("--device_map auto: " + _placement(getattr(net, "hf_device_map", None)
                                                     or {"": device}, hw.device))
        net.eval()
        return cls(net, tokenizer, template, device, ckpt, dtype)

    def unload(self) -> None:
        """Free the model's memory (the engine is unusable afterwards)."""
        import gc
        self.model = None
        gc.collect()
        try:
            from swiftlite.runtime.hardware import accelerator
            if (device := accelerator()) is not None:
                device.empty_cache()
        except Exception:
            pass

    @property
    def default_system(self) -> str | None:
        return self.template.default_system

    # -- inputs ----------------------------------------------------------------------------
    def encode(self, messages, tools=None) -> list[int]:
        """Prompt ids for a conversation ending with a user turn or tool results (a str is one
        user turn); tools: OpenAI function schemas the model may call."""
        from swiftlite.data.formats import BadRow, to_conversation
        from swiftlite.data.template import TemplateRejected
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        elif isinstance(messages, dict):  # a conversation {"messages", "tools"}
            messages, tools = messages["messages"], messages.get("tools", tools)
        try:
            conv = to_conversation({"messages": list(messages), "tools": tools}, "messages",
                                   require_reply=False)
        except (BadRow, KeyError, TypeError, AttributeError) as e:
            raise UsageError(f"cannot answer this conversation: {e}.") from None
        msgs = conv["messages"]
        if msgs[-1]["role"] not in ("user", "tool"):
            raise UsageError("cannot answer this conversation: it must end with a user turn "
                             "(or tool results).")
        try:
            return self.template.encode_prompt(msgs, tools=conv.get("tools"))
        except TemplateRejected as e:
            raise UsageError(f"cannot answer this conversation: the {self.template.describe()} "
                             f"rejects it: {e}.") from None

    def parse(self, text: str) -> dict:
        """A generated reply as {"content", "tool_calls", "reasoning_content"}: tool calls read
        in the syntax of the model's template (e.g. Qwen2.5's <tool_call>{...}</tool_call>)."""
        from swiftlite.data.tools import parse_reply
        return parse_reply(text, getattr(self.template, "source", None))

    def reply(self, messages, tools=None, **gen) -> dict:
        """One answer, parsed: {"content", "tool_calls", "reasoning_content"}."""
        return self.parse(self.chat(messages, tools=tools, **gen))

    def generation_config(self, **gen):
        from transformers import GenerationConfig
        unknown = set(gen) - set(GEN_DEFAULTS)
        if unknown:
            raise UsageError(f"unknown generation argument(s) {', '.join(sorted(unknown))}; "
                             f"known: {', '.join(GEN_DEFAULTS)}.")
        g = {**GEN_DEFAULTS, **{k: v for k, v in gen.items() if v is not None}}
        sample = g["do_sample"] if g["do_sample"] is not None else g["temperature"] > 0
        kw = dict(max_new_tokens=int(g["max_new_tokens"]), do_sample=bool(sample),
                  repetition_penalty=float(g["repetition_penalty"]), eos_token_id=self._eos,
                  pad_token_id=self.tokenizer.pad_token_id, use_cache=True)
        if sample:  # greedy ignores these; passing them anyway only triggers warnings
            kw.update(temperature=float(g["temperature"]) or 1.0, top_p=float(g["top_p"]),
                      top_k=int(g["top_k"]))
        if self._stop_strings:
            kw["stop_strings"] = self._stop_strings
        if g["seed"] is not None:
            from transformers import set_seed
            set_seed(int(g["seed"]))
        return GenerationConfig(**kw)

    # -- generation ------------------------------------------------------------------------
    def stream(self, messages, tools=None, **gen) -> Iterator[str]:
        """Text deltas of the answer as they are generated. Closing the iterator (or Ctrl-C
        while reading it) stops generation at the next token."""
        import torch
        from transformers import StoppingCriteriaList, TextIteratorStreamer
        ids = self.encode(messages, tools)
        config = self.generation_config(**gen)
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True,
                                        skip_special_tokens=True)
        cancel = _Cancel()
        failure = []

        def work():
            try:
                with torch.inference_mode():
                    self.model.generate(
                        input_ids=torch.tensor([ids], device=self.device),
                        attention_mask=torch.ones(1, len(ids), dtype=torch.long,
                                                  device=self.device),
                        generation_config=config, streamer=streamer,
                        stopping_criteria=StoppingCriteriaList([cancel]),
                        tokenizer=self.tokenizer if self._stop_strings else None)
            except BaseException as e:  # re-raised in the reading thread
                failure.append(e)
                streamer.end()

        thread = threading.Thread(target=work, daemon=True, name="swiftlite-generate")
        thread.start()
        cut = _StopText(self.template.stop_words)
        try:
            for piece in streamer:
                text, stopped = cut.feed(piece)
                if text:
                    yield text
                if stopped:
                    break
            else:
                rest = cut.flush()
                if rest:
                    yield rest
        finally:
            cancel.set()
            thread.join()
        if failure:
            raise failure[0]

    def chat(self, messages, tools=None, **gen) -> str:
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        if tools is not None and not isinstance(messages, dict):
            messages = {"messages": messages, "tools": tools}
        return self.generate_batch([messages], **gen)[0]

    def generate_batch(self, conversations: list, max_batch_size: int = 8, progress: bool = False,
                       **gen) -> list[str]:
        """Answers for many conversations (message lists, or {"messages", "tools"} dicts),
        generated max_batch_size at a time with left padding (prompts sorted by length so
        batches pad little); same answers as one by one."""
        return [a.text for a in self.answer_batch(conversations, max_batch_size, progress, **gen)]

    def answer_batch(self, conversations: list, max_batch_size: int = 8, progress: bool = False,
                     **gen) -> list["Answer"]:
        """generate_batch's answers with how each ended (evaluation counts the ones that never
        stopped)."""
        import torch
        from tqdm import tqdm
        prompts = [self.encode(c) for c in conversations]
        config = self.generation_config(**gen)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        answers: list[Answer | None] = [None] * len(prompts)
        pad = self.tokenizer.pad_token_id
        bar = tqdm(total=len(prompts), desc="generating", unit="conv", disable=not progress)
        for start in range(0, len(order), max_batch_size):
            idx = order[start:start + max_batch_size]
            width = max(len(prompts[i]) for i in idx)
            ids = torch.tensor([[pad] * (width - len(prompts[i])) + prompts[i] for i in idx],
                               device=self.device)
            mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i])
                                 for i in idx], device=self.device)
            with torch.inference_mode():
                out = self.model.generate(input_ids=ids, attention_mask=mask,
                                          generation_config=config,
                                          tokenizer=self.tokenizer if self._stop_strings else None)
            for row, i in zip(out[:, width:].tolist(), idx):
                answers[i] = self._decode(row)
            bar.update(len(idx))
        bar.close()
        return answers

    def _decode(self, ids: list[int]) -> "Answer":
        stopped = False
        for k, t in enumerate(ids):
            if t in self._eos:
                ids, stopped = ids[:k], True
                break
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        hits = [text.find(w) for w in self.template.stop_words if w and w in text]
        if hits:
            text, stopped = text[:min(hits)], True
        return Answer(text, "stop" if stopped else "length", len(ids))


@dataclasses.dataclass
class Answer:
    text: str
    finish_reason: str  # "stop": the model ended its turn; "length": max_new_tokens ran out
    tokens: int  # generated tokens, the end of turn excluded


def _eos_ids(model, template) -> list[int]:
    """The template's end-of-turn tokens, plus the model's own EOS ids."""
    ids = list(template.stop_token_ids())
    own = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for t in ([own] if isinstance(own, int) else own or []):
        if t not in ids:
            ids.append(t)
    return ids


class _Cancel:
    """A stopping criterion another thread can trigger (Ctrl-C, a closed stream)."""

    def __init__(self):
        self._event = threading.Event()

    def set(self):
        self._event.set()

    def __call__(self, input_ids, scores, **kwargs):
        import torch
        return torch.full((input_ids.shape[0],), self._event.is_set(), dtype=torch.bool,
                          device=input_ids.device)


class _StopText:
    """Cuts streamed text at the first stop word; holds back a tail that may begin one."""

    def __init__(self, stop_words: list[str]):
        self.words = [w for w in stop_words if w]
        self.pending = ""

    def feed(self, piece: str) -> tuple[str, bool]:
        text = self.pending + piece
        hits = [text.find(w) for w in self.words if w in text]
        if hits:
            self.pending = ""
            return text[:min(hits)], True
        keep = 0
        for w in self.words:  # longest suffix of text that is a proper prefix of a stop word
            for n in range(min(len(w) - 1, len(text)), keep, -1):
                if text.endswith(w[:n]):
                    keep = n
                    break
        self.pending = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], False

    def flush(self) -> str:
        rest, self.pending = self.pending, ""
        return rest


def _placement(device_map: dict, accelerator: str) -> str:
    """e.g. "24 modules on cuda:0, 4 on cuda:1, 2 on cpu" (accelerate names an accelerator by
    its index alone)."""
    from collections import Counter
    counts = Counter(f"{accelerator}:{d}" if isinstance(d, int) else str(d)
                     for d in device_map.values())
    return ", ".join(f"{n} module{'s' if n > 1 else ''} on {d}" for d, n in counts.items())
