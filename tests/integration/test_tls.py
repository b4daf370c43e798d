"""TLS with verification and client certificates, against a real redis-server with
``tls-auth-clients yes``, certificates from a private CA made with the ``openssl`` command for this
test: the settings fields, not only URL query parameters.

The certificates carry the extensions RFC 5280 asks for (a CA: ``basicConstraints`` critical,
``keyUsage`` keyCertSign and cRLSign, a subject key identifier; a leaf: ``subjectAltName`` for
the server, ``keyUsage``, ``extendedKeyUsage``, an authority key identifier): Python 3.13's
default context verifies with ``VERIFY_X509_STRICT``, which refuses a CA without ``keyUsage``
(docs/security.md). A CA made without it (``legacy-ca``) pins that difference on each Python.
"""

from __future__ import annotations

import shutil
import ssl
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import ValidationError
from support import Recorder, Tick, running

from eventbus import EventBus, RedisUnavailable, Settings
from localredis.server import RedisServer, free_port

pytestmark = [
    pytest.mark.anyio,
    pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command"),
]

# RFC 5280 4.2.1.9 and 4.2.1.3: a CA certificate marks basicConstraints critical and, since
# it signs certificates and CRLs, says so in keyUsage; 4.2.1.1-2: key identifiers chain them.
_CA_EXTENSIONS = (
    "basicConstraints = critical, CA:TRUE",
    "keyUsage = critical, keyCertSign, cRLSign",
    "subjectKeyIdentifier = hash",
    "authorityKeyIdentifier = keyid:always",
)
# how a quick `openssl req -x509` CA often looks: no keyUsage (3.13's strict check refuses it)
_LEGACY_CA_EXTENSIONS = ("basicConstraints = critical, CA:TRUE", "subjectKeyIdentifier = hash")
_LEAF_EXTENSIONS = (
    "basicConstraints = critical, CA:FALSE",
    "keyUsage = critical, digitalSignature, keyEncipherment",
    "subjectKeyIdentifier = hash",
    "authorityKeyIdentifier = keyid",
)


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _ca(d: Path, name: str, extensions: tuple[str, ...] = _CA_EXTENSIONS) -> None:
    """A self-signed CA `name` (``name.pem``, ``name.key``) with `extensions` only."""
    config = ["[req]", "distinguished_name = dn", "x509_extensions = ext", "prompt = no"]
    config += ["[dn]", f"CN = {name}", "[ext]", *extensions]
    (d / f"{name}.cnf").write_text("\n".join(config) + "\n")
    _openssl(
        "req",
        "-x509",
        "-config",
        f"{name}.cnf",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-keyout",
        f"{name}.key",
        "-out",
        f"{name}.pem",
        cwd=d,
    )


def _signed(d: Path, name: str, ca: str, *extensions: str) -> None:
    """A leaf `name` signed by `ca`, with `_LEAF_EXTENSIONS` and `extensions`."""
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
    (d / f"{name}.ext").write_text("\n".join((*_LEAF_EXTENSIONS, *extensions)) + "\n")
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
    _ca(d, "legacy-ca", _LEGACY_CA_EXTENSIONS)
    server = ("extendedKeyUsage = serverAuth", "subjectAltName = IP:127.0.0.1")
    _signed(d, "server", "ca", *server)
    _signed(d, "legacy-server", "legacy-ca", *server)
    _signed(d, "client", "ca", "extendedKeyUsage = clientAuth")
    return d


def _tls_server(certs: Path, server: str, ca: str) -> Iterator[str]:
    port = free_port()
    extra = [
        "--tls-port",
        str(port),
        "--tls-cert-file",
        str(certs / f"{server}.pem"),
        "--tls-key-file",
        str(certs / f"{server}.key"),
        "--tls-ca-cert-file",
        str(certs / f"{ca}.pem"),
        "--tls-auth-clients",
        "yes",
    ]
    with RedisServer(extra=extra):  # its plain port answers the readiness check
        yield f"rediss://127.0.0.1:{port}/0"


@pytest.fixture(scope="module")
def tls_url(certs: Path) -> Iterator[str]:
    yield from _tls_server(certs, "server", "ca")


@pytest.fixture(scope="module")
def legacy_tls_url(certs: Path) -> Iterator[str]:
    """A server whose certificate comes from `legacy-ca` (no keyUsage); it trusts clients of
    `ca`."""
    yield from _tls_server(certs, "legacy-server", "ca")


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
    # OpenSSL's words for a chain that does not end at a trusted CA (docs/security.md)
    wrong_ca = "self-signed certificate in certificate chain|unable to get local issuer"
    with pytest.raises(RedisUnavailable, match=wrong_ca):
        async with bus:
            pass
    await bus.aclose()


async def test_a_ca_without_key_usage_is_refused_only_under_strict_verification(
    legacy_tls_url: str, certs: Path
) -> None:
    """Python 3.13's default context sets VERIFY_X509_STRICT: a private CA without keyUsage is
    refused, with a message naming the extension (not a wrong CA's "self-signed certificate in
    certificate chain"); 3.11 and 3.12 accept it."""
    bus = EventBus(_settings(legacy_tls_url, certs, tls_ca_file=certs / "legacy-ca.pem"))
    if ssl.create_default_context().verify_flags & ssl.VERIFY_X509_STRICT:
        with pytest.raises(RedisUnavailable, match="CA cert does not include key usage"):
            async with bus:
                pass
        await bus.aclose()
    else:
        async with bus:
            assert await bus.publish("t", Tick(resource="a", seq=0), resource_id="a")


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
