"""Secrets among arguments: any *_token, *_key, *_secret or *password* value (--hub_token,
an API key). They are used where given and never written: args.json, checkpoints, the Web-UI's
webui.json and the logs get REDACTED instead (swiftlite.log also masks their values)."""
from __future__ import annotations

REDACTED = "<redacted>"


def is_secret(name: str) -> bool:
    n = name.lower().lstrip("-").replace("-", "_")
    return n.endswith(("_token", "_key", "_secret")) or "password" in n or n in (
        "token", "key", "secret")


def redact(value):
    """A copy of a dict/list with every secret-named, non-empty value replaced."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret(str(k)) and v not in (None, "") else redact(v))
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(redact(v) for v in value)
    return value


def redact_argv(argv: list[str]) -> list[str]:
    """`--hub_token X` and `--hub_token=X` with X replaced."""
    out, hide_next = [], False
    for tok in argv:
        if hide_next and not tok.startswith("--"):
            out.append(REDACTED)
            hide_next = False
            continue
        hide_next = False
        if tok.startswith("--"):
            name, eq, _ = tok.partition("=")
            if is_secret(name):
                if eq:
                    tok = f"{name}={REDACTED}"
                else:
                    hide_next = True
        out.append(tok)
    return out


def secret_values(value) -> list[str]:
    """The secret strings inside a dict (nested), to mask in log lines."""
    found = []
    if isinstance(value, dict):
        for k, v in value.items():
            if is_secret(str(k)) and isinstance(v, str) and v:
                found.append(v)
            else:
                found += secret_values(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            found += secret_values(v)
    return found
