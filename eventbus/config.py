"""Settings, read once from the environment (prefix ``EVENTBUS_``) by pydantic-settings.

Configuration enters here and is passed down as objects; nothing deeper reads the environment.
Units are in the field names: ``_s`` seconds, ``_ms`` milliseconds, ``_bytes`` bytes.
"""

from __future__ import annotations

from typing import Literal

from pydantic import AliasChoices, Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from eventbus.sharding import MAX_SHARDS


class Settings(BaseSettings):
    """Deployment-wide settings. Every field can be set as ``EVENTBUS_<FIELD>``.

    The Redis URL is also read from plain ``REDIS_URL``. Invalid values raise
    `pydantic.ValidationError` naming the field.
    """

    model_config = SettingsConfigDict(env_prefix="EVENTBUS_", extra="forbid")

    redis_url: str = Field(
        "redis://127.0.0.1:6379/0",
        validation_alias=AliasChoices("EVENTBUS_REDIS_URL", "REDIS_URL", "redis_url"),
        description="redis:// or rediss:// URL of one node (of any node, for a Cluster).",
    )
    cluster: bool = Field(False, description="Connect with the Redis Cluster protocol.")
    key_prefix: str = Field("eventbus", pattern=r"^[A-Za-z0-9_.\-]{1,100}$")
    hashtag: str = Field("eventbus", pattern=r"^[A-Za-z0-9_.\-]{1,100}$")

    # publishing
    shards: int = Field(16, ge=1, le=MAX_SHARDS, description="Default shard count of a topic.")
    maxlen: int = Field(
        1_000_000, ge=1, description="Approximate cap of each shard stream (XADD MAXLEN ~)."
    )
    max_payload_bytes: int = Field(1_048_576, ge=64, description="Largest encoded entry.")
    compress_threshold_bytes: int = Field(
        1024, ge=0, description="Envelopes at least this large are zstd-compressed."
    )
    publish_batch_max: int = Field(1000, ge=1, description="Most XADDs in one pipeline.")
    publish_pipelines: int = Field(2, ge=1, description="Pipelines in flight at once.")
    publish_replicas: int = Field(
        0, ge=0, description="Replicas that must confirm each publish (WAIT); 0: none."
    )
    publish_replicas_timeout_ms: int = Field(
        1000, ge=0, description="How long WAIT waits for those replicas."
    )
    publish_timeout_s: float = Field(
        10.0, ge=0, description="How long publish retries connection errors before failing."
    )

    # consuming
    liveness_ttl_s: float = Field(
        30.0, gt=0.3, description="A consumer not heard from for this long is dead."
    )
    read_count: int = Field(200, ge=1, description="COUNT of one XREADGROUP.")
    block_min_ms: int = Field(10, ge=1, description="Shortest XREADGROUP BLOCK when idle.")
    block_max_ms: int = Field(1000, ge=1, description="Longest XREADGROUP BLOCK when idle.")
    idle_release_ms: int = Field(
        500, ge=0, description="A held shard idle this long is released for others to take."
    )
    max_in_flight: int = Field(2000, ge=1, description="Entries read but not yet acked, at most.")
    concurrency: int = Field(64, ge=1, description="Handlers running at once, at most.")
    max_attempts: int = Field(5, ge=1, description="Handler attempts before dead-lettering.")
    retry_base_s: float = Field(
        0.1, gt=0, description="Retry n waits base * 2**(n-1), times a random 0.5..1 (jitter)."
    )
    retry_max_s: float = Field(10.0, gt=0, description="Longest retry delay.")
    shutdown_grace_s: float = Field(
        30.0, gt=0, description="Longest wait for in-flight entries at graceful shutdown."
    )
    start: Literal["beginning", "now"] = Field(
        "beginning", description="Where a new consumer group starts reading a topic."
    )

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
