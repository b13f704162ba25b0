"""Adapter URIs and the sources a tenant may fetch from (adapters/sources.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from loraplex.adapters.sources import (
    AdapterSource,
    SourceError,
    parse_adapter_uri,
    source_for,
)


def test_a_uri_is_normalized_to_scheme_authority_and_segments():
    uri = parse_adapter_uri("S3://Bucket/team-a/sql/v2/")
    assert uri.display == "s3://bucket/team-a/sql/v2"
    assert uri.file("adapter_config.json") == "bucket/team-a/sql/v2/adapter_config.json"
    url = parse_adapter_uri("https://host.example/a/b?X-Amz-Signature=secret")
    assert url.display == "https://host.example/a/b", "the query (a signature) is never shown"
    assert url.file("x.json") == "https://host.example/a/b/x.json?X-Amz-Signature=secret"


@pytest.mark.parametrize(
    "uri",
    [
        "file:///etc/passwd",
        "/etc/passwd",
        "s3://bucket/team-a/../team-b/x",
        "s3://bucket/team-a/./x",
        "s3://bucket/team-a//x",
        "s3://bucket/team-a/%2e%2e/x",
        "s3://bucket/team a/x",
        "s3://bucket/team-a\\x",
        "s3://bucket/x?versionId=1",
        "https://host/x#fragment",
        "https://user:pw@host/x",
        "s3:///x",
        "s3://bucket/\u00e9",
        "s3://bucket/" + "a" * 2048,
    ],
)
def test_ambiguous_or_unsupported_uris_are_refused_with_400(uri):
    with pytest.raises(SourceError) as refused:
        parse_adapter_uri(uri)
    assert refused.value.status == 400


def test_a_prefix_holds_only_uris_below_it_on_whole_segments():
    sources = (
        AdapterSource(prefix="s3://bucket/team-a"),
        AdapterSource(prefix="s3://bucket/team-a/private/"),
    )
    assert source_for(parse_adapter_uri("s3://bucket/team-a/x"), sources) is sources[0]
    whole_bucket = (AdapterSource(prefix="s3://bucket/"),)
    assert source_for(parse_adapter_uri("s3://bucket/x"), whole_bucket) is whole_bucket[0]
    chosen = source_for(parse_adapter_uri("s3://bucket/team-a/private/x"), sources)
    assert chosen is sources[1], "the longest prefix wins"
    for outside in (
        "s3://bucket/team-ab/x",
        "s3://bucket/team-a",
        "s3://other/team-a/x",
        "gs://bucket/team-a/x",
    ):
        with pytest.raises(SourceError) as refused:
            source_for(parse_adapter_uri(outside), sources)
        assert refused.value.status == 403


def test_credentials_are_references_resolved_per_fetch_and_never_printed(monkeypatch, tmp_path):
    secret_file = tmp_path / "secret"
    secret_file.write_text("s3cr3t-value\n")
    source = AdapterSource(
        prefix="s3://bucket/team-a",
        endpoint_url="http://127.0.0.1:9",
        access_key_id={"env": "TEAM_A_KEY"},
        secret_access_key={"file": str(secret_file)},
    )
    with pytest.raises(SourceError) as unset:
        source.access()
    assert unset.value.status == 503 and "TEAM_A_KEY" in str(unset.value)
    monkeypatch.setenv("TEAM_A_KEY", "AKIDVALUE")
    access = source.access()
    assert access.storage_options["key"] == "AKIDVALUE"
    assert access.storage_options["secret"] == "s3cr3t-value"
    for text in (repr(access), repr(access.secrets), str(source), repr(source)):
        assert "AKIDVALUE" not in text and "s3cr3t-value" not in text
    assert access.secrets.scrub("key AKIDVALUE / s3cr3t-value") == "key *** / ***"
    anonymous = AdapterSource(prefix="s3://bucket/public").access()
    assert anonymous.storage_options["anon"] is True


@pytest.mark.parametrize(
    "config",
    [
        {"prefix": "https://host"},
        {"prefix": "s3://bucket/a?x=1"},
        {"prefix": "gs://bucket/a", "endpoint_url": "http://x"},
        {"prefix": "s3://bucket/a", "access_key_id": {"env": "K"}},
        {"prefix": "s3://bucket/a", "bearer_token": {"env": "T"}},
        {"prefix": "https://host/a", "gcs_token_file": "/x"},
        {"prefix": "s3://bucket/a", "access_key_id": {"env": "K", "file": "/f"}},
    ],
)
def test_a_source_config_that_cannot_work_is_refused_at_startup(config):
    with pytest.raises(ValidationError):
        AdapterSource(**config)
