"""A `swiftlite deploy` in a child process, and the requests the tests send it."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(*flags, env=None, wait_s=120):
    """`swiftlite deploy ... --port P` in a child process, once /health answers:
    (process, port, log file)."""
    port = free_port()
    log = open(os.path.join(os.environ.get("TMPDIR", "/tmp"), f"deploy-{port}.log"), "w+")
    proc = subprocess.Popen([sys.executable, "-m", "swiftlite.cli", "deploy", "--port", str(port),
                             *map(str, flags)], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    deadline = time.time() + wait_s
    while time.time() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1)
            return proc, port, log
        except OSError:
            if proc.poll() is not None:
                break
            time.sleep(0.5)
    log.seek(0)
    proc.kill()
    raise AssertionError("the server did not start:\n" + log.read()[-4000:])


def post_json(url: str, body=None, *, key=None, raw: bytes | None = None, timeout=120):
    """POST a JSON body (or raw bytes) to a server route: (status, the parsed JSON answer),
    error answers included."""
    import urllib.error
    req = urllib.request.Request(url, data=raw if raw is not None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def read_stream_in_background(open_stream):
    """Reads the streamed chat completion open_stream() returns in a thread, noting when each
    chunk arrived: (thread, text pieces, arrival times); waits until 4 chunks have come."""
    import threading
    pieces, arrivals, started = [], [], threading.Event()

    def read():
        for chunk in open_stream():
            pieces.append(chunk.choices[0].delta.content or "" if chunk.choices else "")
            arrivals.append(time.monotonic())
            if len(pieces) == 4:
                started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert started.wait(60), "the stream never sent 4 chunks"
    return reader, pieces, arrivals


def stop_server(proc) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
