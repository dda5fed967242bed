"""A small playbook for driving one mitmproxy layer without a proxy: scripted
events in, expected commands out.

mitmproxy's layers are sans-I/O: a layer takes events (`DataReceived`,
`Wakeup`, a hook's completion) and answers with commands (`SendData`,
`CloseConnection`, `RequestWakeup`, a hook to run). mitmproxy tests its own
layers this way with a Playbook kept in its repository's tests (not in the
wheel); this is Sluice's own, smaller version of the same idea:

    client = ...  # tctx.client
    flow = Placeholder(HTTPFlow)
    assert (
        Playbook(HttpLayer(tctx, HTTPMode.regular))
        >> DataReceived(client, b"GET http://a.example/ HTTP/1.1\\r\\nHost: a.example\\r\\n\\r\\n")
        << HttpRequestHeadersHook(flow)
        >> reply()
        << HttpRequestHook(flow)
    )

- `>> event` feeds the layer an event. Every command the layer gave before
  it must have been expected (`<<`): nothing it says goes unchecked.
- `<< expected` takes the layer's next command: a command (same type, equal
  attributes; a `Placeholder` attribute binds to what the layer gave, or,
  already bound, must be it), a command class (any of that type), or
  `Matching(predicate, what)`, or a `Placeholder` (the whole command, e.g.
  a wakeup to answer later). `Log` commands are skipped unless `logs=True`.
- `>> reply(value, side_effect=...)` answers the layer's latest blocking
  command (a hook, an `OpenConnection`) as mitmproxy's core would, first
  calling `side_effect` with the hook's arguments (where an addon's hook can
  run, e.g. the gate's `requestheaders`).
- An event's attributes may be Placeholders: they are read when it is fed
  (e.g. `Wakeup(wakeup)`, the `RequestWakeup` captured just before).

`assert playbook` plays what was scripted since it last played (so a test
may go on scripting); inside a running event loop, and for side effects
that are coroutines, use `assert await playbook.play()`. A mismatch fails
with the whole script so far, the layer's actual commands beside it.
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
from collections.abc import Callable, Generator, Iterable
from typing import Any

from mitmproxy.proxy import commands, events, layer

__all__ = ["Matching", "Placeholder", "Playbook", "reply"]


class Placeholder[T]:
    """A value the layer will give (a flow, a server connection, a wakeup):
    bound the first time it is matched, compared with after that. Call it
    for the value."""

    def __init__(self, kind: type[T] | None = None) -> None:
        self.kind = kind
        self._value: Any = _UNBOUND

    def bind_or_compare(self, actual: object) -> bool:
        if self._value is _UNBOUND:
            if self.kind is not None and not isinstance(actual, self.kind):
                return False
            self._value = actual
            return True
        return self._value is actual or self._value == actual

    def __call__(self) -> T:
        if self._value is _UNBOUND:
            raise AssertionError(f"{self!r} was never bound: no command matched it yet")
        return self._value

    def __repr__(self) -> str:
        kind = self.kind.__name__ if self.kind is not None else "any"
        return f"Placeholder({kind})" if self._value is _UNBOUND else f"Placeholder({self._value!r})"


_UNBOUND = object()


class Matching:
    """An expected command given by a predicate, with what it means for the failure text."""

    def __init__(self, predicate: Callable[[commands.Command], bool], what: str) -> None:
        self.predicate, self.what = predicate, what

    def matches(self, command: commands.Command) -> bool:
        return bool(self.predicate(command))

    def __repr__(self) -> str:
        return f"Matching({self.what})"


@dataclasses.dataclass
class _Reply:
    value: Any = None
    side_effect: Callable[..., Any] | None = None

    def __repr__(self) -> str:
        return f"reply({self.value!r})" if self.value is not None else "reply()"


def reply(value: Any = None, *, side_effect: Callable[..., Any] | None = None) -> _Reply:
    """Answer the layer's latest blocking command (see the module text)."""
    return _Reply(value, side_effect)


class Playbook:
    def __init__(self, under_test: layer.Layer, *, logs: bool = False, start: bool = True) -> None:
        self.layer = under_test
        self.logs = logs
        self.script: list[tuple[str, Any]] = [(">>", events.Start())] if start else []
        self.played = 0  # steps already played
        self.actual: list[commands.Command] = []  # everything the layer said
        self.checked = 0  # how many of them were expected
        self.trace: list[str] = []

    def __rshift__(self, event: events.Event | _Reply) -> Playbook:
        self.script.append((">>", event))
        return self

    def __lshift__(self, expected: commands.Command | type | Matching | Placeholder) -> Playbook:
        self.script.append(("<<", expected))
        return self

    # ---- playing -----------------------------------------------------------------

    def __bool__(self) -> bool:
        for awaitable in self._play():
            close = getattr(awaitable, "close", None)
            if close is not None:
                close()
            raise TypeError("a side effect returned a coroutine: use `assert await playbook.play()`")
        return True

    async def play(self) -> bool:
        for awaitable in self._play():
            await awaitable
        return True

    def _play(self) -> Generator[Any, None, None]:
        while self.played < len(self.script):
            direction, step = self.script[self.played]
            self.played += 1
            if direction == "<<":
                self._expect(step)
                continue
            self._all_expected(step)
            if isinstance(step, _Reply):
                event = self._reply_event(step)
                if step.side_effect is not None:
                    result = step.side_effect(*_hook_args(event.command))
                    if inspect.isawaitable(result):
                        yield result
            else:
                event = _resolved(step)
            self.trace.append(f">> {_short(event)}")
            self._feed(self.layer.handle_event(event))
        self._all_expected(None)

    def _feed(self, produced: Iterable[commands.Command]) -> None:
        for command in produced:
            if isinstance(command, commands.Log) and not self.logs:
                continue
            self.actual.append(command)

    def _expect(self, expected: Any) -> None:
        if self.checked >= len(self.actual):
            self._fail(f"expected {expected!r}, but the layer said nothing more")
        actual = self.actual[self.checked]
        self.checked += 1
        if not _matches(expected, actual):
            self._fail(f"expected {_short(expected)}\n        got {_short(actual)}")
        self.trace.append(f"<< {_short(actual)}")

    def _all_expected(self, before: Any) -> None:
        if self.checked < len(self.actual):
            unexpected = ", ".join(_short(c) for c in self.actual[self.checked:])
            where = f"before {before!r}" if before is not None else "at the end of the script"
            self._fail(f"the layer said {unexpected} {where}, and the script did not expect it")

    def _reply_event(self, step: _Reply) -> events.CommandCompleted:
        for command in reversed(self.actual[: self.checked]):
            if command.blocking or isinstance(command, commands.RequestWakeup):
                break
        else:
            self._fail(f"{step!r}: the layer asked for nothing to reply to")
        for kind in type(command).__mro__:
            completed = events.command_reply_subclasses.get(kind)
            if completed is not None:
                break
        else:
            self._fail(f"{step!r}: no reply event for {command!r}")
        if any(f.name == "reply" for f in dataclasses.fields(completed)):
            return completed(command, step.value)
        return completed(command)

    def _fail(self, problem: str) -> None:
        lines = "\n".join(f"    {line}" for line in self.trace)
        raise AssertionError(f"playbook: {problem}\n  played so far:\n{lines}")


def _short(thing: object, limit: int = 240) -> str:
    """One line of a command's or event's repr (flows print over several; data can be long)."""
    text = " ".join(repr(thing).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _hook_args(command: commands.Command) -> list[Any]:
    return command.args() if isinstance(command, commands.StartHook) else []


def _matches(expected: Any, actual: commands.Command) -> bool:
    if isinstance(expected, Placeholder):
        return expected.bind_or_compare(actual)
    if isinstance(expected, Matching):
        return expected.matches(actual)
    if isinstance(expected, type):
        return isinstance(actual, expected)
    if type(expected) is not type(actual):
        return False
    for name, want in vars(expected).items():
        got = getattr(actual, name, _UNBOUND)
        if isinstance(want, Placeholder):
            if not want.bind_or_compare(got):
                return False
        elif want != got:
            return False
    return True


def _resolved(event: events.Event) -> events.Event:
    """The event with its Placeholder attributes replaced by their values."""
    placeholders = {name: value for name, value in vars(event).items() if isinstance(value, Placeholder)}
    if not placeholders:
        return event
    event = copy.copy(event)
    for name, value in placeholders.items():
        setattr(event, name, value())
    return event

