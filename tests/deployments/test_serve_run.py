"""The README's quick start, for real: `serve run serve_config.yaml` from the repository
root starts the platform on the embedded default model; the demo tenant chats with it
(base and a demo adapter) through the `openai` SDK; Ctrl-C stops it cleanly, even when
the parent ignores SIGINT (a background job of a non-interactive shell, some CI runners):
the child gets the default dispositions back (`default_stop_signals`)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from loraplex.deployments.bench.server import default_stop_signals

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
