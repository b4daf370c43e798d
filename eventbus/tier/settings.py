"""Settings of the durable tier, read once from ``EVENTBUS_TIER_*`` by pydantic-settings.

Units are in the field names: ``_s`` seconds, ``_bytes`` bytes. The Redis side (URL, key prefix,
liveness TTL) comes from `eventbus.config.Settings`.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventbus.config.settings import register_variables, warn_unknown_variables

OFFLOADER_GROUP = "_offloader"
"""The lock "group" of offloaders: their shard locks live at ``Keys.locks(topic, "_offloader")``
and their liveness at ``Keys.members(topic, "_offloader")``, taken with the consumers' scripts."""


class TierSettings(BaseSettings):
    """Durable-tier settings. Every field can be set as ``EVENTBUS_TIER_<FIELD>``.

    Invalid values raise `pydantic.ValidationError` naming the field.
    """

    model_config = SettingsConfigDict(env_prefix="EVENTBUS_TIER_", extra="forbid")

    store_url: str = Field(
        "eventbus-segments",
        description="Where segments go: a folder path or file:// URL (default), "
        "s3://bucket/prefix, or memory:// (tests).",
    )
    s3_endpoint: str | None = Field(
        None, description="S3 endpoint URL for S3-compatible stores (else AWS_ENDPOINT_URL)."
    )
    s3_region: str | None = Field(None, description="S3 region (else AWS_DEFAULT_REGION).")

    segment_max_entries: int = Field(100_000, ge=1, description="Entries per segment, at most.")
    segment_max_bytes: int = Field(
        32 << 20,
        ge=1024,
        description="A segment is written once its entries' raw bytes reach this size.",
    )
    segment_max_age_s: float = Field(
        60.0,
        ge=0,
        description="A segment is written once its oldest entry is this old (entry ID time).",
    )
    hot_window_s: float = Field(
        600.0,
        ge=0,
        description="Archived entries younger than this stay in Redis (entry ID time).",
    )
    trim_exact: bool = Field(
        False,
        description="XTRIM MINID without '~'. Default approximate: Redis frees whole stream "
        "nodes only, so it may keep a few more archived entries, never fewer.",
    )
    poll_interval_s: float = Field(1.0, gt=0, description="Pause between idle offload rounds.")
    read_count: int = Field(2000, ge=1, description="COUNT of one XRANGE.")
    zstd_level: int = Field(3, ge=1, le=22, description="Parquet zstd compression level.")
    typed_models: dict[str, str] = Field(
        default_factory=dict,
        description="Topic -> its payload models, 'pkg.mod:Model' or a JSON object "
        '{"<event type>": "pkg.mod:Model"}: segments of these topics also hold the payload as '
        "typed columns (docs/protocol.md). Env: a JSON object.",
    )
    rebuild_data: bool = Field(
        False,
        description="Typed segments leave out an entry's raw data where their columns rebuild "
        "it byte for byte (segment version 3, docs/tier.md): about half the bytes on flights. "
        "Spark's native read sends such segments to the Python source.",
    )

    @field_validator("typed_models", mode="before")
    @classmethod
    def _per_type_objects_as_json(cls, value: Any) -> Any:
        """A topic's per-type models may be given as an object (docs/tier.md's
        ``{"orders": {"OrderPlaced": "pkg.mod:OrderPlaced"}}``, in JSON or in code): kept as its
        JSON text, the form `eventbus.tier.typed.load_models` reads. (Before, only the text was
        accepted: the documented object was a ValidationError.)"""
        if isinstance(value, dict):
            return {k: json.dumps(v) if isinstance(v, dict) else v for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _warn_unknown(self) -> TierSettings:
        warn_unknown_variables()  # ``EVENTBUS_TIER_SEGMNT_MAX_S`` was ignored without a word
        return self


register_variables(TierSettings.model_config["env_prefix"], TierSettings.model_fields)
