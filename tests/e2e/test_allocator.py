"""tcmalloc (lower peak memory), the cast of a checkpoint on load one tensor at a time, and an
instant --help."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
import torch


@pytest.fixture
def tcmalloc() -> str:
    """The system's tcmalloc library (CI installs libtcmalloc-minimal4); skips without it."""
    from swiftlite.runtime.allocator import INSTALL_HINT, find_tcmalloc
    lib = find_tcmalloc()
    if lib is None:
        pytest.skip(f"tcmalloc is not installed here ({INSTALL_HINT})")
    return lib


def test_sft_help_is_instant():
    """`swiftlite sft --help` imports neither torch nor transformers."""
    code = ("import sys, swiftlite.cli as c\n"
            "try:\n    c.main(['sft', '--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'peft') if m in sys.modules))")
    t = time.time()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "--chunked_loss" in out.stdout and "--padding_free" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert time.time() - t < 5  # < 1 s on an idle machine; loose here, CI shares the cores


@pytest.mark.slow
def test_commands_run_under_tcmalloc_when_installed(tcmalloc, tiny_qwen2, chat_jsonl, tmp_path):
    """`swiftlite sft` re-executes itself with tcmalloc preloaded when the system has it (CI
    installs libtcmalloc-minimal4) and says so; SWIFTLITE_ALLOCATOR=glibc keeps glibc. The
    first run also starts the read-ahead helper and, once trained, writes down the files its
    start read for the next start (runtime/prefetch.py): torch's libraries, then modules."""
    from helpers.cli import run_cli
    flags = ["sft", "--model", tiny_qwen2, "--dataset", chat_jsonl, "--template", "qwen",
             "--max_steps", "1", "--per_device_train_batch_size", "2", "--report_to", "none",
             "--save_strategy", "no"]
    cache = tmp_path / "cache"
    r = run_cli(*flags, "--output_dir", tmp_path / "a", env={
        "SWIFTLITE_ALLOCATOR": "", "SWIFTLITE_CACHE": str(cache), "SWIFTLITE_PREFETCH": ""})
    assert "memory allocator: tcmalloc" in r.stderr
    from swiftlite.runtime.prefetch import to_read
    [listing] = (cache / "prefetch").glob("sft-*.txt")
    items = to_read([f"@{listing}"])
    assert all(os.path.isfile(p) for p, _ in items)
    [(_, spans)] = [(p, s) for p, s in items if os.path.basename(p) == "libtorch_cpu.so"]
    assert spans  # the byte ranges the start touched
    code = [p for p, s in items if s is None]
    assert any("/transformers/" in p for p in code) and any("/peft/" in p for p in code)
    r = run_cli(*flags, "--output_dir", tmp_path / "b", env={"SWIFTLITE_ALLOCATOR": "glibc"})
    assert "memory allocator: glibc (SWIFTLITE_ALLOCATOR=glibc)" in r.stderr


def test_a_script_reexecutes_itself_under_tcmalloc(tcmalloc, tmp_path):
    """benchmarks/bench_sft.py trains in its own process (`ab`, `profile`): it re-executes itself
    under tcmalloc like `swiftlite sft`, so its figures are the command's (under glibc its steps
    were slower: docs/performance.md), with its own arguments intact."""
    script = tmp_path / "script.py"
    script.write_text("import sys\nfrom swiftlite.runtime import allocator\n"
                      "allocator.reexec_with_tcmalloc(sys.argv)\n"
                      "print(allocator.active(), sys.argv[1:])\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "SWIFTLITE_ALLOCATOR")}
    out = subprocess.run([sys.executable, str(script), "ab", "--steps", "8"], env=env,
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "tcmalloc ['ab', '--steps', '8']"


def test_allocator_line_says_what_runs_and_what_to_do(monkeypatch):
    from swiftlite.runtime import allocator
    monkeypatch.delenv("SWIFTLITE_ALLOCATOR", raising=False)
    monkeypatch.setattr(allocator, "active", lambda: "glibc")
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: None)
    assert "apt-get install libtcmalloc-minimal4" in allocator.describe()
    monkeypatch.setattr(allocator, "find_tcmalloc", lambda: "/usr/lib/libtcmalloc_minimal.so.4")
    assert "LD_PRELOAD=/usr/lib/libtcmalloc_minimal.so.4" in allocator.describe()  # Python API
    monkeypatch.setenv("SWIFTLITE_ALLOCATOR", "glibc")
    assert allocator.describe() == "memory allocator: glibc (SWIFTLITE_ALLOCATOR=glibc)"
    monkeypatch.setattr(allocator, "active", lambda: "tcmalloc")
    assert allocator.describe().startswith("memory allocator: tcmalloc")


def test_main_called_from_python_never_reexecutes(monkeypatch, tmp_path, capsys):
    """Only the `swiftlite` process itself re-executes under tcmalloc: cli.main(argv) called from
    Python (a notebook, a test runner) must not replace its caller's process."""
    from swiftlite import cli

    def no_exec(*a):
        raise AssertionError("os.execve called from cli.main(argv)")
    monkeypatch.setattr(os, "execve", no_exec)
    monkeypatch.delenv("SWIFTLITE_ALLOCATOR", raising=False)
    assert cli.main(["merge-lora", "--ckpt_dir", str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err


@pytest.mark.slow
def test_tcmalloc_lowers_peak_memory_of_checkpointed_training(tcmalloc, smollm2, tmp_path):
    """Why swiftlite preloads tcmalloc: two checkpointed LoRA steps of SmolLM2-135M (1,400
    then 600 tokens) leave glibc's heap full of holes it cannot return, tcmalloc reuses them.
    Measured on the AVX2-only AMD EPYC (2026-12-08): peak RSS 2,426-2,666 MB under glibc vs
    1,343-1,349 MB under tcmalloc (0.51-0.56). With a third step of 1,000 tokens: 2,261 vs
    1,203 MB (0.53), and 1,896-1,957 vs 1,264 MB (0.65-0.67) on an AMD EPYC family 25 model 17
    (a whole 30-step run: 3,152 vs 1,383 MB). The peak is VmHWM: ru_maxrss would start from
    pytest's own size, which Linux carries over into the child."""
    script = tmp_path / "peak.py"
    script.write_text(
        "import sys, torch\n"
        "from swiftlite.config.arguments import SftArguments\n"
        "from swiftlite.runtime.allocator import peak_rss_bytes\n"
        "from swiftlite.training.speedups.chunked_loss import supervised_head_loss\n"
        "from swiftlite.models.loader import load_model\n"
        "from swiftlite.training.tuners import prepare_model\n"
        "torch.manual_seed(0)\n"
        "m = prepare_model(load_model(sys.argv[1], 'float32'), SftArguments(model='x', dataset=['x']))\n"
        "m.train()\n"
        "for T in (1400, 600):\n"
        "    ids = torch.randint(0, 49000, (1, T)); labels = ids.clone(); labels[:, :T // 4] = -100\n"
        "    pos = torch.cat([torch.arange(T // 4)] * 4)[None]\n"
        "    supervised_head_loss(m, dict(input_ids=ids, labels=labels, position_ids=pos)).backward()\n"
        "print(peak_rss_bytes() // 2**20)\n")
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    peak = {}
    for name, extra in (("glibc", {}), ("tcmalloc", {"LD_PRELOAD": tcmalloc})):
        out = subprocess.run([sys.executable, str(script), smollm2], env={**env, **extra},
                             capture_output=True, text=True, check=True)
        peak[name] = int(out.stdout.split()[-1])
    assert peak["tcmalloc"] < 0.75 * peak["glibc"], peak  # 0.51-0.67 measured (see above)


_LOAD_PEAK = (
    "import sys\n"
    "import swiftlite.models.loader as loader\n"
    "from swiftlite.runtime.allocator import peak_rss_bytes\n"
    "import torch, transformers\n"
    "if sys.argv[2] == 'mapped':\n"
    "    loader.cast_state_dict = lambda *a: None  # transformers' own loading\n"
    "before = peak_rss_bytes()\n"
    "loader.load_model(sys.argv[1], 'bfloat16')\n"
    "print((peak_rss_bytes() - before) // 2**20)\n")


@pytest.mark.slow
def test_model_cast_on_load_reads_one_tensor_at_a_time(smollm2, tiny_qwen2):
    """A checkpoint stored in fp32 and trained with a bf16 base (the CPU default): transformers
    maps the whole file and casts from the mapping, so the fp32 file is resident until loading
    ends; load_model reads and casts one tensor at a time instead. Measured on SmolLM2-135M
    (538 MB in fp32): the peak grows by 876 MB mapped vs 364 MB tensor by tensor. The model is
    the same: weights, buffers, tied head, config, generation config and name_or_path."""
    import swiftlite.models.loader as loader
    peak = {}
    for how in ("mapped", "cast"):
        out = subprocess.run([sys.executable, "-c", _LOAD_PEAK, smollm2, how],
                             capture_output=True, text=True, check=True)
        peak[how] = int(out.stdout.split()[-1])
    assert peak["cast"] < peak["mapped"] - 300, peak  # the fp32 file is 513 MiB

    ours = loader.load_model(tiny_qwen2, "bfloat16")
    assert loader.cast_state_dict(tiny_qwen2, torch.bfloat16) is not None  # the path taken
    assert loader.cast_state_dict(tiny_qwen2, torch.float32) is None  # nothing to cast
    real = loader.cast_state_dict
    try:
        loader.cast_state_dict = lambda *a: None
        theirs = loader.load_model(tiny_qwen2, "bfloat16")
    finally:
        loader.cast_state_dict = real
    a, b = ours.state_dict(), theirs.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {t.dtype for t in a.values()} == {torch.bfloat16}
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in theirs.named_buffers()]
    assert all(torch.equal(x, y) for x, y in zip(ours.buffers(), theirs.buffers()))
    assert ours.config.to_dict() == theirs.config.to_dict()
    assert ours.name_or_path == theirs.name_or_path == tiny_qwen2
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()
    tied = ours.get_output_embeddings().weight is ours.get_input_embeddings().weight
    assert tied == (theirs.get_output_embeddings().weight is theirs.get_input_embeddings().weight)




_GROWTH_CHILD = r"""
import json, sys, torch
from swiftlite.models.loader import load_model
model = load_model(sys.argv[1], "bfloat16")  # bf16 matmuls go through oneDNN's primitives
model.eval()
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) / 1024 for l in f if l.startswith("VmRSS:"))
with torch.no_grad():  # logits for the last token only: the layers' matmuls are what is cached
    # Warm up: the first primitives (more than the bounded caches hold) and, with the longest
    # input, the allocator's largest activation buffers
    for n in [*range(8, 24), 128]:
        model(torch.randint(0, 1000, (1, n)), logits_to_keep=1)
    before = rss_mb()
    for n in range(60, 100):  # 40 token counts never seen before, as a padding-free run has
        model(torch.randint(0, 1000, (1, n)), logits_to_keep=1)
print(json.dumps({"growth_mb": rss_mb() - before}))
"""


@pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                    reason="torch runs bf16 matmuls through oneDNN only on CPUs with AVX-512 "
                           "(this one emulates them outside oneDNN, with no cache to grow)")
@pytest.mark.slow
def test_memory_does_not_grow_with_each_new_token_count(smollm2):
    """oneDNN (bf16 matmuls on a CPU) caches a compiled primitive per matmul shape, and the
    ideep layer torch calls it through caches one more: megabytes per new token count
    for a SmolLM2-135M layer's shapes, each cache growing to 1,024 entries by default. A
    padding-free batch has a new token count nearly every step, so a run's memory grew all
    along (30 steps: +380 MB) until the caches were bounded (models.loader.load_model).
    Checked to fail with ONEDNN_PRIMITIVE_CACHE_CAPACITY=LRU_CACHE_CAPACITY=1024."""
    out = subprocess.run([sys.executable, "-c", _GROWTH_CHILD, smollm2], capture_output=True,
                         text=True, env={k: v for k, v in os.environ.items()
                                         if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY",
                                                      "LRU_CACHE_CAPACITY")})
    assert out.returncode == 0, out.stderr[-3000:]
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth_mb"]
    # Measured: 9-14 MB bounded, 102-107 MB with the default 1,024 entries (glibc and tcmalloc)
    assert growth < 40, f"RSS grew by {growth:.0f} MB over 40 new token counts"

