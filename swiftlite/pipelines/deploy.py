"""`swiftlite deploy`: serve a checkpoint, a merged model or a model, plus named LoRA adapters
over the same base, with an OpenAI-compatible API (inference/server).

  swiftlite deploy --ckpt_dir output/.../checkpoint-50            # -> http://127.0.0.1:8000/v1
  swiftlite deploy --model tiny-qwen2 --adapters a=ckpt_a b=ckpt_b
  swiftlite deploy --ckpt_dir ... --infer_backend vllm [--vllm_python venv/bin/python]

Safe by default: it listens on 127.0.0.1; another --host needs an --api_key (or
--allow_remote_without_key true); the key is never logged or written anywhere.
"""
from __future__ import annotations

import os

from swiftlite.config.arguments import DEPLOY_PT_BATCH, DeployArguments
from swiftlite.config.parsing import build
from swiftlite.errors import UsageError
from swiftlite.log import info


def check_exposure(args: DeployArguments) -> None:
    from swiftlite.runtime.http_guard import is_loopback
    if not is_loopback(args.host) and not args.api_key and not args.allow_remote_without_key:
        raise UsageError(f"--host {args.host} makes the server reachable from other machines, "
                         "and no --api_key is set. Set --api_key (or SWIFTLITE_API_KEY), or "
                         "pass --allow_remote_without_key true if that is what you want.")


def served_names(args: DeployArguments, ckpt) -> dict[str, str | None]:
    """Model names clients use -> the adapter folder each serves (None: the base model).
    A LoRA checkpoint is served by its folder's name, and its base by the base's name."""
    from swiftlite.models.registry import model_name
    served: dict[str, str | None] = {}
    if ckpt.kind == "adapter":
        served[args.served_model_name or os.path.basename(os.path.normpath(ckpt.path))] = \
            ckpt.path
        # the base by the name it was trained under (an alias), else its folder's name
        served.setdefault(model_name(args.model or ckpt.run_args.get("model") or
                                     ckpt.model_dir), None)
    else:
        served[args.served_model_name or model_name(args.model or ckpt.path)] = None
    for spec in args.adapters:
        name, _, path = spec.partition("=")
        if name in served:
            raise UsageError(f"--adapters {spec}: the name {name} is already served; pick "
                             "another name.")
        served[name] = path
    return served


def _preflight(ckpt, served: dict[str, str | None]) -> None:
    """Each served checkpoint's run said whether its samples all ended with a trained
    end-of-turn token; one that did not may not stop."""
    from swiftlite.inference.checkpoints import warn_if_trained_without_end_of_turn
    for path in dict.fromkeys([ckpt.path, *(p for p in served.values() if p)]):
        warn_if_trained_without_end_of_turn(path)


def load(args: DeployArguments):
    """(engine, served names -> adapter name in the engine's PeftModel, or None)."""
    from swiftlite.inference.engine import InferEngine, engine_overrides
    engine = InferEngine.load(args.ckpt_dir, args.model, **engine_overrides(args))
    served: dict[str, str | None] = {}
    names = served_names(args, engine.ckpt)
    _preflight(engine.ckpt, names)
    for name, path in names.items():
        if path is None:
            served[name] = None
        elif path == engine.ckpt.path:
            served[name] = "default"  # the checkpoint's adapter, loaded with the model
        else:
            from peft import PeftModel
            if isinstance(engine.model, PeftModel):
                engine.model.load_adapter(path, adapter_name=name)
            else:
                engine.model = PeftModel.from_pretrained(engine.model, path, adapter_name=name)
            engine.model.eval()
            served[name] = name
            info(f"adapter {name}: {path}")
    return engine, served


def serve_vllm(args: DeployArguments) -> int:
    from swiftlite.inference.checkpoints import TEMPLATE_FIELDS, describe
    from swiftlite.inference.server import vllm_backend
    kw = {k: getattr(args, k) for k in TEMPLATE_FIELDS + ("torch_dtype",)
          if getattr(args, k) is not None}
    ckpt = describe(args.ckpt_dir, args.model, **kw)
    served = served_names(args, ckpt)
    _preflight(ckpt, served)
    from swiftlite.inference.server.vllm_lora import check_adapters
    check_adapters({name: path for name, path in served.items() if path is not None})
    info(f"serving {', '.join(served)} through vLLM at http://{args.host}:{args.port}/v1"
         + (" (API key required)" if args.api_key else ""))
    return vllm_backend.serve(args, ckpt, served)


def deploy(args: DeployArguments | dict | None = None, **kwargs) -> None:
    """Python API: `swiftlite.deploy(ckpt_dir=..., port=8000)` serves until interrupted."""
    if args is None or isinstance(args, dict):
        args = build(DeployArguments, {**(args or {}), **kwargs}, where="swiftlite.deploy")
    if args.api_key is None and os.environ.get("SWIFTLITE_API_KEY"):
        args.api_key = os.environ["SWIFTLITE_API_KEY"]
    args.validate()
    check_exposure(args)
    if args.infer_backend == "vllm":
        code = serve_vllm(args)
        if code not in (0, -2, -15):  # ended by Ctrl-C / SIGTERM
            raise UsageError(f"vLLM's server exited with status {code} (its log is above).")
        return
    import uvicorn

    from swiftlite.inference.server.app import create_app
    engine, served = load(args)
    from swiftlite.config.sizes import parse_size
    from swiftlite.runtime.http_guard import HostOriginGuard, default_hosts
    app = create_app(engine, served, api_key=args.api_key,
                     max_batch_size=args.max_batch_size or DEPLOY_PT_BATCH,
                     max_queue_size=args.max_queue_size,
                     max_request_bytes=parse_size(args.max_request_size))
    # Origin: null passes only where the key is needed anyway; /v1 POSTs are JSON only.
    app.add_middleware(HostOriginGuard,
                       hosts=args.allowed_hosts or default_hosts(args.host, share=False),
                       null_origin_ok=bool(args.api_key), json_routes=("/v1/",))
    info(f"serving {', '.join(served)} at http://{args.host}:{args.port}/v1"
         + (" (API key required)" if args.api_key else ""))
    from swiftlite.runtime import gc_start
    gc_start.release(freeze=True)  # the engine and the app are kept to the end
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")


def main(argv: list[str]) -> None:
    from swiftlite.config.argv import parse_argv
    args = parse_argv(DeployArguments, argv, "swiftlite deploy",
                      "Serve a model or checkpoints with an OpenAI-compatible API.")
    deploy(args)
