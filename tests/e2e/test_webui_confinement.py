"""The Web-UI's children get only the environment they need, and a checkpoint folder inside the
allowed folders cannot make the Web-UI load a base model from outside them (issue #41)."""
import json
import os
import shutil

from swiftlite.webui.policy import Policy


def _children_environ(command: bytes) -> list[dict]:
    """The environment of each living child process of this one whose command line holds
    `command`, read from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                mine = command in f.read()
            if ppid == os.getpid() and mine:
                with open(f"/proc/{pid}/environ", "rb") as f:
                    pairs = [e.split(b"=", 1) for e in f.read().split(b"\0") if b"=" in e]
                found.append({k.decode(): v.decode() for k, v in pairs})
        except (OSError, ValueError, IndexError):
            continue
    return found


def test_the_export_child_gets_only_the_environment_it_needs(tiny_run, tmp_path, monkeypatch):
    """Before: `swiftlite merge-lora` started by the Export tab had the Web-UI's whole
    environment, its login (SWIFTLITE_WEBUI_AUTH) among it."""
    from swiftlite.webui.widgets import run_child
    secrets = {"SWIFTLITE_WEBUI_AUTH": "admin:hunter2", "AWS_SECRET_ACCESS_KEY": "aws-s3cr3t",
               "HF_TOKEN": "hf_s3cr3t", "OPENAI_API_KEY": "sk-s3cr3t", "GITHUB_TOKEN": "gh"}
    for k, v in {**secrets, "HF_HOME": str(tmp_path / "hf"), "LC_ALL": "C.UTF-8"}.items():
        monkeypatch.setenv(k, v)
    child = None
    argv = ["merge-lora", "--ckpt_dir", tiny_run.last_checkpoint, "--output_dir",
            str(tmp_path / "m-merged"), "--verify", "false"]
    for text, rc in run_child(argv):
        if child is None and rc is None:  # its first line: it is running
            child = _children_environ(b"merge-lora")
    assert rc == 0, text[-2000:]
    (env,) = child
    assert not set(secrets) & set(env), sorted(env)
    assert not any(v in env.values() for v in secrets.values())
    for kept in ("PATH", "HOME", "HF_HOME", "LC_ALL", "PYTHONUNBUFFERED"):
        assert kept in env, kept
    assert env["HF_HOME"] == str(tmp_path / "hf")


def _adapter_pointing_at(folder, base: str, args: dict | None) -> str:
    """An uploaded adapter checkpoint whose files name `base` as its base model."""
    os.makedirs(folder)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "base_model_name_or_path": base}))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    if args is not None:
        (folder / "args.json").write_text(json.dumps(args))
    return str(folder)


def test_a_checkpoint_cannot_name_a_base_outside_the_allowed_folders(tmp_path, tiny_qwen2):
    """Before: an upload whose args.json (model_dir) or adapter_config.json
    (base_model_name_or_path) named a model outside the allowed folders made the Infer tab load
    it; Export and Eval did not look at the base at all."""
    from swiftlite.config.arguments import MergeArguments
    from swiftlite.webui.eval_tab import eval_args
    root, outside = tmp_path / "root", tmp_path / "outside"
    shutil.copytree(tiny_qwen2, outside)
    uploads = root / "uploads"
    policy = Policy(str(root))
    via_args = _adapter_pointing_at(uploads / "a", "tiny-qwen2",
                                    {"model": "tiny-qwen2", "model_dir": str(outside)})
    via_adapter = _adapter_pointing_at(uploads / "b", str(outside), None)
    for ckpt in (via_args, via_adapter):
        problems = policy.infer_problems(ckpt)
        assert problems and str(outside) in problems[0] and "outside the output root" in \
            problems[0], problems
        merge = MergeArguments(ckpt_dir=ckpt, output_dir=ckpt + "-merged")
        assert any(str(outside) in p for p in policy.merge_problems(merge, merge.output_dir))
        try:
            eval_args(ckpt, {"eval_dataset": "self-cognition#2"}, policy)
            raise AssertionError("eval was allowed")
        except Exception as e:
            assert str(outside) in str(e), e
    # The same base inside --allowed_paths, or a model built by swiftlite itself, is fine.
    assert Policy(str(root), [str(outside)]).infer_problems(via_args) == []
    built = _adapter_pointing_at(uploads / "c", tiny_qwen2,
                                 {"model": "tiny-qwen2", "model_dir": tiny_qwen2})
    assert policy.infer_problems(built) == []
