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

    def credentials(self) -> tuple[str, str] | None:
        value = self.auth or os.environ.get(AUTH_ENV) or None
        if value is None:
            return None
        user, sep, password = value.partition(":")
        if not sep or not user or not password:
            where = "--auth" if self.auth else AUTH_ENV
            raise UsageError(f"{where}: expected user:password, e.g. --auth admin:s3cret")
        return user, password


def create_app(output_root: str = "output"):
    """The gr.Blocks app; the runs and uploads live under output_root."""
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr

    from swiftlite.webui import export_tab, infer_tab, train_tab
    from swiftlite.webui.runs import RunManager

    manager = RunManager(output_root)
    # The form checks unknown flags against transformers.TrainingArguments. Import it now:
    # transformers' lazy imports are not thread-safe, and handlers run in worker threads.
    from swiftlite.config.parsing import training_arguments_fields
    training_arguments_fields()
    with gr.Blocks(title="swiftlite", analytics_enabled=False) as demo:
        gr.Markdown("## swiftlite: LoRA fine-tuning for Qwen2-class models")
        with gr.Tabs():
            train = train_tab.build(manager)
            infer_tab.build(manager)
            export_tab.build(manager)
        demo.load(train["refresh"], train["refresh_inputs"], train["refresh_outputs"])
    return demo


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(WebUIArguments, argv, "swiftlite web-ui", "Start the Gradio Web-UI.")
    credentials = args.credentials()
    if not 0 < args.port < 65536:
        raise UsageError(f"--port {args.port}: expected 1-65535")
    _check_port_free(args.host, args.port)
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    import gradio as gr
    demo = create_app(args.output_root)
    print(f"[swiftlite] web-ui: http://{args.host}:{args.port} (runs in "
          f"{os.path.abspath(args.output_root)})", flush=True)
    demo.queue(default_concurrency_limit=4).launch(
        server_name=args.host, server_port=args.port, share=args.share, auth=credentials,
        ssr_mode=False, quiet=True, show_error=True, theme=gr.themes.Default(), css=CSS)


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
