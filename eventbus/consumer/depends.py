"""Handler dependencies: parameters after ``(event[, ctx])`` resolved per event from declared
providers, as FastAPI users know them::

    async def session(ctx: Context) -> AsyncIterator[AsyncSession]:
        async with ctx.state.sessions() as s:     # app-scoped state, set in on_startup
            yield s                               # the code after it: cleanup, after the handler

    @bus.subscriber("orders", group="billing")
    async def bill(event: OrderPlaced, db: Annotated[AsyncSession, Depends(session)]) -> None:
        ...

A provider is a function (``def`` or ``async def``; a generator, sync or async, for a value
with cleanup) whose parameters are themselves dependencies (``Depends(other)``) or the event's
`Context` (a parameter annotated ``Context``). Providers run on the event loop before each
attempt (a ``def`` one too: keep it quick, or make it ``async``); each runs at most once per
attempt, its value shared by the parameters and providers that depend on it
(``Depends(p, use_cache=False)`` runs it each time). Generators are closed after the attempt, in
reverse order, the handler's exception thrown into them (a provider may log it; the attempt
fails whatever the provider does). ``x: T = Depends(p)`` works like
``x: Annotated[T, Depends(p)]``. With ``from __future__ import annotations``, providers named in
``Annotated[...]`` must be importable from the handler's module (module level), as in FastAPI.

App-scoped state (a pool, a client) is set once at start-up (``bus.state.x = ...`` in an
``on_startup`` hook) and read by providers from ``ctx.state``.

A handler without dependencies is registered as it is and pays nothing; one with dependencies
is called through a wrapper that takes ``(event, ctx)`` (`with_dependencies`).
"""

from __future__ import annotations

import contextlib
import inspect
import typing
from collections.abc import Callable
from typing import Any

import anyio.to_thread

from eventbus.errors import ConfigError


class Depends:
    """A dependency: the value of `provider` for the event being handled (module docstring).
    `use_cache`: share one value per event (default) or run the provider each time."""

    __slots__ = ("provider", "use_cache")

    def __init__(self, provider: Callable[..., Any], *, use_cache: bool = True) -> None:
        if not callable(provider):
            raise ConfigError(f"Depends takes a function, got {type(provider).__name__}")
        self.provider, self.use_cache = provider, use_cache

    def __repr__(self) -> str:
        return f"Depends({getattr(self.provider, '__qualname__', self.provider)!r})"


def _depends_of(param: inspect.Parameter, hint: Any) -> Depends | None:
    """The `Depends` of a parameter: its default, or in its ``Annotated[...]`` metadata."""
    if isinstance(param.default, Depends):
        return param.default
    for extra in getattr(hint, "__metadata__", ()):
        if isinstance(extra, Depends):
            return extra
    return None


def _is_context(hint: Any) -> bool:
    from eventbus.consumer.context import Context  # (context imports the publishing layer)

    return hint is Context or (
        typing.get_origin(hint) is typing.Annotated and typing.get_args(hint)[0] is Context
    )


class _Plan:
    """How to call one function: its parameters, each a `Depends` or the Context (None)."""

    def __init__(self, func: Callable[..., Any], skip: int = 0) -> None:
        self.func = func
        name = getattr(func, "__qualname__", repr(func))
        try:
            hints = typing.get_type_hints(func, include_extras=True)
        except NameError as exc:
            raise ConfigError(f"{name}: cannot resolve its annotations ({exc})") from exc
        self.params: list[tuple[str, Depends | None]] = []
        for param in list(inspect.signature(func).parameters.values())[skip:]:
            dep = _depends_of(param, hints.get(param.name))
            if dep is None and not _is_context(hints.get(param.name)):
                raise ConfigError(
                    f"{name}: parameter {param.name!r} is neither a dependency (Depends(...)) "
                    "nor the Context"
                )
            self.params.append((param.name, dep))
        target = inspect.unwrap(func)
        self.is_async_gen = inspect.isasyncgenfunction(target)
        self.is_gen = inspect.isgeneratorfunction(target)
        self.is_async = inspect.iscoroutinefunction(target)


class _Resolver:
    """The providers' values for one event attempt; generators exit with `stack`."""

    def __init__(self, plans: dict[Callable[..., Any], _Plan], ctx: Any, stack: Any) -> None:
        self.plans, self.ctx, self.stack = plans, ctx, stack
        self.cache: dict[Callable[..., Any], Any] = {}

    async def kwargs(self, plan: _Plan) -> dict[str, Any]:
        return {
            name: self.ctx if dep is None else await self.value(dep) for name, dep in plan.params
        }

    async def value(self, dep: Depends) -> Any:
        if dep.use_cache and dep.provider in self.cache:
            return self.cache[dep.provider]
        plan = self.plans[dep.provider]
        kwargs = await self.kwargs(plan)
        func = plan.func
        if plan.is_async_gen:
            value = await self.stack.enter_async_context(
                contextlib.asynccontextmanager(func)(**kwargs)
            )
        elif plan.is_gen:
            value = self.stack.enter_context(contextlib.contextmanager(func)(**kwargs))
        elif plan.is_async:
            value = await func(**kwargs)
        else:
            value = func(**kwargs)
        if dep.use_cache:
            self.cache[dep.provider] = value
        return value


def with_dependencies(handler: Callable[..., Any]) -> Callable[..., Any]:
    """`handler` itself when no parameter after ``(event[, ctx])`` is a dependency; else an
    ``async def (event, ctx)`` that resolves them per attempt, calls `handler` (a ``def`` one in
    a worker thread) and closes the generator providers after it. Its signature and
    annotations are the event's and the Context's, its name `handler`'s.
    A second parameter that is no dependency is the Context, as for any handler.

    :raises ConfigError: for a parameter that is neither a dependency nor the Context, or a
        provider whose annotations do not resolve
    """
    try:
        params = list(inspect.signature(handler).parameters.values())
        hints = typing.get_type_hints(handler, include_extras=True)
    except (TypeError, ValueError):  # a partial, a callable object: no dependencies read
        return handler
    except NameError as exc:
        if any("Depends(" in str(p.annotation) for p in params):
            raise ConfigError(
                f"handler {getattr(handler, '__qualname__', handler)}: cannot resolve the "
                f"annotations of its dependencies ({exc}); define the providers and models at "
                "module level"
            ) from exc
        return handler  # registration reports the unresolved annotation
    takes_context = len(params) > 1 and _depends_of(params[1], hints.get(params[1].name)) is None
    first = 2 if takes_context else 1
    if not any(_depends_of(p, hints.get(p.name)) for p in params[first:]):
        return handler
    from eventbus.consumer.context import Context

    plan = _Plan(handler, skip=first)
    plans: dict[Callable[..., Any], _Plan] = {}
    todo = [dep for _, dep in plan.params if dep is not None]
    while todo:  # every provider reachable, planned once
        dep = todo.pop()
        if dep.provider not in plans:
            plans[dep.provider] = _Plan(dep.provider)
            todo += [d for _, d in plans[dep.provider].params if d is not None]
    is_async = inspect.iscoroutinefunction(inspect.unwrap(handler))
    event_name = params[0].name

    async def call(event: Any, ctx: Any) -> Any:
        error: BaseException | None = None
        async with contextlib.AsyncExitStack() as stack:
            kwargs = await _Resolver(plans, ctx, stack).kwargs(plan)
            args = (event, ctx) if takes_context else (event,)
            try:
                if is_async:
                    return await handler(*args, **kwargs)
                return await anyio.to_thread.run_sync(
                    lambda: handler(*args, **kwargs), abandon_on_cancel=True
                )
            except BaseException as exc:
                error = exc
                raise
        assert error is not None  # a provider's exit swallowed it: the attempt still failed
        raise error

    call.__name__ = getattr(handler, "__name__", "handler")
    call.__qualname__ = getattr(handler, "__qualname__", call.__name__)
    call.__module__ = getattr(handler, "__module__", call.__module__)
    call.__doc__ = handler.__doc__
    ann: dict[str, Any] = {event_name: hints.get(event_name, Any), "ctx": Context}
    if "return" in hints:  # a request handler's reply model (the contract reads it)
        ann["return"] = hints["return"]
    call.__annotations__ = ann
    call.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [
            inspect.Parameter(event_name, inspect.Parameter.POSITIONAL_OR_KEYWORD),
            inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ]
    )
    return call


__all__ = ["Depends", "with_dependencies"]
