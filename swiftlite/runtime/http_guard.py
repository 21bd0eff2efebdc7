"""Host and Origin checks in front of the Web-UI and the deploy server (an ASGI middleware).

DNS rebinding: a web page on attacker.example can make its own name resolve to 127.0.0.1 and
then talk to a Web-UI on this machine as if it were its own site; the browser sends
`Host: attacker.example`. Answering only known Host names stops that. A page on another site
that posts to the Web-UI directly (cross-site request) sends its own `Origin`; requests whose
Origin is not the Web-UI's own address are refused too. Both checks cover HTTP and WebSocket.

`Origin: null` is what a sandboxed iframe or a local file sends: a page of any site can make
it, so it is refused unless every request needs a secret anyway (an API key, a login). Routes
that take JSON take only `application/json` bodies: a page of another site can post
text/plain (or a body with no type) without asking the browser first, but not JSON.
"""
from __future__ import annotations

import socket
from urllib.parse import urlsplit

LOOPBACK_NAMES = ["localhost", "127.0.0.1", "::1"]


def is_loopback(host: str) -> bool:
    """Does listening on `host` keep a server on this machine?"""
    import ipaddress
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def default_hosts(host: str, share: bool) -> list[str]:
    """The names a browser may use for this Web-UI: loopback, --host, and when listening on
    every address, this machine's names and addresses; gradio.live links with --share."""
    hosts = list(LOOPBACK_NAMES)
    if host in ("0.0.0.0", "::", ""):
        hosts += [socket.gethostname(), socket.getfqdn()]
        try:
            import psutil
            hosts += [a.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
                      for a in addrs if a.family in (socket.AF_INET, socket.AF_INET6)]
        except Exception:  # no psutil or no interfaces: names only
            pass
    else:
        hosts.append(host)
    if share:
        hosts.append("*.gradio.live")
    return sorted({h.lower() for h in hosts if h})


def host_name(host_header: str) -> str:
    """'127.0.0.1:7860' -> '127.0.0.1', '[::1]:7860' -> '::1'."""
    h = host_header.strip().lower()
    if h.startswith("["):
        return h[1:h.find("]")] if "]" in h else h
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def allowed(name: str, hosts: list[str]) -> bool:
    return any(p == "*" or p == name or (p.startswith("*.") and name.endswith(p[1:]))
               for p in hosts)


def problem(host_header: str, origin: str, hosts: list[str],
            null_origin_ok: bool = False) -> str | None:
    """Why a request is refused, or None. null_origin_ok: every request needs a key or login."""
    if not allowed(host_name(host_header), hosts):
        return (f"Host {host_header!r} is not a name of this Web-UI (start swiftlite web-ui "
                "with --allowed_hosts NAME to answer it)")
    if origin == "null":
        return None if null_origin_ok else (
            "cross-site request with Origin: null (a sandboxed page or a local file) refused; "
            "it is answered only where an API key or a login is required")
    if origin and urlsplit(origin).netloc.lower() != host_header.lower():
        return f"cross-site request from {origin!r} refused"
    return None


def is_json(content_type: str) -> bool:
    """application/json, with or without parameters (charset=utf-8)."""
    return content_type.split(";", 1)[0].strip().lower() == "application/json"


class HostOriginGuard:
    """hosts: the Host names answered; json_routes: path prefixes whose POSTs must be JSON."""

    def __init__(self, app, hosts: list[str], null_origin_ok: bool = False,
                 json_routes: tuple[str, ...] = ()):
        self.app, self.hosts = app, [h.lower() for h in hosts]
        self.null_origin_ok, self.json_routes = null_origin_ok, json_routes

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket"):
            headers = {k.lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
            status, why = 403, problem(headers.get(b"host", ""),
                                       headers.get(b"origin", "").strip().lower(), self.hosts,
                                       self.null_origin_ok)
            if why and scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008, "reason": why[:120]})
                return
            if not why and scope.get("method") == "POST" and \
                    scope["path"].startswith(self.json_routes) and \
                    not is_json(headers.get(b"content-type", "")):
                status, why = 415, (f"{scope['path']} takes a JSON body: send it with "
                                    "Content-Type: application/json")
            if why:
                await refuse(send, status, why)
                return
        await self.app(scope, receive, send)


async def refuse(send, status: int, why: str) -> None:
    body = (why + "\n").encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"text/plain; charset=utf-8"),
                            (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})
