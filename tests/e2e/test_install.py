"""swiftlite installs from a wheel, not only from a checkout: the templates, presets and the
built-in dataset ship inside the package. The fresh venv borrows only the third-party
dependencies of the test environment (a path entry, not its editable swiftlite)."""
import glob
import os
import subprocess
import sys
import sysconfig

import pytest

from helpers.cli import REPO

pytestmark = pytest.mark.slow


def test_wheel_installs_into_a_fresh_venv_with_its_data(tmp_path):
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(dist), REPO], check=True)
    wheel = glob.glob(str(dist / "swiftlite-*.whl"))[0]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", wheel],
                   check=True)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    with open(os.path.join(site, "deps.pth"), "w") as f:
        f.write(sysconfig.get_paths()["purelib"] + "\n")
    code = (
        "import swiftlite, os\n"
        "from swiftlite.data.template import template_names\n"
        "from swiftlite.data import load_conversations\n"
        "assert 'site-packages' in swiftlite.__file__ and os.path.dirname(swiftlite.__file__) != "
        f"{os.path.join(REPO, 'swiftlite')!r}, swiftlite.__file__\n"
        "assert {'qwen', 'chatml', 'smollm', 'llama3', 'default'} <= set(template_names())\n"
        "convs, _ = load_conversations(['self-cognition#5'], model_name=['X'], model_author=['Y'])\n"
        "assert len(convs) == 5\n"
        "import importlib.resources as r\n"
        "assert (r.files('swiftlite.training.deepspeed_configs') / 'zero2.json').is_file()\n"
        "import swiftlite.webui.app, importlib.util\n"
        "assert importlib.util.find_spec('webui') is None  # no generic top-level package\n"
        "print('ok')\n")
    r = subprocess.run([str(py), "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr
    r = subprocess.run([str(venv / "bin" / "swiftlite"), "sft", "--help"], capture_output=True,
                       text=True, cwd=tmp_path)
    assert r.returncode == 0 and "--lora_rank" in r.stdout
