"""`swiftlite infer`: talk to a checkpoint or a model.

  --query TEXT        one answer printed to stdout (greedy unless --temperature > 0), then exit;
                      with --tools, the parsed answer {content, tool_calls} as JSON
  --val_dataset FILE  batch mode: every conversation answered, JSONL written to --result_path
  (neither)           interactive chat in the terminal, streaming, with multi-turn history

The engine (loading, templates, generation) lives in swiftlite.inference.engine.InferEngine.
"""
from __future__ import annotations

import json
import os
import sys
import time

from swiftlite.config.arguments import InferArguments
from swiftlite.config.parsing import build
from swiftlite.errors import UsageError
from swiftlite.inference.engine import InferEngine  # noqa: F401  (public: swiftlite.pipelines.infer.InferEngine)
from swiftlite.log import info
from swiftlite.runtime.atomic import write_lines

HELP = """commands:
  /clear          forget the conversation so far
  /system TEXT    set the system prompt (starts a new conversation); /system alone shows it
  /multiline      type several lines; finish with a line holding only /end
  /tool TEXT      answer the model's tool call with this result (with --tools)
  /quit           leave (also /exit or Ctrl-D); Ctrl-C stops an answer"""


def read_tools(tools: str | None) -> list[dict] | None:
    """--tools (a JSON file, or JSON text) as a list of function schemas."""
    if tools is None:
        return None
    from swiftlite.data.tools import BadRow, normalize_tools
    text = tools
    if os.path.isfile(text):
        with open(text, encoding="utf-8") as f:
            text = f.read()
    elif not text.lstrip().startswith(("[", "{")):
        raise UsageError(f"--tools {tools}: no such file, and not JSON text.")
    try:
        return normalize_tools(text)
    except BadRow as e:
        raise UsageError(f"--tools: {e}.") from None


def load_engine(args: InferArguments) -> InferEngine:
    from swiftlite.inference.engine import engine_overrides
    return InferEngine.load(args.ckpt_dir, args.model, **engine_overrides(args))


def infer(args: InferArguments | dict | None = None, *, messages=None, engine=None, **kwargs):
    """Python API.

    swiftlite.infer(ckpt_dir=..., query="Who are you?") -> str
    swiftlite.infer(ckpt_dir=..., messages=[{"role": "user", "content": "Hi"}]) -> str
    swiftlite.infer(ckpt_dir=..., messages=[conversation, ...]) -> [str, ...]
    swiftlite.infer(ckpt_dir=..., val_dataset=["data.jsonl"]) -> [{messages, response, ...}]
    (the last also writes the JSONL file; its path is printed). Pass engine= to reuse a loaded
    InferEngine.
    """
    if args is None or isinstance(args, dict):
        args = build(InferArguments, {**(args or {}), **kwargs}, where="swiftlite.infer")
    args.validate()
    engine = engine or load_engine(args)
    gen = args.generation_kwargs()
    if args.val_dataset:
        return batch_infer(engine, args)[1]
    if messages is None and args.query is None:
        raise UsageError("swiftlite.infer: pass query=..., messages=... or val_dataset=[...].")
    tools = read_tools(args.tools)
    if messages is None:
        messages = [{"role": "user", "content": args.query}]
    if messages and isinstance(messages[0], (list, str)):  # several conversations
        return engine.generate_batch(messages, max_batch_size=args.max_batch_size, **gen)
    if tools:
        return engine.reply(messages, tools=tools, **gen)
    return engine.chat(messages, **gen)


# -- batch mode ------------------------------------------------------------------------------
def batch_infer(engine: InferEngine, args: InferArguments) -> tuple[str, list[dict]]:
    """Answer every conversation of --val_dataset; returns (result path, records)."""
    from swiftlite.data import load_conversations
    convs, report = load_conversations(args.val_dataset, require_reply=False,
                                       skip_bad_rows=args.skip_bad_rows)
    tools = read_tools(args.tools)
    prompts, refs = [], []
    for c in convs:  # a conversation ending with a reply: that reply is the reference
        msgs = c["messages"]
        prompt = {"messages": msgs[:-1] if msgs[-1]["role"] == "assistant" else msgs,
                  "tools": c.get("tools") or tools}
        prompts.append(prompt)
        refs.append(msgs[-1] if msgs[-1]["role"] == "assistant" else None)
    info(f"answering {len(prompts)} conversation(s) from {' '.join(args.val_dataset)} "
         f"({report.summary()}), {args.max_batch_size} at a time")
    t0 = time.time()
    answers = engine.generate_batch(prompts, max_batch_size=args.max_batch_size, progress=True,
                                    **args.generation_kwargs())
    records = []
    for p, a, r in zip(prompts, answers, refs):
        rec = {"messages": p["messages"], "response": a}
        if p["tools"]:
            rec["tools"] = p["tools"]
            rec["tool_calls"] = engine.parse(a)["tool_calls"]
        if r is not None:
            rec["reference"] = r["content"]
            if r.get("tool_calls"):
                rec["reference_tool_calls"] = r["tool_calls"]
        records.append(rec)
    path = args.result_path or _default_result_path(args)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    write_lines(path, (json.dumps(rec, ensure_ascii=False) for rec in records))
    info(f"{len(records)} answers in {time.time() - t0:.1f} s written to {path}")
    return path, records


def _default_result_path(args: InferArguments) -> str:
    root = args.ckpt_dir or "output"
    return os.path.join(root, "infer_result", time.strftime("%Y%m%d-%H%M%S") + ".jsonl")


# -- interactive mode ------------------------------------------------------------------------
def chat_loop(engine: InferEngine, gen: dict, *, stream: bool = True, stdin=None,
              stdout=None, tools=None) -> None:
    """Multi-turn chat on a terminal (or any text streams, for tests and pipes)."""
    stdin, stdout = stdin or sys.stdin, stdout or sys.stdout
    system = engine.default_system
    history: list[dict] = []

    def say(text="", end="\n"):
        stdout.write(text + end)
        stdout.flush()

    def read(prompt: str) -> str | None:
        say(prompt, end="")
        line = stdin.readline()
        return None if line == "" else line.rstrip("\n")

    say(f"swiftlite chat: {engine.template.describe()}; system prompt: {system!r}"
        + (f"; tools: {', '.join(t['function']['name'] for t in tools)}" if tools else "")
        + f"\n{HELP}")
    while True:
        try:
            line = read("<<< ")
        except KeyboardInterrupt:
            say("\n(Ctrl-C stops an answer; /quit or Ctrl-D leaves)")
            continue
        if line is None:
            say()
            return
        cmd, _, rest = line.strip().partition(" ")
        if cmd in ("/quit", "/exit"):
            return
        if cmd == "/help":
            say(HELP)
            continue
        if cmd == "/clear":
            history = []
            say("(conversation cleared)")
            continue
        if cmd == "/system":
            if rest.strip():
                system, history = rest.strip(), []
                say("(system prompt set; conversation cleared)")
            else:
                say(f"(system prompt: {system!r})")
            continue
        turn = {"role": "user", "content": line}
        if cmd == "/tool":
            if not history or not history[-1].get("tool_calls") and history[-1]["role"] != "tool":
                say("(/tool answers a tool call of the model; there is none to answer)")
                continue
            turn = {"role": "tool", "content": rest}
        elif cmd == "/multiline":
            lines = []
            while (more := read("... ")) is not None and more.strip() != "/end":
                lines.append(more)
            line = "\n".join(lines)
            turn = {"role": "user", "content": line}
        elif cmd.startswith("/") and cmd[1:].isalpha():
            say(f"(unknown command {cmd}; /help lists them)")
            continue
        if not turn["content"].strip() and turn["role"] == "user":
            continue
        messages = ([{"role": "system", "content": system}] if system is not None else []) + \
            history + [turn]
        answer = _answer(engine, messages, gen, stream, say, tools)
        if answer is not None:
            reply = engine.parse(answer) if tools else {"content": answer, "tool_calls": []}
            assistant = {"role": "assistant", "content": reply["content"]}
            if reply["tool_calls"]:
                assistant["tool_calls"] = reply["tool_calls"]
                for c in reply["tool_calls"]:
                    say(f"(tool call: {c['function']['name']}({c['function']['arguments']}); "
                        "answer with /tool RESULT)")
            history += [turn, assistant]


def _answer(engine, messages, gen, stream, say, tools=None) -> str | None:
    """Print one answer; Ctrl-C stops it and keeps the session (the turn is dropped)."""
    say(">>> ", end="")
    if not stream:
        try:
            answer = engine.chat(messages, tools=tools, **gen)
        except KeyboardInterrupt:
            say("(stopped)")
            return None
        say(answer)
        return answer
    parts = []
    pieces = engine.stream(messages, tools=tools, **gen)
    try:
        for piece in pieces:
            parts.append(piece)
            say(piece, end="")
    except KeyboardInterrupt:
        pieces.close()  # stops generation at the next token
        say(" (stopped)")
        return None
    say()
    return "".join(parts)


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(InferArguments, argv, "swiftlite infer",
                      "Chat with a checkpoint or model (interactive), answer one --query, or "
                      "batch-infer a --val_dataset.")
    args.validate()
    read_tools(args.tools)  # a bad --tools is reported before the model loads
    if args.val_dataset:  # read and check the data before loading the model
        from swiftlite.data import load_conversations
        load_conversations(args.val_dataset, require_reply=False,
                           skip_bad_rows=args.skip_bad_rows)
    engine = load_engine(args)
    from swiftlite.runtime import gc_start
    gc_start.release(freeze=True)  # the engine is kept to the end
    gen = args.generation_kwargs()
    tools = read_tools(args.tools)
    if args.query is not None and tools:
        print(json.dumps(engine.reply(args.query, tools=tools, **gen), ensure_ascii=False),
              flush=True)
    elif args.query is not None:
        print(engine.chat(args.query, **gen), flush=True)
    elif args.val_dataset:
        print(batch_infer(engine, args)[0])
    else:
        chat_loop(engine, gen, stream=args.stream, tools=tools)
