"""`eventbus.client.credentials`: a URL's user name and password move into a redis-py
`CredentialProvider`, the rest of the URL connects as before, and no repr shows them. Building
clients here connects nothing; tests/integration/test_password_redaction.py authenticates with them
against a real redis-server."""

from __future__ import annotations

import pytest
import redis
import redis.asyncio
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.connection import parse_url

from eventbus.client.credentials import Credentials, from_url, split_credentials


@pytest.mark.parametrize(
    ("url", "bare", "credentials"),
    [
        ("redis://h:1/0", "redis://h:1/0", None),
        ("redis://:s3cret@h:1/0", "redis://h:1/0", ("s3cret",)),
        ("redis://alice:s3cret@h:1/2", "redis://h:1/2", ("alice", "s3cret")),
        ("rediss://alice:p%40ss%2Fw@h/0?ssl_cert_reqs=none", "rediss://h/0?ssl_cert_reqs=none",
         ("alice", "p@ss/w")),
        ("redis://h:1/0?password=s3cret&db=3", "redis://h:1/0?db=3", ("s3cret",)),
        ("redis://bob@h:1/0?password=s3cret", "redis://h:1/0", ("bob", "s3cret")),
        ("redis://:from-url@h/0?password=from-query", "redis://h/0", ("from-url",)),
        ("unix://:s3cret@/tmp/redis.sock?db=1", "unix:///tmp/redis.sock?db=1", ("s3cret",)),
        ("redis://:@h:1/0", "redis://h:1/0", None),
        ("redis://:s3cret@[::1]:6379/0", "redis://[::1]:6379/0", ("s3cret",)),
        ("redis://alice@h:1/0", "redis://h:1/0", ("alice", "")),
    ],
)  # fmt: skip
def test_split_credentials(url: str, bare: str, credentials: tuple[str, ...] | None) -> None:
    got_url, got = split_credentials(url)
    assert got_url == bare
    assert (got.get_credentials() if got else None) == credentials
    # the rest of the URL means to redis-py what it meant before
    before = {k: v for k, v in parse_url(url).items() if k not in ("username", "password")}
    assert parse_url(got_url) == before


def test_credentials_repr_names_the_user_only() -> None:
    assert repr(Credentials("alice", "s3cret")) == "Credentials(username='alice', password=***)"


@pytest.mark.parametrize(
    "client_class", [redis.Redis, redis.asyncio.Redis, RedisCluster], ids=lambda c: c.__module__
)
def test_clients_from_url_show_no_password(client_class: type) -> None:
    client = from_url(client_class, "redis://alice:s3cret-pw@h:1/0", socket_timeout=2.0)
    kwargs = (
        client.connection_kwargs
        if client_class is RedisCluster
        else (client.connection_pool.connection_kwargs)
    )
    assert kwargs["credential_provider"].get_credentials() == ("alice", "s3cret-pw")
    assert kwargs["socket_timeout"] == 2.0
    pool = getattr(client, "connection_pool", None)
    for text in (repr(client), str(client), repr(pool), repr(kwargs)):
        assert "s3cret" not in text
