"""The files of an export that come from the checkpoint's chat template, written by a process
of its own beside llama.cpp's converter: the GGUF metadata the converter sets in its header
(llamacpp_child.py waits for it) and the Ollama Modelfile.

Reading the template loads transformers and the tokenizer, about 100 MiB that the export's
own process would otherwise hold until the end, beside the converter and the quantizer. This
process reads it while the converter imports its libraries, and has ended before the converter
reaches its peak.

  python -m swiftlite.pipelines.export_template JOB.json
      JOB.json: {"ckpt": the CheckpointInfo's fields, "trust_remote_code", "metadata": the
      path to write the GGUF metadata to (or null), "modelfile": write_modelfile()'s
      arguments, "result": the path to write {"family": the Modelfile TEMPLATE's family} to}.
      Exit code 2 with the message on stderr for a usage error, 1 for anything else; what it
      warns on stderr is shown by the export.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

from swiftlite.errors import RunError, UsageError
from swiftlite.inference.checkpoints import _UNSET, CheckpointInfo


def start(ckpt, trust_remote_code: bool, metadata: str | None, modelfile: dict, workdir: str):
    """The worker process; finish() it."""
    from dataclasses import asdict
    fields = asdict(ckpt)
    if ckpt.system_or(_UNSET) is _UNSET:  # the template's default: not a JSON value
        del fields["system"]
    job = {"ckpt": fields, "trust_remote_code": trust_remote_code, "metadata": metadata,
           "modelfile": modelfile, "result": os.path.join(workdir, "template-result.json")}
    path = os.path.join(workdir, "template-job.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(job, f)
    proc = subprocess.Popen([sys.executable, "-m", "swiftlite.pipelines.export_template", path],
                            env={**os.environ, "TOKENIZERS_PARALLELISM": "false"},
                            stderr=subprocess.PIPE, text=True, errors="replace")
    return proc, job["result"]


def finish(worker) -> str:
    """Wait for the worker: the Modelfile TEMPLATE's family, or the worker's error raised."""
    proc, result = worker
    err = proc.communicate()[1].strip()
    if proc.returncode == 2:
        raise UsageError(err.splitlines()[-1] if err else "reading the chat template failed")
    if proc.returncode != 0:
        raise RunError(f"reading the checkpoint's chat template failed (exit code "
                       f"{proc.returncode}):\n{err[-3000:]}")
    if err:
        print(err, file=sys.stderr, flush=True)
    with open(result, encoding="utf-8") as f:
        return json.load(f)["family"]


def stop(worker) -> None:
    """End the worker if it still runs (the export failed elsewhere)."""
    if worker[0].poll() is None:
        worker[0].kill()
        worker[0].wait()


def write(job: dict) -> str:
    from swiftlite.export.gguf import template_metadata, write_metadata
    from swiftlite.export.modelfile import write_modelfile
    from swiftlite.inference.checkpoints import training_template
    ckpt = CheckpointInfo(**job["ckpt"])
    template = training_template(ckpt, job["trust_remote_code"])[1]
    if job["metadata"]:
        write_metadata(template_metadata(template), job["metadata"])
    m = job["modelfile"]
    return write_modelfile(m["path"], m["source"], template, ckpt.system_or(None),
                           m["model_dir"], m["adapter"], note=m["note"])


def main(path: str) -> None:
    with open(path, encoding="utf-8") as f:
        job = json.load(f)
    try:
        family = write(job)
    except UsageError as e:
        print(e, file=sys.stderr)
        sys.exit(2)
    with open(job["result"], "w", encoding="utf-8") as f:
        json.dump({"family": family}, f)


if __name__ == "__main__":
    main(sys.argv[1])
