"""Redis addresses: checking a Redis URL, reading Sentinel addresses, and keeping passwords out
of what is printed, logged or raised (`redact_url`, `scrub`)."""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

REDACTED = "***"
_SECRET_QUERY = re.compile(r"pass|secret|token|key", re.IGNORECASE)
_SCHEMES = ("redis", "rediss", "unix")


def redact_url(url: str) -> str:
    """`url` with its password (and secret-looking query values) replaced by ``***``: the form
    in which a URL may be printed, logged, raised or used as a label. Works on malformed URLs
    too (everything between ``://`` and the last ``@`` is treated as user info)."""
    if not isinstance(url, str):
        return REDACTED
    scheme, sep, rest = url.partition("://")
    if not sep:
        return REDACTED if "@" in url else url
    userinfo, at, hostpart = rest.rpartition("@")
    if at:
        user, colon, _password = userinfo.partition(":")
        rest = f"{user}:{REDACTED}@{hostpart}" if colon else f"{REDACTED}@{hostpart}"
        if colon and not user:
            rest = f":{REDACTED}@{hostpart}"
    base, q, query = rest.partition("?")
    if q:
        pairs = [
            f"{k}={REDACTED}" if _SECRET_QUERY.search(k) else f"{k}={v}"
            for k, v in parse_qsl(query.split("#", 1)[0], keep_blank_values=True)
        ]
        rest = f"{base}?{'&'.join(pairs)}"
    return f"{scheme}://{rest}"


def url_secrets(url: str) -> list[str]:
    """The secret strings of `url` (its password, raw and percent-decoded, and secret query
    values), for scrubbing them from text that did not come from `redact_url`."""

    found: list[str] = []
    _scheme, sep, rest = url.partition("://")
    if not sep:
        return found
    userinfo, at, _host = rest.rpartition("@")
    if at:
        user, colon, password = userinfo.partition(":")
        secret = password if colon else user
        found += [secret, unquote(secret)]
    _base, q, query = rest.partition("?")
    if q:
        found += [v for k, v in parse_qsl(query, keep_blank_values=True) if _SECRET_QUERY.search(k)]
    return sorted({s for s in found if len(s) >= 3}, key=len, reverse=True)


def scrub(text: str, url: str) -> str:
    """`text` with `url` redacted and every secret of `url` replaced by ``***`` (for messages
    that came from elsewhere, e.g. a library's exception)."""
    text = text.replace(url, redact_url(url))
    for secret in url_secrets(url):
        text = text.replace(secret, REDACTED)
    return text


def check_redis_url(url: str) -> str:
    """Return `url` if it is a usable ``redis://``, ``rediss://`` or ``unix://`` URL; raise
    `ValueError` (message with the URL redacted) if not."""
    shown = redact_url(url)
    hint = (
        "; percent-encode reserved characters in the user name and password "
        "(/ as %2F, # as %23, ? as %3F, @ as %40, : as %3A)"
    )
    try:
        parts = urlsplit(url)
        port = parts.port  # raises ValueError when the port is not a number
    except ValueError:  # its message may quote part of the password: not repeated
        raise ValueError(f"invalid Redis URL {shown}: the port is not a number{hint}") from None
    if parts.scheme not in _SCHEMES:
        raise ValueError(
            f"invalid Redis URL {shown}: the scheme must be redis://, rediss:// or unix://"
        )
    if parts.fragment or "#" in url:
        raise ValueError(f"invalid Redis URL {shown}: it contains '#'{hint}")
    if parts.scheme == "unix":
        if not parts.path:
            raise ValueError(f"invalid Redis URL {shown}: unix:// needs a socket path")
        return url
    if not parts.hostname:
        raise ValueError(f"invalid Redis URL {shown}: no host{hint}")
    if port is not None and not 0 < port < 65536:
        raise ValueError(f"invalid Redis URL {shown}: port {port} is out of range")
    db = parts.path.lstrip("/")
    if "/" in parts.path[1:] or "@" in parts.path or (db and not db.isdigit()):
        raise ValueError(f"invalid Redis URL {shown}: the path must be a database number{hint}")
    if "@" in parts.query:
        raise ValueError(f"invalid Redis URL {shown}: '@' after the host{hint}")
    return url


def _shown_address(item: Any) -> str:
    """A sentinel address as an error may quote it: a user name or password (anything before
    ``@``) replaced by ``***``, with a hint where the sentinels' credentials belong."""
    if isinstance(item, str):
        text = item
    elif isinstance(item, list | tuple) and len(item) == 2:
        text = f"{item[0]}:{item[1]}"
    else:
        return f"of type {type(item).__name__}"
    if "@" not in text:
        return repr(text)
    host = text.rpartition("@")[2]
    shown = redact_url(text) if "://" in text else f"{REDACTED}@{host}"
    return (
        f"{shown!r} (credentials do not belong in a sentinel address: "
        "set sentinel_username / sentinel_password)"
    )


def parse_sentinels(value: Any) -> list[tuple[str, int]]:
    """Sentinel addresses from ``"host:port,host:port"`` or a list of ``"host:port"`` strings or
    ``(host, port)`` pairs (IPv6 hosts in brackets: ``[::1]:26379``); raises `ValueError` naming
    the bad item, with anything before an ``@`` (credentials) replaced by ``***``."""
    if value is None:
        return []
    if isinstance(value, str):
        if "@" in value:  # a password may hold ',' too: no part of it is quoted
            raise ValueError(
                "sentinel addresses contain '@': credentials do not belong in them, set "
                "sentinel_username / sentinel_password (the address list is not shown: "
                "it may hold a password)"
            )
        items: list[Any] = [v.strip() for v in value.split(",") if v.strip()]
    elif isinstance(value, list | tuple):
        items = list(value)
    else:
        raise ValueError("sentinels must be 'host:port,host:port' or a list of addresses")
    out: list[tuple[str, int]] = []
    for item in items:
        if isinstance(item, list | tuple) and len(item) == 2:
            host, port_text = str(item[0]), str(item[1])
        elif isinstance(item, str):
            host, colon, port_text = item.rpartition(":")
            if not colon:
                raise ValueError(f"sentinel address {_shown_address(item)} has no port (host:port)")
        else:
            raise ValueError(f"sentinel address {_shown_address(item)} is not host:port")
        host = host.strip()
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        if not host or any(c in host for c in " /@[]"):
            raise ValueError(f"sentinel address {_shown_address(item)}: invalid host")
        if not port_text.strip().isdigit() or not 0 < int(port_text) < 65536:
            raise ValueError(f"sentinel address {_shown_address(item)}: the port must be 1-65535")
        out.append((host, int(port_text)))
    return out
