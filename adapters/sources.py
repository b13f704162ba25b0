"""Where a tenant may fetch adapters from: URI prefixes and the credentials that go with
them, as serve_config.yaml declares them per tenant (`tenants[].adapter_sources`).

A registration by URI (`s3://`, `gs://`, `https://`) is allowed only under one of its
tenant's prefixes, matched on whole path segments after the URI is normalized (no `..`,
no empty segments, no query or fragment except on http(s) URLs). Credentials are
references (an environment variable or a file), resolved when a fetch starts; their
values are handed to fsspec and to nothing else: `AccessSecrets.scrub` removes them from
any text that leaves the fetcher, and URIs are shown without their query
(`AdapterUri.display`), where presigned URLs carry their signature.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

PROTOCOLS = {"s3": "s3", "gs": "gcs", "gcs": "gcs", "http": "http", "https": "http"}
"""URI scheme -> fsspec protocol."""
MAX_URI_CHARS = 2048
SEGMENT = re.compile(r"^[A-Za-z0-9._~@=+,:-]+$")
"""Characters a path segment may hold (no spaces, no percent-escapes, no backslash)."""


class SourceError(Exception):
    """A URI the tenant may not fetch from; `status` is the HTTP status to answer."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True)
class AdapterUri:
    """A normalized adapter URI: `scheme://authority/segments...` with no trailing '/'."""

    scheme: str
    authority: str
    segments: tuple[str, ...]
    query: str = ""

    @property
    def protocol(self) -> str:
        return PROTOCOLS[self.scheme]

    @property
    def display(self) -> str:
        """The URI without its query: what logs, errors and adapter cards show."""
        return f"{self.scheme}://{self.authority}/{'/'.join(self.segments)}".rstrip("/")

    def file(self, name: str) -> str:
        """The fsspec path of file `name` in this folder."""
        path = "/".join((*self.segments, name))
        if self.protocol == "http":
            query = f"?{self.query}" if self.query else ""
            return f"{self.scheme}://{self.authority}/{path}{query}"
        return f"{self.authority}/{path}"

    def folder(self) -> str:
        """The fsspec path of this folder (object stores; listing)."""
        return "/".join((self.authority, *self.segments))

    def under(self, prefix: AdapterUri) -> bool:
        return (
            (self.scheme, self.authority) == (prefix.scheme, prefix.authority)
            and self.segments[: len(prefix.segments)] == prefix.segments
            and len(self.segments) > len(prefix.segments)
        )


def parse_adapter_uri(uri: str, *, allow_query: bool = True) -> AdapterUri:
    """The normalized URI; SourceError(400) for anything ambiguous or unsupported."""
    if len(uri) > MAX_URI_CHARS or not uri.isascii() or not uri.isprintable():
        raise SourceError(400, "the adapter URI must be printable ASCII, at most 2048 chars")
    parts = urlsplit(uri)
    scheme = parts.scheme.lower()
    if scheme not in PROTOCOLS:
        raise SourceError(
            400, f"adapter URI scheme {parts.scheme!r} is not one of {sorted(PROTOCOLS)}"
        )
    if parts.fragment or (parts.query and not (allow_query and PROTOCOLS[scheme] == "http")):
        raise SourceError(400, "the adapter URI may carry a query only on http(s) URLs")
    if not parts.netloc or "@" in parts.netloc:
        raise SourceError(400, "the adapter URI needs a host or bucket, without credentials")
    segments = tuple(parts.path.strip("/").split("/")) if parts.path.strip("/") else ()
    for segment in segments:
        if segment in ("", ".", "..") or not SEGMENT.match(segment):
            raise SourceError(400, f"adapter URI path segment {segment!r} is not allowed")
    return AdapterUri(scheme, parts.netloc.lower(), segments, parts.query)


class SecretRef(BaseModel):
    """A credential by reference: the environment variable or the file that holds it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    env: str | None = Field(None, description="environment variable holding the value")
    file: str | None = Field(None, description="file holding the value (stripped)")

    @model_validator(mode="after")
    def _one_reference(self) -> SecretRef:
        if (self.env is None) == (self.file is None):
            raise ValueError("a credential names exactly one of `env` or `file`")
        return self

    def resolve(self) -> str:
        if self.env is not None:
            value = os.environ.get(self.env)
            if not value:
                raise SourceError(503, f"credential variable {self.env} is unset on this node")
            return value
        try:
            value = Path(self.file).read_text().strip()
        except OSError:
            raise SourceError(
                503, f"credential file {self.file} is unreadable on this node"
            ) from None
        if not value:
            raise SourceError(503, f"credential file {self.file} is empty")
        return value


class AdapterSource(BaseModel):
    """One URI prefix a tenant may register adapters from, and how to authenticate there.
    Without credentials the fetch is anonymous (a public bucket or URL)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prefix: str = Field(description="s3://bucket/path, gs://bucket/path or https://host/path")
    endpoint_url: str | None = Field(
        None, description="S3-compatible endpoint (MinIO, Ceph, R2); default: AWS"
    )
    region: str | None = Field(None, description="S3 region")
    access_key_id: SecretRef | None = Field(None, description="S3 access key id")
    secret_access_key: SecretRef | None = Field(None, description="S3 secret access key")
    session_token: SecretRef | None = Field(None, description="S3 session token")
    bearer_token: SecretRef | None = Field(None, description="http(s): Authorization: Bearer")
    gcs_token_file: str | None = Field(
        None, description="gs: a service-account JSON file (its path, read by gcsfs)"
    )

    @field_validator("prefix")
    @classmethod
    def _normalized_prefix(cls, prefix: str) -> str:
        try:
            parsed = parse_adapter_uri(prefix, allow_query=False)
        except SourceError as exc:
            raise ValueError(str(exc)) from None
        if not parsed.segments and parsed.protocol == "http":
            raise ValueError("an http(s) prefix needs a path below the host")
        return parsed.display

    @model_validator(mode="after")
    def _credentials_fit_the_scheme(self) -> AdapterSource:
        protocol = self.uri().protocol
        s3 = (self.endpoint_url, self.region, self.access_key_id, self.secret_access_key)
        if protocol != "s3" and any(v is not None for v in (*s3, self.session_token)):
            raise ValueError(f"{self.prefix}: S3 options on a non-s3 prefix")
        if (self.access_key_id is None) != (self.secret_access_key is None):
            raise ValueError(f"{self.prefix}: give access_key_id and secret_access_key together")
        if protocol != "http" and self.bearer_token is not None:
            raise ValueError(f"{self.prefix}: bearer_token is for http(s) prefixes")
        if protocol != "gcs" and self.gcs_token_file is not None:
            raise ValueError(f"{self.prefix}: gcs_token_file is for gs:// prefixes")
        return self

    def uri(self) -> AdapterUri:
        return parse_adapter_uri(self.prefix, allow_query=False)

    def access(self) -> SourceAccess:
        """fsspec storage options with the credentials resolved (SourceError(503) when a
        referenced credential is missing on this node)."""
        options: dict[str, Any] = {"skip_instance_cache": True}
        secrets: list[str] = []
        protocol = self.uri().protocol
        if protocol == "s3":
            options["config_kwargs"] = {"connect_timeout": 10, "read_timeout": 60}
            if self.endpoint_url is not None:
                options["endpoint_url"] = self.endpoint_url
            if self.region is not None:
                options["client_kwargs"] = {"region_name": self.region}
            if self.access_key_id is not None and self.secret_access_key is not None:
                options["key"] = self.access_key_id.resolve()
                options["secret"] = self.secret_access_key.resolve()
                secrets += [options["key"], options["secret"]]
                if self.session_token is not None:
                    options["token"] = self.session_token.resolve()
                    secrets.append(options["token"])
            else:
                options["anon"] = True
        elif protocol == "gcs":
            options["token"] = self.gcs_token_file or "anon"
        elif self.bearer_token is not None:
            token = self.bearer_token.resolve()
            options["client_kwargs"] = {"headers": {"Authorization": f"Bearer {token}"}}
            secrets.append(token)
        return SourceAccess(protocol, options, AccessSecrets(tuple(secrets)))


@dataclass(frozen=True)
class AccessSecrets:
    """The resolved credential values of one fetch; never printed."""

    values: tuple[str, ...]

    def __repr__(self) -> str:
        return f"AccessSecrets({len(self.values)} hidden)"

    def scrub(self, text: str) -> str:
        for value in self.values:
            text = text.replace(value, "***")
        return text


@dataclass(frozen=True)
class SourceAccess:
    protocol: str
    storage_options: dict[str, Any]
    secrets: AccessSecrets

    def __repr__(self) -> str:
        return f"SourceAccess({self.protocol}, credentials hidden)"


def source_for(uri: AdapterUri, sources: tuple[AdapterSource, ...]) -> AdapterSource:
    """The tenant's source whose prefix holds `uri` (the longest); SourceError(403) if
    none does."""
    matches = [s for s in sources if uri.under(s.uri())]
    if not matches:
        raise SourceError(403, f"{uri.display} is not under any adapter source you may use")
    return max(matches, key=lambda s: len(s.uri().segments))
