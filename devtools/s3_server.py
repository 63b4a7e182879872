"""A local S3 API server for the tests of the lake on S3: moto's standalone server on loopback.

`start(config)` runs `moto_server` (from the pinned `moto[server]` dev dependency) on
127.0.0.1 and returns its endpoint; `stop(config)` ends it. With `serialized`, the same moto
application handles one request at a time (`python -m devtools.s3_server HOST PORT`): moto checks
a conditional PUT's `If-None-Match` and then stores the object in two steps, so two concurrent
PUTs of one key could both pass on its threaded server, where S3 lets exactly one win.
With `users`, the server enforces AWS signatures and IAM policies once those users exist: each
gets an access key allowed to do anything on S3, so a request signed with any other key is
refused, as on AWS. The server keeps its objects in memory: a restart starts empty.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import boto3
import requests

ALLOW_S3 = json.dumps(
    {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "s3:*", "Resource": "*"}]}
)


@dataclass
class S3ServerConfig:
    port: int
    log_dir: Path
    region: str = "us-east-1"
    # IAM users to create, each with an access key; when empty the server accepts any key.
    users: list[str] = field(default_factory=list)
    # One request at a time, so a conditional PUT is atomic as on S3 (see the module's doc).
    serialized: bool = False

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass(frozen=True)
class AccessKey:
    user: str
    key_id: str
    secret: str


def _pid_file(config: S3ServerConfig) -> Path:
    return config.log_dir / "moto.pid"


def start(config: S3ServerConfig, *, timeout_s: float = 60) -> dict[str, AccessKey]:
    """Starts the server and returns each configured user's access key (none: no auth)."""
    config.log_dir.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "AWS_DEFAULT_REGION": config.region}
    # Create the users and their keys and policies (3 calls each) before signatures count.
    if config.users:
        env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(3 * len(config.users))
    if config.serialized:
        command = [sys.executable, "-m", "devtools.s3_server", "127.0.0.1", str(config.port)]
    else:
        command = [str(Path(sys.executable).with_name("moto_server"))]
        command += ["-H", "127.0.0.1", "-p", str(config.port)]
    log = open(config.log_dir / "moto.log", "ab")
    process = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=Path(__file__).resolve().parents[1],
        start_new_session=True,
    )
    log.close()
    _pid_file(config).write_text(str(process.pid))
    deadline = time.monotonic() + timeout_s
    while True:
        if process.poll() is not None:
            tail = (config.log_dir / "moto.log").read_text(errors="replace")[-2000:]
            raise RuntimeError(f"moto_server exited with {process.returncode}:\n{tail}")
        try:
            if requests.get(f"{config.endpoint}/moto-api/", timeout=2).ok:
                break
        except requests.ConnectionError:
            pass
        if time.monotonic() > deadline:
            stop(config)
            raise RuntimeError(f"moto_server did not answer on {config.endpoint}")
        time.sleep(0.2)
    return {user: _create_user(config, user) for user in config.users}


def _create_user(config: S3ServerConfig, user: str) -> AccessKey:
    iam = boto3.client(
        "iam",
        endpoint_url=config.endpoint,
        region_name=config.region,
        aws_access_key_id="bootstrap",
        aws_secret_access_key="bootstrap",
    )
    iam.create_user(UserName=user)
    key = iam.create_access_key(UserName=user)["AccessKey"]
    iam.put_user_policy(UserName=user, PolicyName="s3-all", PolicyDocument=ALLOW_S3)
    return AccessKey(user=user, key_id=key["AccessKeyId"], secret=key["SecretAccessKey"])


def stop(config: S3ServerConfig) -> None:
    pid_file = _pid_file(config)
    if not pid_file.exists():
        return
    pid = int(pid_file.read_text())
    try:
        os.killpg(pid, signal.SIGTERM)
        for _ in range(100):
            os.kill(pid, 0)
            time.sleep(0.1)
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    pid_file.unlink()


def serve_serialized(host: str, port: int) -> None:
    """moto's server application, each request handled whole before the next one starts.

    Threads still accept connections (S3A keeps its connections open), but a lock spans each
    request's handling, where moto reads and changes its state.
    """
    from moto.moto_server.werkzeug_app import (
        DomainDispatcherApplication,
        MotoRequestHandler,
        create_backend_app,
    )
    from werkzeug.serving import run_simple

    os.environ.setdefault("MOTO_PORT", str(port))
    app = DomainDispatcherApplication(create_backend_app)
    lock = threading.Lock()

    def serialized(environ, start_response):
        with lock:
            # moto's responses are built whole (no streaming), so the state is settled here.
            return list(app(environ, start_response))

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    run_simple(host, port, serialized, threaded=True, request_handler=MotoRequestHandler)


if __name__ == "__main__":
    serve_serialized(sys.argv[1], int(sys.argv[2]))
