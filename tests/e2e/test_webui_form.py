"""The Web-UI's Train form: form values -> SftArguments -> `swiftlite sft` argv -> the CLI's own
parser gives back the same arguments; errors are caught before anything starts; run states
come from disk."""
from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
import time

import pytest

from swiftlite.config.arguments import SftArguments
from swiftlite.config.argv import parse_argv
from swiftlite.errors import UsageError
from swiftlite.webui import form
from swiftlite.webui.policy import Policy
from swiftlite.webui.runs import RunManager, describe, find_runs, status, write_state

from helpers.cli import CHAT_ROWS, write_jsonl


def _form(**overrides) -> dict:
    """What the page sends: every field's widget showing its default, then the user's edits."""
    raw = {f.name: form.widget_value(f, form.default(f)) for f in form.fields()}
    raw.update(overrides)
    return raw


def _policy(tmp_path) -> Policy:
    """Runs under tmp_path; the session's shared data files (beside it) may be read."""
    return Policy(str(tmp_path), [str(tmp_path.parent)])


def _round_trip(args: SftArguments) -> SftArguments:
    return parse_argv(SftArguments, form.command_argv(args), "swiftlite sft", "")


def test_form_is_generated_from_the_dataclass():
    from swiftlite.config.rlhf_args import RlhfArguments
    names = {f.name for f in dataclasses.fields(RlhfArguments)}
    assert set(form.FIELDS) == names - {"training_args", "add_version", "rlhf_type"}
    lr = form.FIELDS["learning_rate"]
    assert form.info(lr).startswith(lr.metadata["help"]) and "default: 0.0001" in form.info(lr)
    assert form.kind(form.FIELDS["truncation_strategy"]) == "choice"
    assert form.kind(form.FIELDS["dataset"]) == "list"
    assert form.kind(form.FIELDS["gradient_checkpointing"]) == "bool"


def test_untouched_form_is_the_cli_default(tmp_path, chat_jsonl):
    args = form.to_args(_form(model="tiny-qwen2", dataset=chat_jsonl),
                        policy=_policy(tmp_path))
    cli = parse_argv(SftArguments, ["--model", "tiny-qwen2", "--dataset", chat_jsonl,
                                    "--output_dir", str(tmp_path / "tiny-qwen2")], "sft", "")
    assert args == cli
    assert form.command_argv(args) == ["--model", "tiny-qwen2", "--dataset", chat_jsonl,
                                       "--output_dir", str(tmp_path / "tiny-qwen2")]


def test_round_trip_with_every_kind_of_field(tmp_path, chat_jsonl):
    other = write_jsonl(tmp_path / "my data.jsonl", CHAT_ROWS)
    raw = _form(model="tiny-qwen2", template="qwen", system="You are terse.",
                dataset=f"self-cognition#32 {shlex.quote(other)}", model_name="Swifty 斯威夫特",
                model_author="Lab", lora_rank="4", lora_alpha="16", lora_dropout="0",
                target_modules="q_proj v_proj", max_steps="7", num_train_epochs="1",
                per_device_train_batch_size="4", gradient_accumulation_steps="2",
                learning_rate="3e-4", max_length="512", truncation_strategy="right",
                gradient_checkpointing=False, skip_bad_rows=True, save_total_limit="2",
                output_dir=str(tmp_path / "runs"))
    args = form.to_args(raw, "--report_to none --eval_strategy=no --dataloader_num_workers 0",
                        policy=_policy(tmp_path))
    assert args.dataset == ["self-cognition#32", other]
    assert args.model_name == ["Swifty", "斯威夫特"]
    assert args.learning_rate == 3e-4 and args.gradient_checkpointing is False
    assert args.training_args == {"report_to": "none", "eval_strategy": "no",
                                  "dataloader_num_workers": 0}
    assert _round_trip(args) == args
    # The preview is a shell command whose words are exactly that argv.
    words = shlex.split(form.preview(args).replace("\\\n", " "))
    assert words[:2] == ["swiftlite", "sft"] and words[2:] == form.command_argv(args)
    assert form.preview(args, nproc=2).startswith("NPROC_PER_NODE=2 swiftlite sft")


@pytest.mark.parametrize("typed,value", [("", None), ("false", False), ("true", True)])
def test_a_setting_that_defaults_to_the_model_has_three_states(tmp_path, chat_jsonl, typed, value):
    """--enable_thinking (Optional[bool]): empty leaves the model's default, not false."""
    assert form.kind(form.FIELDS["enable_thinking"]) == "text"
    args = form.to_args(_form(model="tiny-qwen3", dataset=chat_jsonl, enable_thinking=typed),
                        policy=_policy(tmp_path))
    assert args.enable_thinking is value and _round_trip(args) == args


def test_preview_command_is_what_the_cli_runs(tmp_path, chat_jsonl):
    """The command the preview shows, run by a real shell: the CLI accepts every flag
    (--help after the flags: argparse parses them all, then prints help and exits 0)."""
    args = form.to_args(_form(model="tiny-qwen2", dataset=chat_jsonl, max_steps="3",
                              target_modules="q_proj k_proj", gradient_checkpointing=False),
                        "--report_to none", policy=_policy(tmp_path))
    cmd = form.preview(args).replace("swiftlite sft", f"{shlex.quote(sys.executable)} -m "
                                     "swiftlite.cli sft", 1) + " --help"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("edits, extra, expected", [
    ({"dataset": ""}, "", "--dataset is required"),
    ({"model": "no-such-model"}, "", "--model no-such-model: no such folder"),
    ({"model": "/nowhere/model"}, "", "no such folder"),
    ({"learning_rate": "fast"}, "", "--learning_rate: expected a number, got 'fast'"),
    ({"lora_rank": "2.5"}, "", "--lora_rank: expected a whole number"),
    ({"lora_rank": "0"}, "", "--lora_rank must be a positive number"),
    ({"dataset": "missing.jsonl"}, "", "--dataset missing.jsonl: no such file"),
    ({"dataset": "self-cognition#x"}, "", "a positive number of rows"),
    ({"output_dir": "/tmp/elsewhere"}, "", "must be inside the Web-UI's output root"),
    ({}, "--learning_rat 1", "did you mean --learning_rate"),
    ({}, "stray", "write --name value pairs"),
    ({}, "--max_steps 3", "already a field of the form"),
])
def test_form_errors_name_the_field(tmp_path, chat_jsonl, edits, extra, expected):
    raw = _form(**{"model": "tiny-qwen2", "dataset": chat_jsonl, **edits})
    with pytest.raises(UsageError) as e:
        form.to_args(raw, extra, policy=_policy(tmp_path))
    assert expected in str(e.value)


def test_several_problems_reported_together(tmp_path):
    with pytest.raises(UsageError) as e:
        form.to_args(_form(model="", dataset="", lora_rank="-1"), policy=_policy(tmp_path))
    msg = str(e.value)
    assert "--model is required" in msg and "--dataset is required" in msg and "--lora_rank" in msg


def test_model_folder_must_be_a_model(tmp_path, chat_jsonl, tiny_qwen2):
    allowed = Policy(str(tmp_path), [str(tmp_path.parent), os.path.dirname(tiny_qwen2)])
    assert form.to_args(_form(model=tiny_qwen2, dataset=chat_jsonl),
                        policy=allowed).model == tiny_qwen2
    with pytest.raises(UsageError, match="has no config.json"):
        form.to_args(_form(model=str(tmp_path), dataset=chat_jsonl), policy=_policy(tmp_path))


def test_run_states_live_on_disk(tmp_path):
    """States survive the Web-UI process: they are read back from the run folder alone."""
    root = tmp_path / "out"
    cli_run = root / "m" / "v0-20260101-000000"
    cli_run.mkdir(parents=True)
    (cli_run / "args.json").write_text("{}")
    assert status(str(cli_run)) == "incomplete"
    (cli_run / "metrics.json").write_text("{}")
    assert status(str(cli_run)) == "finished"
    gone = root / "m" / "v1-20260101-000001"
    gone.mkdir()
    # A run whose process vanished without a recorded end (e.g. the Web-UI was restarted).
    write_state(str(gone), status="running", pid=os.getpid(), create_time=0.0, started=0)
    assert status(str(gone)) == "failed"
    write_state(str(gone), stop_requested=True)
    assert status(str(gone)) == "stopped"
    assert set(find_runs(str(root))) == {str(cli_run), str(gone)}


def test_second_start_is_refused_while_one_runs(tmp_path):
    """A live process recorded as a running run (in its own process group, as Start makes
    them): a second Start is refused and creates nothing; Stop ends the group."""
    root = tmp_path / "out"
    manager = RunManager(str(root))
    busy = root / "m" / "v0-20260101-000000"
    busy.mkdir(parents=True)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                               start_new_session=True)
    try:
        import psutil
        write_state(str(busy), status="running", pid=sleeper.pid, pgid=sleeper.pid,
                    create_time=psutil.Process(sleeper.pid).create_time(), started=time.time())
        assert status(str(busy)) == "running"
        with pytest.raises(UsageError, match="already in progress"):
            manager.start(["--model", "tiny-qwen2"], str(root / "m"))
        assert find_runs(str(root)) == [str(busy)]  # nothing half-made
        manager.stop(str(busy))
        deadline = time.time() + 20
        while time.time() < deadline and status(str(busy)) != "stopped":
            time.sleep(0.2)
        assert status(str(busy)) == "stopped"
        assert sleeper.wait(timeout=5) != 0
    finally:
        if sleeper.poll() is None:
            sleeper.kill()


@pytest.mark.slow
def test_failed_run_is_marked_failed_with_its_log(tmp_path):
    """A run that the CLI rejects (exit 2: a malformed row) is 'failed', and its log says why."""
    root = tmp_path / "out"
    bad = write_jsonl(tmp_path / "bad.jsonl", [CHAT_ROWS[0], "{not json"])
    manager = RunManager(str(root))
    run = manager.start(["--model", "tiny-qwen2", "--dataset", bad, "--report_to", "none"],
                        str(root / "m"))
    deadline = time.time() + 120
    while time.time() < deadline and status(run) in ("running", "stopping"):
        time.sleep(0.5)
    info = describe(run)
    assert info.status == "failed"
    state = json.loads(open(os.path.join(run, "webui.json")).read())
    assert state["returncode"] == 2
    assert f"{bad}:2" in open(os.path.join(run, "webui.log")).read()


def test_web_ui_flags_and_safe_defaults(monkeypatch):
    from swiftlite.webui.app import AUTH_ENV, WebUIArguments
    monkeypatch.delenv(AUTH_ENV, raising=False)
    args = parse_argv(WebUIArguments, [], "swiftlite web-ui", "")
    assert (args.host, args.port, args.share, args.credentials()) == ("127.0.0.1", 7860, False,
                                                                       None)
    args = parse_argv(WebUIArguments, ["--host", "0.0.0.0", "--port", "8000", "--share",
                                       "--auth", "bob:pw:with:colons"], "swiftlite web-ui", "")
    assert (args.host, args.port, args.share) == ("0.0.0.0", 8000, True)
    assert args.credentials() == ("bob", "pw:with:colons")
    monkeypatch.setenv(AUTH_ENV, "alice:s3cret")
    assert parse_argv(WebUIArguments, [], "web-ui", "").credentials() == ("alice", "s3cret")
    monkeypatch.setenv(AUTH_ENV, "no-colon")
    with pytest.raises(UsageError, match=f"{AUTH_ENV}: expected user:password"):
        parse_argv(WebUIArguments, [], "web-ui", "").credentials()
    with pytest.raises(UsageError, match="did you mean --port"):
        parse_argv(WebUIArguments, ["--prot", "1"], "web-ui", "")


def test_web_ui_on_a_taken_port_says_so_in_one_line(tmp_path):
    import socket
    from helpers.cli import run_cli
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = run_cli("web-ui", "--port", str(port), "--output_root", str(tmp_path / "out"),
                    check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"--port {port}: 127.0.0.1:{port} is already in use" in r.stderr
    assert f"--port {port + 1}" in r.stderr


def test_uploads_are_kept_inside_the_output_root(tmp_path):
    from swiftlite.webui.train_tab import keep_upload
    root = tmp_path / "out"
    a = write_jsonl(tmp_path / "data.jsonl", CHAT_ROWS[:1])
    first = keep_upload(a, str(root))
    assert first == str(root / "uploads" / "data.jsonl")
    assert keep_upload(a, str(root)) == first  # the same file again: reused
    (tmp_path / "other").mkdir()
    b = write_jsonl(tmp_path / "other" / "data.jsonl", CHAT_ROWS[1:])
    second = keep_upload(b, str(root))  # same name, other content: not overwritten
    assert second == str(root / "uploads" / "data-1.jsonl")
    assert open(first).read() == open(a).read() and open(second).read() == open(b).read()


def test_run_list_tolerates_a_run_name_it_no_longer_lists(tmp_path):
    """A poll already under way when Start changes the run list arrives with the previous
    selection. Gradio checks a dropdown's value against the choices it last sent this session
    (CI once failed the browser test with "Value: ... is not in the list of choices"), so the
    run list must accept such a name, and refresh must fall back to the newest run and say so."""
    import gradio as gr
    from swiftlite.webui import train_tab
    root = tmp_path / "out"
    for age, name in ((100, "v0-20260101-000000"), (0, "v1-20260101-000001")):
        (root / "m" / name).mkdir(parents=True)
        (root / "m" / name / "args.json").write_text("{}")
        os.utime(root / "m" / name, (time.time() - age,) * 2)  # newest first: by mtime
    with gr.Blocks():
        tab = train_tab.build(RunManager(str(root)), Policy(str(root)))
    run_select = tab["refresh_inputs"]
    run_select.choices = [("m/v1-20260101-000001",) * 2]  # what Start sent this session
    assert run_select.preprocess("m/v0-deleted") == "m/v0-deleted"  # no "not in the list" error
    rels = ["m/v1-20260101-000001", "m/v0-20260101-000000"]
    table, choices, status_md, *_ , known = tab["refresh"]("m/v0-deleted", rels)
    assert known == rels and [row[0] for row in table] == rels
    assert choices["value"] == "m/v1-20260101-000001" and choices["choices"] == rels
    assert "m/v1-20260101-000001" in status_md


def test_infer_tools_box_takes_function_schemas_or_names_the_fault():
    from swiftlite.errors import UsageError
    from swiftlite.webui.infer_tab import parse_tools
    assert parse_tools("  ") is None
    assert parse_tools('[{"name": "f", "parameters": {}}]') == [
        {"type": "function", "function": {"name": "f", "parameters": {}}}]
    with pytest.raises(UsageError, match="tools: .*not valid JSON"):
        parse_tools("[{oops")


def test_stage_picks_the_command_and_its_arguments(tmp_path, chat_jsonl):
    from swiftlite.config.rlhf_args import RlhfArguments
    policy = _policy(tmp_path)
    raw = _form(model="tiny-qwen2", dataset=chat_jsonl, beta="0.3", max_steps="5",
                per_device_train_batch_size="2")
    sft = form.to_args(raw, policy=policy)
    assert type(sft) is SftArguments and form.command(sft) == "sft"
    assert "--beta" not in form.command_argv(sft)  # the preference fields are not SFT's
    kto = form.to_args(raw, policy=policy, stage="KTO")
    assert isinstance(kto, RlhfArguments) and (kto.rlhf_type, kto.beta) == ("kto", 0.3)
    text = form.preview(kto)
    assert text.startswith("swiftlite rlhf") and "--rlhf_type kto" in text
    assert parse_argv(RlhfArguments, form.command_argv(kto), "swiftlite rlhf", "") == kto
    with pytest.raises(UsageError, match="--adapters .*outside"):
        form.to_args({**raw, "adapters": "/etc"}, policy=policy, stage="DPO")
