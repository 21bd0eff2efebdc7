"""`swiftlite deploy`: serve a checkpoint, a merged model or a model, plus named LoRA adapters
over the same base, with an OpenAI-compatible API (inference/server).

  swiftlite deploy --ckpt_dir output/.../checkpoint-50            # -> http://127.0.0.1:8000/v1
  swiftlite deploy --model tiny-qwen2 --adapters a=ckpt_a b=ckpt_b

Safe by default: it listens on 127.0.0.1; another --host needs an --api_key (or
--allow_remote_without_key true); the key is never logged or written anywhere.
"""
from __future__ import annotations

import ipaddress
import os

from swiftlite.config.arguments import DeployArguments
from swiftlite.config.parsing import build
from swiftlite.errors import UsageError
from swiftlite.log import info


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_exposure(args: DeployArguments) -> None:
    if not _is_loopback(args.host) and not args.api_key and not args.allow_remote_without_key:
        raise UsageError(f"--host {args.host} makes the server reachable from other machines, "
                         "and no --api_key is set. Set --api_key (or SWIFTLITE_API_KEY), or "
                         "pass --allow_remote_without_key true if that is what you want.")


def load(args: DeployArguments):
    """(engine, served names -> adapter name or None)."""
    from swiftlite.inference.engine import InferEngine
    from swiftlite.models.registry import model_name
    overrides = {k: v for k, v in {"template": args.template, "torch_dtype": args.torch_dtype,
                                   "trust_remote_code": args.trust_remote_code,
                                   "attn_impl": args.attn_impl, "system": args.system}.items()
                 if v is not None}
    engine = InferEngine.load(args.ckpt_dir, args.model, **overrides)
    ckpt = engine.ckpt
    base_name = model_name(args.model or ckpt.model_dir)
    served: dict[str, str | None] = {}
    if ckpt.kind == "adapter":
        served[args.served_model_name or os.path.basename(os.path.normpath(ckpt.path))] = "default"
        served.setdefault(base_name, None)
    else:
        served[args.served_model_name or base_name] = None
    for spec in args.adapters:
        name, _, path = spec.partition("=")
        from peft import PeftModel
        if isinstance(engine.model, PeftModel):
            engine.model.load_adapter(path, adapter_name=name)
        else:
            engine.model = PeftModel.from_pretrained(engine.model, path, adapter_name=name)
        engine.model.eval()
        served[name] = name
        info(f"adapter {name}: {path}")
    return engine, served


def deploy(args: DeployArguments | dict | None = None, **kwargs) -> None:
    """Python API: `swiftlite.deploy(ckpt_dir=..., port=8000)` serves until interrupted."""
    if args is None or isinstance(args, dict):
        args = build(DeployArguments, {**(args or {}), **kwargs}, where="swiftlite.deploy")
    if args.api_key is None and os.environ.get("SWIFTLITE_API_KEY"):
        args.api_key = os.environ["SWIFTLITE_API_KEY"]
    args.validate()
    check_exposure(args)
    import uvicorn

    from swiftlite.inference.server.app import create_app
    engine, served = load(args)
    app = create_app(engine, served, api_key=args.api_key, max_batch_size=args.max_batch_size,
                     max_queue_size=args.max_queue_size)
    info(f"serving {', '.join(served)} at http://{args.host}:{args.port}/v1"
         + (" (API key required)" if args.api_key else ""))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(DeployArguments, argv, "swiftlite deploy",
                      "Serve a model or checkpoints with an OpenAI-compatible API.")
    deploy(args)
