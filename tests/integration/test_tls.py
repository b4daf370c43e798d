"""TLS with verification and client certificates (issue 10 item 17), against a real
redis-server with ``tls-auth-clients yes``, certificates from a self-signed CA made with the
``openssl`` command for this test: the settings fields, not only URL query parameters."""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from support import Recorder, Tick, running

from eventbus import EventBus, RedisUnavailable, Settings
from eventbus.testing.server import RedisServer, free_port

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str) -> None:
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=d,
    )


def _signed(d: Path, name: str, ca: str, *extensions: str) -> None:
    _openssl(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        f"/CN={name}",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.csr",
        cwd=d,
    )
    (d / f"{name}.ext").write_text("\n".join(extensions) + "\n")
    _openssl(
        "x509",
        "-req",
        "-in",
        f"{name}.csr",
        "-CA",
        f"{ca}.pem",
        "-CAkey",
        f"{ca}.key",
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        f"{name}.ext",
        "-out",
        f"{name}.pem",
        cwd=d,
    )


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("tls")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _signed(d, "server", "ca", "subjectAltName=IP:127.0.0.1")
    _signed(d, "client", "ca", "extendedKeyUsage=clientAuth")
    return d


@pytest.fixture(scope="module")
def tls_url(certs: Path) -> Iterator[str]:
    port = free_port()
    extra = [
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(certs / "server.pem"),
        "--tls-key-file",
        str(certs / "server.key"),
        "--tls-ca-cert-file",
        str(certs / "ca.pem"),
        "--tls-auth-clients",
        "yes",
    ]
    with RedisServer(extra=extra):  # its plain port answers the readiness check
        yield f"rediss://127.0.0.1:{port}/0"


def _settings(url: str, d: Path, **kw: object) -> Settings:
    files = {
        "tls_ca_file": d / "ca.pem",
        "tls_cert_file": d / "client.pem",
        "tls_key_file": d / "client.key",
    }
    return Settings(redis_url=url, shards=2, block_max_ms=50, **{**files, **kw})  # type: ignore[arg-type]


async def test_publish_and_consume_over_tls_with_a_client_certificate(
    tls_url: str, certs: Path
) -> None:
    rec = Recorder()
    bus = EventBus(_settings(tls_url, certs))
    bus.subscriber("t", group="g")(rec.add)
    async with running(bus):
        for i in range(3):
            await bus.publish("t", Tick(resource="a", seq=i), resource_id="a")
        await rec.wait_for(3)
    assert rec.by_resource() == {"a": [0, 1, 2]}


async def test_a_server_signed_by_another_ca_is_refused(tls_url: str, certs: Path) -> None:
    bus = EventBus(_settings(tls_url, certs, tls_ca_file=certs / "other-ca.pem"))
    with pytest.raises(RedisUnavailable, match="cannot reach Redis"):
        async with bus:
            pass
    await bus.aclose()


async def test_without_a_client_certificate_the_server_refuses(tls_url: str, certs: Path) -> None:
    bus = EventBus(_settings(tls_url, certs, tls_cert_file=None, tls_key_file=None))
    with pytest.raises(RedisUnavailable):
        async with bus:
            pass
    await bus.aclose()


def test_tls_files_are_checked_when_the_settings_are_made(certs: Path) -> None:
    with pytest.raises(ValidationError, match="rediss://"):
        Settings(redis_url="redis://127.0.0.1:6379/0", tls_ca_file=certs / "ca.pem")
    with pytest.raises(ValidationError, match="go together"):
        Settings(redis_url="rediss://127.0.0.1:6379/0", tls_cert_file=certs / "client.pem")
    with pytest.raises(ValidationError, match="does not exist"):
        Settings(redis_url="rediss://127.0.0.1:6379/0", tls_ca_file=certs / "missing.pem")
