"""The README's quick start, for real: `serve run serve_config.yaml` from the repository
root starts the platform on the embedded default model, served over HTTP by the ingress
replica itself (no Serve proxy process); a completion sent the moment the port accepts a
connection gets its answer; the demo tenant chats with it
(base and a demo adapter) through the `openai` SDK; Ctrl-C stops it cleanly, even when
the parent ignores SIGINT (a background job of a non-interactive shell, some CI runners):
the child gets the default dispositions back (`default_stop_signals`)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest

from loraplex.tools.serve_bench.server import default_stop_signals

REPO = Path(__file__).resolve().parents[2]
URL = "http://127.0.0.1:8000"
DEMO_KEY = "sk-loraplex-demo"
MODEL = "smollm2-135m-instruct"


def _healthy() -> bool:
    try:
        with urllib.request.urlopen(f"{URL}/health", timeout=2) as response:
            return response.status == 200
    except OSError:
        return False


def _port_open() -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", 8000)) == 0


def _first_completion(timeout_s: float) -> tuple[int, str]:
    """A completion sent the moment the port accepts a connection (the ingress replica
    opens it as it starts, before the model's replica is up): it must wait through the
    model's cold start for its answer (the ingress's `cold_start_wait_s`), not get a
    404 or a 503."""
    body = {"model": MODEL, "prompt": "Hello, my name is", "max_tokens": 4}
    request = urllib.request.Request(
        f"{URL}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {DEMO_KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


@pytest.mark.slow
def test_serve_run_serve_config_answers_chat_and_stops_cleanly(tmp_path):
    assert not _healthy(), "something already answers on 127.0.0.1:8000"
    serve_cli = Path(sys.executable).with_name("serve")
    log = (tmp_path / "serve-run.log").open("w")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)
    inherited = signal.signal(signal.SIGINT, signal.SIG_IGN)  # the worst parent
    try:
        process = subprocess.Popen(
            [str(serve_cli), "run", "serve_config.yaml"],
            cwd=REPO,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=default_stop_signals,
        )
    finally:
        signal.signal(signal.SIGINT, inherited)
    try:
        deadline = time.monotonic() + 420
        while not _port_open():
            assert process.poll() is None, (tmp_path / "serve-run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "nothing listened on 127.0.0.1:8000"
            time.sleep(0.1)
        status, body = _first_completion(timeout_s=deadline - time.monotonic())
        assert status == 200, body
        assert json.loads(body)["choices"][0]["text"], body
        while not _healthy():
            assert process.poll() is None, (tmp_path / "serve-run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "serve run did not become ready"
            time.sleep(2)
        client = openai.OpenAI(base_url=f"{URL}/v1", api_key=DEMO_KEY, max_retries=3)
        wait_until = time.monotonic() + 120
        models = set()
        while time.monotonic() < wait_until and MODEL not in models:
            try:
                models = {m.id for m in client.models.list().data}
            except openai.APIError:
                time.sleep(2)
        assert {MODEL, f"{MODEL}:french", f"{MODEL}:pirate"} <= models
        messages = [{"role": "user", "content": "What is the capital of France?"}]
        base = client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=24, temperature=0
        )
        assert base.choices[0].message.content.strip()
        french = client.chat.completions.create(
            model=f"{MODEL}:french", messages=messages, max_tokens=24, temperature=0
        )
        assert french.choices[0].message.content != base.choices[0].message.content
        titles = subprocess.run(
            ["ps", "-s", str(process.pid), "-o", "args="], capture_output=True, text=True
        ).stdout
        assert "ServeReplica:loraplex:OpenAIIngress" in titles, titles
        assert "ProxyActor" not in titles, titles
    finally:
        os.killpg(process.pid, signal.SIGINT)
        try:
            process.wait(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            raise
        finally:
            log.close()
    output = (tmp_path / "serve-run.log").read_text()
    assert process.returncode == 0, output[-3000:]
    assert not _healthy(), "the platform still answers after Ctrl-C"
