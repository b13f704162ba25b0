"""A real S3-compatible server on loopback for the adapter-source tests: moto's server
mode with IAM authentication on (requests signed by unknown or wrong keys are refused),
one bucket, an IAM user per tenant allowed to read only its own prefix, and a
throttling TCP proxy in front of it for slow downloads."""

from __future__ import annotations

import json
import logging
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

BUCKET = "adapters"
REGION = "us-east-1"


@dataclass
class S3Server:
    endpoint: str
    client: object
    """boto3 S3 client with full access (the operator uploading objects)."""
    iam: object
    keys: dict[str, tuple[str, str]] = field(default_factory=dict)

    def put(self, key: str, body: bytes) -> None:
        self.client.put_object(Bucket=BUCKET, Key=key, Body=body)

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=BUCKET, Key=key)

    def user_for_prefix(self, user: str, prefix: str) -> tuple[str, str]:
        """(access key id, secret) of a new IAM user that may list and read
        `s3://adapters/<prefix>/` and nothing else."""
        policy = {
            "Version": "2012-10-17",
            "Statement": [
                {
                    "Effect": "Allow",
                    "Action": "s3:GetObject",
                    "Resource": f"arn:aws:s3:::{BUCKET}/{prefix}/*",
                },
                {
                    "Effect": "Allow",
                    "Action": "s3:ListBucket",
                    "Resource": f"arn:aws:s3:::{BUCKET}",
                    "Condition": {"StringLike": {"s3:prefix": [f"{prefix}/*"]}},
                },
            ],
        }
        self.iam.create_user(UserName=user)
        self.iam.put_user_policy(
            UserName=user, PolicyName="read", PolicyDocument=json.dumps(policy)
        )
        key = self.iam.create_access_key(UserName=user)["AccessKey"]
        self.keys[user] = (key["AccessKeyId"], key["SecretAccessKey"])
        return self.keys[user]


def _boto_client(service: str, endpoint: str, key: str, secret: str):
    import boto3

    return boto3.client(
        service,
        endpoint_url=endpoint,
        region_name=REGION,
        aws_access_key_id=key,
        aws_secret_access_key=secret,
    )


def moto_api(endpoint: str, call: str, body: bytes) -> None:
    request = urllib.request.Request(
        f"{endpoint}/moto-api/{call}", data=body, headers={"Content-Type": "text/plain"}
    )
    urllib.request.urlopen(request, timeout=10).read()


@contextmanager
def s3_server() -> Iterator[S3Server]:
    """moto's server on a free loopback port; IAM authentication is enforced once the
    operator user exists (moto's reset-auth call)."""
    from moto.server import ThreadedMotoServer

    # The server stands for a remote one: its own debug log (requests with their
    # signed headers) is not loraplex's, which the tests search for credentials.
    for name in ("moto", "werkzeug"):
        logging.getLogger(name).setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        # moto's backends and its authentication switch are per process: a server
        # started after another one begins empty, without authentication, then turns
        # it on once its operator user exists.
        moto_api(endpoint, "reset-auth", b"inf")
        moto_api(endpoint, "reset", b"")
        iam = _boto_client("iam", endpoint, "setup", "setup")
        iam.create_user(UserName="operator")
        admin_policy = {
            "Version": "2012-10-17",
            "Statement": [{"Effect": "Allow", "Action": ["s3:*", "iam:*"], "Resource": "*"}],
        }
        iam.put_user_policy(
            UserName="operator", PolicyName="all", PolicyDocument=json.dumps(admin_policy)
        )
        key = iam.create_access_key(UserName="operator")["AccessKey"]
        operator = (key["AccessKeyId"], key["SecretAccessKey"])
        moto_api(endpoint, "reset-auth", b"0")
        client = _boto_client("s3", endpoint, *operator)
        client.create_bucket(Bucket=BUCKET)
        yield S3Server(endpoint, client, _boto_client("iam", endpoint, *operator))
    finally:
        server.stop()


@contextmanager
def throttled(endpoint: str, bytes_per_s: int) -> Iterator[str]:
    """A TCP proxy to `endpoint` (http://host:port) that sends the server's bytes to the
    client at `bytes_per_s`; yields its own http://127.0.0.1:port."""
    host, port = endpoint.removeprefix("http://").split(":")
    listener = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def pipe(source: socket.socket, target: socket.socket, rate: int | None) -> None:
        try:
            while data := source.recv(4096 if rate else 65536):
                target.sendall(data)
                if rate:
                    time.sleep(len(data) / rate)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def serve() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            upstream = socket.create_connection((host, int(port)))
            for args in ((client, upstream, None), (upstream, client, bytes_per_s)):
                threading.Thread(target=pipe, args=args, daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(5)
        listener.close()
