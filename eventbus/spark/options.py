"""The options of ``format("eventbus")``, parsed once into a `SourceOptions` (picklable).

Spark passes options as strings (names case-insensitive). Every problem raises `ConfigError`
naming the option, when the DataFrame is defined (``load()``), not when a task runs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any

from eventbus.config.addresses import check_redis_url, redact_url
from eventbus.errors import ConfigError
from eventbus.protocol.ids import EntryId, parse_id
from eventbus.protocol.keys import CoordinationSlots, Keys, check_name
from eventbus.spark.names import canonical, shown
from eventbus.spark.offsets import parse_start
from eventbus.tier.store import Store, open_store

if TYPE_CHECKING:
    from pydantic import BaseModel

# The entry codec (`eventbus.tier.typed`, `eventbus.tier.dictionaries`: pydantic, msgspec,
# zstandard, redis) is imported where a model is used or entries are decoded: Spark's stream
# planner and the Python processes that unpickle these options start without it, at every
# query start (tests/unit/test_spark_planner_imports.py pins it).

MODES = ("PERMISSIVE", "FAILFAST")


def models_option(models: Any) -> str:
    """The ``model`` option's text for a model class or a mapping type -> model (or path)."""
    if isinstance(models, str):
        return models
    if isinstance(models, type):
        return f"{models.__module__}:{models.__qualname__}"
    if isinstance(models, Mapping):
        return json.dumps({k: models_option(v) for k, v in models.items()})
    from eventbus.protocol.codec import event_type_of

    return json.dumps({event_type_of(m): models_option(m) for m in models})


def _int(options: Mapping[str, str], name: str, default: int | None, low: int = 0) -> int | None:
    raw = options.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        raise ConfigError(f"option {shown(name)} must be an integer, got {raw!r}") from None
    if value < low:
        raise ConfigError(f"option {shown(name)} must be >= {low}, got {value}")
    return value


def _bool(options: Mapping[str, str], name: str, default: bool) -> bool:
    raw = options.get(name)
    if raw is None:
        return default
    if raw.lower() in ("true", "1", "yes"):
        return True
    if raw.lower() in ("false", "0", "no"):
        return False
    raise ConfigError(f"option {shown(name)} must be true or false, got {raw!r}")


def _on_gap(options: Mapping[str, str]) -> str | None:
    """``onGap`` (``warn``/``fail``) or Kafka's ``failOnDataLoss`` (``true`` is ``fail``)."""
    on_gap = options.get("ongap")
    if on_gap is not None and on_gap.lower() not in ("warn", "fail"):
        raise ConfigError(f"option onGap must be 'warn' or 'fail', got {on_gap!r}")
    if "failondataloss" not in options:
        return on_gap.lower() if on_gap else None
    lossy = "fail" if _bool(options, "failondataloss", True) else "warn"
    if on_gap is not None and on_gap.lower() != lossy:
        raise ConfigError(f"options onGap={on_gap} and failOnDataLoss disagree")
    return lossy


@dataclass(frozen=True, slots=True, repr=False)
class SourceOptions:
    """Parsed options. Sizes in bytes. Pickled to every executor and shown in task errors: its
    repr has the Redis URL's password redacted."""

    store: str
    topic: str
    redis_url: str | None = None
    model: str | None = None
    mode: str = "PERMISSIVE"
    validate: bool = True
    shards: int | None = None
    key_prefix: str = "eventbus"
    hashtag: str = "eventbus"
    coordination_slots: CoordinationSlots = "shared"  # the setting: where checkpoints live
    pack_bytes: int = 8 << 20
    store_factory: str | None = None
    table: str = "events"
    on_gap: str | None = None  # "warn" | "fail"; None: batch reads warn, streams fail
    max_entries_per_trigger: int | None = None
    starting_offsets: str = "earliest"
    ending_offsets: str = "latest"  # batch reads only (a stream refuses another)
    resource_id_col: str | None = None
    event_id_col: str | None = None
    event_type: str | None = None
    headers_col: str | None = None
    s3_endpoint: str | None = None
    s3_region: str | None = None
    subscribed: tuple[str, ...] = ()  # ``subscribe``'s topics, else (topic,)
    native: bool = True  # `eventbus.spark.read`: False reads through the Python source
    pushdown: bool = True  # filter pushdown prunes segments
    starting_timestamp: int | None = None  # batch reads: entries added at or after (Unix ms)
    ranges: str | None = None  # internal: the Redis-tail parts planned by `eventbus.spark.native`
    plan: bool = False  # internal: a stream of micro-batch bounds (`eventbus.spark.native_stream`)

    @classmethod
    def parse(
        cls, options: Mapping[str, str], *, need_store: bool = True, load_model: bool = True
    ) -> SourceOptions:
        """Parse Spark's option map. Raises `ConfigError` for a missing or invalid option;
        `load_model`: the ``model`` option's classes are imported now to check them (else at
        their first use, `models`)."""
        opts = canonical(options)
        topics = tuple(t.strip() for t in opts.get("subscribe", "").split(",") if t.strip())
        if topics and opts.get("topic"):
            raise ConfigError("options topic and subscribe exclude each other: give one")
        topic = topics[0] if topics else opts.get("topic")
        if not topic:
            raise ConfigError("option topic is required: .option('topic', 'orders')")
        for name in topics or (topic,):
            check_name("topic", name)
        store = opts.get("store", "")
        if need_store and not store:
            raise ConfigError(
                "option store is required: a segment store URL (folder, file://, s3://bucket/p)"
            )
        mode = opts.get("mode", "PERMISSIVE").upper()
        if mode not in MODES:
            raise ConfigError(f"option mode must be one of {', '.join(MODES)}, got {mode!r}")
        table = opts.get("table", "events").lower()
        if table not in ("events", "gaps"):
            raise ConfigError(f"option table must be 'events' or 'gaps', got {table!r}")
        on_gap = _on_gap(opts)
        given = opts.get("coordinationslots", "shared")
        if given not in ("shared", "topic"):
            raise ConfigError(
                f"option coordinationSlots must be 'shared' or 'topic' (the bus's setting "
                f"coordination_slots), got {given!r}"
            )
        slots: CoordinationSlots = "topic" if given == "topic" else "shared"
        parsed = cls(
            store=store,
            topic=topic,
            redis_url=opts.get("redisurl") or None,
            model=opts.get("model") or None,
            mode=mode,
            validate=_bool(opts, "validate", True),
            shards=_int(opts, "shards", None, 1),
            key_prefix=opts.get("keyprefix", "eventbus"),
            hashtag=opts.get("hashtag", "eventbus"),
            coordination_slots=slots,
            pack_bytes=_int(opts, "packbytes", 8 << 20) or 0,
            store_factory=opts.get("storefactory") or None,
            table=table,
            on_gap=on_gap,
            max_entries_per_trigger=_int(opts, "maxoffsetspertrigger", None, 1),
            starting_offsets=opts.get("startingoffsets", "earliest"),
            ending_offsets=opts.get("endingoffsets", "latest"),
            resource_id_col=opts.get("resourceidcol") or None,
            event_id_col=opts.get("eventidcol") or None,
            event_type=opts.get("eventtype") or None,
            headers_col=opts.get("headerscol") or None,
            s3_endpoint=opts.get("s3endpoint") or None,
            s3_region=opts.get("s3region") or None,
            native=_bool(opts, "native", True),
            pushdown=_bool(opts, "pushdown", True),
            starting_timestamp=_int(opts, "startingtimestamp", None),
            ranges=opts.get("_ranges") or None,
            plan=_bool(opts, "_plan", False),
            subscribed=topics or (topic,),
        )
        parsed.keys()  # validates key_prefix / hashtag / coordination_slots
        if parsed.redis_url:
            try:
                check_redis_url(parsed.redis_url)
            except ValueError as exc:  # its message has the URL redacted
                raise ConfigError(f"option redis_url: {exc}") from None
        if parsed.starting_timestamp is not None and "startingoffsets" in opts:
            raise ConfigError(
                "options startingTimestamp and startingOffsets exclude each other: give one"
            )
        if load_model:
            parsed.models()  # fails now, not in a task
        return parsed

    def __repr__(self) -> str:
        shown = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.redis_url:
            shown["redis_url"] = redact_url(self.redis_url)
        return f"SourceOptions({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    def keys(self) -> Keys:
        return Keys(self.key_prefix, self.hashtag, self.coordination_slots)

    def models(self) -> dict[str | None, type[BaseModel]] | None:
        """The ``model`` option's models by event type (`eventbus.tier.typed.load_models`);
        None without the option."""
        if not self.model:
            return None
        from eventbus.tier.typed import load_models

        return load_models(self.model)

    def open_store(self, *, entries: bool = True) -> Store:
        """The segment store: ``store_factory(url)`` when given (an obstore store, e.g. with
        custom credentials or instrumentation), else `eventbus.tier.open_store(url)` for reading
        (a missing local folder is `StoreNotFound`), with the ``s3_endpoint`` / ``s3_region``
        options, else ``EVENTBUS_TIER_S3_ENDPOINT`` / ``_REGION`` as the CLI reads them.
        `entries`: the process decodes entries, so compressed entries' dictionaries are loaded
        from this store on a miss (`eventbus.tier.dictionaries.read_from`); planning passes
        False and does not import the codec."""
        if self.store_factory:
            from eventbus.tier.typed import load_object

            factory = load_object(self.store_factory, "store_factory")
            made = factory(self.store)
            # an `Objects` wrapper keeps the obstore store in `.store`
            if entries:
                _read_dictionaries(getattr(made, "store", made), self.subscribed or (self.topic,))
            return made
        endpoint, region = self.s3_endpoint, self.s3_region
        if self.store.startswith(("s3://", "s3a://")) and not (endpoint and region):
            from eventbus.tier.settings import TierSettings

            tier = TierSettings()
            endpoint, region = endpoint or tier.s3_endpoint, region or tier.s3_region
        store = open_store(self.store, endpoint=endpoint, region=region, create=False)
        if entries:
            _read_dictionaries(store, self.subscribed or (self.topic,))
        return store

    def redis(self) -> Any:
        """A synchronous, binary-safe redis-py client of ``redis_url`` (None without it); its
        user name and password are a `CredentialProvider`, so no repr of it shows them."""
        if not self.redis_url:
            return None
        import redis

        from eventbus.client.credentials import from_url

        return from_url(redis.Redis, self.redis_url)


def _read_dictionaries(store: Store, topics: tuple[str, ...]) -> None:
    """Compressed entries of `topics` find their dictionaries in `store` (on a cache miss)."""
    from eventbus.tier.dictionaries import read_from

    for topic in topics:
        read_from(store, topic)


def batch_offsets(opts: SourceOptions, topic: str, name: str) -> dict[int, EntryId] | None:
    """`topic`'s bounds in a batch read's ``startingOffsets`` (``earliest`` or a JSON offset:
    per shard the entry ID after which to read) or ``endingOffsets`` (``latest`` or a JSON
    offset: per shard the last entry ID to read); shards left out are not bounded. A JSON
    offset of several topics is keyed by topic and names each (`parse_start`). Raises
    `ConfigError`."""
    text = opts.starting_offsets if name == "startingOffsets" else opts.ending_offsets
    value = parse_start(text, topic, opts.subscribed, name)
    open_end = "earliest" if name == "startingOffsets" else "latest"
    if value == open_end:
        return None
    if not isinstance(value, dict):
        raise ConfigError(f"option {name} of a batch read: {open_end} or JSON, not {text!r}")
    return {int(k): parse_id(v) for k, v in value.items()}
