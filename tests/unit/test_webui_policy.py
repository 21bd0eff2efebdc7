"""What a browser user may make the Web-UI do (webui.policy): every path inside the output root
or the operator's --allowed_paths, no code from models, no hub downloads and no custom
DeepSpeed configs unless the operator allows them, no pass-through flags that upload or name
paths, Export only to new *-merged folders, and no exposed Web-UI without a login. Each case
was possible from the form before."""
from __future__ import annotations

import json
import os

import pytest

from swiftlite import cli
from swiftlite.errors import UsageError
from swiftlite.webui import form
from swiftlite.webui.policy import Policy

from helpers.cli import CHAT_ROWS, write_jsonl


def _form(**overrides) -> dict:
    raw = {f.name: form.widget_value(f, form.default(f)) for f in form.fields()}
    raw.update({"model": "tiny-qwen2", "dataset": "self-cognition#8", **overrides})
    return raw


def refused(policy, match, extra="", **edits):
    with pytest.raises(UsageError) as e:
        form.to_args(_form(**edits), extra, policy=policy)
    assert match in str(e.value), str(e.value)


def test_paths_outside_the_root_and_the_allow_list_are_refused(tmp_path):
    root, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    root.mkdir()
    elsewhere.mkdir()
    private = write_jsonl(elsewhere / "private.jsonl", CHAT_ROWS)
    strict = Policy(str(root))
    refused(strict, f"--dataset {private}: outside the output root", dataset=private)
    (root / "link.jsonl").symlink_to(private)  # a symlink inside the root does not escape
    refused(strict, "outside the output root", dataset=str(root / "link.jsonl"))
    refused(strict, "--template", template=str(elsewhere / "t.json"))
    refused(strict, "--resume_from_checkpoint", resume_from_checkpoint=str(elsewhere))
    refused(strict, "--output_dir", output_dir=str(elsewhere))
    # The operator's allow-list opens a folder for reading, never for writing.
    allowed = Policy(str(root), [str(elsewhere)])
    assert form.to_args(_form(dataset=private), policy=allowed).dataset == [private]
    refused(allowed, "must be inside the Web-UI's output root", output_dir=str(elsewhere))


def test_code_from_models_and_hub_downloads_only_when_the_operator_allows(tmp_path):
    strict = Policy(str(tmp_path))
    refused(strict, "--trust_remote_code: running code shipped with a model is off",
            trust_remote_code=True)
    refused(strict, "downloading from the Hugging Face hub is off", model="someone/model")
    refused(strict, "--allow_hub true", model="Qwen2-0.5B-Instruct")  # an alias of a hub model
    assert form.to_args(_form(model="tiny-qwen2"), policy=strict)  # built here, from PyPI
    open_ = Policy(str(tmp_path), allow_remote_code=True, allow_hub=True)
    args = form.to_args(_form(model="someone/model", trust_remote_code=True), policy=open_)
    assert args.trust_remote_code and args.model == "someone/model"


def test_deepspeed_from_the_web_ui_is_presets_only(tmp_path):
    strict = Policy(str(tmp_path))
    assert form.to_args(_form(deepspeed="zero2"), policy=strict).deepspeed == "zero2"
    writes_anywhere = json.dumps({"zero_optimization": {"stage": 2},
                                  "tensorboard": {"enabled": True, "output_path": "/etc/x"}})
    refused(strict, "only the presets", deepspeed=writes_anywhere)
    config = tmp_path.parent / "ds.json"
    config.write_text(writes_anywhere)
    refused(strict, "only the presets", deepspeed=str(config))
    custom = Policy(str(tmp_path), allow_custom_deepspeed=True)
    refused(custom, "outside the output root", deepspeed=str(config))  # still confined
    assert form.to_args(_form(deepspeed=writes_anywhere), policy=custom).deepspeed


@pytest.mark.parametrize("extra, match", [
    ("--push_to_hub true", "--push_to_hub: not allowed from the Web-UI"),
    ("--hub_model_id me/model", "--hub_model_id: not allowed"),
    ("--report_to wandb", "--report_to wandb: only none or tensorboard"),
    ("--trackio_space_id me/space", "--trackio_space_id: not allowed"),
    ("--accelerator_config /tmp/a.json", "--accelerator_config: not allowed"),
])
def test_pass_through_flags_that_upload_or_name_paths_are_refused(tmp_path, extra, match):
    refused(Policy(str(tmp_path)), match, extra)


def test_harmless_pass_through_flags_still_work(tmp_path):
    args = form.to_args(_form(), "--report_to none --eval_strategy no", policy=Policy(str(tmp_path)))
    assert args.training_args == {"report_to": "none", "eval_strategy": "no"}


def test_infer_loads_only_allowed_checkpoints_and_models(tmp_path, tiny_run):
    run_dir = os.path.dirname(tiny_run.last_checkpoint)
    policy = Policy(os.path.dirname(run_dir))
    assert policy.infer_problems(tiny_run.last_checkpoint) == []
    assert policy.infer_problems("tiny-qwen2") == []
    assert "outside the output root" in policy.infer_problems(str(tmp_path))[0]
    assert "hub is off" in policy.infer_problems("someone/model")[0]
    # A checkpoint trained with trust_remote_code would run its model's code when loaded.
    ckpt = tmp_path / "out" / "v0" / "checkpoint-1"
    ckpt.mkdir(parents=True)
    (ckpt / "args.json").write_text(json.dumps({"model": "tiny-qwen2",
                                                "trust_remote_code": True}))
    assert "trust_remote_code" in Policy(str(tmp_path / "out")).infer_problems(str(ckpt))[0]


def test_export_writes_only_new_merged_folders(tmp_path, tiny_run):
    from swiftlite.webui.export_tab import merge_args, merge_fields
    assert "exist_ok" not in {f.name for f in merge_fields()}  # not offered at all
    ckpt = tiny_run.last_checkpoint
    run_dir = os.path.dirname(ckpt)
    policy = Policy(os.path.dirname(run_dir))
    fresh = os.path.join(run_dir, f"policy-{os.getpid()}-merged")  # new, inside the root
    assert merge_args(ckpt, {"output_dir": fresh}, policy).output_dir == fresh
    for output_dir, match in ((run_dir, "named *-merged"),  # another run's folder
                              (os.path.join(run_dir, "x-merged"), None),
                              (str(tmp_path / "y-merged"), "must be inside the output root")):
        if match is None:
            os.makedirs(output_dir)
            match = "already exists"
        with pytest.raises(UsageError, match=match.replace("*", r"\*")):
            merge_args(ckpt, {"output_dir": output_dir}, policy)
    with pytest.raises(UsageError, match="--exist_ok: the Web-UI never replaces a folder"):
        merge_args(ckpt, {"exist_ok": True}, policy)


@pytest.mark.parametrize("flags", [["--host", "0.0.0.0"], ["--share"], ["--host", "10.1.2.3"]])
def test_an_exposed_web_ui_needs_a_login(tmp_path, capsys, monkeypatch, flags):
    monkeypatch.delenv("SWIFTLITE_WEBUI_AUTH", raising=False)
    rc = cli.main(["web-ui", "--output_root", str(tmp_path / "out"), *flags])
    err = capsys.readouterr().err
    assert rc == 2 and "a login is required: add --auth user:password" in err, err


def test_host_and_origin_checks():
    from swiftlite.runtime.http_guard import default_hosts, problem
    hosts = default_hosts("127.0.0.1", share=False)
    assert problem("127.0.0.1:7860", "", hosts) is None
    assert problem("localhost:7860", "http://localhost:7860", hosts) is None
    assert problem("[::1]:7860", "", hosts) is None
    assert "not a name of this Web-UI" in problem("attacker.example:7860", "", hosts)
    assert "cross-site" in problem("127.0.0.1:7860", "http://attacker.example", hosts)
    # Origin null: any site can send it (a sandboxed iframe), so only behind a key or login.
    assert "Origin: null" in problem("127.0.0.1:7860", "null", hosts)
    assert problem("127.0.0.1:7860", "null", hosts, null_origin_ok=True) is None
    assert problem("abc.gradio.live", "https://abc.gradio.live",
                   default_hosts("127.0.0.1", share=True)) is None
