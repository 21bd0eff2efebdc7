"""`swiftlite web-ui`: the Gradio app (Train, Infer, Export tabs).

Built only on swiftlite's public API. Training runs as `swiftlite sft` child processes, so a run
started here is the same as one started from a shell and outlives a closed browser tab.
Listens on 127.0.0.1 unless --host says otherwise; works offline (no analytics, local fonts).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from swiftlite.config.arguments import arg
from swiftlite.errors import UsageError
from swiftlite.webui.runs import AUTH_ENV  # defined with the runs it is kept from

# Gradio's routes that take a JSON body (its own client posts JSON to them; the upload and
# login routes take forms).
GRADIO_JSON_ROUTES = tuple(f"/gradio_api/{r}" for r in ("queue/join", "run/", "api/", "call/"))
CSS = """
.form-error { color: #b91c1c; border: 1px solid #fca5a5; background: #fef2f2;
              padding: 8px 12px; border-radius: 6px; }
.form-ok { color: #166534; border: 1px solid #86efac; background: #f0fdf4;
           padding: 8px 12px; border-radius: 6px; }
.run-state { font-weight: 600; }
"""


@dataclass
class WebUIArguments:
    """Arguments of `swiftlite web-ui`."""
    host: str = arg("127.0.0.1", "address to listen on; 0.0.0.0 exposes the UI to the network",
                    group="web-ui")
    port: int = arg(7860, "port to listen on", group="web-ui")
    share: bool = arg(False, "also publish a temporary public gradio.live link (needs internet)",
                      group="web-ui")
    auth: Optional[str] = arg(None, f"require a login, user:password (or set {AUTH_ENV})",
                              group="web-ui")
    output_root: str = arg("output", "folder for runs, uploads and merged models; the runs "
                           "list shows the runs found here", group="web-ui")
    allowed_paths: list[str] = arg(None, "more folders a browser user may read models, data, "
                                   "templates and checkpoints from (everything else outside "
                                   "the output root is refused)", group="web-ui", factory=list)
    allow_remote_code: bool = arg(False, "let browser users tick trust_remote_code (runs Python "
                                  "code shipped with a model)", group="web-ui")
    allow_hub: bool = arg(False, "let browser users download models from the Hugging Face hub",
                          group="web-ui")
    allow_custom_deepspeed: bool = arg(False, "let browser users give DeepSpeed config files or "
                                       "JSON (a config can make DeepSpeed write anywhere); "
                                       "otherwise only the presets", group="web-ui")
    allowed_hosts: list[str] = arg(None, "Host header values to answer (DNS-rebinding "
                                   "protection), e.g. gpu-box.lan; default: loopback names, "
                                   "--host and this machine's name", group="web-ui",
                                   factory=list)
    max_upload_size: str = arg("1GiB", "largest file a browser may upload", group="web-ui")
    max_new_tokens: int = arg(2048, "longest answer the Infer tab may ask for", group="web-ui")

    def credentials(self) -> tuple[str, str] | None:
        value = self.auth or os.environ.get(AUTH_ENV) or None
        if value is None:
            return None
        user, sep, password = value.partition(":")
        if not sep or not user or not password:
            where = "--auth" if self.auth else AUTH_ENV
            raise UsageError(f"{where}: expected user:password, e.g. --auth admin:s3cret")
        return user, password


    def policy(self):
        from swiftlite.webui.policy import Policy
        missing = [p for p in self.allowed_paths if not os.path.isdir(p)]
        if missing:
            raise UsageError(f"--allowed_paths {' '.join(missing)}: no such folder")
        return Policy(os.path.abspath(self.output_root),
                      [os.path.abspath(p) for p in self.allowed_paths],
                      allow_remote_code=self.allow_remote_code, allow_hub=self.allow_hub,
                      allow_custom_deepspeed=self.allow_custom_deepspeed,
                      max_new_tokens=self.max_new_tokens)

    def check_exposure(self) -> None:
        """Reachable from other machines means anyone there can train and run code: only
        behind a login."""
        from swiftlite.runtime.http_guard import is_loopback
        if self.credentials() is None and (self.share or not is_loopback(self.host)):
            how = "--share publishes a public link" if self.share else \
                f"--host {self.host} listens beyond this machine"
            raise UsageError(f"{how}, so a login is required: add --auth user:password (or set "
                             f"{AUTH_ENV}), or listen on 127.0.0.1 only.")


def create_app(output_root: str = "output", policy=None):
    """The gr.Blocks app; the runs and uploads live under output_root; `policy`
    (webui.policy.Policy) is what browser users may do, by default the strictest."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    from swiftlite.webui import eval_tab, export_tab, infer_tab, train_tab
    from swiftlite.webui.policy import Policy
    from swiftlite.webui.runs import RunManager

    policy = policy or Policy(os.path.abspath(output_root))
    manager = RunManager(output_root)
    # The form checks unknown flags against transformers.TrainingArguments' fields. Read them
    # now: on a first start that imports transformers, whose lazy imports are not thread-safe,
    # and handlers run in worker threads.
    from swiftlite.config.ta_fields import training_arguments_fields
    training_arguments_fields()
    with gr.Blocks(title="swiftlite", analytics_enabled=False) as demo:
        gr.Markdown("## swiftlite: LoRA fine-tuning for Qwen2-class models")
        with gr.Tabs():
            train = train_tab.build(manager, policy)
            infer_tab.build(manager, policy)
            eval_tab.build(manager, policy)
            export_tab.build(manager, policy)
        demo.load(train["refresh"], train["refresh_inputs"], train["refresh_outputs"])
    return demo


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(WebUIArguments, argv, "swiftlite web-ui", "Start the Gradio Web-UI.")
    credentials = args.credentials()
    args.check_exposure()
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: expected 1-65535")
    from swiftlite.config.sizes import parse_size
    try:
        max_upload = parse_size(args.max_upload_size)
    except ValueError as e:
        raise UsageError(f"--max_upload_size: {e}") from None
    policy = args.policy()
    _check_port_free(args.host, args.port)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr
    from starlette.middleware import Middleware

    from swiftlite.runtime.http_guard import HostOriginGuard, default_hosts
    hosts = args.allowed_hosts or default_hosts(args.host, args.share)
    demo = create_app(args.output_root, policy)
    print(f"[swiftlite] web-ui: http://{args.host}:{args.port} (runs in "
          f"{os.path.abspath(args.output_root)})", flush=True)
    demo.queue(default_concurrency_limit=4).launch(
        server_name=args.host, server_port=args.port, share=args.share, auth=credentials,
        ssr_mode=False, quiet=True, show_error=True, theme=gr.themes.Default(), css=CSS,
        max_file_size=max_upload,
        app_kwargs={"middleware": [Middleware(
            HostOriginGuard, hosts=hosts, null_origin_ok=credentials is not None,
            json_routes=GRADIO_JSON_ROUTES)]})


def _check_port_free(host: str, port: int) -> None:
    """Gradio reports a taken port with a traceback, after the app is built; say it first.
    Bound as the server will be (its address family, SO_REUSEADDR); only "in use" is reported,
    anything else is left to gradio."""
    import errno
    import socket
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)[0]
    except OSError:
        return
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            if e.errno != errno.EADDRINUSE:
                return
            raise UsageError(f"--port {port}: {host}:{port} is already in use (another "
                             f"web-ui?). Pass another --port, e.g. --port {port + 1}.") from None
