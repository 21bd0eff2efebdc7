"""The package's layout: folders are layers, dependencies point down only, and facts that
several parts use are written once (each test names the fact it protects)."""
from __future__ import annotations

import ast
import dataclasses
import os

from helpers.cli import REPO

PACKAGE = os.path.join(REPO, "swiftlite")
# Top to bottom. A module may import from its own folder and from any layer below its own.
LAYERS = [
    {"swiftlite.cli", "swiftlite.webui"},
    {"swiftlite.pipelines"},
    {"swiftlite.training", "swiftlite.inference", "swiftlite.export"},
    {"swiftlite.evaluation"},
    {"swiftlite.estimate"},
    {"swiftlite.data", "swiftlite.models", "swiftlite.templates"},
    {"swiftlite.config"},
    {"swiftlite.runtime"},
    {"swiftlite.errors", "swiftlite.log"},
]


def modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, REPO)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def imports(mods: dict[str, str]) -> dict[str, set[str]]:
    """module -> the package modules it imports, at module level or inside functions."""
    graph = {}
    for name, path in mods.items():
        targets = set()
        for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
            if isinstance(node, ast.Import):
                found = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{path}:{node.lineno}: relative import"
                # `from pkg import module` depends on pkg.module; `from m import name` on m
                found = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods
                         else node.module for a in node.names]
            else:
                continue
            for t in found:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                # a module's own package (its __init__) is part of it, not a dependency
                if t and t != name and not name.startswith(t + "."):
                    targets.add(t)
        graph[name] = targets
    return graph


def layer_of(module: str) -> tuple[int, str]:
    for i, layer in enumerate(LAYERS):
        for top in layer:
            if module == top or module.startswith(top + "."):
                return i, top
    return -1, module  # swiftlite/__init__.py: the lazy public API above everything


def test_no_import_cycles():
    graph = imports(modules())
    index, low, stack, on, cycles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert cycles == []


def test_dependencies_point_down_only():
    wrong = []
    for module, targets in imports(modules()).items():
        mine, my_top = layer_of(module)
        for t in targets:
            theirs, their_top = layer_of(t)
            if their_top != my_top and theirs <= mine:
                wrong.append(f"{module} -> {t}")
    assert wrong == []


def test_every_folder_is_a_layer():
    folders = {n for n in modules() if n.count(".") == 1}
    assert {n for n in folders if layer_of(n)[0] < 0} == set()


def test_estimate_of_deepspeed_auto_is_the_estimate_of_this_run():
    """--deepspeed auto estimated a run with --chunked_loss false as if chunked, and left
    lora_dropout at its default: its inputs are now derived from the run's arguments."""
    from swiftlite.config.arguments import EstimateArguments, SftArguments
    from swiftlite.estimate.plan import for_training, run
    sft = SftArguments(model="Qwen2-0.5B-Instruct", dataset=["x"], chunked_loss=False,
                       lora_dropout=0.0, lora_rank=16, max_length=4096,
                       selective_checkpointing=True, per_device_train_batch_size=2,
                       target_modules=["q_proj", "v_proj"])
    est = for_training(sft, torch_dtype="bfloat16", gpus=2, nodes=1, gpu_memory="24GB")
    for f in dataclasses.fields(EstimateArguments):
        if f.name in {g.name for g in dataclasses.fields(SftArguments)} and f.name not in (
                "torch_dtype",):
            assert getattr(est, f.name) == getattr(sft, f.name), f.name
    assert est.batch_size == 2 and est.gpus == 2
    unchunked = run(est)["rows"][0]["gpu"]["activations"]
    chunked = run(dataclasses.replace(est, chunked_loss=True))["rows"][0]["gpu"]["activations"]
    assert unchunked > chunked


def test_training_arguments_fields_of_the_same_name_are_forwarded():
    """trainer._training_arguments copied 14 fields by hand; a shared field is now forwarded
    unless it is listed, with its reason, as translated."""
    from transformers import TrainingArguments

    from swiftlite.config.arguments import SftArguments
    from swiftlite.training.trainer import TRANSLATED, forwarded_fields
    ta = {f.name for f in dataclasses.fields(TrainingArguments)}
    shared = {f.name for f in dataclasses.fields(SftArguments)} & ta
    args = SftArguments(model="x", dataset=["x"], weight_decay=0.02, logging_steps=3)
    forwarded = forwarded_fields(args)
    assert set(forwarded) == shared - set(TRANSLATED)
    assert set(TRANSLATED) <= shared  # no stale entry
    assert forwarded["weight_decay"] == 0.02 and forwarded["logging_steps"] == 3


def test_one_home_for_shared_facts():
    """Facts that were written in several places, and had started to drift."""
    from swiftlite.config import constants
    from swiftlite.config.arguments import GenerationArguments, SftArguments
    from swiftlite.estimate import memory
    from swiftlite.inference.engine import GEN_DEFAULTS
    from swiftlite.training import deepspeed
    from swiftlite.training.speedups import chunked_loss
    assert memory.LOSS_CHUNK == chunked_loss.CHUNK == constants.LOSS_CHUNK_ROWS
    assert memory.STAGES == tuple(constants.STAGES)
    assert set(deepspeed.preset_names()) == set(constants.STAGES) - {"none"}
    assert GEN_DEFAULTS == dataclasses.asdict(GenerationArguments())
    args = SftArguments(model="x", dataset=["x"], per_device_train_batch_size=2)
    assert args.accumulation_steps(world_size=2) * 2 * 2 == constants.DEFAULT_TOTAL_BATCH


def test_no_literal_ignore_index_or_stage_notes_outside_their_home():
    """-100 lived as template.IGNORE_INDEX, loss.IGNORE and bare literals."""
    found = []
    for name, path in modules().items():
        if name == "swiftlite.config.constants":
            continue
        for i, line in enumerate(open(path, encoding="utf-8"), 1):
            code = line.split("#")[0]
            if "-100" in code and "[-100 x" not in code and '"""' not in code and not \
                    code.strip().startswith(("-", "labels", "positions")):
                found.append(f"{path}:{i}: {line.strip()}")
    assert found == []
