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

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Annotated, Any, Literal, Unpack, get_args

from pydantic import ConfigDict, Field, SkipValidation, TypeAdapter, ValidationError, with_config
from typing_extensions import TypedDict  # pydantic validates this one's on Python 3.11

from eventbus.config import Settings
from eventbus.consumer.context import RetryPolicy
from eventbus.errors import ConfigError, shown
from eventbus.protocol.keys import check_name

Ack = Literal["after", "before"]
OnFailure = Literal["continue", "park"]
OnUnknown = Literal["dead_letter", "skip"]
ON_UNKNOWN: tuple[OnUnknown, ...] = get_args(OnUnknown)
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

Positive = Annotated[float, Field(gt=0)]  # NaN is not > 0; inf is (no limit)
Count = Annotated[int, Field(gt=0)]
TypeName = Annotated[str, Field(min_length=1)]


@with_config(ConfigDict(strict=True, extra="forbid"))
class SubscriberArgs(TypedDict, total=False):
    """The keyword arguments of ``@bus.subscriber(topic, **options)`` as a caller gives them
    (None or absent: unset), listed once for `EventBus.subscriber` and `SubscriberOptions.of`
    (``**options: Unpack[SubscriberArgs]``, PEP 692), and checked by pydantic from these
    annotations (strict: ``True`` is no count, ``"3"`` no number; `ARGS`). `SubscriberOptions`
    documents each; the one name that differs is ``type_name`` (one name or several), kept as
    ``type_names``."""

    group: SkipValidation[str | None]  # checked once prefixed, as a name (`check_name`)
    ack: Ack | None
    max_attempts: Count | None
    on_failure: OnFailure | None
    retry_base_s: Positive | None
    retry_max_s: Positive | None
    dedup_window_s: Positive | None
    handler_timeout_s: Annotated[float, Field(ge=0)] | None
    batch: bool
    max_batch: Count
    on_unknown: OnUnknown | None
    type_name: TypeName | list[TypeName] | tuple[TypeName, ...] | None
    broadcast: bool


ARGS = TypeAdapter(SubscriberArgs)
_MUST = {
    "ack": f"one of {get_args(Ack)}",
    "max_attempts": "an integer > 0",
    "on_failure": f"one of {get_args(OnFailure)}",
    "retry_base_s": "a number > 0",
    "retry_max_s": "a number > 0",
    "dedup_window_s": "a number > 0",
    "handler_timeout_s": "a number >= 0",
    "batch": "True or False",
    "max_batch": "an integer > 0",
    "on_unknown": f"one of {ON_UNKNOWN}",
    "type_name": "an event type name or a list of them (non-empty strings)",
    "broadcast": "True or False",
}
"""What each checked option must be, as its `ConfigError` says."""


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
        caller mypy does not check may pass anything. Raises `ConfigError` naming the option
        and the value refused, or the unknown keywords."""
        try:
            args = ARGS.validate_python(options)
        except ValidationError as exc:
            raise _refused(topic, options, exc) from None
        if args.get("batch") and args.get("dedup_window_s") is not None:
            raise ConfigError("batch=True takes no dedup_window_s")
        timeout_s = args.get("handler_timeout_s")
        timeout_s = settings.handler_timeout_s if timeout_s is None else timeout_s
        type_name = args.get("type_name") or ()
        return cls(
            group=_group(topic, args.get("group"), args.get("broadcast", False)),
            ack=args.get("ack") or "after",
            max_attempts=args.get("max_attempts") or settings.max_attempts,
            on_failure=args.get("on_failure") or "continue",
            retry_base_s=args.get("retry_base_s") or settings.retry_base_s,
            retry_max_s=args.get("retry_max_s") or settings.retry_max_s,
            dedup_window_s=args.get("dedup_window_s"),
            handler_timeout_s=timeout_s or None,  # 0: no limit
            on_unknown=args.get("on_unknown") or "dead_letter",
            batch=args.get("batch", False),
            max_batch=args.get("max_batch", 500),
            type_names=(type_name,) if isinstance(type_name, str) else tuple(type_name),
            broadcast=args.get("broadcast", False),
            given=frozenset(name for name in GROUP_OPTIONS if args.get(name) is not None),
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


def _refused(topic: str, given: Mapping[str, Any], exc: ValidationError) -> ConfigError:
    """The `ConfigError` of `ARGS`'s `exc`: the unknown keywords if any (all of them), else
    the first option refused, with what it must be and the value given (cut short)."""
    errors = exc.errors()
    unknown = sorted(str(e["loc"][0]) for e in errors if e["type"] == "extra_forbidden")
    if unknown:
        return ConfigError(f"subscriber of topic {topic!r}: no option {unknown}")
    name = str(errors[0]["loc"][0])
    return ConfigError(f"{name} must be {_MUST[name]}, got {shown(given.get(name))}")


def _group(topic: str, group: Any, broadcast: bool) -> str:
    """The consumer group's name: `group`, or a broadcast subscriber's ``_broadcast[.group]``.
    Raises `ConfigError` when there is none, it is no valid name, or a group's starts with
    ``_`` (eventbus's own)."""
    if broadcast:
        group = BROADCAST_PREFIX if group is None else f"{BROADCAST_PREFIX}.{group}"
    if group is None:
        raise ConfigError(f"subscriber of topic {topic!r}: give a group (or broadcast=True)")
    check_name("group", group)
    if group.startswith("_") and not broadcast:
        raise ConfigError(f"group {group!r}: names starting with '_' are reserved for eventbus")
    return str(group)
