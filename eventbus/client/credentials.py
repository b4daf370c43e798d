"""Redis credentials kept out of every repr: a URL's user name and password go to redis-py in a
`CredentialProvider` instead of connection keywords.

redis-py's ``ConnectionPool.__repr__`` lists every connection keyword, the password included, so
``repr(client)`` of a client made by ``from_url("redis://u:secret@h")`` shows ``secret``; a
client made by `from_url` here shows ``credential_provider=Credentials(username='u',
password=***)``. The connections authenticate as before (``AUTH [user] password`` on connect).
"""

from __future__ import annotations

from typing import Any, TypeVar
from urllib.parse import parse_qsl, unquote, urlencode, urlsplit

from redis.credentials import UsernamePasswordCredentialProvider

from eventbus.config.addresses import REDACTED

C = TypeVar("C")
_CREDENTIAL_QUERY = ("username", "password")


class Credentials(UsernamePasswordCredentialProvider):
    """A fixed user name and password for redis-py (``AUTH``); its repr shows the user name and
    ``***``. No user name (``None`` or ``""``): ``AUTH password`` as the default user."""

    def __repr__(self) -> str:
        return f"Credentials(username={self.username!r}, password={REDACTED})"


def split_credentials(url: str) -> tuple[str, Credentials | None]:
    """`url` without its user name and password, and `Credentials` holding them (None when the
    URL has neither).

    They are read as redis-py's ``parse_url`` reads them: the user info before ``@``
    (percent-decoded), else the ``username=`` / ``password=`` query values (the first non-empty
    one). Everything else of the URL (scheme, host, port, path, other query values) is kept as
    it was, so ``from_url`` of the result connects where `url` does. A URL with neither is
    returned unchanged. Does not validate `url` (`eventbus.config.addresses.check_redis_url`).
    """
    parts = urlsplit(url)
    _userinfo, at, hostport = parts.netloc.rpartition("@")
    pairs = parse_qsl(parts.query, keep_blank_values=True)
    in_query = [(k, v) for k, v in pairs if k in _CREDENTIAL_QUERY]
    if not at and not in_query:
        return url, None
    found: dict[str, str] = {}
    for name, value in in_query:  # parse_url takes each name's first non-empty value
        if value and name not in found:
            found[name] = unquote(value)
    if parts.username:
        found["username"] = unquote(parts.username)
    if parts.password:
        found["password"] = unquote(parts.password)
    query = parts.query
    if in_query:
        query = urlencode([(k, v) for k, v in pairs if k not in _CREDENTIAL_QUERY])
    bare = f"{parts.scheme}://{hostport}{parts.path}"
    bare += f"?{query}" if query else ""
    bare += f"#{parts.fragment}" if parts.fragment else ""
    if not found:
        return bare, None
    return bare, Credentials(found.get("username"), found.get("password"))


def from_url(client_class: type[C], url: str, **options: Any) -> C:
    """``client_class.from_url(url, **options)`` (a redis-py `Redis` or `RedisCluster`, sync or
    asyncio) with the URL's user name and password passed as `Credentials`
    (`split_credentials`), so that no repr of the client, its pool, nodes or connections shows
    the password. Raises what ``from_url`` raises (``ValueError`` for an unknown scheme)."""
    bare, credentials = split_credentials(url)
    if credentials is not None:
        options["credential_provider"] = credentials
    return client_class.from_url(bare, **options)  # type: ignore[attr-defined, no-any-return]
