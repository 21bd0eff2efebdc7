"""The `swiftlite` command: a table from command name to function, with lazy imports so that
`--help` answers at once. Errors a user can fix are printed without a traceback
(exit 2 for usage/config errors, 1 for failures during a run)."""
from __future__ import annotations

import importlib
import os
import sys

from swiftlite.errors import SwiftliteError

# command -> (module:function taking argv, one-line description)
COMMANDS = {
    "sft": ("swiftlite.pipelines.sft:main", "LoRA (or full) supervised fine-tuning"),
    "rlhf": ("swiftlite.pipelines.rlhf:main", "preference training: DPO (and its loss types), "
                                              "ORPO, SimPO, CPO, KTO"),
    "eval": ("swiftlite.pipelines.eval:main", "score a model or checkpoint: ROUGE, BLEU, exact "
                                              "match, tool calls, multiple choice, loss"),
    "merge-lora": ("swiftlite.pipelines.merge:main", "merge a LoRA checkpoint into a plain model"),
    "export": ("swiftlite.pipelines.export:main", "export to GGUF (llama.cpp, LM Studio, Ollama) "
                                                  "with an Ollama Modelfile"),
    "infer": ("swiftlite.pipelines.infer:main", "chat with a model or checkpoint, or batch-infer a "
                                                "dataset"),
    "deploy": ("swiftlite.pipelines.deploy:main", "serve a model or checkpoints with an "
                                                  "OpenAI-compatible API"),
    "estimate": ("swiftlite.pipelines.estimate:main", "estimate training memory per GPU for each "
                                                      "DeepSpeed stage"),
    "web-ui": ("swiftlite.webui.app:main", "start the Gradio Web-UI"),
}
# Commands that run a model: worth tcmalloc's lower peak memory (see runtime/allocator.py).
ALLOCATOR_COMMANDS = ("sft", "rlhf", "eval", "infer", "merge-lora", "export", "deploy")
# Commands whose start reads the training libraries: read ahead (see runtime/prefetch.py).
PREFETCH_COMMANDS = ("sft", "rlhf")


def main(argv: list[str] | None = None) -> int:
    own_process = argv is None  # the `swiftlite` command itself, not a call from Python
    argv = list(sys.argv[1:] if argv is None else argv)
    # The `deepspeed` launcher puts --local_rank=N before the command; LOCAL_RANK says the same.
    argv = [a for a in argv if not a.startswith(("--local_rank=", "--local-rank="))]
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: swiftlite COMMAND [--flag value ...]\n\ncommands:")
        for name, (_, desc) in COMMANDS.items():
            print(f"  {name:<12} {desc}")
        print("\n`swiftlite COMMAND --help` lists a command's flags.")
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        from swiftlite import __version__
        print(f"swiftlite {__version__}")
        return 0
    command = argv[0]
    if command not in COMMANDS:
        import difflib
        close = difflib.get_close_matches(command, COMMANDS, n=1)
        print(f"swiftlite: unknown command {command!r}" + (f"; did you mean {close[0]!r}?" if close
              else f"; commands: {', '.join(COMMANDS)}"), file=sys.stderr)
        return 2
    runs = own_process and not {"-h", "--help"} & set(argv)  # the command itself, not its help
    if runs and command in ALLOCATOR_COMMANDS:
        from swiftlite.runtime.allocator import reexec_with_tcmalloc  # returns unless it re-executes
        reexec_with_tcmalloc(["-m", "swiftlite.cli", *argv])
        from swiftlite.runtime import gc_start
        gc_start.hold()  # until the run's first step or request (see gc_start.py)
    if own_process:
        from swiftlite.runtime import imports
        imports.command_process = True
    # Once per run: in the process that stays (after the re-execution), not in each rank
    if runs and command in PREFETCH_COMMANDS and "LOCAL_RANK" not in os.environ:
        from swiftlite.runtime import prefetch
        prefetch.start(command, argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from swiftlite.log import hide_library_noise
    hide_library_noise()
    target, _ = COMMANDS[command]
    module, func = target.split(":")
    try:
        getattr(importlib.import_module(module), func)(argv[1:])
    except SwiftliteError as e:
        print(f"swiftlite {command}: error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print(f"swiftlite {command}: interrupted", file=sys.stderr)
        return 130
    if own_process:
        _end_rank()
    return 0


def _end_rank() -> None:
    """A torchrun rank that finished its command waits for the others (rank 0 writes the plots
    and metrics after the last collective), ends the process group (DeepSpeed's references to it
    too), runs the exit handlers and leaves without the interpreter's teardown. Gloo's threads
    met in that teardown aborted finished runs ("terminate called without an active exception":
    a ZeRO-2 offload test once, a ZeRO-3 resume in CI once, the other rank still writing)."""
    from swiftlite.runtime.distributed import barrier, end_process_group, process_group
    if process_group() is None:
        return
    barrier()
    end_process_group()
    import atexit
    atexit._run_exitfuncs()  # logging, report_to integrations: what a normal exit would run
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
