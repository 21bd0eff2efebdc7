"""Preference rows (`swiftlite rlhf`), detected per file and normalised to one canonical shape:

  a pair      {"messages": the prompt (ends with a user or tool turn), "chosen": an assistant
               message, "rejected": an assistant message, "tools"?}
  unpaired    {"messages": the prompt, "completion": an assistant message, "label": bool}
              (KTO: true = desirable)

Replies are assistant messages as in SFT rows, so they may carry tool calls and reasoning.

  pair-messages   ms-swift: "messages" ending with the chosen reply, plus "rejected_response"
                  (a string) or "rejected_messages" (the whole conversation, rejected last)
  pair-trl        TRL: "prompt" / "chosen" / "rejected", message lists or strings; the prompt
                  may be "question" or "query" instead, or "messages" beside string replies;
                  without any, the prompt is what chosen and rejected share (TRL's implicit
                  prompt, cut back to a whitespace); a "system" beside them comes first
  pair-sharegpt   LLaMA-Factory: "conversations" plus "chosen" / "rejected" turns ({from, value})
  pair-alpaca     LLaMA-Factory: "instruction" / "input" / "chosen" / "rejected" strings
  kto-messages    ms-swift: "messages" ending with the completion, plus "label"
  kto-trl         TRL: "prompt" / "completion" / "label"

KTO also takes paired files: each pair becomes a desirable and an undesirable row. A row that
does not fit raises BadRow with a reason; the loader adds file and line.
"""
from __future__ import annotations

from swiftlite.data.formats import to_conversation
from swiftlite.data.tools import BadRow

PAIR_FORMATS = ("pair-messages", "pair-trl", "pair-sharegpt", "pair-alpaca")
KTO_FORMATS = ("kto-messages", "kto-trl")
KEYS = {"pair-messages": {"messages", "rejected_response", "rejected_messages"},
        "pair-trl": {"chosen", "rejected"}, "pair-sharegpt": {"conversations", "chosen"},
        "pair-alpaca": {"instruction", "chosen"}, "kto-messages": {"messages", "label"},
        "kto-trl": {"completion", "label"}}
EXPECTED = ("'messages' + 'rejected_response' (ms-swift), 'prompt' + 'chosen' + 'rejected' "
            "(TRL), 'conversations' + 'chosen' + 'rejected' (LLaMA-Factory ShareGPT), "
            "'instruction' + 'chosen' + 'rejected' (LLaMA-Factory Alpaca); for KTO also "
            "'messages' + 'label' or 'prompt' + 'completion' + 'label'")


# (format, the keys that make a row one), the first that fits wins
_DETECT = (("pair-messages", {"messages", "rejected_response"}),
           ("pair-messages", {"messages", "rejected_messages"}),
           ("pair-sharegpt", {"conversations", "chosen", "rejected"}),
           ("pair-alpaca", {"instruction", "chosen", "rejected"}),
           ("pair-trl", {"chosen", "rejected"}),
           ("kto-messages", {"messages", "label"}),
           ("kto-trl", {"completion", "label"}))


def detect_preference_format(row) -> str | None:
    if not isinstance(row, dict):
        return None
    return next((fmt for fmt, keys in _DETECT if keys <= row.keys()), None)


def to_preference(row, fmt: str) -> dict:
    """One row in format fmt as a canonical pair or unpaired row; BadRow says why it is not."""
    if not isinstance(row, dict):
        raise BadRow(f"expected a JSON object, got {type(row).__name__}", "not an object")
    if fmt == "pair-messages":
        prompt, chosen, tools = _split_last(_conversation({"messages": row["messages"]}, row,
                                                          "messages"), "messages")
        if row.get("rejected_response") is not None:
            rejected = _reply(row["rejected_response"], "rejected_response")
        elif row.get("rejected_messages") is not None:
            other, rejected, _ = _split_last(_conversation(
                {"messages": row["rejected_messages"]}, row, "messages"), "rejected_messages")
            if other != prompt:
                raise BadRow("'rejected_messages' does not share the prompt of 'messages' (all "
                             "but the last message must be equal)", "prompts differ")
        else:
            raise BadRow("no rejected reply: add 'rejected_response' (a string) or "
                         "'rejected_messages'", "missing rejected")
        return _pair(prompt, chosen, rejected, tools)
    if fmt == "pair-trl":
        return _trl_pair(row)
    if fmt in ("pair-sharegpt", "pair-alpaca"):
        base = "sharegpt" if fmt == "pair-sharegpt" else "alpaca"
        replies = []
        for key in ("chosen", "rejected"):
            if row.get(key) is None:
                raise BadRow(f"'{key}' is missing", f"missing {key}")
            if base == "sharegpt":
                turns = row.get("conversations")
                if not isinstance(turns, list):
                    raise BadRow("'conversations' must be a list of {from, value} objects",
                                 "unknown format")
                full = {**row, "conversations": turns + [row[key]]}
            else:
                full = {**row, "output": row[key]}
            replies.append(_split_last(_conversation(full, row, base), key))
        (prompt, chosen, tools), (_, rejected, _) = replies
        return _pair(prompt, chosen, rejected, tools)
    if fmt == "kto-messages":
        prompt, completion, tools = _split_last(_conversation({"messages": row["messages"]}, row,
                                                              "messages"), "messages")
        return _unpaired(prompt, completion, row.get("label"), tools)
    if fmt == "kto-trl":
        prompt, tools = _prompt(row.get("prompt"), row)
        return _unpaired(prompt, _reply(row.get("completion"), "completion"), row.get("label"),
                         tools)
    raise BadRow(f"unknown format {fmt!r}", "unknown format")


def unpair(rows: list[dict]) -> list[dict]:
    """KTO from paired rows: each pair as a desirable (chosen) and an undesirable (rejected)
    row, as TRL's unpair_preference_dataset does."""
    out = []
    for r in rows:
        if "label" in r:
            out.append(r)
            continue
        base = {k: v for k, v in r.items() if k not in ("chosen", "rejected")}
        out += [{**base, "completion": r["chosen"], "label": True},
                {**base, "completion": r["rejected"], "label": False}]
    return out


def _conversation(fields: dict, row: dict, fmt: str) -> dict:
    """The SFT normalisation of a conversation ending with an assistant reply (roles, tool calls
    and order checked as for SFT rows); the row's tools and system come along."""
    full = {**{k: row[k] for k in ("tools", "system", "history", "input") if k in row}, **fields}
    if fmt == "alpaca":
        full["instruction"] = row.get("instruction")
    return to_conversation(full, fmt)


def _split_last(conv: dict, key: str) -> tuple[list, dict, list | None]:
    """(prompt messages, the last message as the reply, tools)."""
    msgs = conv["messages"]
    if len(msgs) < 2 or msgs[-1]["role"] != "assistant":
        raise BadRow(f"'{key}' must end with an assistant reply after the prompt", "no reply")
    return msgs[:-1], msgs[-1], conv.get("tools")


def _reply(value, key: str) -> dict:
    """An assistant message from a string, a message, or a one-message list."""
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if isinstance(value, str):
        return {"role": "assistant", "content": value}
    if isinstance(value, dict):
        conv = to_conversation({"messages": [{"role": "user", "content": "."}, value]},
                               "messages")
        if conv["messages"][-1]["role"] == "assistant":
            return conv["messages"][-1]
    if value is None:
        raise BadRow(f"'{key}' is missing", f"missing {key.split('_')[0]}")
    raise BadRow(f"'{key}' must be a string or one assistant message", f"bad {key}")


def _prompt(value, row: dict) -> tuple[list, list | None]:
    """TRL's explicit prompt: a string (one user turn) or a message list ending with a user or
    tool turn."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise BadRow("'prompt' must be a string or a list of messages", "bad prompt")
    conv = to_conversation({"messages": value, "tools": row.get("tools"),
                            "system": row.get("system")}, "messages", require_reply=False)
    if conv["messages"][-1]["role"] == "assistant":
        raise BadRow("the prompt ends with an assistant turn: the reply to learn must be in "
                     "'chosen' / 'rejected' / 'completion'", "prompt ends with assistant")
    return conv["messages"], conv.get("tools")


# Where a TRL-style pair may hold its prompt: TRL's own key, then the names other datasets use
# (Intel/orca_dpo_pairs: question), then a conversation beside two string replies.
_PROMPT_KEYS = ("prompt", "question", "query", "messages")


def _trl_pair(row: dict) -> dict:
    chosen, rejected = row.get("chosen"), row.get("rejected")
    for key, v in (("chosen", chosen), ("rejected", rejected)):
        if v is None:
            raise BadRow(f"'{key}' is missing", f"missing {key}")
    key = next((k for k in _PROMPT_KEYS if row.get(k) is not None), None)
    whole = all(isinstance(v, list) and len(v) > 1 for v in (chosen, rejected))
    if key is not None and not whole:
        prompt, tools = _prompt(row[key], row)
        return _pair(prompt, _reply(chosen, "chosen"), _reply(rejected, "rejected"), tools)
    # the implicit prompt: what chosen and rejected share
    if isinstance(chosen, str) and isinstance(rejected, str):
        n = 0
        while n < min(len(chosen), len(rejected)) and chosen[n] == rejected[n]:
            n += 1
        while n > 0 and not chosen[n - 1].isspace():  # never inside a word
            n -= 1
        if not chosen[:n].strip():
            raise BadRow("'chosen' and 'rejected' share no prompt; add 'prompt'", "no prompt")
        prompt, _ = _prompt(chosen[:n].strip(), row)
        return _pair(prompt, _reply(chosen[n:].lstrip(), "chosen"),
                     _reply(rejected[n:].lstrip(), "rejected"), None)
    if not (isinstance(chosen, list) and isinstance(rejected, list)):
        raise BadRow("'chosen' and 'rejected' must both be message lists or both strings",
                     "bad chosen")
    conv_c = to_conversation({"messages": chosen, "tools": row.get("tools"),
                              "system": row.get("system")}, "messages")
    conv_r = to_conversation({"messages": rejected, "tools": row.get("tools"),
                              "system": row.get("system")}, "messages")
    pc, reply_c, tools = _split_last(conv_c, "chosen")
    pr, reply_r, _ = _split_last(conv_r, "rejected")
    if pc != pr:
        raise BadRow("'chosen' and 'rejected' must be the same conversation up to their last "
                     "(assistant) message", "prompts differ")
    if key is not None:  # whole conversations beside a prompt (ultrafeedback_binarized)
        prompt, _ = _prompt(row[key], row)
        if [m["content"] for m in prompt if m["role"] == "user"][-1:] != \
                [m["content"] for m in pc if m["role"] == "user"][-1:]:
            raise BadRow(f"'{key}' is not the last user turn of the conversations in 'chosen' "
                         "and 'rejected'", "prompts differ")
    return _pair(pc, reply_c, reply_r, tools)


def _pair(prompt: list, chosen: dict, rejected: dict, tools) -> dict:
    if chosen.get("role") != "assistant" or rejected.get("role") != "assistant":
        raise BadRow("chosen and rejected must be assistant replies", "bad reply")
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        raise BadRow("the prompt must end with a user (or tool) turn", "prompt ends with assistant")
    out = {"messages": [_no_loss(m) for m in prompt], "chosen": _no_loss(chosen),
           "rejected": _no_loss(rejected)}
    if tools:
        out["tools"] = tools
    return out


def _unpaired(prompt: list, completion: dict, label, tools) -> dict:
    if isinstance(label, str) and label.strip().lower() in ("true", "false"):
        label = label.strip().lower() == "true"  # a CSV cell
    if not isinstance(label, bool):
        raise BadRow(f"'label' must be true or false, got {label!r}", "bad label")
    if not prompt or prompt[-1]["role"] not in ("user", "tool"):
        raise BadRow("the prompt must end with a user (or tool) turn", "prompt ends with assistant")
    out = {"messages": [_no_loss(m) for m in prompt], "completion": _no_loss(completion),
           "label": label}
    if tools:
        out["tools"] = tools
    return out


def _no_loss(m: dict) -> dict:
    """Preference training trains the reply alone: a message's own "loss" key has no say."""
    return {k: v for k, v in m.items() if k != "loss"}
