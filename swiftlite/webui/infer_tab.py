"""The Infer tab: load a checkpoint (adapter or merged) or a model through
swiftlite.pipelines.infer.InferEngine, chat with streamed answers, unload to free memory.

One engine per Web-UI process (a model is big; browsers share it), guarded by a lock."""
from __future__ import annotations

import dataclasses
import gc
import html
import os
import threading

import gradio as gr

from swiftlite.errors import SwiftliteError

from swiftlite.webui import form
from swiftlite.webui.choices import all_checkpoints, is_adapter, labelled

_lock = threading.Lock()
_engine = {"engine": None, "name": None}


def gen_fields():
    """The generation settings are `swiftlite infer`'s own flags (GenerationArguments)."""
    from swiftlite.config.arguments import GenerationArguments
    return dataclasses.fields(GenerationArguments)


def gen_kwargs(source: str, values: dict, max_new_tokens: int | None = None) -> dict:
    """Widget texts -> checked generation kwargs for InferEngine.stream (UsageError if bad);
    max_new_tokens is the operator's cap per answer."""
    from swiftlite.config.arguments import GenerationArguments, InferArguments
    from swiftlite.config.parsing import build
    from swiftlite.errors import UsageError
    given = {k: v for k, v in values.items() if not (isinstance(v, str) and not v.strip())}
    build(InferArguments, {"model": source or "model", **given}, where="generation settings"
          ).validate()  # the CLI's range checks (temperature >= 0, 0 < top_p <= 1, ...)
    gen = build(GenerationArguments, given, where="generation settings")
    if max_new_tokens is not None and gen.max_new_tokens > max_new_tokens:
        raise UsageError(f"max_new_tokens {gen.max_new_tokens}: at most {max_new_tokens} in this "
                         "Web-UI (the operator's --max_new_tokens)")
    return {f.name: getattr(gen, f.name) for f in dataclasses.fields(gen)}


def load_engine(source: str):
    """InferEngine for a checkpoint folder, a merged folder, a model folder or an alias."""
    from swiftlite.inference.engine import InferEngine
    if os.path.isdir(source) and is_adapter(source):
        return InferEngine.load(ckpt_dir=source)
    if os.path.isdir(source) and os.path.isfile(os.path.join(source, "args.json")):
        return InferEngine.load(ckpt_dir=source)  # a merged checkpoint keeps args.json
    return InferEngine.load(model=source)


def build(manager, policy) -> None:
    root = manager.root
    with gr.Tab("Infer", id="infer", elem_id="tab-infer"):
        with gr.Row():
            source = gr.Dropdown(label="checkpoint or model", choices=[], allow_custom_value=True,
                                 info="a checkpoint under the output root (adapter or merged), a "
                                      "model folder, or an alias such as tiny-qwen2",
                                 elem_id="infer-source", scale=4)
            rescan = gr.Button("Refresh list", scale=1, elem_id="infer-rescan")
        with gr.Row():
            load_btn = gr.Button("Load", variant="primary", elem_id="infer-load")
            unload_btn = gr.Button("Unload", elem_id="infer-unload")
        state = gr.HTML("No model loaded.", elem_id="infer-state")
        system = gr.Textbox(label="system", lines=2, elem_id="infer-system",
                            info="system prompt; empty: the checkpoint's own default")
        tools = gr.Textbox(label="tools", lines=2, elem_id="infer-tools",
                           info="functions the model may call: a JSON list of OpenAI function "
                                "schemas (empty: none); its tool calls are shown under the answer")
        with gr.Accordion("generation settings", open=False):
            gen = []
            fields = list(gen_fields())
            for i in range(0, len(fields), 4):
                with gr.Row():
                    for f in fields[i:i + 4]:
                        common = dict(label=f.name, info=form.info(f), elem_id=f"infer-{f.name}")
                        gen.append(gr.Checkbox(value=bool(form.default(f)), **common)
                                   if form.default(f) is not None and form.kind(f) == "bool"
                                   else gr.Textbox(value=form.widget_value(f, form.default(f)),
                                                   max_lines=1, **common))
        chat = gr.Chatbot(label="chat", height=360, elem_id="infer-chat")
        with gr.Row():
            prompt = gr.Textbox(label="message", scale=5, max_lines=4, elem_id="infer-prompt")
            send = gr.Button("Send", variant="primary", scale=1, elem_id="infer-send")
            clear = gr.Button("Clear", scale=1, elem_id="infer-clear")

    def scan():
        from swiftlite.models.registry import MODELS
        return gr.update(choices=labelled(root, all_checkpoints(root)) + list(MODELS))

    def load(src):
        src = (src or "").strip()
        if not src:
            return "<div class='form-error'>Choose a checkpoint or model first.</div>", gr.skip()
        if src.startswith(("/", ".")) and not os.path.isdir(src):
            return f"<div class='form-error'>{html.escape(src)}: no such folder.</div>", gr.skip()
        refused = policy.infer_problems(src)
        if refused:
            return f"<div class='form-error'>{html.escape('; '.join(refused))}</div>", gr.skip()
        with _lock:
            _free()
            try:
                engine = load_engine(src)
            except ImportError as e:
                return (f"<div class='form-error'>Inference is not available in this build "
                        f"({html.escape(str(e))}).</div>", gr.skip())
            except Exception as e:  # a UsageError or a broken folder: show it, keep serving
                return f"<div class='form-error'>{html.escape(str(e))}</div>", gr.skip()
            _engine.update(engine=engine, name=src)
        return (f"<div class='form-ok'>Loaded <code>{html.escape(src)}</code></div>",
                getattr(engine, "default_system", None) or "")

    def unload():
        with _lock:
            name = _engine["name"]
            _free()
        return "No model loaded." + (f" (unloaded {html.escape(name)})" if name else "")

    def respond(message, history, sys_prompt, tools_text, *gen_values):
        history = list(history or [])
        if not (message or "").strip():
            yield history, message
            return
        engine = _engine["engine"]
        if engine is None:
            history += [{"role": "user", "content": message},
                        {"role": "assistant", "content": "(load a checkpoint or model first)"}]
            yield history, ""
            return
        messages = ([{"role": "system", "content": sys_prompt}] if sys_prompt.strip() else [])
        messages += [{"role": m["role"], "content": _text(m["content"])} for m in history]
        messages.append({"role": "user", "content": message})
        history += [{"role": "user", "content": message}, {"role": "assistant", "content": ""}]
        try:
            gen = gen_kwargs(_engine["name"], {f.name: v for f, v in zip(gen_fields(),
                                                                         gen_values)},
                             policy.max_new_tokens)
            tool_list = parse_tools(tools_text)
        except SwiftliteError as e:
            history[-1]["content"] = f"(not sent: {e})"
            yield history, message
            return
        yield history, ""
        with _lock:
            try:
                for piece in engine.stream(messages, tools=tool_list, **gen):
                    history[-1]["content"] += piece
                    yield history, ""
                calls = engine.parse(history[-1]["content"])["tool_calls"] if tool_list else []
                if calls:
                    history[-1]["content"] += "".join(
                        f"\n(tool call: {c['function']['name']}({c['function']['arguments']}))"
                        for c in calls)
                    yield history, ""
            except SwiftliteError as e:
                history[-1]["content"] += f"\n(error: {e})"
                yield history, ""

    rescan.click(scan, None, source)
    source.focus(scan, None, source)
    load_btn.click(load, source, [state, system])
    unload_btn.click(unload, None, state)
    send.click(respond, [prompt, chat, system, tools, *gen], [chat, prompt])
    prompt.submit(respond, [prompt, chat, system, tools, *gen], [chat, prompt])
    clear.click(lambda: ([], ""), None, [chat, prompt])


def parse_tools(text: str | None) -> list[dict] | None:
    """The tools box: empty, or a JSON list of function schemas (UsageError naming the fault)."""
    from swiftlite.data.tools import BadRow, normalize_tools
    from swiftlite.errors import UsageError
    if not (text or "").strip():
        return None
    try:
        return normalize_tools(text)
    except BadRow as e:
        raise UsageError(f"tools: {e}") from None


def _text(content) -> str:
    """Chatbot message content as plain text (gradio may hand back a list of parts)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(c.get("text", "") if isinstance(c, dict) else str(c) for c in content)
    return str(content)


def _free() -> None:
    engine = _engine["engine"]
    _engine.update(engine=None, name=None)
    if engine is not None:
        engine.unload()
        del engine
        gc.collect()
