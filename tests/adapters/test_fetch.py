"""Fetching adapter folders from a real S3-compatible server (moto's server mode with
IAM authentication on, tests/s3_server.py): content-addressed folders, one download per
URI, refusals before any download, slow and replaced objects, and the cache's eviction
(adapters/fetch.py)."""

from __future__ import annotations

import hashlib
import http.server
import logging
import os
import threading
import time
from pathlib import Path

import pytest
from filelock import FileLock
from s3_server import s3_server, throttled

from loraplex.adapters.fetch import (
    EVICTION_GRACE_S,
    FETCHED_DIR,
    AdapterFetcher,
    FetchError,
    FetchLimits,
)
from loraplex.adapters.sources import AdapterSource, SecretRef, parse_adapter_uri
from loraplex.adapters.store import ADAPTER_FILES

CONFIG, WEIGHTS = ADAPTER_FILES
LIMITS = FetchLimits(max_bytes=1 << 20, max_files=8, timeout_s=60, chunk_bytes=16 << 10)


@pytest.fixture(scope="module")
def s3():
    with s3_server() as server:
        yield server


def put_adapter(s3, prefix: str, weights: bytes = b"w" * 1000, config: bytes = b"{}") -> None:
    s3.put(f"{prefix}/{CONFIG}", config)
    s3.put(f"{prefix}/{WEIGHTS}", weights)


@pytest.fixture(scope="module")
def team_a(s3, tmp_path_factory):
    """A source for `s3://adapters/team-a` with that prefix's own IAM user."""
    key, secret = s3.user_for_prefix("team-a", "team-a")
    folder = tmp_path_factory.mktemp("creds")
    (folder / "key").write_text(key)
    (folder / "secret").write_text(secret)
    return AdapterSource(
        prefix="s3://adapters/team-a",
        endpoint_url=s3.endpoint,
        access_key_id={"file": str(folder / "key")},
        secret_access_key={"file": str(folder / "secret")},
    )


def fetch(source: AdapterSource, uri: str, root: Path, limits: FetchLimits = LIMITS):
    return AdapterFetcher(limits).fetch(root, parse_adapter_uri(uri), source.access())


def test_the_same_bytes_give_the_same_folder_and_an_unchanged_object_is_not_downloaded_again(
    s3, team_a, tmp_path
):
    put_adapter(s3, "team-a/one")
    put_adapter(s3, "team-a/copy")
    first = fetch(team_a, "s3://adapters/team-a/one", tmp_path)
    assert first.downloaded and first.folder == tmp_path / FETCHED_DIR / first.sha256
    assert (first.folder / WEIGHTS).read_bytes() == b"w" * 1000 and first.size == 1002
    assert first.relative == f"{FETCHED_DIR}/{first.sha256}"
    copy = fetch(team_a, "s3://adapters/team-a/copy", tmp_path)
    assert copy.folder == first.folder and copy.downloaded, "same bytes, same identity"
    again = fetch(team_a, "s3://adapters/team-a/one", tmp_path)
    assert again.folder == first.folder and not again.downloaded
    put_adapter(s3, "team-a/one", weights=b"v" * 1000)
    changed = fetch(team_a, "s3://adapters/team-a/one", tmp_path)
    assert changed.downloaded and changed.sha256 != first.sha256
    assert not [p for p in (tmp_path / FETCHED_DIR).iterdir() if p.name.startswith(".partial")]


def test_concurrent_fetches_of_one_uri_download_it_once(s3, team_a, tmp_path, caplog):
    put_adapter(s3, "team-a/busy", weights=b"b" * 50_000)
    fetcher = AdapterFetcher(LIMITS)
    uri = parse_adapter_uri("s3://adapters/team-a/busy")
    with throttled(s3.endpoint, 100_000) as slow:
        source = team_a.model_copy(update={"endpoint_url": slow})
        results = []

        def one() -> None:
            results.append(fetcher.fetch(tmp_path, uri, source.access()))

        with caplog.at_level(logging.INFO, logger="loraplex.adapters.fetch"):
            threads = [threading.Thread(target=one) for _ in range(6)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(60)
    assert len(results) == 6 and len({r.folder for r in results}) == 1
    assert caplog.text.count(" fetched: ") == 1, caplog.text


@pytest.mark.parametrize(
    ("uri", "status", "code"),
    [
        ("s3://adapters/team-a/nothing-here", 404, "adapter_not_found"),
        ("s3://adapters/team-a/half", 404, "adapter_not_found"),
        ("s3://adapters/team-a/big", 413, "adapter_too_large"),
        ("s3://adapters/team-a/crowded", 413, "adapter_too_large"),
        ("s3://adapters/team-b/theirs", 403, "source_denied"),
    ],
)
def test_what_cannot_be_fetched_is_refused_before_any_download(
    s3, team_a, tmp_path, uri, status, code
):
    s3.put(f"team-a/half/{CONFIG}", b"{}")
    put_adapter(s3, "team-a/big", weights=b"x" * (LIMITS.max_bytes + 1))
    put_adapter(s3, "team-a/crowded")
    for i in range(LIMITS.max_files):
        s3.put(f"team-a/crowded/extra-{i}", b"")
    put_adapter(s3, "team-b/theirs")
    source = team_a.model_copy(update={"prefix": "s3://adapters"})
    with pytest.raises(FetchError) as refused:
        fetch(source, uri, tmp_path)
    assert (refused.value.status, refused.value.code) == (status, code), refused.value
    assert not list((tmp_path / FETCHED_DIR).glob(".partial-*"))
    assert not list((tmp_path / FETCHED_DIR).glob("?" * 64))


def test_a_wrong_secret_is_refused_and_appears_in_no_error_or_log(
    s3, team_a, tmp_path, caplog, monkeypatch
):
    put_adapter(s3, "team-a/locked")
    monkeypatch.setenv("WRONG_SECRET", "wrong-secret-value-123")
    source = team_a.model_copy(update={"secret_access_key": SecretRef(env="WRONG_SECRET")})
    key = Path(team_a.access_key_id.file).read_text()
    with caplog.at_level(logging.DEBUG), pytest.raises(FetchError) as refused:
        fetch(source, "s3://adapters/team-a/locked", tmp_path)
    assert refused.value.status == 403
    for secret in ("wrong-secret-value-123", key):
        assert secret not in str(refused.value) and secret not in caplog.text


def test_a_slow_object_logs_progress_and_one_past_the_deadline_fails_with_503(
    s3, team_a, tmp_path, caplog
):
    put_adapter(s3, "team-a/slow", weights=b"s" * 200_000)
    with throttled(s3.endpoint, 40_000) as slow:
        source = team_a.model_copy(update={"endpoint_url": slow})
        with caplog.at_level(logging.INFO, logger="loraplex.adapters.fetch"):
            done = fetch(source, "s3://adapters/team-a/slow", tmp_path / "patient")
        assert done.size == 200_002
        assert "MiB fetched" in caplog.text, "progress while it downloads"
        hurried = LIMITS.model_copy(update={"timeout_s": 1.0})
        started = time.monotonic()
        with pytest.raises(FetchError) as late:
            fetch(source, "s3://adapters/team-a/slow", tmp_path / "hurried", hurried)
    assert (late.value.status, late.value.code) == (503, "fetch_timeout")
    assert time.monotonic() - started < 10
    assert not list((tmp_path / "hurried" / FETCHED_DIR).glob(".partial-*"))


def test_an_object_replaced_mid_download_is_refused_with_409(s3, team_a, tmp_path):
    put_adapter(s3, "team-a/moving", weights=b"1" * 200_000)
    with throttled(s3.endpoint, 50_000) as slow:
        source = team_a.model_copy(update={"endpoint_url": slow})
        replace = threading.Timer(1.0, lambda: s3.put(f"team-a/moving/{WEIGHTS}", b"2" * 200_000))
        replace.start()
        with pytest.raises(FetchError) as changed:
            fetch(source, "s3://adapters/team-a/moving", tmp_path)
        replace.join()
    assert (changed.value.status, changed.value.code) == (409, "adapter_changed")
    assert not list((tmp_path / FETCHED_DIR).glob("?" * 64)), "no folder of mixed versions"
    assert fetch(team_a, "s3://adapters/team-a/moving", tmp_path).downloaded, "a retry works"


def test_unused_fetched_folders_are_evicted_oldest_first_past_the_cache_size(tmp_path):
    def folder(tenant: str, char: str, size: int, age_s: float) -> Path:
        path = tmp_path / tenant / FETCHED_DIR / (char * 64)
        path.mkdir(parents=True)
        (path / WEIGHTS).write_bytes(b"x" * size)
        then = time.time() - age_s
        os.utime(path, (then, then))
        return path

    old = folder("a", "1", 400, EVICTION_GRACE_S + 300)
    older_in_use = folder("a", "2", 400, EVICTION_GRACE_S + 400)
    middle = folder("b", "3", 400, EVICTION_GRACE_S + 200)
    fresh = folder("b", "4", 400, 10)
    fetcher = AdapterFetcher(LIMITS.model_copy(update={"cache_bytes": 500}))
    removed = fetcher.evict(tmp_path, in_use={older_in_use})
    assert removed == [old, middle], "oldest unused first, while over 500 bytes"
    assert older_in_use.is_dir() and fresh.is_dir(), "in use, or within the grace period"


@pytest.fixture
def http_folder(tmp_path):
    """An HTTP server on loopback serving `tmp_path/site` to callers that send
    `Authorization: Bearer http-token`, 403 to others."""
    site = tmp_path / "site"
    site.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(site), **kwargs)

        def send_head(self):
            if self.headers.get("Authorization") != "Bearer http-token":
                self.send_error(403)
                return None
            return super().send_head()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield site, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(5)


def test_an_http_folder_is_fetched_with_its_bearer_token(http_folder, tmp_path, monkeypatch):
    site, url = http_folder
    (site / "team" / "one").mkdir(parents=True)
    (site / "team" / "one" / CONFIG).write_bytes(b"{}")
    (site / "team" / "one" / WEIGHTS).write_bytes(b"h" * 3000)
    monkeypatch.setenv("HTTP_TOKEN", "http-token")
    source = AdapterSource(prefix=f"{url}/team", bearer_token=SecretRef(env="HTTP_TOKEN"))
    fetched = fetch(source, f"{url}/team/one", tmp_path / "root")
    assert fetched.size == 3002 and (fetched.folder / WEIGHTS).read_bytes() == b"h" * 3000
    anonymous = AdapterSource(prefix=f"{url}/team")
    with pytest.raises(FetchError) as refused:
        fetch(anonymous, f"{url}/team/one", tmp_path / "other")
    assert refused.value.status == 404 and "refused access" in str(refused.value)
    with pytest.raises(FetchError) as missing:
        fetch(source, f"{url}/team/none", tmp_path / "other")
    assert missing.value.status == 404


def test_a_fetch_waiting_on_another_process_past_the_deadline_fails_with_503(s3, team_a, tmp_path):
    """Another process (here: this test) holds the URI's lock; the fetch gives up after
    `timeout_s` with a 503 instead of waiting on."""
    put_adapter(s3, "team-a/locked-elsewhere")
    uri = parse_adapter_uri("s3://adapters/team-a/locked-elsewhere")
    locks = tmp_path / FETCHED_DIR / ".locks"
    locks.mkdir(parents=True)
    digest = hashlib.sha256(uri.file("").encode()).hexdigest()[:32]
    hurried = AdapterFetcher(LIMITS.model_copy(update={"timeout_s": 1.0}))
    with FileLock(str(locks / digest)):
        with pytest.raises(FetchError) as waited:
            hurried.fetch(tmp_path, uri, team_a.access())
    assert (waited.value.status, waited.value.code) == (503, "fetch_timeout")
    assert AdapterFetcher(LIMITS).fetch(tmp_path, uri, team_a.access()).downloaded
