"""The object store: obstore's stores behind a few functions the tier needs.

`open_store` turns a URL into an obstore store: a folder path or ``file://`` URL (the default, a
`LocalStore` that creates the folder), ``s3://bucket/prefix`` (an `S3Store` configured from the
standard AWS settings, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``,
``AWS_DEFAULT_REGION``, ``AWS_ALLOW_HTTP`` ..., overridable by arguments), or ``memory://``
(a `MemoryStore`, for tests). Any other URL obstore knows (``gs://``, ``az://``) is passed on.

All three stores put atomically (a reader sees a whole object or none) and support create-only
puts (`put_create`), which the offloader relies on.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import obstore
from obstore.exceptions import AlreadyExistsError, BaseError
from obstore.store import LocalStore, MemoryStore, S3Store
from obstore.store import from_url as _from_url

from eventbus.config.addresses import redact_url
from eventbus.tier.errors import StoreError
from eventbus.tier.layout import (
    SEGMENT_SUFFIX,
    SegmentRef,
    parse_segment_key,
    segment_key_in,
    shard_of_folder,
    shard_prefixes,
)

Store = LocalStore | MemoryStore | S3Store | Any
"""Any obstore store (the union names the three the tier is tested with)."""


class StoreNotFound(StoreError):
    """A store opened for reading does not exist (a mistyped folder). `url` is what was given."""

    def __init__(self, url: str, path: Path) -> None:
        super().__init__(
            f"no segment store at {url!r} ({path} is not a folder): check --store / "
            "EVENTBUS_TIER_STORE_URL"
        )
        self.url, self.path = url, path


def _local(url: str, path: Path, create: bool) -> LocalStore:
    path = path.resolve()
    if not create and not path.is_dir():
        raise StoreNotFound(url, path)
    return LocalStore(path, mkdir=create)


def open_store(
    url: str,
    *,
    endpoint: str | None = None,
    region: str | None = None,
    allow_http: bool | None = None,
    create: bool = True,
) -> Store:
    """Open the store at `url` (see the module docstring for the schemes).

    For S3, `endpoint` and `region` override ``AWS_ENDPOINT_URL`` / ``AWS_DEFAULT_REGION``;
    `allow_http` defaults to True when the endpoint is ``http://`` (MinIO, moto, localstack).
    With ``create=False`` (readers: replay) a local folder must exist: `StoreNotFound` if not.
    Raises `StoreError` when obstore rejects the URL or configuration.
    """
    try:
        if url.startswith("memory://"):
            return MemoryStore()
        if url.startswith("file://"):
            return _local(url, Path(url.removeprefix("file://") or "/"), create)
        if "://" not in url:
            return _local(url, Path(url), create)
        if url.startswith(("s3://", "s3a://")):
            config: dict[str, Any] = {}
            if endpoint:
                config["endpoint"] = endpoint
            if region:
                config["region"] = region
            client: dict[str, Any] = {}
            if allow_http or (allow_http is None and (endpoint or "").startswith("http://")):
                client["allow_http"] = True
            elif not endpoint:
                _refuse_plain_http_from_env(url)
            return S3Store.from_url(url, config=config or None, client_options=client or None)  # type: ignore[arg-type]
        return _from_url(url)
    except (BaseError, ValueError, OSError) as exc:
        raise StoreError(f"cannot open object store {url!r}: {exc}") from exc


def _refuse_plain_http_from_env(url: str) -> None:
    """obstore takes the endpoint from ``AWS_ENDPOINT_URL`` but refuses plain HTTP unless
    ``AWS_ALLOW_HTTP`` is true: every request would then fail at once, and a retrying caller
    (the offloader) would retry for ever. Say so now instead."""
    env = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT") or ""
    allowed = os.environ.get("AWS_ALLOW_HTTP", "").strip().lower() in ("true", "1", "yes")
    if env.lower().startswith("http://") and not allowed:
        raise StoreError(
            f"cannot open object store {url!r}: AWS_ENDPOINT_URL is a plain-HTTP endpoint "
            f"({redact_url(env)}) and AWS_ALLOW_HTTP is not set: set AWS_ALLOW_HTTP=true to "
            "allow it (an S3-compatible server on a trusted network), or use https://"
        )


def describe(store: Store) -> str:
    """A short text naming the store, for logs and error messages."""
    if isinstance(store, LocalStore):
        return f"file://{store.prefix}"
    if isinstance(store, S3Store):
        prefix = f"/{store.prefix}" if store.prefix else ""
        return f"s3://{store.config.get('bucket', '?')}{prefix}"
    return type(store).__name__


async def put_create(store: Store, key: str, data: bytes) -> bool:
    """Create object `key` holding `data`, only if no object has that key.

    Returns True when this call created it, False when it already existed (the existing object is
    left untouched). The put is atomic. Raises `StoreError` on any other failure.
    """
    try:
        await obstore.put_async(store, key, data, mode="create", use_multipart=False)
    except AlreadyExistsError:
        return False
    except (BaseError, OSError) as exc:
        raise StoreError(f"put {key!r} to {describe(store)} failed: {exc}") from exc
    return True


async def get_bytes(store: Store, key: str) -> bytes:
    """The whole content of object `key`. Raises `FileNotFoundError` if it does not exist and
    `StoreError` on other failures."""
    try:
        result = await obstore.get_async(store, key)
        return bytes(await result.bytes_async())
    except FileNotFoundError:
        raise
    except (BaseError, OSError) as exc:
        raise StoreError(f"get {key!r} from {describe(store)} failed: {exc}") from exc


def get_bytes_sync(store: Store, key: str) -> bytes:
    """Blocking `get_bytes`, for the replay iterators."""
    try:
        return bytes(obstore.get(store, key).bytes())
    except FileNotFoundError:
        raise
    except (BaseError, OSError) as exc:
        raise StoreError(f"get {key!r} from {describe(store)} failed: {exc}") from exc


def _refs(metas: list[Any]) -> list[SegmentRef]:
    """The segments among listed objects, in entry-ID order; one per range when both layouts
    hold it (an offloader of each version finished the same intent): the first listed, the
    Hive-style folder's."""
    refs: dict[tuple[Any, Any], SegmentRef] = {}
    for meta in metas:
        ref = parse_segment_key(meta["path"], int(meta["size"]))
        if ref is not None:
            refs.setdefault((ref.first, ref.last), ref)
    return sorted(refs.values())


def _listings(topic: str, shard: int, after: SegmentRef | None) -> list[tuple[str, str | None]]:
    """(prefix, offset) of each folder of the shard (`shard_prefixes`): the keys after `after`'s
    range in that folder, when given."""
    return [
        (prefix, None if after is None else segment_key_in(prefix, after.first, after.last))
        for prefix in shard_prefixes(topic, shard)
    ]


def _after(meta: Any, offset: str | None) -> bool:
    # a store that ignores ``offset`` must not hand back the segment listed after
    return offset is None or meta["path"] > offset


async def list_segments(
    store: Store, topic: str, shard: int, *, after: SegmentRef | None = None
) -> list[SegmentRef]:
    """The segments of one shard in entry-ID order, from both layouts' folders
    (`eventbus.tier.layout`); only those whose key sorts after `after`'s when given (a cheap
    "what is new since" listing). Raises `StoreError`."""
    metas = []
    for prefix, offset in _listings(topic, shard, after):
        try:
            stream = obstore.list(store, prefix, offset=offset, chunk_size=1000)
            metas += [m async for chunk in stream for m in chunk if _after(m, offset)]
        except (BaseError, OSError) as exc:
            raise StoreError(f"list {prefix!r} failed: {exc}") from exc
    return _refs(metas)


def list_segments_sync(
    store: Store, topic: str, shard: int, *, after: SegmentRef | None = None
) -> list[SegmentRef]:
    """Blocking `list_segments`."""
    metas = []
    for prefix, offset in _listings(topic, shard, after):
        try:
            stream = obstore.list(store, prefix, offset=offset, chunk_size=1000)
            metas += [m for chunk in stream for m in chunk if _after(m, offset)]
        except (BaseError, OSError) as exc:
            raise StoreError(f"list {prefix!r} failed: {exc}") from exc
    return _refs(metas)


def list_shards_sync(store: Store, topic: str) -> list[int]:
    """The shards that have a folder for `topic` (either layout's), ascending. Raises
    `StoreError`."""
    try:
        result = obstore.list_with_delimiter(store, f"{topic}/")
    except (BaseError, OSError) as exc:
        raise StoreError(f"list {topic!r}/ failed: {exc}") from exc
    shards = set()
    for prefix in result["common_prefixes"]:
        shard = shard_of_folder(prefix.rstrip("/").rsplit("/", 1)[-1])
        if shard is not None:
            shards.add(shard)
    return sorted(shards)


def list_keys_sync(store: Store, prefix: str) -> list[tuple[str, int]]:
    """Every (key, size) under `prefix`, sorted by key. Raises `StoreError`."""
    try:
        metas = [m for chunk in obstore.list(store, prefix, chunk_size=1000) for m in chunk]
    except (BaseError, OSError) as exc:
        raise StoreError(f"list {prefix!r} failed: {exc}") from exc
    return sorted((m["path"], int(m["size"])) for m in metas)


__all__ = [
    "SEGMENT_SUFFIX",
    "Store",
    "StoreNotFound",
    "describe",
    "get_bytes",
    "get_bytes_sync",
    "list_keys_sync",
    "list_segments",
    "list_segments_sync",
    "list_shards_sync",
    "open_store",
    "put_create",
]
