"""The policy's `state` key (top level only): where quotas and login
throttles are counted when several processes must agree.

    state:
      store:
        url: rediss://valkey:6379/0
        password: {file: valkey-password}   # or {env: NAME}; never inline
      timeout: 50ms                         # the longest a decision waits on the store
      on_error: local                       # while the store is down: count in process (local, the
                                            # default) or refuse what needs a shared limit (closed)

Without `state` every count stays in the process (policy.quotas.MemoryCounters).
The store itself is sluice/state_store.py; this module only reads the
settings, so the loader's one addition is a call to `read_state`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from sluice.policy.credentials import Secret, value_problem

if TYPE_CHECKING:
    import yaml

STATE_KEYS = ("store", "timeout", "on_error")
STORE_KEYS = ("url", "password")
PASSWORD_KEYS = ("file", "env")
ON_ERROR = ("local", "closed")
SCHEMES = ("redis", "rediss")
DEFAULT_TIMEOUT = 0.05
MAX_TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class StateSettings:
    """A shared store's settings. Equal settings keep the connection across
    a reload; any change reconnects (counters start empty in the new store)."""

    url: str
    password: Secret | None = None  # None: the store needs none
    password_source: str | None = None  # "file PATH" / "env NAME", for messages
    timeout: float = DEFAULT_TIMEOUT
    on_error: str = "local"

    @property
    def where(self) -> str:
        """The store's address without credentials, for lines and logs."""
        parts = urlsplit(self.url)
        host = parts.hostname or "?"
        return f"{parts.scheme}://{host}:{parts.port or 6379}{parts.path or ''}"


def read_state(reader: Any, node: yaml.Node) -> StateSettings | None:
    """`state` from the policy (problems go to the loader's reader)."""
    from sluice.policy.loader import _q, parse_duration

    keys = reader.mapping(node, STATE_KEYS, "state")
    if "store" not in keys:
        reader.problem(node, "state needs a store: {url: redis://HOST:PORT/DB}")
        return None
    store = reader.mapping(keys["store"][1], STORE_KEYS, "state.store")
    if "url" not in store:
        reader.problem(keys["store"][1], "state.store needs a url: redis://HOST:PORT/DB or rediss://HOST:PORT/DB")
        return None
    url = reader.scalar(store["url"][1])
    problem = url_problem(url)
    if problem:
        shown = _q(url) if isinstance(url, str) and "@" not in url else "(not shown: it may hold a secret)"
        reader.problem(store["url"][1], f"state.store.url {shown} {problem}")
        return None
    password, source = None, None
    if "password" in store:
        password, source = _password(reader, store["password"][1])
        if password is None and source is None:
            return None
    timeout = DEFAULT_TIMEOUT
    if "timeout" in keys:
        try:
            timeout = parse_duration(reader.scalar(keys["timeout"][1]))
        except ValueError as e:
            reader.problem(keys["timeout"][1], f"state.timeout: {e}")
            return None
        if timeout > MAX_TIMEOUT:
            reader.problem(keys["timeout"][1], f"state.timeout must be at most {MAX_TIMEOUT:g}s: every decision "
                                               "that needs the store may wait this long")
            return None
    on_error = "local"
    if "on_error" in keys:
        on_error = reader.scalar(keys["on_error"][1])
        if on_error not in ON_ERROR:
            reader.problem(keys["on_error"][1], "state.on_error must be local (count in this process while the "
                                                "store is down) or closed (refuse what needs a shared limit while "
                                                f"the store is down), not {_q(on_error)}")
            return None
    return StateSettings(url, password, source, timeout, on_error)


def url_problem(url: object) -> str | None:
    if not isinstance(url, str) or not url:
        return "must be text: redis://HOST:PORT/DB or rediss://HOST:PORT/DB"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a bad port)
    except ValueError as e:
        return f"is not a URL ({e})"
    if parts.scheme not in SCHEMES:
        return "must start redis:// or rediss:// (TLS)"
    if not parts.hostname:
        return "names no host"
    if parts.password or parts.username:
        return "must not carry credentials: give state.store.password as {file: PATH} or {env: NAME}"
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        return "may name only a database number after the host (/0)"
    return None


def _password(reader: Any, node: yaml.Node) -> tuple[Secret | None, str | None]:
    """(the secret, where it came from); (None, None) after a problem. A
    secret not read (text-only loading, as `sluice policy check` may do) is
    a Secret(None) with its source."""
    from sluice.policy.loader import _q

    import yaml as _yaml

    if isinstance(node, _yaml.ScalarNode):
        reader.problem(node, "state.store.password must not be written in the policy: give {file: PATH} or "
                             "{env: NAME}")
        return None, None
    spec = reader.mapping(node, PASSWORD_KEYS, "state.store.password")
    kinds = [k for k in PASSWORD_KEYS if k in spec]
    if len(kinds) != 1:
        reader.problem(node, "state.store.password needs exactly one of file: PATH or env: NAME")
        return None, None
    kind = kinds[0]
    where = spec[kind][1]
    text = reader.scalar(where)
    if not isinstance(text, str) or not text:
        reader.problem(where, f"state.store.password: {kind} must be a non-empty string")
        return None, None
    source = f"{kind} {text}"
    raw: str | None
    if kind == "file":
        if reader.read_secret is None:
            return Secret(None), source
        try:
            raw = reader.read_secret(text)
        except OSError as e:
            reader.problem(where, f"state.store.password: cannot read {_q(text)} ({e.strerror or e})")
            return None, None
        except UnicodeDecodeError:
            reader.problem(where, f"state.store.password: {_q(text)} is not UTF-8 text")
            return None, None
        except Exception as e:  # the reader's own refusals (too large, not a regular file)
            reader.problem(where, f"state.store.password: cannot read {_q(text)}: {e}")
            return None, None
        raw = raw.strip("\r\n")
    else:
        if reader.environ is None:
            return Secret(None), source
        raw = reader.environ.get(text)
        if raw is None:
            reader.problem(where, f"state.store.password: the environment variable {_q(text)} is not set")
            return None, None
    wrong = value_problem(raw)
    if wrong:
        reader.problem(where, f"state.store.password: {_q(text)} {wrong}")
        return None, None
    return Secret(raw), source

