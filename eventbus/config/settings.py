"""Settings, read once from the environment (prefix ``EVENTBUS_``) by pydantic-settings.

Configuration enters here and is passed down as objects; nothing deeper reads the environment.
Units are in the field names: ``_s`` seconds, ``_ms`` milliseconds, ``_bytes`` bytes.
"""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    SecretStr,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventbus.config.addresses import check_redis_url, parse_sentinels, redact_url

MAX_SHARDS = 1024
"""The most shards a topic may have (`eventbus.protocol.sharding.check_shards`)."""

DECOMPRESSION_FACTOR = 64
"""An envelope may decompress to at most this many times `max_payload_bytes`: consumers refuse
bigger ones (`DecodeError`) and publishers refuse to send them (`PayloadTooLarge`)."""


class Settings(BaseSettings):
    """Deployment-wide settings. Every field can be set as ``EVENTBUS_<FIELD>``.

    The Redis URL is also read from plain ``REDIS_URL``. Invalid values raise
    `pydantic.ValidationError` naming the field (the CLI names the environment variable:
    `env_name`). An ``EVENTBUS_*`` variable that is no setting is logged at WARNING with the
    closest setting's name (`unknown_variables`).
    """

    # hide_input_in_errors: a rejected redis_url must not print its password
    model_config = SettingsConfigDict(
        env_prefix="EVENTBUS_",
        extra="forbid",
        hide_input_in_errors=True,
        use_attribute_docstrings=True,  # each field's docstring is its description
    )

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("EVENTBUS_REDIS_URL", "REDIS_URL", "redis_url"),
    )
    """redis:// or rediss:// URL of one node (of any node, for a Cluster); reserved characters in
    the password percent-encoded. Printed only redacted."""
    redis_connect_timeout_s: PositiveFloat = 5.0
    """Seconds to wait for a TCP (and TLS) connection to Redis."""
    redis_timeout_margin_s: PositiveFloat = 5.0
    """Seconds a Redis reply may take beyond the longest server-side wait (XREADGROUP BLOCK
    block_max_ms, WAIT publish_replicas_timeout_ms); their sum is the socket read timeout
    (redis_read_timeout_s)."""
    tls_ca_file: Path | None = None
    """PEM file of the CA(s) that signed the server's certificate (rediss:// URLs; default: the
    system's CAs). Overrides the URL's ssl_ca_certs."""
    tls_cert_file: Path | None = None
    """PEM client certificate, for servers with tls-auth-clients yes."""
    tls_key_file: Path | None = None
    """PEM private key of tls_cert_file."""
    cluster: bool = False
    """Connect with the Redis Cluster protocol."""
    sentinels: str = ""
    """Redis Sentinel addresses, host:port,host:port (in code also a list of 'host:port' or (host,
    port)); with sentinel_service, the primary is found through them and redis_url gives only
    credentials, database and TLS. Empty: no Sentinel."""
    sentinel_service: str = Field("", pattern=r"^[^\s,]{0,200}$")
    """Master name the sentinels monitor (sentinel monitor <name> ...)."""
    sentinel_username: str | None = None
    """ACL user of the sentinels themselves (not of the primary)."""
    sentinel_password: SecretStr | None = None
    """Password of the sentinels themselves (their requirepass)."""
    key_prefix: str = Field("eventbus", pattern=r"^[A-Za-z0-9_.\-]{1,100}$")
    """First part of every key name (`eventbus.protocol.keys`): deployments sharing a Redis differ
    here."""
    hashtag: str = Field("eventbus", pattern=r"^[A-Za-z0-9_.\-]{1,100}$")
    """The ``{hashtag}`` of the coordination keys (topic registry, locks, liveness, parked and
    control hashes, checkpoints): on a Cluster they live in its slot, or in one slot per topic
    (coordination_slots)."""
    coordination_slots: Literal["shared", "topic"] = "shared"
    """Where a topic's locks, liveness, lock epochs, parked and control hashes and checkpoints
    hash on a Redis Cluster: 'shared', every topic's under {hashtag} (one node carries all
    coordination); 'topic', each topic's under {hashtag:topic}, so the Cluster spreads
    coordination over its nodes by topic. Every member of a topic must use the same value: a
    topic changes layout only stopped, with eventbus topic migrate-slots
    (docs/operations.md)."""

    # publishing
    shards: int = Field(16, ge=1, le=MAX_SHARDS)
    """Default shard count of a topic."""
    maxlen: PositiveInt = 1_000_000
    """Approximate cap of each shard stream (XADD MAXLEN ~)."""
    max_payload_bytes: int = Field(1_048_576, ge=64)
    """Largest encoded entry in bytes; an envelope may decompress to at most
    `DECOMPRESSION_FACTOR` (64) times this (max_decompressed_bytes)."""
    compress_threshold_bytes: NonNegativeInt = 1024
    """Envelopes at least this large are zstd-compressed."""
    publish_batch_max: PositiveInt = 1000
    """Most XADDs in one pipeline."""
    publish_pipelines: PositiveInt = 2
    """Pipelines in flight at once."""
    publish_replicas: NonNegativeInt = 0
    """Replicas that must confirm each publish (WAIT); 0: none."""
    publish_replicas_timeout_ms: NonNegativeInt = 1000
    """How long WAIT waits for those replicas."""
    publish_timeout_s: PositiveFloat = 10.0
    """Seconds a publish() may take, retries of connection errors included, before it raises
    PublishError (a deadline on the caller)."""

    # consuming
    liveness_ttl_s: float = Field(30.0, gt=0.3)
    """A consumer not heard from for this long is dead."""
    read_count: PositiveInt = 200
    """COUNT of one XREADGROUP."""
    block_min_ms: PositiveInt = 10
    """Shortest XREADGROUP BLOCK when idle."""
    block_max_ms: PositiveInt = 1000
    """Longest XREADGROUP BLOCK when idle."""
    read_linger_ms: NonNegativeInt = 0
    """After a read that got entries but filled no shard's `read_count`, wait this long (ms)
    before the next read, so that each read, its acks and the handlers' own batched writes
    carry more entries: Kafka's ``fetch.max.wait.ms`` trade for throughput jobs, at the cost of
    up to this much added latency. 0: read again at once."""
    retention: Literal["maxlen", "acked"] = "maxlen"
    """Default retention of a topic (eventbus.protocol.retention): 'maxlen' caps streams only;
    'acked' keeps entries until every group acked them (MAXLEN stays the hard cap)."""
    retention_trim_exact: bool = False
    """Trim exactly to the acked point (XTRIM MINID without ~): more CPU."""
    trim_check_s: PositiveFloat = 5.0
    """How often a consumer checks each held shard for entries trimmed (MAXLEN) before its group
    read them (and at once when it takes a shard)."""
    lock_interval_ms: NonNegativeInt = 100
    """Shortest time between two lock rounds (lock_shards.lua) of a consumer; the read rounds
    between them read the shards it holds, under the lease its heartbeats keep. Bounds the
    lock calls on the hashtag's node to 1000 / lock_interval_ms per consumer and second. 0: a
    lock round before every read."""
    idle_release_ms: NonNegativeInt = 500
    """A held shard idle this long is released for others to take."""
    max_in_flight: PositiveInt = 16_000
    """Entries read but not yet acked, at most (a round can overshoot by one read). The default
    holds two full reads of 16 shards at a batch subscriber's ``max_batch`` of 500 (five at
    `read_count` 200): a draining consumer sends its next read while its workers handle the
    last one, rather than after that one's XACKs are confirmed. A shard is read only while
    at most one read's worth of its own entries is in flight (two at most, whatever this cap:
    a hot shard's hand-over does not grow with it)."""
    concurrency: PositiveInt = 64
    """Handlers running at once, at most."""
    gc_threshold: NonNegativeInt = 50_000
    """While the bus is entered (``async with bus:``) or its consumers run (`EventBus.run`,
    ``eventbus run``): the first threshold of Python's cyclic garbage collector
    (`gc.set_threshold`), i.e. container objects allocated between two collections of the
    youngest generation; the process's own thresholds come back when the last bus leaves.
    Python's default, 700, made the collector take up to a fifth of a busy consumer's or
    publisher's CPU (docs/performance.md). 0 leaves the process's setting alone."""
    max_attempts: PositiveInt = 5
    """Handler attempts before dead-lettering."""
    retry_base_s: PositiveFloat = 0.1
    """Retry n waits base * 2**(n-1), times a random 0.5..1 (jitter)."""
    retry_max_s: PositiveFloat = 10.0
    """Longest retry delay."""
    shutdown_grace_s: PositiveFloat = 30.0
    """Longest wait for in-flight entries at graceful shutdown."""
    handler_timeout_s: NonNegativeFloat | None = 300.0
    """Seconds one handler attempt may run: then it is cancelled (async handler) or abandoned (sync
    handler: its thread runs on, unwaited) and counts as a failed attempt (HandlerTimeout). 0 or
    None: no limit. Per subscriber: handler_timeout_s=."""
    start: Literal["beginning", "now"] = "beginning"
    """Where a new consumer group starts reading a topic."""

    @field_validator("redis_url")
    @classmethod
    def _valid_url(cls, value: str) -> str:
        return check_redis_url(value)

    @field_validator("sentinels", mode="before")
    @classmethod
    def _valid_sentinels(cls, value: Any) -> str:
        return ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in parse_sentinels(value))

    @property
    def sentinel_addresses(self) -> list[tuple[str, int]]:
        """`sentinels` as (host, port) pairs; empty without Sentinel."""
        return parse_sentinels(self.sentinels)

    @model_validator(mode="after")
    def _sentinel_complete(self) -> Settings:
        if bool(self.sentinels) != bool(self.sentinel_service):
            raise ValueError(
                "sentinels (EVENTBUS_SENTINELS) and sentinel_service (EVENTBUS_SENTINEL_SERVICE) "
                "go together: set both, or neither"
            )
        if self.sentinels and self.cluster:
            raise ValueError(
                "sentinels and cluster exclude each other: a Redis Cluster fails over by itself"
            )
        if self.sentinels and self.redis_url.startswith("unix:"):
            raise ValueError(
                "with sentinels, redis_url must be redis:// or rediss:// (it gives "
                "the primary's credentials, database and TLS)"
            )
        return self

    def __repr_args__(self) -> Any:
        for name, value in super().__repr_args__():
            yield name, redact_url(value) if name == "redis_url" else value

    @property
    def redacted_url(self) -> str:
        """`redis_url` with its password replaced by ``***``: the form to print or log."""
        return redact_url(self.redis_url)

    @property
    def redis_read_timeout_s(self) -> float:
        """Socket read timeout of every Redis connection, in seconds: the longest server-side
        wait a command may ask for (``block_max_ms``, ``publish_replicas_timeout_ms``) plus
        ``redis_timeout_margin_s``. A server that stops answering fails a call after this."""
        longest_ms = max(self.block_max_ms, self.publish_replicas_timeout_ms)
        return longest_ms / 1000 + self.redis_timeout_margin_s

    @property
    def max_decompressed_bytes(self) -> int:
        """Largest decompressed envelope, in bytes, that consumers decode and publishers send:
        ``DECOMPRESSION_FACTOR * max_payload_bytes``."""
        return self.max_payload_bytes * DECOMPRESSION_FACTOR

    @model_validator(mode="after")
    def _tls_complete(self) -> Settings:
        tls = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(tls) and not self.redis_url.startswith("rediss:"):
            raise ValueError("tls_* files need a rediss:// redis_url (TLS)")
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together: set both, or neither")
        for path in tls:
            if path is not None and not path.is_file():
                raise ValueError(f"TLS file {str(path)!r} does not exist")
        return self

    @property
    def tls_options(self) -> dict[str, str]:
        """redis-py's ``ssl_*`` connection options from the ``tls_*`` files (empty if none)."""
        out = {}
        for option, path in (
            ("ssl_ca_certs", self.tls_ca_file),
            ("ssl_certfile", self.tls_cert_file),
            ("ssl_keyfile", self.tls_key_file),
        ):
            if path is not None:
                out[option] = str(path)
        return out

    @model_validator(mode="after")
    def _warn_unknown(self) -> Settings:
        warn_unknown_variables()  # a misspelt EVENTBUS_ variable is otherwise silently ignored
        return self

    @model_validator(mode="after")
    def _blocks_ordered(self) -> Settings:
        if self.block_min_ms > self.block_max_ms:
            raise ValueError("block_min_ms must not exceed block_max_ms")
        return self

    @property
    def lease_s(self) -> float:
        """How long after its last confirmed refresh a consumer trusts its locks: the liveness
        TTL minus a 20 % safety margin for clock-rate drift and scheduling delay."""
        return self.liveness_ttl_s * 0.8


OTHER_VARIABLES = frozenset({"EVENTBUS_UVLOOP", "EVENTBUS_TEST_REDIS_URL"})
"""``EVENTBUS_*`` variables read outside `Settings` (the event loop, the pytest plugin)."""
_families: dict[str, frozenset[str]] = {}
_warned: set[str] = set()


def register_variables(prefix: str, fields: Iterable[str]) -> None:
    """Declare a family of settings read outside `Settings` from ``<prefix><FIELD>`` (the
    durable tier's ``EVENTBUS_TIER_*``, `eventbus.tier.TierSettings`), so that a misspelt member
    is warned too. Until its family registers, a prefixed variable is not judged: a process
    that never loads the tier does not read them."""
    _families[prefix.upper()] = frozenset(f"{prefix}{name}".upper() for name in fields)


def env_name(field: str, environ: Mapping[str, str] | None = None) -> str:
    """The environment variable a user sets for `field` (a `Settings` field, or a name pydantic
    reports for it): ``EVENTBUS_<FIELD>``, or ``REDIS_URL`` for `redis_url` when that is the one
    set (``EVENTBUS_REDIS_URL`` wins when both are)."""
    environ = os.environ if environ is None else environ
    name = field.lower().removeprefix("eventbus_")
    if name == "redis_url" and "EVENTBUS_REDIS_URL" not in environ and "REDIS_URL" in environ:
        return "REDIS_URL"
    return f"EVENTBUS_{name.upper()}"


def unknown_variables(environ: Mapping[str, str] | None = None) -> list[str]:
    """One line per ``EVENTBUS_*`` variable of `environ` (default: the process's) that nothing
    reads (a misspelt setting is otherwise ignored without a word), with the closest known
    name: ``EVENTBUS_SHRADS is not an eventbus setting (did you mean EVENTBUS_SHARDS?)``.
    A variable of a registered family (`register_variables`) is judged against that family."""
    environ = os.environ if environ is None else environ
    known = {f"EVENTBUS_{name.upper()}" for name in Settings.model_fields} | OTHER_VARIABLES
    lines = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("EVENTBUS_") or upper in known:
            continue
        family = next((p for p in _families if upper.startswith(p)), None)
        if family is None and upper.startswith("EVENTBUS_TIER_"):
            continue  # the tier's family, not loaded in this process
        candidates = _families[family] if family else known
        if upper in candidates:
            continue
        close = difflib.get_close_matches(upper, sorted(candidates), n=1, cutoff=0.6)
        hint = f" (did you mean {close[0]}?)" if close else ""
        lines.append(f"{name} is not an eventbus setting{hint}; it is ignored")
    return lines


def warn_unknown_variables(*, log: bool = True) -> list[str]:
    """The `unknown_variables` lines not given before in this process, logged at WARNING
    (logger ``eventbus.config``) unless `log` is False (the caller shows them itself)."""
    new = [line for line in unknown_variables() if line not in _warned]
    _warned.update(new)
    for line in new if log else ():
        logging.getLogger("eventbus.config").warning("%s", line)
    return new
