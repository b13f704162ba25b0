"""A cold start as a new operator meets it: `serve run serve_config.yaml` on a fresh cache
(GGUF conversion, native kernel build, GEMM probe), and a completion sent the moment
port 8000 answers anything. It must get its answer, not a 503 or Serve's 404: the proxy
opens before the controller has built the app, and proxy_middleware.py holds the
request until the app's route exists.

    .venv/bin/python scripts/check_cold_start.py [--keep-cache]

Prints when the port first answered and what /health said then, the completion's status
and how long it waited (through the app's build and the model's cold start), and when
/health turned 200. The platform is stopped (SIGTERM to `serve run`, then `ray stop`)
at the end.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

logger = logging.getLogger("check_cold_start")
URL = "http://127.0.0.1:8000"
KEY = "sk-loraplex-demo"
PORT_WAIT_S = 600.0


def _get(path: str, timeout: float = 30.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(URL + path, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as error:
        return 0, repr(error)


def _complete(timeout: float) -> tuple[int, str]:
    body = {"model": "smollm2-135m-instruct", "prompt": "Hello, my name is", "max_tokens": 8}
    request = urllib.request.Request(
        URL + "/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")


def _port_answers() -> tuple[int, str] | None:
    status, body = _get("/health", timeout=2.0)
    return None if status == 0 else (status, body)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--keep-cache", action="store_true", help="use the usual cache")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled"}
    cache = None
    if not args.keep_cache:
        cache = tempfile.mkdtemp(prefix="loraplex-fresh-cache-")
        env["LORAPLEX_CACHE_DIR"] = cache
    serve = shutil.which("serve", path=str(Path(sys.executable).parent)) or "serve"
    started = time.monotonic()
    process = subprocess.Popen(
        [serve, "run", "serve_config.yaml"],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        first = None
        while first is None:
            if time.monotonic() - started > PORT_WAIT_S or process.poll() is not None:
                logger.error("the port never answered (serve run exit %s)", process.poll())
                return 1
            first = _port_answers()
            if first is None:
                time.sleep(0.1)
        answered_s = time.monotonic() - started
        logger.info("port answered after %.1f s: /health %d %s", answered_s, *first)
        status, body = _complete(timeout=PORT_WAIT_S)
        logger.info(
            "the completion sent at %.1f s got %d after %.1f s: %s",
            answered_s,
            status,
            time.monotonic() - started - answered_s,
            body[:160],
        )
        while _get("/health")[0] != 200:
            time.sleep(0.5)
        logger.info("/health 200 after %.1f s", time.monotonic() - started)
        return 0 if status == 200 else 1
    finally:
        os.killpg(process.pid, signal.SIGTERM)
        process.wait(timeout=120)
        subprocess.run([str(Path(serve).parent / "ray"), "stop", "--force"], env=env, check=False)
        if cache is not None:
            shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
