"""Fixtures of the durable-tier integration tests: an S3-API server (moto) on loopback, and a
segment store per test, either a local folder or S3 through the same code path users run
(`open_store("s3://...")` configured by the standard AWS environment variables)."""

from __future__ import annotations

import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from localredis.server import free_port

BUCKET = "eventbus-test"


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """An S3-API server (moto) on a free loopback port, with the test bucket created."""
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    req = urllib.request.Request(f"{endpoint}/{BUCKET}", method="PUT")
    urllib.request.urlopen(req, timeout=10).close()
    yield endpoint
    server.stop()


@pytest.fixture
def s3_env(s3_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> str:
    """Standard AWS settings pointing at the moto server; returns a fresh s3:// store URL."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "test")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "test")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_endpoint)
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    return f"s3://{BUCKET}/run-{uuid.uuid4().hex[:8]}"


@pytest.fixture(params=["local", "s3"])
def store_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """A fresh, empty segment store URL: a local folder, or a prefix in the moto S3 bucket."""
    if request.param == "local":
        return str(tmp_path / "segments")
    url: str = request.getfixturevalue("s3_env")
    return url
