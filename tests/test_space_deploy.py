"""Runs as a Hugging Face Space: the README's front matter and requirements resolve for the Python it
names, and the server honours the variables a Space (or any container) sets."""
from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from core.settings import Settings

ROOT = Path(__file__).resolve().parent.parent
# the Space's machine: Linux x86-64 with a recent glibc; a wheel for any of these tags installs there
SPACE_PLATFORMS = ["manylinux_2_28_x86_64"] + [f"manylinux_2_{v}_x86_64" for v in range(17, 28)] + \
    ["manylinux2014_x86_64", "linux_x86_64"]


def front_matter() -> dict[str, str]:
    text = (ROOT / "README.md").read_text()
    m = re.match(r"---\n(.*?)\n---\n", text, re.S)
    assert m, "README.md must start with the Space's YAML front matter"
    out = {}
    for line in m.group(1).splitlines():
        key, _, value = line.partition(":")
        out[key.strip()] = value.strip().strip('"').strip("'")
    return out


def pins(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, version = line.split("==", 1)
            out[name.strip().lower()] = version.strip()
    return out


def test_front_matter_names_python_and_the_pinned_gradio():
    fm = front_matter()
    assert fm["sdk"] == "gradio" and fm["app_file"] == "app.py"
    assert re.fullmatch(r"3\.\d+", fm.get("python_version", "")), "python_version must be set (e.g. \"3.11\")"
    assert fm["sdk_version"] == pins(ROOT / "requirements.txt")["gradio"]
    # what the README tells a person matches what the Space gets
    minor = fm["python_version"]
    assert f"Python ≥ {minor}" in (ROOT / "README.md").read_text()
    assert f"(3, {minor.split('.')[1]})" in (ROOT / "Makefile").read_text()


def _pypi_reachable() -> bool:
    try:
        with socket.create_connection(("pypi.org", 443), timeout=5):
            return True
    except OSError:
        return False


@pytest.mark.slow
def test_requirements_resolve_for_the_space_python(tmp_path):
    """pip resolves the Space's install (gradio[oauth] at sdk_version, which the Space adds, plus
    requirements.txt) from binary wheels for the front matter's Python on Linux x86-64."""
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable from here (CI reaches it)")
    fm = front_matter()
    cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
           "--python-version", fm["python_version"], "--only-binary=:all:",
           *[a for p in SPACE_PLATFORMS for a in ("--platform", p)],
           "--report", str(tmp_path / "report.json"),
           f"gradio[oauth]=={fm['sdk_version']}", "-r", str(ROOT / "requirements.txt")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "PIP_NO_INPUT": "1"})
    errors = "\n".join(line for line in (r.stdout + r.stderr).splitlines() if not line.startswith("WARNING: Location"))
    assert r.returncode == 0, f"requirements do not resolve for Python {fm['python_version']}:\n{errors[-3000:]}"
    import json

    report = json.loads((tmp_path / "report.json").read_text())
    got = {i["metadata"]["name"].lower(): i["metadata"]["version"] for i in report["install"]}
    for name, version in pins(ROOT / "requirements.txt").items():
        assert got.get(name, "").split("+")[0] == version, f"{name}: pinned {version}, resolved {got.get(name)}"


@pytest.mark.slow
def test_requirements_do_not_resolve_for_python_3_10():
    """The reason python_version is set: Spaces' default (3.10) cannot install these pins."""
    if not _pypi_reachable():
        pytest.skip("PyPI is not reachable from here (CI reaches it)")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
                        "--python-version", "3.10", "--only-binary=:all:",
                        *[a for p in SPACE_PLATFORMS for a in ("--platform", p)], "numpy==" +
                        pins(ROOT / "requirements.txt")["numpy"]], capture_output=True, text=True, timeout=300)
    assert r.returncode != 0


# -- where it listens ------------------------------------------------------------------------------
def test_gradio_server_variables_are_honoured(monkeypatch):
    for k in ("ATELIER_HOST", "ATELIER_PORT", "SPACE_ID", "ATELIER_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("GRADIO_SERVER_NAME", "0.0.0.0")
    monkeypatch.setenv("GRADIO_SERVER_PORT", "7861")
    s = Settings.from_env()
    assert (s.host, s.port) == ("0.0.0.0", 7861)
    assert s.public, "a non-loopback address serves strangers: public mode by default"
    monkeypatch.setenv("ATELIER_HOST", "127.0.0.1")      # ours win over Gradio's
    assert Settings.from_env().host == "127.0.0.1" and not Settings.from_env().public
    assert Settings.from_env(host="127.0.0.5").host == "127.0.0.5"   # and the command line over both


def test_a_space_listens_on_all_addresses_in_public_mode(monkeypatch):
    for k in ("ATELIER_HOST", "GRADIO_SERVER_NAME", "ATELIER_MODE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SPACE_ID", "someone/atelier")
    s = Settings.from_env()
    assert s.host == "0.0.0.0" and s.on_space and s.public
    assert Settings.from_env(mode="local").mode == "local"     # the host can say otherwise


def _bound_port(host: str) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((host, 0))
    return s


@pytest.mark.slow
def test_app_listens_where_gradio_variables_say(tmp_path):
    """`python app.py` with only GRADIO_SERVER_NAME/PORT set serves there (127.0.0.2: another loopback address,
    so the test shows the variable was read, not the default). The startup banner names our flags."""
    host = "127.0.0.2"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ATELIER_", "GRADIO_", "SPACE"))}
    env.update(GRADIO_SERVER_NAME=host, ATELIER_OUTPUT_DIR=str(tmp_path / "out"),
               ATELIER_CACHE_DIR=str(tmp_path / "cache"), ATELIER_MODELS_DIR=str(tmp_path / "models"),
               ATELIER_RUNS_DIR=str(tmp_path / "runs"), GRADIO_ANALYTICS_ENABLED="False", PYTHONUNBUFFERED="1")
    for _attempt in range(3):     # the port is free when picked; another process may take it before the app binds
        sock = _bound_port(host)
        port = sock.getsockname()[1]
        sock.close()
        env["GRADIO_SERVER_PORT"] = str(port)
        log = tmp_path / f"app-{port}.log"
        with open(log, "w") as out:
            proc = subprocess.Popen([sys.executable, "app.py", "--device", "cpu"], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 240
            while time.monotonic() < deadline and proc.poll() is None:
                if "Atelier studio" in log.read_text():
                    break
                time.sleep(0.5)
            text = log.read_text()
            if proc.poll() is not None and "Cannot find empty port" in text:
                continue
            assert proc.poll() is None, f"the app exited:\n{text[-2000:]}"
            assert f"http://{host}:{port}" in text, text[-2000:]
            with urllib.request.urlopen(f"http://{host}:{port}/", timeout=30) as r:
                assert r.status == 200
            assert "--share" in text and "share=True" not in text, "the banner must name our flag"
            return
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    pytest.fail("no free port could be bound three times in a row")
