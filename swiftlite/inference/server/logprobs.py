"""Log-probabilities in OpenAI's two shapes, from the scheduler's TokenLogprob entries.

  chat         {"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}, ...]}
  completions  {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's text is what its bytes decode to; `bytes` are the token's own bytes, so that a
character split over several tokens can be put back together by the client.
"""
from __future__ import annotations

import json
import re
from functools import lru_cache

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback


def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet reversed: the printable character standing for each byte."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


class TokenText:
    """Token id -> (text, bytes), cached: the same few thousand ids come back again and again."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.byte_level = _is_byte_level(tokenizer)
        self.bytes_of = lru_cache(maxsize=65536)(self._bytes_of)
        self._decoder = _byte_decoder()

    def _bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:  # an id past the tokenizer's vocabulary (the model's is padded)
            return b""
        if token_id in self.added:
            return piece.encode()
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if self.byte_level and all(c in self._decoder for c in piece):
            return bytes(self._decoder[c] for c in piece)
        return piece.replace("\u2581", " ").encode()  # SentencePiece's word start

    def text(self, token_id: int) -> str:
        return self.bytes_of(token_id).decode("utf-8", errors="replace")


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder") or {}
    except (ValueError, AttributeError):
        return False
    kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders") or []]
    return "ByteLevel" in kinds


def chat(entries, tt: TokenText) -> dict:
    """Chat's shape: every generated token with its k likeliest alternatives."""
    def one(token_id, logprob):
        b = tt.bytes_of(token_id)
        return {"token": b.decode("utf-8", errors="replace"), "logprob": logprob,
                "bytes": list(b)}
    return {"content": [{**one(e.token, e.logprob),
                         "top_logprobs": [one(i, v) for i, v in e.top]} for e in entries]}


def legacy(entries, tt: TokenText, offset: int = 0) -> tuple[dict, int]:
    """The completions shape, text offsets counted from `offset`; returns it and the offset
    after the last token. The alternatives include the chosen token, as OpenAI's and vLLM's do
    (one more than k when it is not among them); the first prompt token has none."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        text = tt.text(e.token)
        out["tokens"].append(text)
        out["token_logprobs"].append(e.logprob)
        if e.logprob is None:
            out["top_logprobs"].append(None)
        else:
            top = {}
            for i, v in [*e.top, (e.token, e.logprob)]:  # two ids of one text: the likelier
                top.setdefault(tt.text(i), v)
            out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out, offset
