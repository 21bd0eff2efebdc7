"""The Web-UI in a real browser: Debian's Chromium driven by Playwright, the app started as
`swiftlite web-ui` in a child process on a free 127.0.0.1 port, real tiny-qwen2 training runs.

One flow, in order (each step needs the previous one): form errors -> preview -> start a
self-cognition run and see it finish with its log and loss curve, also after a reload and in a
second browser -> Infer tab chats with its checkpoint -> Export tab merges it -> a second run's
loss curve grows while it trains, a concurrent start is refused, then it is stopped midway.
Screenshots go to test-artifacts/webui/.
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import warnings

import pytest
from playwright.sync_api import expect

from helpers.cli import CHAT_ROWS, REPO, write_jsonl
from helpers.marks import HAS_LLAMACPP

pytestmark = [pytest.mark.slow, pytest.mark.browser]

CHROMIUM = "/usr/bin/chromium"
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run"]
SHOTS = os.path.join(REPO, "test-artifacts", "webui")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_app(tmp, *extra, env=None):
    """`swiftlite web-ui` as a user starts it; returns (process, url, output root, log path)."""
    port, root, log = _free_port(), str(tmp / "out"), str(tmp / "webui-app.log")
    proc = subprocess.Popen(
        [sys.executable, "-m", "swiftlite.cli", "web-ui", "--port", str(port), "--output_root",
         root, *extra], stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=str(tmp),
        env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", **(env or {})},
        start_new_session=True)
    url = f"http://127.0.0.1:{port}/"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"web-ui exited {proc.returncode}:\n{open(log).read()[-4000:]}")
        try:
            urllib.request.urlopen(url, timeout=2)
            return proc, url, root, log
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"web-ui did not answer on {url}:\n{open(log).read()[-4000:]}")


def stop_app(proc, root):
    from swiftlite.webui.runs import find_runs, read_state
    for run in find_runs(root):  # never leave a training child behind, even on failure
        state = read_state(run)
        if state.get("status") == "running" and state.get("pgid"):
            try:
                os.killpg(state["pgid"], signal.SIGKILL)
            except ProcessLookupError:
                pass
    os.killpg(proc.pid, signal.SIGTERM)
    proc.wait(timeout=30)


@pytest.fixture(scope="module")
def browser():
    if not os.path.exists(CHROMIUM):
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (see scripts/test.sh)")
    from playwright.sync_api import sync_playwright
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        yield b
        b.close()


def open_page(browser, url, external: list | None = None):
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    if external is not None:  # the page must not need any host but the app itself
        page.on("request", lambda r: external.append(r.url)
                if not r.url.startswith((url.rstrip("/"), "data:", "blob:")) else None)
    page.goto(url)
    page.wait_for_selector("#train-start", timeout=60_000)
    return page


def field(page, elem_id):
    return page.locator(f"#{elem_id}").locator("input, textarea").first


def fill_until_kept(page, elem_id, value, tries=5):
    """Fill a field that an accordion has just opened: under load Gradio may mount its input
    again after the first fill (seen once in CI: the field was empty when the form was read)."""
    for _ in range(tries):
        field(page, elem_id).fill(value)
        page.wait_for_timeout(300)
        if field(page, elem_id).input_value() == value:
            return
    raise AssertionError(f"#{elem_id} does not keep {value!r}")


def status_text(page) -> str:
    return page.locator("#run-status").inner_text()


def wait_status(page, pattern, timeout_s, message=""):
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = status_text(page)
        if re.search(pattern, text):
            return text
        assert "Error" not in text, f"{message}: the page shows an error: {text!r}"
        page.wait_for_timeout(500)
    raise AssertionError(f"{message}: status is {status_text(page)!r}\nlog:\n"
                         f"{page.locator('#run-log textarea').input_value()[-3000:]}")


def shot(page, name):
    os.makedirs(SHOTS, exist_ok=True)
    page.screenshot(path=os.path.join(SHOTS, f"{name}.png"), full_page=True)


STEPS = 10  # of the first run the browser test starts: its checkpoint is inferred, merged, ...


def fill_run_form(page, max_steps: int):
    field(page, "train-model").fill("tiny-qwen2")
    page.get_by_role("option", name="tiny-qwen2", exact=True).click()
    if not page.locator("#train-logging_steps input, #train-logging_steps textarea").first \
            .is_visible():
        page.get_by_text("more train arguments").click()
    values = {"dataset": "self-cognition#32", "model_name": "Swifty", "model_author": "Lab",
              "max_steps": str(max_steps), "per_device_train_batch_size": "4",
              "gradient_accumulation_steps": "1", "learning_rate": "5e-3",
              "logging_steps": "1", "save_steps": "15", "extra": "--report_to none"}
    for name, value in values.items():
        fill_until_kept(page, f"train-{name}", value)


def click_and_wait(page, button, target, pattern, timeout_s=60):
    """Click, then wait for the target element's text to match (handlers are async)."""
    page.locator(f"#{button}").click()
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        text = page.locator(f"#{target}").inner_text()
        if re.search(pattern, text):
            return text
        page.wait_for_timeout(300)
    raise AssertionError(f"#{target} never matched {pattern!r}: {text!r}")


def test_train_infer_eval_export_and_stop_in_a_browser(tmp_path, browser):
    from swiftlite.webui.runs import find_runs, read_state
    proc, url, root, log = start_app(tmp_path)
    external, page = [], None
    try:
        page = open_page(browser, url, external)

        # Form errors appear next to the form, before anything starts.
        field(page, "train-model").fill("no-such-model")
        field(page, "train-learning_rate").fill("fast")
        text = click_and_wait(page, "train-start", "train-message", "Please fix")
        assert "--dataset is required" in text and "--model no-such-model" in text
        assert "--learning_rate: expected a number, got 'fast'" in text
        assert not find_runs(root)

        # An uploaded dataset is kept inside the output root and added to the dataset field.
        upload = write_jsonl(tmp_path / "my-data.jsonl", CHAT_ROWS)
        page.locator("#train-upload input[type=file]").set_input_files(upload)
        kept = os.path.join(root, "uploads", "my-data.jsonl")
        expect(field(page, "train-dataset")).to_have_value(kept, timeout=20_000)
        assert open(kept).read() == open(upload).read()

        # Preview shows the exact command.
        fill_run_form(page, max_steps=STEPS)
        cmd = click_and_wait(page, "train-preview", "train-command", "swiftlite sft")
        for flag in ("--model tiny-qwen2", "--dataset 'self-cognition#32'",
                     f"--max_steps {STEPS}",
                     "--learning_rate 0.005", "--logging_steps 1", "--report_to none",
                     f"--output_dir {root}/tiny-qwen2"):
            assert flag in cmd, cmd
        shot(page, "train-preview")

        # Start: the run finishes, its log and loss curve shown (the curve growing while a run
        # trains is watched on the second run below, which runs until it is stopped).
        click_and_wait(page, "train-start", "train-message", "Started")
        wait_status(page, r"finished|failed", 300, "the run did not end")
        assert "finished" in status_text(page), page.locator("#run-log textarea").input_value()
        assert "[swiftlite]" in page.locator("#run-log textarea").input_value()
        assert page.locator("#run-plot canvas, #run-plot svg").count() > 0
        shot(page, "train-finished")
        (run,) = find_runs(root)
        assert read_state(run)["status"] == "finished" and read_state(run)["returncode"] == 0
        ckpt = os.path.join(run, f"checkpoint-{STEPS}")
        assert os.path.isfile(os.path.join(ckpt, "adapter_config.json"))

        # The same state after a reload and in a second browser.
        page.reload()
        page.wait_for_selector("#train-start")
        wait_status(page, r"finished", 20, "after a reload")
        other = open_page(browser, url)
        expect(other.locator("#runs-table")).to_contain_text("finished", timeout=20_000)

        # Infer: load the checkpoint, get an answer, unload.
        page.get_by_role("tab", name="Infer").click()
        field(page, "infer-source").fill(ckpt)
        click_and_wait(page, "infer-load", "infer-state", "Loaded|error|fix", 120)
        assert "Loaded" in page.locator("#infer-state").inner_text()
        page.get_by_text("generation settings").click()
        field(page, "infer-max_new_tokens").fill("16")
        field(page, "infer-prompt").fill("Who are you?")
        page.locator("#infer-send").click()
        bot = page.locator("#infer-chat .bot, #infer-chat [data-testid='bot']").last
        bot.wait_for(timeout=60_000)
        deadline = time.time() + 60
        while time.time() < deadline and not bot.inner_text().strip():
            page.wait_for_timeout(300)
        answer = bot.inner_text().strip()
        assert answer and "load a checkpoint" not in answer and "error" not in answer, answer
        shot(page, "infer")
        click_and_wait(page, "infer-unload", "infer-state", "No model loaded")

        # Export: merge the checkpoint; the merged folder is a plain model.
        page.get_by_role("tab", name="Export").click()
        field(page, "export-ckpt").fill(ckpt)
        text = click_and_wait(page, "export-merge", "export-result", "Merged model|fix|failed",
                              240)
        assert "Merged model" in text, page.locator("#export-log textarea").input_value()
        merged = page.locator("#export-folder").inner_text()
        assert os.path.isfile(os.path.join(merged, "config.json"))
        assert not os.path.exists(os.path.join(merged, "adapter_config.json"))
        shot(page, "export")
        if HAS_LLAMACPP:  # GGUF: q8_0 is llama.cpp's converter alone (the k-quants: test_export)
            field(page, "export-quant").click()
            page.get_by_role("option", name="q8_0", exact=True).click()
            text = click_and_wait(page, "export-gguf", "export-result",
                                  "GGUF and Modelfile|fix|failed", 240)
            assert "GGUF and Modelfile" in text, page.locator("#export-log textarea").input_value()
            folder = page.locator("#export-folder").inner_text()
            assert folder == ckpt + "-gguf", folder
            name = f"{os.path.basename(run)}-checkpoint-{STEPS}-q8_0.gguf".lower()
            assert sorted(os.listdir(folder)) == [".swiftlite-output.json", "Modelfile", name]
            shot(page, "export-gguf")
        else:
            warnings.warn("no llama.cpp venv: the Export tab's GGUF step was not run")

        # Eval: the checkpoint against its base on "who are you" questions.
        who = os.path.join(root, "who.jsonl")
        with open(who, "w") as f:
            for q in ("Who are you?", "What is your name?"):
                f.write(json.dumps({"messages": [{"role": "user", "content": q}, {
                    "role": "assistant", "content": "I am Swifty, an AI assistant by Lab."}]})
                        + "\n")
        page.get_by_role("tab", name="Eval").click()
        field(page, "eval-ckpt").fill(ckpt)
        for name, value in (("eval_dataset", who), ("compare", "tiny-qwen2"),
                            ("max_new_tokens", "8")):
            field(page, f"eval-{name}").fill(value)
        text = click_and_wait(page, "eval-run", "eval-result", "Figures and predictions|fix|failed",
                              240)
        assert "Figures and predictions" in text, page.locator("#eval-log textarea").input_value()
        folder = page.locator("#eval-folder").inner_text()
        metrics = json.load(open(os.path.join(folder, "metrics.json")))
        assert metrics["compare"]["model"] == "tiny-qwen2" and metrics["overall"]["rows"] == 2
        cells = page.locator("#eval-metrics tr[data-metric='rougeL'] td")
        assert cells.nth(1).inner_text() == f"{metrics['overall']['rougeL']:.2f}"
        assert cells.nth(2).inner_text() == f"{metrics['compare']['overall']['rougeL']:.2f}"
        page.locator("#eval-chart img").wait_for(timeout=20_000)
        shot(page, "eval")

        # A second run: a concurrent Start is refused; Stop ends it midway.
        page.get_by_role("tab", name="Train").click()
        fill_run_form(page, max_steps=5000)  # the reload above emptied the form
        click_and_wait(page, "train-start", "train-message", "Started")
        points, t0 = set(), time.time()  # the loss curve grows while the run trains
        while len(points - {0}) < 2 and time.time() - t0 < 300:
            text = status_text(page)
            if "running" in text and (m := re.search(r"(\d+) loss points", text)):
                points.add(int(m.group(1)))
            page.wait_for_timeout(400)
        assert len(points - {0}) >= 2, f"the loss curve never updated while training: {points}"
        wait_status(page, r"running · step ([2-9]|\d\d+)/", 60,
                    "the second run never logged two steps")
        text = click_and_wait(page, "train-start", "train-message", "already in progress")
        assert len(find_runs(root)) == 2  # the refused start made no folder
        click_and_wait(page, "train-stop", "train-message", "Stopping")
        wait_status(page, r"\bstopped\b", 60, "the run was not stopped")
        run2 = next(r for r in find_runs(root) if r != run)
        state = read_state(run2)
        assert state["status"] == "stopped" and state["returncode"] != 0
        assert not os.path.exists(os.path.join(run2, "metrics.json"))
        assert 0 < max(r["step"] for r in map(json.loads, open(os.path.join(
            run2, "logging.jsonl")))) < 5000
        other.reload()
        expect(other.locator("#runs-table")).to_contain_text("stopped", timeout=20_000)
        shot(page, "train-stopped")
        assert not external, f"the page requested other hosts: {external[:5]}"
    except Exception:
        if page is not None:
            shot(page, "failure")  # what the page showed when the flow broke
        raise
    finally:
        stop_app(proc, root)


def test_login_required_with_auth(tmp_path, browser):
    """--auth (here from SWIFTLITE_WEBUI_AUTH): the app shows a login form first."""
    proc, url, root, log = start_app(tmp_path, env={"SWIFTLITE_WEBUI_AUTH": "alice:s3cret"})
    try:
        page = browser.new_context().new_page()
        page.goto(url)
        # Without a login, the app's endpoints refuse to serve its config.
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(url + "config", timeout=10)
        assert e.value.code in (401, 403)
        page.get_by_label("username").fill("alice")
        page.get_by_label("password").fill("wrong")
        page.get_by_role("button", name="Login").click()
        page.get_by_text("Incorrect Credentials").wait_for(timeout=20_000)
        assert page.locator("#train-start").count() == 0
        page.get_by_label("username").fill("alice")  # the form is emptied after a failure
        page.get_by_label("password").fill("s3cret")
        page.get_by_role("button", name="Login").click()
        page.wait_for_selector("#train-start", timeout=30_000)
    finally:
        stop_app(proc, root)


def test_foreign_hosts_cross_site_requests_and_big_uploads_are_refused(tmp_path):
    """DNS rebinding (a foreign Host header), a cross-site request (a foreign Origin, or
    Origin: null from a sandboxed page), a non-JSON body to a JSON route (what a form of
    another site can post) and an upload over --max_upload_size, against the real server; the
    app's own requests pass."""
    import http.client
    proc, url, root, log = start_app(tmp_path, "--max_upload_size", "64KiB")
    port = int(url.rsplit(":", 1)[1].strip("/"))

    def get(path, **headers):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        c.request("GET", path, headers=headers)
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")

    def post(path, body, content_type, **headers):
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        c.request("POST", path, body=body, headers={"Content-Type": content_type, **headers})
        r = c.getresponse()
        return r.status, r.read().decode("utf-8", "replace")

    def upload(size, **headers):
        body = (b"--b\r\nContent-Disposition: form-data; name=\"files\"; filename=\"d.jsonl\"\r\n"
                b"Content-Type: application/octet-stream\r\n\r\n" + b"x" * size + b"\r\n--b--\r\n")
        return post("/gradio_api/upload", body, "multipart/form-data; boundary=b", **headers)

    try:
        assert get("/config")[0] == 200
        status, body = get("/config", Host=f"attacker.example:{port}")
        assert status == 403 and "not a name of this Web-UI" in body
        status, body = get("/config", Origin="http://attacker.example")
        assert status == 403 and "cross-site request" in body
        assert get("/config", Origin=f"http://127.0.0.1:{port}")[0] == 200
        status, body = get("/config", Origin="null")
        assert status == 403 and "Origin: null" in body
        assert upload(1000, Origin="null")[0] == 403  # answered 200 before
        join = json.dumps({"data": [], "fn_index": 0, "session_hash": "s", "trigger_id": 1})
        status, body = post("/gradio_api/queue/join", join, "text/plain")
        assert status == 415 and "application/json" in body
        assert post("/gradio_api/queue/join", join, "application/json", Origin="null")[0] == 403
        assert upload(1000)[0] == 200
        status, body = upload(200_000)
        assert status == 413, (status, body)
    finally:
        stop_app(proc, root)


def test_preference_stage_in_a_browser(tmp_path, browser):
    """The stage choice: DPO turns the form into `swiftlite rlhf --rlhf_type dpo`, whose run
    trains on uploaded pairs and logs the rewards; back on SFT the preference fields are unused."""
    from test_rlhf import arithmetic_pairs

    from swiftlite.webui.runs import find_runs, read_state
    proc, url, root, log = start_app(tmp_path)
    page = None
    try:
        page = open_page(browser, url)
        pairs = write_jsonl(tmp_path / "pairs.jsonl", arithmetic_pairs(16, 3))
        page.locator("#train-upload input[type=file]").set_input_files(pairs)
        kept = os.path.join(root, "uploads", "pairs.jsonl")
        expect(field(page, "train-dataset")).to_have_value(kept, timeout=20_000)
        field(page, "train-model").fill("tiny-qwen2")
        page.get_by_role("option", name="tiny-qwen2", exact=True).click()
        page.locator("#train-stage").get_by_text("DPO", exact=True).click()
        for name, value in {"max_steps": "4", "per_device_train_batch_size": "4",
                            "gradient_accumulation_steps": "1", "learning_rate": "1e-2",
                            "extra": "--report_to none"}.items():
            field(page, f"train-{name}").fill(value)
        page.get_by_text("more train arguments").click()
        fill_until_kept(page, "train-logging_steps", "1")
        page.get_by_text("more rlhf arguments").click()
        fill_until_kept(page, "train-beta", "0.2")
        cmd = click_and_wait(page, "train-preview", "train-command", "swiftlite rlhf")
        assert "--rlhf_type dpo" in cmd and "--beta 0.2" in cmd and "--logging_steps 1" in cmd, cmd
        shot(page, "rlhf-preview")
        click_and_wait(page, "train-start", "train-message", "Started")
        wait_status(page, r"finished|failed", 240, "the DPO run did not finish")
        (run,) = find_runs(root)
        assert read_state(run)["status"] == "finished", open(os.path.join(run, "webui.log")
                                                             ).read()[-3000:] \
            if os.path.exists(os.path.join(run, "webui.log")) else read_state(run)
        rows = [json.loads(line) for line in open(os.path.join(run, "logging.jsonl"))]
        assert sum("rewards/margins" in r and "loss" in r for r in rows) == 4, rows
        wait_status(page, r"4 loss points", 30, "the page did not show the run's losses")
        assert json.load(open(os.path.join(run, "args.json")))["rlhf_type"] == "dpo"
        shot(page, "rlhf-finished")
        page.locator("#train-stage").get_by_text("SFT", exact=True).click()
        cmd = click_and_wait(page, "train-preview", "train-command", "swiftlite sft")
        assert "--beta" not in cmd and "rlhf" not in cmd, cmd
    except Exception:
        if page is not None:
            shot(page, "rlhf-failure")
        raise
    finally:
        stop_app(proc, root)
