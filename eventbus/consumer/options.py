"""`SubscriberOptions`: the options of one ``@bus.subscriber(...)``, checked and resolved once.

One frozen record per subscription (arq's ``func()`` -> ``Function`` is the model): built by
`SubscriberOptions.of` when ``@bus.subscriber`` is called (every bad option raises `ConfigError`
naming it, before any handler is decorated), then read by registration (which merges the records
of several handlers of one (topic, group): `merge`), by the consumer (`Subscription.options`)
and by the option table of docs/operations.md (a unit test checks that it lists these fields).

The options that shape the consumer (`GROUP_OPTIONS`) belong to the (topic, group): a handler
may set one the others left unset (it then applies to all), or repeat one; setting it to another
value is a `ConfigError`. `given` names those a handler set explicitly.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields, replace
from typing import Any, Literal, TypedDict, Unpack

from eventbus.config import Settings
from eventbus.consumer.context import RetryPolicy
from eventbus.errors import ConfigError, shown
from eventbus.protocol.keys import check_name

Ack = Literal["after", "before"]
OnFailure = Literal["continue", "park"]
OnUnknown = Literal["dead_letter", "skip"]
ON_UNKNOWN: tuple[OnUnknown, ...] = ("dead_letter", "skip")
BROADCAST_PREFIX = "_broadcast"
GROUP_OPTIONS = (
    "ack",
    "max_attempts",
    "on_failure",
    "retry_base_s",
    "retry_max_s",
    "dedup_window_s",
    "handler_timeout_s",
    "on_unknown",
)
"""The options of the (topic, group), shared by all its handlers."""
_CHOICES: dict[str, tuple[str, ...]] = {
    "ack": ("after", "before"),
    "on_failure": ("continue", "park"),
    "on_unknown": ON_UNKNOWN,
}


class SubscriberArgs(TypedDict, total=False):
    """The keyword arguments of ``@bus.subscriber(topic, **options)`` as a caller gives them
    (None or absent: unset), listed once for `EventBus.subscriber` and `SubscriberOptions.of`
    (``**options: Unpack[SubscriberArgs]``, PEP 692). `SubscriberOptions` documents each; the
    one name that differs is ``type_name`` (one name or several), kept as ``type_names``."""

    group: str | None
    ack: Ack | None
    max_attempts: int | None
    on_failure: OnFailure | None
    retry_base_s: float | None
    retry_max_s: float | None
    dedup_window_s: float | None
    handler_timeout_s: float | None
    batch: bool
    max_batch: int
    on_unknown: OnUnknown | None
    type_name: str | Sequence[str] | None
    broadcast: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class SubscriberOptions:
    """One subscriber's options, resolved against the settings (the one record of them).

    :param group: the consumer group (a broadcast subscriber's name: ``_broadcast[.<group>]``)
    :param ack: ``"after"``: XACK after the handler succeeded (at-least-once); ``"before"``:
        NOACK reads (at-most-once)
    :param max_attempts: handler attempts before the entry is dead-lettered
    :param on_failure: after the dead letter, ``"continue"`` with the resource's next event or
        ``"park"`` the resource until an operator requeues or drops it
    :param retry_base_s: seconds before the second attempt, doubling per attempt
    :param retry_max_s: seconds between two attempts at most
    :param dedup_window_s: seconds an event ID handled successfully is remembered and skipped
        when delivered again (None: no de-duplication)
    :param handler_timeout_s: seconds one attempt may take (None: no limit)
    :param on_unknown: an event type no handler takes is ``"dead_letter"``-ed or ``"skip"``-ped
    :param batch: the handler takes lists of up to `max_batch` consecutive entries of one shard
    :param max_batch: the most entries of one batch handler call
    :param type_names: the event types the handler takes instead of its model's (aliases), or
        those a ``dict``/``bytes`` handler takes
    :param broadcast: every running instance gets every event (no consumer group)
    :param given: the `GROUP_OPTIONS` this handler set explicitly (in a merged record, its
        handlers did)

    A (topic, group)'s merged record keeps its first handler's `batch`, `max_batch` and
    `type_names` (a batch handler is alone in its group; routing has used the type names).
    The fields have no defaults: `of` resolves every option, the settings' values and the
    defaults (docs/operations.md's table) in one place.
    """

    group: str
    ack: Ack
    max_attempts: int
    on_failure: OnFailure
    retry_base_s: float
    retry_max_s: float
    dedup_window_s: float | None
    handler_timeout_s: float | None
    on_unknown: OnUnknown
    batch: bool
    max_batch: int
    type_names: tuple[str, ...]
    broadcast: bool
    given: frozenset[str] = frozenset()

    @classmethod
    def of(
        cls, settings: Settings, topic: str, **options: Unpack[SubscriberArgs]
    ) -> SubscriberOptions:
        """The options of ``@bus.subscriber(topic, **options)`` (None: unset, the settings'
        value or the one another handler of the group set), checked whatever their types: a
        caller mypy does not check may pass anything. Raises `ConfigError` naming the option,
        or the unknown keyword."""
        raw: dict[str, Any] = dict(options)  # checked by value, whatever the declared types
        get = raw.get
        unknown = set(options) - SubscriberArgs.__optional_keys__
        if unknown:
            raise ConfigError(f"subscriber of topic {topic!r}: no option {sorted(unknown)}")
        for name in ("batch", "broadcast"):
            if not isinstance(get(name, False), bool):
                raise ConfigError(f"{name} must be True or False, got {shown(get(name))}")
        for name, allowed in _CHOICES.items():
            if get(name) is not None and get(name) not in allowed:
                raise ConfigError(f"{name} must be one of {allowed}, got {shown(get(name))}")
        for name in ("max_attempts", "max_batch"):
            _number(name, get(name), integer=True)
        for name in ("retry_base_s", "retry_max_s", "dedup_window_s"):
            _number(name, get(name))
        _number("handler_timeout_s", get("handler_timeout_s"), zero=True)
        if get("batch") and get("dedup_window_s") is not None:
            raise ConfigError("batch=True takes no dedup_window_s")
        group, broadcast = get("group"), get("broadcast", False)
        if broadcast:
            group = BROADCAST_PREFIX if group is None else f"{BROADCAST_PREFIX}.{group}"
        if group is None:
            raise ConfigError(f"subscriber of topic {topic!r}: give a group (or broadcast=True)")
        check_name("group", group)
        if group.startswith("_") and not broadcast:
            raise ConfigError(f"group {group!r}: names starting with '_' are reserved for eventbus")
        timeout_s = get("handler_timeout_s")
        timeout_s = settings.handler_timeout_s if timeout_s is None else timeout_s
        return cls(
            group=group,
            ack=get("ack") or "after",
            max_attempts=get("max_attempts") or settings.max_attempts,
            on_failure=get("on_failure") or "continue",
            retry_base_s=get("retry_base_s") or settings.retry_base_s,
            retry_max_s=get("retry_max_s") or settings.retry_max_s,
            dedup_window_s=get("dedup_window_s"),
            handler_timeout_s=timeout_s or None,  # 0: no limit
            on_unknown=get("on_unknown") or "dead_letter",
            batch=get("batch", False),
            max_batch=get("max_batch", 500),
            type_names=_type_names(get("type_name")),
            broadcast=broadcast,
            given=frozenset(name for name in GROUP_OPTIONS if get(name) is not None),
        )

    @property
    def retry(self) -> RetryPolicy:
        """How a failing handler is retried (`RetryPolicy`)."""
        return RetryPolicy(self.max_attempts, self.retry_base_s, self.retry_max_s)

    def merge(self, other: SubscriberOptions, where: str) -> SubscriberOptions:
        """The (topic, group)'s options once the handler of `other` joins the one(s) these are
        of: the group options `other` set explicitly apply to all. Raises `ConfigError` when one
        of them was set explicitly to another value (`where` names the group and handler)."""
        for name in sorted(other.given & self.given):
            if getattr(other, name) != getattr(self, name):
                raise ConfigError(
                    f"{where} sets {name}={getattr(other, name)!r}, but another handler of the "
                    f"group set {getattr(self, name)!r}; its handlers share one consumer and its "
                    "options"
                )
        return replace(
            self,
            **{name: getattr(other, name) for name in other.given},
            given=self.given | other.given,
        )


FIELDS = tuple(f.name for f in fields(SubscriberOptions) if f.name != "given")
"""The options, in order (docs/operations.md's table lists them)."""


def _number(name: str, value: Any, *, integer: bool = False, zero: bool = False) -> None:
    """`value` is None, or a number > 0 (>= 0 with `zero`; an integer with `integer`)."""
    if value is None:
        return
    kinds = int if integer else (int, float)
    if (
        isinstance(value, bool)
        or not isinstance(value, kinds)
        or not value >= 0
        or (value == 0 and not zero)
    ):
        what = ("an integer" if integer else "a number") + (" >= 0" if zero else " > 0")
        raise ConfigError(f"{name} must be {what}, got {shown(value)}")


def _type_names(type_name: Any) -> tuple[str, ...]:
    """``type_name=``: one event type name or a list of them, each a non-empty string."""
    if type_name is None:
        return ()
    names = [type_name] if isinstance(type_name, str) else type_name
    if not isinstance(names, list | tuple) or not all(isinstance(n, str) and n for n in names):
        raise ConfigError(
            "type_name must be an event type name or a list of them (non-empty strings), "
            f"got {shown(type_name)}"
        )
    return tuple(names)
