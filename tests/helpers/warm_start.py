"""A warm interpreter for the suite's `swiftlite` children (run_cli in helpers/cli.py).

A `swiftlite sft` child spends most of its CPU importing torch, transformers, peft and their kin
before it does anything a test looks at, and the suite starts such children by the hundred on
two cores (docs/testing.md has the figures). So each pytest worker keeps a server that has
imported them once, and forks a child per run, as torch's DataLoader forks its workers: after
the imports, before any computation. The child then becomes `python -m swiftlite.cli ARGV` as a
fresh process is once it has imported those libraries: the same environment (tcmalloc preloaded
by swiftlite's own re-execution), working directory and sys.path, standard streams to files,
fresh random seeds, and a normal interpreter exit.

Two servers, because a training run and the other commands import different sets: `sft` and
`rlhf` leave bitsandbytes, DeepSpeed and SciPy out when a run does not use them
(runtime/imports.py), the other commands import whatever their libraries import. The training
server leaves out what a plain run leaves out; a run that needs one of those libraries (QLoRA,
--deepspeed, a bitsandbytes optimizer) says so as it parses its arguments, before it has done
anything, and runs as a fresh process instead.

A fresh process also runs: `--help`, every command that starts a server or reads stdin (their
tests start their own processes), a run while the server is busy (a test's threads), and a run
given variables a library may read as it is imported (a child takes only swiftlite's own, read
when used, but for the allocator's, and pytest's name of the running test). When the worker's
own environment has changed (a test that trained in it set oneDNN's cache sizes), the server
starts again with it. SWIFTLITE_TEST_WARM=0 runs every child fresh.
"""
from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading

TRAINING = ("sft", "rlhf")  # the commands that leave unused libraries out
OTHERS = ("infer", "eval", "merge-lora", "export")
NEEDS_FRESH = 75  # a training child's exit code: this run needs a library the server left out
_servers: dict[str, tuple[subprocess.Popen, dict] | None] = {}  # kind -> (server, its env)
_lock = threading.Lock()
forked = 0  # runs this process has had run by a server


def run(args: list[str], env: dict, cwd, timeout: float, out: str, err: str) -> int | None:
    """Run `swiftlite ARGS` in a forked child, in this process's environment and `env`, its
    stdout and stderr written to the files out and err; its exit code, or None when it must run
    as a fresh process instead. Raises subprocess.TimeoutExpired (the child killed) as
    subprocess.run does."""
    kind = ("training" if args and args[0] in TRAINING else
            "others" if args and args[0] in OTHERS else None)
    if (kind is None or {"-h", "--help"} & set(args) or os.environ.get("SWIFTLITE_TEST_WARM") == "0"
            or not _lock.acquire(blocking=False)):
        return None
    try:
        if kind not in _servers or _servers[kind] and _moved_on(_servers[kind][1]):
            _stop(kind)
            _servers[kind] = _start(kind)
        server, server_env = _servers[kind] or (None, None)
        wanted = {**os.environ, **env}
        changed = {name: wanted.get(name) for name in {*wanted, *server_env}
                   if wanted.get(name) != server_env.get(name)}
        if server is None or not all(map(_read_at_run_time, changed)):
            return None
        _send(server, {"argv": args, "env": changed, "cwd": os.path.abspath(cwd or os.getcwd()),
                       "out": out, "err": err})
        pid = _receive(server, None)["pid"]
        reply = _receive(server, timeout)
        if reply is None:
            os.kill(pid, signal.SIGKILL)
            _receive(server, None)
            raise subprocess.TimeoutExpired(["swiftlite", *args], timeout)
        if reply["rc"] == NEEDS_FRESH and kind == "training":
            return None
        global forked
        forked += 1
        return reply["rc"]
    except (OSError, ValueError):  # the server ended: fresh processes from now on
        _servers[kind] = None
        return None
    finally:
        _lock.release()


def _read_at_run_time(name: str) -> bool:
    """A variable whose value a forked child can still take: pytest's name of the running test,
    and swiftlite's own (read when used), except the allocator's (read before the re-execution
    that the server has done) and this file's."""
    return name == "PYTEST_CURRENT_TEST" or (
        name.startswith("SWIFTLITE_") and name not in ("SWIFTLITE_ALLOCATOR",
                                                        "SWIFTLITE_TEST_WARM"))


def _moved_on(server_env: dict) -> bool:
    """Whether this process's environment has changed since the server started, beyond what a
    child takes (a test that trained in this process set oneDNN's cache sizes, for one): the
    server is then started again, with it."""
    return any(os.environ.get(name) != server_env.get(name) and not _read_at_run_time(name)
               for name in {*os.environ, *server_env})


def _stop(kind: str) -> None:
    server = (_servers.pop(kind, None) or (None,))[0]
    if server is not None:
        server.stdin.close()  # the server ends at the end of its input
        server.wait()


def _start(kind: str) -> tuple[subprocess.Popen, dict] | None:
    env = dict(os.environ)
    proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), kind], bufsize=0,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, env=env)
    return (proc, env) if _receive(proc, 600) == {"ready": True} else None


def _send(proc: subprocess.Popen, message: dict) -> None:
    proc.stdin.write((json.dumps(message) + "\n").encode())


def _receive(proc: subprocess.Popen, timeout: float | None) -> dict | None:
    """The server's next message; None after `timeout` seconds without one. Unbuffered: a
    buffer could hold a message that select() would then wait for."""
    if timeout is not None and not select.select([proc.stdout], [], [], timeout)[0]:
        return None
    line = proc.stdout.readline()
    if not line:
        raise OSError("the warm-start server ended")
    return json.loads(line)


# -- the server (this file run as a script) ------------------------------------------------------

def _reply(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _import(kind: str) -> None:
    """What the kind's commands import before they run, leaving out what they leave out."""
    from swiftlite.runtime import allocator
    allocator.reexec_with_tcmalloc([os.path.abspath(__file__), kind])  # as cli.main does
    from swiftlite.log import hide_library_noise
    hide_library_noise()  # as cli.main does before a command's imports
    if kind == "training":
        from swiftlite.runtime import imports
        imports.command_process = True  # as cli.main sets it in the child too
        plain = type("PlainRun", (), {"training_args": {}, "quant_bits": None, "deepspeed": None})
        before = {name for name, module in sys.modules.items() if module is None}
        imports.leave_out_unused(plain())
        _check_left_out(imports, [name for name, module in sys.modules.items()
                                  if module is None and name not in before])
        import matplotlib.pyplot  # noqa: F401 (the loss plot)
        import swiftlite.pipelines.rlhf  # noqa: F401
        import swiftlite.pipelines.sft  # noqa: F401
        import swiftlite.training.trainer  # noqa: F401
        import transformers.trainer  # noqa: F401
    import torch  # noqa: F401
    import peft  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401
    import transformers.models.qwen2.modeling_qwen2  # noqa: F401


def _check_left_out(imports, left_out: list[str]) -> None:
    """A training child whose run needs a library this server left out exits NEEDS_FRESH when
    it decides what to leave out, before it has done anything."""
    decide = imports.leave_out_unused

    def leave_out_unused(args) -> None:
        for name in left_out:
            del sys.modules[name]
        decide(args)
        if any(name not in sys.modules for name in left_out):
            os._exit(NEEDS_FRESH)
    imports.leave_out_unused = leave_out_unused


def _serve() -> dict:
    """Fork a child per request and report its pid and exit code; returns in the child."""
    requests = os.fdopen(0, "rb", buffering=0)
    _reply({"ready": True})
    while line := requests.readline():
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            return request
        _reply({"pid": pid})
        _, status = os.waitpid(pid, 0)
        _reply({"rc": os.waitstatus_to_exitcode(status)})
    sys.exit(0)


def _become(request: dict) -> None:
    """This child as `python -m swiftlite.cli ARGV` started in the request's folder."""
    import random
    for name, value in request["env"].items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    os.chdir(request["cwd"])
    sys.path[0] = os.getcwd()  # `python -m` puts the working directory first
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY),
                            (1, request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(path, flags, 0o600)
        os.dup2(opened, fd)
        os.close(opened)
    random.seed()  # a fresh process seeds from the OS; a forked one would share the server's
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = ["-m", *request["argv"]]


if __name__ == "__main__":
    _import(sys.argv[1])
    _become(_serve())
    import runpy
    runpy.run_module("swiftlite.cli", run_name="__main__", alter_sys=True)
