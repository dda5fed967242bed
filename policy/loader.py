"""YAML text -> Policy, validated like a compiler validates code.

Every problem is collected (not just the first) and reported as
`FILE:LINE:COL: message`. Loading is safe (SafeLoader: no arbitrary tags) and
bounded (file size, node count after alias expansion), so an alias bomb or a
huge file is refused rather than expanded. Pure: `load_policy_text` takes text;
only `load_policy_file` touches the file system (and `password_file` entries).
"""

from __future__ import annotations

import base64
import difflib
import enum
import hashlib
import math
import os
import re
import stat
from dataclasses import dataclass, fields, replace
from pathlib import Path
from urllib.parse import urlsplit
from typing import Any, Literal
from collections.abc import Callable, Mapping

import yaml

from sluice.policy import approvals as appr
from sluice.policy import credentials as creds
from sluice.policy.approvals import ApprovalSettings
from sluice.policy.reasons import Reason
from sluice.policy.clients import secret_verifier
from sluice.policy.hosts import INTERNAL_SUFFIXES, canonical_ip, internal_name
from sluice.policy.matchers import (
    AddressSet,
    HostMatcher,
    PatternError,
    covers_pattern,
    parse_cidr,
    parse_host_pattern,
)
from sluice.policy.ranges import IPV4_NON_PUBLIC, IPV6_NON_PUBLIC, NonPublicRange
from sluice.policy.reasons import MAX_NOTE_CHARS
from sluice.policy.units import size_text
from sluice.policy.request_rules import PathPattern, PathPatternError, QueryGlob, RequestRule, RuleSet
from sluice.policy.state import read_state
from sluice.policy.model import (
    STANDARD_METHODS,
    ClientProfile,
    DnsSettings,
    Limits,
    Policy,
    Rules,
    UpstreamProxy,
)

MAX_POLICY_BYTES = 4 * 1024 * 1024
MAX_NODES = 500_000  # after alias expansion


@dataclass(frozen=True, slots=True)
class Problem:
    file: str
    line: int
    col: int
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}:{self.col}: {self.message}"


class PolicyInvalid(Exception):
    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


# Keys a profile may override, and the top level may set.
RULE_KEYS = ("action", "allow", "deny", "ports", "methods", "private_networks", "limits", "intercept",
             "strip_request_headers",
             "refusal_note", "credentials", "rules", "upstream_proxy", "approvals")
# `state` (the shared store, issue 23) is read by policy/state.py, its one place.
TOP_KEYS = ("version",) + RULE_KEYS + ("dns", "clients", "require_client", "proxy_addresses", "state")
PROFILE_KEYS = ("name", "users", "sources") + RULE_KEYS
DNS_KEYS = tuple(f.name for f in fields(DnsSettings))
LIMIT_KEYS = tuple(f.name for f in fields(Limits))
USER_KEYS = ("password_hash", "password_file")
CREDENTIAL_KEYS = ("hosts", "set_headers", "allow_plain_http")
CREDENTIAL_VALUE_KEYS = ("file", "env", "format")
UPSTREAM_PROXY_KEYS = ("url", "credentials")
REQUEST_RULE_ACTIONS = ("allow", "deny")
REQUEST_RULE_KEYS = ("hosts", "methods", "paths", "query")
APPROVAL_KEYS = ("ask", "grant_for", "wait", "notify")
NOTIFY_KEYS = ("webhook", "secret")
SECRET_KEYS = ("file", "env")
SIZE_LIMITS = {"max_response_bytes", "max_request_bytes", "tunnel_max_bytes", "max_header_bytes", "bytes_per_hour",
               "h2_stream_buffer_bytes"}
COUNT_LIMITS = {"max_header_count", "max_connections", "max_total_connections", "max_tunnels", "burst",
                "h2_max_concurrent_streams",
                "max_requests_per_host_per_minute", "max_upstreams_per_connection"}
RATE_LIMITS = {"requests_per_second"}
PREFIX_LIMITS = {"ipv6_client_prefix"}
# Limits that apply while a request head is read, before the client (and so
# its profile) is known: only the top level may set them.
GLOBAL_LIMITS = ("max_header_bytes", "max_header_count", "header_timeout", "max_total_connections",
                 "h2_stream_buffer_bytes", "h2_max_concurrent_streams", "ipv6_client_prefix")
H2_MAX_SETTING = 2**31 - 1  # the largest SETTINGS_MAX_CONCURRENT_STREAMS h2 sends
OPTIONAL_LIMITS = {"tunnel_max_bytes", "tunnel_max_seconds", "max_connections", "max_total_connections", "max_tunnels",
                   "requests_per_second", "burst", "bytes_per_hour", "max_requests_per_host_per_minute"}

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(B|KB|KiB|MB|MiB|GB|GiB|TB|TiB)?\s*$", re.I)
_SIZE_UNITS = {"b": 1, "kb": 10**3, "kib": 2**10, "mb": 10**6, "mib": 2**20, "gb": 10**9, "gib": 2**30, "tb": 10**12,
               "tib": 2**40}
_DURATION_UNITS = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, None: 1}
_METHOD = re.compile(r"^[A-Z][A-Z-]{0,31}$")
_DNS_NAME = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*\.?")
_HEADER = re.compile(r"^[!#$%&'*+.^_`|~0-9A-Za-z-]+$")

# Messages quote text from the file only as a short escaped snippet: the path
# may point at any file (a shadow file, a key), and messages reach stderr and
# the audit log.
SNIPPET_CHARS = 40
MESSAGE_CHARS = 200
MAX_SECRET_BYTES = 64 * 1024  # a password_file holds one password


def _q(value: object, limit: int = SNIPPET_CHARS) -> str:
    """repr() of a value from the file, at most `limit` characters of it,
    non-printable characters escaped, a cut marked with '…'."""
    if isinstance(value, str):
        k = min(len(value), limit)
        while k and len(repr(value[:k])) > limit + 2:  # escapes count too
            k -= 1
        shown = repr(value[:k])
        return shown if k == len(value) else shown[:-1] + "…" + shown[-1]
    try:
        shown = repr(value)
    except ValueError:  # an int over Python's 4300-digit str() limit
        return "(a number too long to show)"
    return shown if len(shown) <= limit else shown[:limit] + "…"


def _clean(text: str, limit: int = MESSAGE_CHARS) -> str:
    """A message from elsewhere (an exception): non-printables escaped, capped."""
    text = "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
    return text if len(text) <= limit else text[:limit] + "…"


def _scrub(error: object, *quoted: object) -> str:
    """An exception's message with each whole repr() of `quoted` text replaced by its snippet."""
    message = str(error)
    for text in quoted:
        if isinstance(text, str):
            message = message.replace(repr(text), _q(text))
    return _clean(message)


_QUOTED = re.compile(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"")


def _yaml_message(text: str | None) -> str:
    """PyYAML's problem text, with anything it quotes from the file (an alias
    or tag name, a character) cut to a snippet."""
    def cut(m: re.Match[str]) -> str:
        quoted: str = m.group(0)
        return quoted if len(quoted) <= SNIPPET_CHARS + 2 else quoted[: SNIPPET_CHARS + 1] + "…" + quoted[-1]
    return _clean(_QUOTED.sub(cut, text or "unknown error"))


_PLAUSIBLE_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,39}")
_KEY_PREFIX = re.compile(r"[A-Za-z0-9_-]{1,16}")


def _unknown_key(key: str, allowed: tuple[str, ...], what: str) -> str:
    """A key that could not be a policy key (too long, odd characters) is
    likely a line of some other file (`root:$6$...:::` parses as a key): say
    how long it is and how it starts, never the whole of it."""
    hint = difflib.get_close_matches(key, allowed, n=1)
    suggestion = f"; did you mean {_q(hint[0])}?" if hint else f"; known keys: {', '.join(allowed)}"
    if _PLAUSIBLE_KEY.fullmatch(key):
        return f"unknown key {_q(key)} in {what}{suggestion}"
    start = _KEY_PREFIX.match(key)
    starting = f" starting {_q(start.group(0))}" if start else ""
    unshown = "" if hint else " (not shown; is this a policy file?)"
    return f"unknown key of {len(key)} characters{starting} in {what}{unshown}{suggestion}"


def parse_duration(value: object, *, allow_zero: bool = False) -> float:
    if isinstance(value, bool):
        raise ValueError("expected a duration like '20s', '500ms' or '2m'")
    if isinstance(value, (int, float)):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if not m:
            raise ValueError(f"{_q(value)} is not a duration (write e.g. '20s', '500ms', '2m')")
        seconds = float(m.group(1)) * _DURATION_UNITS[m.group(2)]
    if seconds < 0 or (seconds == 0 and not allow_zero):
        raise ValueError("a duration must be greater than zero")
    return seconds


def parse_size(value: object) -> int:
    if isinstance(value, bool):
        raise ValueError("expected a size like '10MiB' or '512KiB'")
    if isinstance(value, int):
        size = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError(f"{_q(value)} is not a size (write e.g. '10MiB', '512KiB', '2GB')")
        size = int(float(m.group(1)) * _SIZE_UNITS[(m.group(2) or "b").lower()])
    if size <= 0:
        raise ValueError("a size must be greater than zero")
    return size


def parse_count(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{_q(value)} is not a count (write a whole number such as 100)")
    if value <= 0:
        raise ValueError("a count must be greater than zero")
    return value


def parse_prefix(value: object) -> int:
    """An IPv6 prefix length: a whole number from 1 to 128."""
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 128:
        raise ValueError(f"{_q(value)} is not an IPv6 prefix length (write a whole number from 1 to 128, such as 64)")
    return value


def parse_rate(value: object) -> float:
    """Requests a second: a number greater than zero (0.5 is one every 2 s)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{_q(value)} is not a rate (write a number of requests a second, such as 5 or 0.5)")
    if value <= 0:
        raise ValueError("a rate must be greater than zero")
    return float(value)


def _version_problem(version: object) -> str:
    """What is wrong with a `version` value that is not the number 1."""
    if isinstance(version, str):
        return f"version is the string {_q(version)}; write the number 1 without quotes (`version: 1`)"
    if isinstance(version, int) and not isinstance(version, bool):
        return f"unsupported policy version {_q(version)}; this Sluice reads version 1"
    kind = "a list or mapping" if version is _NOT_SCALAR else "empty" if version is None else \
        f"a {'boolean' if isinstance(version, bool) else type(version).__name__} ({_q(version)})"
    return f"version must be the number 1, not {kind}"


def hash_password(password: str, *, iterations: int = 200_000, salt: bytes | None = None) -> str:
    """The verifier format `password_hash` takes: pbkdf2_sha256$ITER$SALT$HASH (hex)."""
    import os

    salt = salt if salt is not None else os.urandom(16)
    digest = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    return f"pbkdf2_sha256${iterations}${salt.hex()}${digest.hex()}"


def _check_verifier(text: str) -> str | None:
    """None if `text` is a well-formed verifier, else what is wrong."""
    if text.startswith("sha256:"):
        return ("unsalted 'sha256:' hashes are not accepted (one fast hash: a leaked policy gives the password "
                "away); make a pbkdf2_sha256 hash with `sluice policy hash-password`, or use password_file")
    parts = text.split("$")
    if len(parts) == 4 and parts[0] == "pbkdf2_sha256" and parts[1].isdigit() and int(parts[1]) >= 10_000:
        try:
            bytes.fromhex(parts[2]), bytes.fromhex(parts[3])
            return None
        except ValueError:
            pass
    return "expected 'pbkdf2_sha256$ITERATIONS$SALT$HASH' (from `sluice policy hash-password`)"


class _Reader:
    """Walks the composed YAML node tree, collecting problems with positions."""

    def __init__(self, file: str, read_secret: Callable[[str], str] | None,
                 environ: Mapping[str, str] | None = None) -> None:
        self.file = file
        self.problems: list[Problem] = []
        self.read_secret = read_secret
        self.environ = environ  # None: environment values are not read (text-only loading)
        self._credential_nodes: dict[int, yaml.Node] = {}  # id(Credential) -> its hosts node
        self._rule_nodes: dict[int, yaml.Node] = {}  # id(RequestRule) -> its hosts node
        self._constructor = yaml.SafeLoader("")
        # Top-level entries that match nothing at the top level, with the test
        # that a profile inheriting them (key: "allow" or "deny") makes them match.
        self._never_at_top: list[tuple[yaml.Node, str, Callable[[Rules], bool], str]] = []
        self.inherits: dict[str, set[str]] = {"allow": set(), "deny": set()}  # key -> profiles inheriting it

    def problem(self, node: yaml.Node | None, message: str) -> None:
        line, col = (node.start_mark.line + 1, node.start_mark.column + 1) if node is not None else (1, 1)
        self.problems.append(Problem(self.file, line, col, message))

    def origin(self, node: yaml.Node) -> str:
        return f"{self.file}:{node.start_mark.line + 1}"

    def scalar(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            return _NOT_SCALAR
        try:
            return self._constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, TypeError, OverflowError):
            return _NOT_SCALAR  # reported by _scan before the reader runs

    def mapping(self, node: yaml.Node, allowed: tuple[str, ...], what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, f"{what} must be a mapping of keys to values")
            return {}
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for key_node, value_node in node.value:
            key = self.scalar(key_node)
            if not isinstance(key, str):
                self.problem(key_node, f"keys in {what} must be strings")
                continue
            if key in out:
                self.problem(key_node,
                             f"{_q(key)} appears twice in {what} (first at line {out[key][0].start_mark.line + 1})")
                continue
            if key not in allowed:
                self.problem(key_node, _unknown_key(key, allowed, what))
                continue
            out[key] = (key_node, value_node)
        return out

    def sequence(self, node: yaml.Node, what: str) -> list[yaml.Node]:
        if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:null":
            return []
        if not isinstance(node, yaml.SequenceNode):
            self.problem(node, f"{what} must be a list")
            return []
        return list(node.value)

    # ---- typed values -------------------------------------------------

    def patterns(self, node: yaml.Node, what: str) -> HostMatcher:
        entries: list[tuple[str, str]] = []
        seen: dict[tuple[str, str], int] = {}
        for item in self.sequence(node, what):
            text = self.scalar(item)
            if text is _NOT_SCALAR:
                self.problem(item, f"in {what}: each entry must be a host pattern string such as 'example.com'")
                continue
            try:
                key = parse_host_pattern(text)
            except PatternError as e:
                self.problem(item, f"in {what}: {_scrub(e, text)}")
                continue
            if key in seen:
                self.problem(item, f"in {what}: {_q(text)} is listed twice (first at line {seen[key]})")
                continue
            seen[key] = item.start_mark.line + 1
            entries.append((text, self.origin(item)))
        try:
            return HostMatcher.build(entries)
        except PatternError as e:  # already reported above; defensive
            self.problem(node, str(e))
            return HostMatcher()

    def ports(self, node: yaml.Node) -> frozenset[int] | None:
        out = set()
        items = self.sequence(node, "ports")
        for item in items:
            value = self.scalar(item)
            if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
                self.problem(item, f"ports: {_q(value)} is not a port number (1-65535)")
            else:
                out.add(value)
        if not items and isinstance(node, yaml.SequenceNode):
            self.problem(node, "ports is empty: nothing could be reached; list at least one port")
        return frozenset(out)

    def methods(self, node: yaml.Node) -> frozenset[str]:
        out = set()
        for item in self.sequence(node, "methods"):
            value = self.scalar(item)
            if not isinstance(value, str) or not _METHOD.match(value.upper()):
                self.problem(item, f"methods: {_q(value)} is not an HTTP method")
                continue
            if value.upper() not in STANDARD_METHODS:
                hint = difflib.get_close_matches(value.upper(), sorted(STANDARD_METHODS), n=1)
                self.problem(item, f"methods: {_q(value)} is not a standard HTTP method"
                             + (f"; did you mean {_q(hint[0])}?" if hint else ""))
                continue
            out.add(value.upper())
        return frozenset(out)

    def private_networks(self, node: yaml.Node, what: str = "private_networks") -> AddressSet:
        entries = []
        for item in self.sequence(node, what):
            value = self.scalar(item)
            if not isinstance(value, str):
                shown = "this entry" if value is _NOT_SCALAR else repr(value)
                self.problem(item, f"{what}: {shown} must be a CIDR string such as '10.0.0.5/32' or '10.0.0.5/32:8080'")
                continue
            cidr, port = _split_cidr_port(value)
            try:
                if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
                    raise PatternError(f"{_q(value)} has an invalid port {_q(port)}")
                entries.append(AddressSet.entry(cidr, int(port) if port else None, self.origin(item), value))
            except PatternError as e:
                self.problem(item, f"{what}: {_scrub(e, value, cidr)}")
        return AddressSet(tuple(entries))

    def proxy_addresses(self, node: yaml.Node) -> frozenset[str]:
        """`proxy_addresses`: IP addresses (no CIDRs, no ports) that reach
        this host without being on its interfaces (NAT)."""
        out = set()
        for item in self.sequence(node, "proxy_addresses"):
            value = self.scalar(item)
            try:
                if not isinstance(value, str):
                    raise ValueError
                out.add(canonical_ip(value))
            except ValueError:
                shown = "this entry" if value is _NOT_SCALAR else _q(value)
                self.problem(item,
                             f"proxy_addresses: {shown} must be an IP address such as '203.0.113.7' or '2001:db8::7' "
                                   "(one address of this host, no CIDR or port)")
        return frozenset(out)

    def headers(self, node: yaml.Node) -> frozenset[str]:
        out = set()
        for item in self.sequence(node, "strip_request_headers"):
            value = self.scalar(item)
            if not isinstance(value, str) or not _HEADER.match(value):
                self.problem(item, f"strip_request_headers: {_q(value)} is not a header name")
            else:
                out.add(value.lower())
        return frozenset(out)

    def upstream_proxy(self, node: yaml.Node, base: UpstreamProxy | None) -> UpstreamProxy | None:
        """`upstream_proxy: {url: http://HOST:PORT, credentials: {file: PATH}}`:
        the parent proxy the dialer CONNECTs through; null: direct (a profile
        clearing the top level's)."""
        if isinstance(node, yaml.ScalarNode):
            if self.scalar(node) is None:
                return None
            self.problem(node, "upstream_proxy must be a mapping: {url: http://HOST:PORT} (with credentials: "
                               "{file: PATH} if the parent asks for them), or null for direct connections")
            return base
        keys = self.mapping(node, UPSTREAM_PROXY_KEYS, "upstream_proxy")
        if not keys:
            if isinstance(node, yaml.MappingNode):
                self.problem(node, "upstream_proxy needs url: http://HOST:PORT (or null for direct connections)")
            return base
        if "url" not in keys:
            self.problem(node, "upstream_proxy needs url: http://HOST:PORT, the parent proxy's address")
            return base
        url_node = keys["url"][1]
        url = self.scalar(url_node)
        try:
            if not isinstance(url, str):
                raise ValueError("must be text such as 'http://corp-proxy:3128'")
            host, port = parse_upstream_proxy_url(url)
        except ValueError as e:
            # Never quoted: a URL with user:password@ would put the secret in the message.
            self.problem(url_node, f"upstream_proxy.url {e}")
            return base
        authorization, source = None, None
        if "credentials" in keys:
            cred_node = keys["credentials"][1]
            if not isinstance(cred_node, yaml.MappingNode):
                # Never quote it: it may be the secret itself.
                self.problem(cred_node, "upstream_proxy.credentials is written inline; secrets never go in the "
                                        "policy: write {file: PATH} or {env: NAME} holding user:password")
                return base
            header = self.credential_value("Proxy-Authorization", cred_node, "upstream_proxy.credentials")
            if header is None:
                return base
            authorization, source = header.value, header.source
            if header.format is None and header.value.known:
                # No format: the value is user:password, sent as Basic auth.
                pair = header.value.reveal()
                if ":" not in pair:
                    self.problem(cred_node, f"upstream_proxy.credentials: the {header.source} must hold user:password "
                                            "(or give format: \"Bearer {}\" to send its text as the whole "
                                            "Proxy-Authorization value)")
                    return base
                authorization = creds.Secret("Basic " + base64.b64encode(pair.encode("utf-8")).decode("ascii"))
        return UpstreamProxy(host, port, url, authorization, source, self.origin(node))

    def note(self, node: yaml.Node, base: str | None) -> str | None:
        """refusal_note: one line of text appended to refusals; null clears an inherited one."""
        value = self.scalar(node)
        if value is None:
            return None
        if not isinstance(value, str):
            shown = ("a list or mapping" if value is _NOT_SCALAR else
                     f"the {'boolean' if isinstance(value, bool) else 'number'} {_q(value)}"
                     if isinstance(value, (bool, int, float)) else f"{_q(value)}")
            self.problem(node, f"refusal_note must be text (one sentence appended to refusals), not {shown}")
            return base
        text = value.strip()
        if not text:
            self.problem(node, "refusal_note is empty; write a sentence (e.g. who to ask for access) or remove the key")
        elif len(text) > MAX_NOTE_CHARS:
            self.problem(node,
                         f"refusal_note is {len(text)} characters; keep it to one sentence of at most {MAX_NOTE_CHARS}")
        elif not text.isprintable():
            self.problem(node,
                         "refusal_note must be one line of printable text (no line breaks, tabs or control characters)")
        else:
            return text
        return base

    # ---- credentials (policy.credentials) -----------------------------

    def credentials(self, node: yaml.Node, top_level: bool) -> tuple[creds.Credential, ...]:
        """A `credentials` list. Values come from a file or an environment
        variable, never from the policy; no message ever quotes a value."""
        out: list[creds.Credential] = []
        seen_hosts: dict[tuple[str, ...], int] = {}
        for item in self.sequence(node, "credentials"):
            keys = self.mapping(item, CREDENTIAL_KEYS, "a credentials entry")
            if not isinstance(item, yaml.MappingNode):
                continue
            if "hosts" not in keys or "set_headers" not in keys:
                missing = " and ".join(k for k in ("hosts", "set_headers") if k not in keys)
                self.problem(item, f"a credentials entry needs {missing}")
                continue
            hosts_node = keys["hosts"][1]
            hosts = self.patterns(hosts_node, "credentials hosts")
            texts = tuple(str(self.scalar(n)) for n in self.sequence(hosts_node, "credentials hosts"))
            if not texts and isinstance(hosts_node, (yaml.SequenceNode, yaml.ScalarNode)):
                self.problem(hosts_node, "credentials hosts is empty: name the hosts these headers are for")
            if hosts.everything:
                self.problem(hosts_node,
                             "credentials hosts may not be '*': a secret would go to every host; name its hosts")
            for address in hosts.addresses.entries:
                if address.prefixlen != (32 if address.version == 4 else 128):
                    self.problem(hosts_node, f"credentials hosts: {_q(address.rule.text)} is a network; name single "
                                             "hosts (or IP addresses) a secret may go to")
            if texts in seen_hosts:
                self.problem(hosts_node,
                             f"credentials: this hosts list is already an entry (line {seen_hosts[texts]}); "
                                         "give each hosts list one entry")
            seen_hosts.setdefault(texts, item.start_mark.line + 1)
            headers = self.credential_headers(keys["set_headers"][1], top_level)
            plain = False
            if "allow_plain_http" in keys:
                value = self.scalar(keys["allow_plain_http"][1])
                if not isinstance(value, bool):
                    self.problem(keys["allow_plain_http"][1],
                                 f"allow_plain_http must be true or false, not {_q(value)}")
                else:
                    plain = value
            entry = creds.Credential(hosts=hosts, hosts_text=texts, headers=headers, allow_plain_http=plain,
                                     origin=self.origin(item))
            self._credential_nodes[id(entry)] = hosts_node
            out.append(entry)
        return tuple(out)

    def credential_headers(self, node: yaml.Node, top_level: bool) -> tuple[creds.CredentialHeader, ...]:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, "set_headers must map header names to {file: PATH} or {env: NAME}")
            return ()
        if not node.value and top_level:
            self.problem(node, "set_headers is empty (an empty one only makes sense in a client profile, to drop "
                               "the top level's entry with the same hosts)")
        out: list[creds.CredentialHeader] = []
        names: set[str] = set()
        for key_node, value_node in node.value:
            name = self.scalar(key_node)
            if not isinstance(name, str) or not _HEADER.match(name):
                self.problem(key_node, f"set_headers: {_q(name)} is not a header name")
                continue
            if name.lower() in names:
                self.problem(key_node, f"set_headers: {_q(name)} is listed twice")
                continue
            names.add(name.lower())
            if name.lower() in creds.FORBIDDEN_HEADERS:
                self.problem(key_node,
                             f"set_headers: {_q(name)} frames or routes the request; a credential cannot set it")
                continue
            if not isinstance(value_node, yaml.MappingNode):
                # Never quote it: it may be the secret itself.
                self.problem(value_node, f"set_headers: the value of {_q(name)} is written inline; secrets never go in "
                                         "the policy: write {file: PATH} or {env: NAME} (with format: \"Bearer {}\" "
                                         "if the header needs more than the secret)")
                continue
            header = self.credential_value(name, value_node)
            if header is not None:
                out.append(header)
        return tuple(out)

    def credential_value(self, name: str, node: yaml.Node, what: str | None = None) -> creds.CredentialHeader | None:
        """A {file: PATH} or {env: NAME} value (with an optional format); `what`
        starts its problems (default: the set_headers entry `name`)."""
        spec = self.mapping(node, CREDENTIAL_VALUE_KEYS,
                            f"the value of {what}" if what else f"the value of header {_q(name)}")
        what = what or f"set_headers: {_q(name)}"
        sources = [k for k in ("file", "env") if k in spec]
        if len(sources) != 1:
            self.problem(node, f"{what} needs exactly one of file: PATH or env: NAME")
            return None
        kind = sources[0]
        where = spec[kind][1]
        text = self.scalar(where)
        if not isinstance(text, str) or not text:
            self.problem(where, f"{what}: {kind} must be a non-empty string")
            return None
        fmt = None
        if "format" in spec:
            fmt = self.scalar(spec["format"][1])
            if not isinstance(fmt, str) or fmt.count(creds.FORMAT_SLOT) != 1:
                self.problem(spec["format"][1], f"{what}: format must be text with exactly one {{}} "
                                                "where the secret goes, e.g. \"Bearer {}\"")
                return None
            if creds.value_problem(fmt.replace(creds.FORMAT_SLOT, "x")):
                self.problem(spec["format"][1], f"{what}: format must be one line of text")
                return None
        path = None
        if kind == "file":
            path = text if os.path.isabs(text) else os.path.join(os.path.dirname(os.path.abspath(self.file)), text)
            source = f"file {text}"
            raw = self._credential_file(what, text, where)
            if raw is _NOT_READ:
                return None
        else:
            source = f"env {text}"
            if self.environ is None:
                raw = None
            elif text not in self.environ:
                self.problem(where, f"{what}: the environment variable {_q(text)} is not set")
                return None
            else:
                raw = self.environ[text]
        if raw is None:
            return creds.CredentialHeader(name, source, creds.Secret(None), path, fmt)
        wrong = creds.value_problem(raw)
        if wrong:
            self.problem(where, f"{what}: the {'file' if kind == 'file' else 'variable'} "
                                f"{_q(text)} {wrong}")
            return None
        return creds.CredentialHeader(name, source, creds.Secret(creds.format_value(raw, fmt)), path, fmt)

    def _credential_file(self, what: str, text: str, where: yaml.Node) -> str | None | Literal[_Unread.NOT_READ]:
        """The file's text (None when files are not read), or _NOT_READ after a problem."""
        if self.read_secret is None:
            return None
        try:
            return self.read_secret(text)
        except OSError as e:
            self.problem(where, f"{what}: cannot read {_q(text)} ({e.strerror or e})")
        except FileRefused as e:
            self.problem(where, f"{what}: cannot read {_q(text)}: {e}")
        except UnicodeDecodeError:
            self.problem(where, f"{what}: {_q(text)} is not UTF-8 text")
        return _NOT_READ

    def credentials_intercepted(self, top: Rules, clients: tuple[ClientProfile, ...], require_client: bool) -> None:
        """Every credentials host must be intercepted for HTTPS by the rules
        it applies under, or its HTTPS requests would go through a raw tunnel
        the proxy never sees (and the header would never be set)."""
        scopes = ([] if require_client and clients else [(None, top)]) + [(p.name, p.rules) for p in clients]
        reported: set[tuple[int, str]] = set()
        for profile, rules in scopes:
            for entry in rules.credentials:
                node = self._credential_nodes.get(id(entry))
                if node is None or not entry.headers:
                    continue
                for text in entry.hosts_text:
                    if covers_pattern(rules.intercept, text) or (id(entry), text) in reported:
                        continue
                    reported.add((id(entry), text))
                    item = next((n for n in self.sequence(node, "credentials hosts") if self.scalar(n) == text), node)
                    where = f"client profile {_q(profile)}'s" if profile is not None else "the top level's"
                    self.problem(item, f"credentials host {_q(text)} ({entry.origin}) is not intercepted by {where} "
                                       f"`intercept`, so its HTTPS requests pass through a tunnel the proxy never "
                                       f"sees: add {_q(text)} to {where} `intercept`")

    # ---- request rules (policy.request_rules) --------------------------

    def request_rules(self, node: yaml.Node) -> RuleSet:
        """A `rules` list: each entry `allow: {...}` or `deny: {...}` with
        `hosts` and optionally `methods`, `paths` and `query`."""
        out: list[RequestRule] = []
        for item in self.sequence(node, "rules"):
            keys = self.mapping(item, REQUEST_RULE_ACTIONS, "a rules entry")
            if not isinstance(item, yaml.MappingNode):
                continue
            if len(keys) != 1:
                if len(keys) > 1 or not item.value:
                    self.problem(item,
                                 "a rules entry is one of `allow: {hosts: [...], ...}` or `deny: {hosts: [...], ...}`")
                continue
            action, (_, spec_node) = next(iter(keys.items()))
            rule = self.request_rule(action, spec_node, item)
            if rule is not None:
                out.append(rule)
        return RuleSet(tuple(out))

    def request_rule(self, action: str, node: yaml.Node, item: yaml.Node) -> RequestRule | None:
        what = f"a rules {action} entry"
        spec = self.mapping(node, REQUEST_RULE_KEYS, what)
        if not isinstance(node, yaml.MappingNode):
            return None
        if "hosts" not in spec:
            self.problem(node, f"{what} needs `hosts` (the host patterns it applies to, as in `allow`)")
            return None
        before = len(self.problems)
        hosts_node = spec["hosts"][1]
        hosts = self.patterns(hosts_node, "rules hosts")
        texts = tuple(str(self.scalar(n)) for n in self.sequence(hosts_node, "rules hosts"))
        if not texts and len(self.problems) == before:
            self.problem(hosts_node, "rules hosts is empty: name the hosts this rule applies to ('*' for every host)")
        methods = None
        if "methods" in spec:
            methods_node = spec["methods"][1]
            methods = self.methods(methods_node)
            if not methods and len(self.problems) == before:
                self.problem(methods_node, "rules methods is empty, so the rule could never match; leave `methods` out "
                                           "for any method")
            if "CONNECT" in methods:
                self.problem(methods_node,
                             "rules methods: CONNECT never reaches a rule with `methods` (a CONNECT is decided "
                                           "by the rules with only `hosts`, and an intercepted one by the requests "
                                           "inside); remove it")
        paths = None
        if "paths" in spec:
            compiled = []
            for path_node in self.sequence(spec["paths"][1], "rules paths"):
                try:
                    compiled.append(PathPattern.compile(self.scalar(path_node)
                                                        if isinstance(path_node, yaml.ScalarNode) else None))
                except PathPatternError as e:
                    self.problem(path_node, f"rules paths: {_scrub(e, self.scalar(path_node))}")
            if not compiled and len(self.problems) == before:
                self.problem(spec["paths"][1],
                             "rules paths is empty, so the rule could never match; leave `paths` out for any path")
            paths = tuple(compiled)
        query = None
        if "query" in spec:
            query_node = spec["query"][1]
            if not isinstance(query_node, yaml.MappingNode) or not query_node.value:
                self.problem(query_node, "rules query must map parameter names to globs, e.g. {state: open, page: '*'}")
            else:
                globs: list[QueryGlob] = []
                for key_node, value_node in query_node.value:
                    name, glob = self.scalar(key_node), self.scalar(value_node)
                    if not isinstance(name, str) or not name:
                        self.problem(key_node, "rules query: each key must be a parameter name")
                    elif isinstance(glob, bool) or not isinstance(glob, (str, int)):
                        self.problem(value_node,
                                     f"rules query: the glob for {_q(name)} must be text such as 'open' or '*'")
                    elif any(q.name == name for q in globs):
                        self.problem(key_node, f"rules query: {_q(name)} is listed twice")
                    else:
                        globs.append(QueryGlob.compile(name, str(glob)))
                query = tuple(globs)
        if len(self.problems) != before:
            return None
        rule = RequestRule(action, hosts, texts, methods, paths, query, origin=self.origin(item),
                           line=item.start_mark.line + 1, column=item.start_mark.column + 1)
        self._rule_nodes[id(rule)] = hosts_node
        return rule

    # ---- approvals (policy.approvals) --------------------------------

    def approvals(self, node: yaml.Node, base: ApprovalSettings | None) -> ApprovalSettings | None:
        """An `approvals` block; a profile's keys override the top level's
        (`approvals: null` in a profile turns them off)."""
        if isinstance(node, yaml.ScalarNode) and self.scalar(node) is None:
            return None
        keys = self.mapping(node, APPROVAL_KEYS, "approvals")
        settings = base or ApprovalSettings()
        changes: dict[str, Any] = {"origin": self.origin(node)}
        if "ask" in keys:
            changes["ask"] = self.approval_ask(keys["ask"][1])
        for key in ("grant_for", "wait"):
            if key not in keys:
                continue
            value_node = keys[key][1]
            try:
                changes[key] = parse_duration(self.scalar(value_node), allow_zero=key == "wait")
            except ValueError as e:
                self.problem(value_node, f"approvals.{key}: {e}")
                continue
            if key == "wait" and changes[key] > appr.MAX_WAIT:
                self.problem(value_node, f"approvals.wait is at most {appr.MAX_WAIT:g}s (a held request holds "
                                         "its client connection); agents retry after Retry-After instead")
        if "notify" in keys:
            changes["notify"] = self.approval_notify(keys["notify"][1])
        result = replace(settings, **changes)
        if not result.ask and isinstance(node, yaml.MappingNode):
            self.problem(node, "approvals needs `ask`: the refusals that become requests for approval, e.g. "
                               "[host_not_allowed, rule_denied]")
        return result

    def approval_ask(self, node: yaml.Node) -> frozenset[Reason]:
        out: set[Reason] = set()
        for item in self.sequence(node, "approvals.ask"):
            value = self.scalar(item)
            if isinstance(value, str) and value in {r.value for r in appr.ASKABLE}:
                out.add(Reason(value))
            else:
                self.problem(item, f"approvals.ask: {_q(value)} is never askable: "
                                   f"{appr.never_askable_why(str(value))}; askable: "
                                   f"{', '.join(sorted(r.value for r in appr.ASKABLE))}")
        return frozenset(out)

    def approval_notify(self, node: yaml.Node) -> appr.Notify | None:
        keys = self.mapping(node, NOTIFY_KEYS, "approvals.notify")
        if not isinstance(node, yaml.MappingNode):
            return None
        if "webhook" not in keys or "secret" not in keys:
            missing = " and ".join(k for k in NOTIFY_KEYS if k not in keys)
            self.problem(node, f"approvals.notify needs {missing} (the webhook's body is signed with the secret)")
            return None
        url_node = keys["webhook"][1]
        url = self.scalar(url_node)
        parts = urlsplit(url) if isinstance(url, str) else None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            self.problem(url_node, f"approvals.notify.webhook must be an http(s) URL with a host, not {_q(url)}")
            return None
        if parts.username is not None or parts.password is not None:
            self.problem(url_node, "approvals.notify.webhook must not carry user:password@ (the body is signed)")
            return None
        secret_node = keys["secret"][1]
        spec = self.mapping(secret_node, SECRET_KEYS, "approvals.notify.secret")
        sources = [k for k in SECRET_KEYS if k in spec]
        if len(sources) != 1:
            self.problem(secret_node, "approvals.notify.secret needs exactly one of file: PATH or env: NAME "
                                      "(the secret never goes in the policy)")
            return None
        kind = sources[0]
        where = spec[kind][1]
        text = self.scalar(where)
        if not isinstance(text, str) or not text:
            self.problem(where, f"approvals.notify.secret: {kind} must be a non-empty string")
            return None
        raw: str | None
        if kind == "file":
            read = self._credential_file("approvals.notify.secret", text, where)
            if read is _NOT_READ:
                return None
            raw = read.strip() if isinstance(read, str) else None
        elif self.environ is None:
            raw = None
        elif text not in self.environ:
            self.problem(where, f"approvals.notify.secret: the environment variable {_q(text)} is not set")
            return None
        else:
            raw = self.environ[text].strip()
        if raw == "":
            self.problem(where, f"approvals.notify.secret: the {'file' if kind == 'file' else 'variable'} "
                                f"{_q(text)} is empty")
            return None
        return appr.Notify(url, creds.Secret(raw), f"{kind} {text}")

    def rules_intercepted(self, top: Rules, clients: tuple[ClientProfile, ...], require_client: bool) -> None:
        """A rule on methods, paths or query needs to see the request: every
        host it names must be intercepted for HTTPS by the rules it applies
        under, or its HTTPS requests pass in a tunnel the proxy never opens."""
        scopes = ([] if require_client and clients else [(None, top)]) + [(p.name, p.rules) for p in clients]
        reported: set[tuple[int, str]] = set()
        for profile, rules in scopes:
            for rule in rules.request_rules.rules:
                node = self._rule_nodes.get(id(rule))
                if node is None or rule.host_only:
                    continue
                for text in rule.hosts_text:
                    if covers_pattern(rules.intercept, text) or (id(rule), text) in reported:
                        continue
                    reported.add((id(rule), text))
                    item = next((n for n in self.sequence(node, "rules hosts") if self.scalar(n) == text), node)
                    where = f"client profile {_q(profile)}'s" if profile is not None else "the top level's"
                    kinds = " and ".join(k for k,
                                         v in (("methods", rule.methods), ("paths", rule.paths), ("query", rule.query))
                                         if v is not None)
                    self.problem(item,
                                 f"the rule at {rule.origin} checks {kinds} on {_q(text)}, which {where} `intercept` "
                                       "does not name, so its HTTPS requests pass through a tunnel the proxy never "
                                       f"sees: add {_q(text)} to {where} `intercept`, or keep only `hosts` in this "
                                       f"rule")

    def limits(self, node: yaml.Node, base: Limits) -> Limits:
        changes: dict[str, Any] = {}
        for key, (_key_node, value_node) in self.mapping(node, LIMIT_KEYS, "limits").items():
            value = self.scalar(value_node)
            if value is _NOT_SCALAR:
                self.problem(value_node, f"limits.{key} must be a single value, not a list or mapping")
                continue
            if value is None and key in OPTIONAL_LIMITS:
                changes[key] = None
                continue
            try:
                if key in SIZE_LIMITS:
                    changes[key] = parse_size(value)
                elif key in COUNT_LIMITS:
                    changes[key] = parse_count(value)
                elif key in RATE_LIMITS:
                    changes[key] = parse_rate(value)
                elif key in PREFIX_LIMITS:
                    changes[key] = parse_prefix(value)
                else:
                    changes[key] = parse_duration(value)
            except ValueError as e:
                self.problem(value_node, f"limits.{key}: {e}")
        limits = replace(base, **changes)
        if limits.h2_max_concurrent_streams > H2_MAX_SETTING:
            self.problem(node, f"limits.h2_max_concurrent_streams: {limits.h2_max_concurrent_streams} is more than "
                               f"HTTP/2 can announce (at most {H2_MAX_SETTING})")
        if "burst" in changes and limits.burst is not None and limits.requests_per_second is None:
            self.problem(node, "limits.burst has no effect without limits.requests_per_second (the rate its bucket "
                               "refills at)")
        return limits

    def dns(self, node: yaml.Node) -> DnsSettings:
        changes: dict[str, Any] = {}
        for key, (_key_node, value_node) in self.mapping(node, DNS_KEYS, "dns").items():
            if key == "nameservers":
                servers = []
                for item in self.sequence(value_node, "dns.nameservers"):
                    text = self.scalar(item)
                    try:
                        servers.append(_nameserver(text))
                    except ValueError as e:
                        self.problem(item, f"dns.nameservers: {e}")
                changes[key] = tuple(servers)
            elif not isinstance(value_node, yaml.ScalarNode):
                self.problem(value_node, f"dns.{key} must be a single value, not a list or mapping")
            else:
                try:
                    changes[key] = parse_duration(self.scalar(value_node), allow_zero=key == "min_ttl")
                except ValueError as e:
                    self.problem(value_node, f"dns.{key}: {e}")
        settings = replace(DnsSettings(), **changes)
        if settings.min_ttl > settings.max_ttl:
            self.problem(node, "dns.min_ttl is greater than dns.max_ttl")
        return settings

    def rules(self, keys: dict[str, tuple[yaml.Node, yaml.Node]], base: Rules, top_level: bool = True) -> Rules:
        changes: dict[str, Any] = {}
        for key, (_key_node, value_node) in keys.items():
            if key == "action":
                value = self.scalar(value_node)
                if value not in ("enforce", "report"):
                    self.problem(value_node, f"action must be 'enforce' or 'report', not {_q(value)}")
                else:
                    changes[key] = value
            elif key in ("allow", "deny", "intercept"):
                changes[key] = self.patterns(value_node, key)
            elif key == "ports":
                changes[key] = self.ports(value_node)
            elif key == "methods":
                changes[key] = self.methods(value_node)
            elif key == "private_networks":
                changes[key] = self.private_networks(value_node)
            elif key == "limits":
                changes[key] = self.limits(value_node, base.limits)
            elif key == "strip_request_headers":
                changes[key] = self.headers(value_node)
            elif key == "refusal_note":
                changes[key] = self.note(value_node, base.refusal_note)
            elif key == "credentials":
                changes[key] = creds.merge(self.credentials(value_node, top_level), base.credentials)
            elif key == "rules":
                changes["request_rules"] = self.request_rules(value_node)
            elif key == "upstream_proxy":
                changes[key] = self.upstream_proxy(value_node, base.upstream_proxy)
            elif key == "approvals":
                changes[key] = self.approvals(value_node, base.approvals)
        rules = replace(base, **changes)
        self._shadowed(rules, keys)
        self._never_match(rules, keys, top_level)
        return rules

    def _shadowed(self, rules: Rules, keys: dict[str, tuple[yaml.Node, yaml.Node]]) -> None:
        """An allow entry that a deny entry always overrides can never match."""
        if rules.allow is None or not rules.deny or "allow" not in keys:
            return
        allow_node = keys["allow"][1]
        for item in self.sequence(allow_node, "allow"):
            text = self.scalar(item)
            try:
                kind, key = parse_host_pattern(text)
            except PatternError:
                continue
            if kind in ("everything", "cidr"):
                continue
            if not covers_pattern(rules.deny, text):
                continue
            deny = rules.deny.match_name(key if kind != "subdomains" else f"x.{key}")
            if deny is not None:
                self.problem(item, f"allow entry {_q(text)} can never match: the deny rule {_q(deny.text)} "
                                   f"({deny.origin}) always wins")

    def _never_match(self, rules: Rules, keys: dict[str, tuple[yaml.Node, yaml.Node]], top_level: bool) -> None:
        """Entries that can only match what Sluice refuses anyway are errors,
        not silent no-ops: a wildcard that covers internal names only (allow or
        deny), an exact internal name under deny, and an allow IP/CIDR whose
        every address is non-public and not opened by `private_networks`."""
        can_match: Callable[..., bool]  # (rules, key=the entry) -> bool
        for what in ("allow", "deny"):
            node = keys[what][1] if what in keys else None
            if not isinstance(node, yaml.SequenceNode):
                continue
            for item in node.value:
                text = self.scalar(item)
                try:
                    kind, key = parse_host_pattern(text)
                except PatternError:
                    continue  # reported by patterns()
                if kind in ("subdomains", "apex_and_subdomains"):
                    suffix = _internal_suffix(key)
                    if suffix is None:
                        continue
                    if what == "allow":
                        self.problem(item,
                                     f"allow entry {_q(text)} can never match: every name it covers is an internal "
                                     f"name (*.{suffix}), which Sluice refuses before any rule is read; only an exact "
                                     f"entry makes an internal name reachable (e.g. {_q('wiki.' + suffix)}), "
                                     "never a wildcard")
                        continue
                    # It still denies an internal name that an allow list names exactly.
                    can_match = lambda r, key=key: r.allow is not None and any(  # noqa: E731
                        name == key or name.endswith("." + key) for name in r.allow.exact)
                    message = (f"deny entry {_q(text)} can never match: every name it covers is an internal name "
                               f"(*.{suffix}), which Sluice refuses before any rule is read; remove it")
                elif kind == "exact" and what == "deny":
                    why = internal_name(key)
                    if not why:
                        continue
                    can_match = lambda r, key=key: r.allow is not None and key in r.allow.exact  # noqa: E731
                    message = (f"deny entry {_q(text)} can never match: {key} is {why}, which Sluice refuses anyway "
                               "(only an exact `allow` entry makes it reachable); remove it")
                elif kind == "cidr" and what == "allow":
                    blocked = _wholly_non_public(key)
                    if blocked is None:
                        continue
                    can_match = lambda r, key=key: _opens_any(r.private_networks, key)  # noqa: E731
                    message = (f"allow entry {_q(text)} can never match: every address in it is non-public "
                               f"({blocked.cidr} is {blocked.name}) and no `private_networks` entry opens any of it, "
                               "so Sluice refuses every address it covers; to reach one, list it in `private_networks`")
                else:
                    continue
                if can_match(rules):
                    continue
                if top_level:  # a profile that inherits this list may still make it match
                    self._never_at_top.append((item, what, can_match, message))
                else:
                    self.problem(item, message)

    def never_match_at_top(self, clients: tuple[ClientProfile, ...]) -> None:
        """Report the top-level entries found to match nothing, unless a profile
        that inherits them (allow or deny) makes them match."""
        for item, what, can_match, message in self._never_at_top:
            if not any(can_match(p.rules) for p in clients if p.name in self.inherits[what]):
                self.problem(item, message)
        self._never_at_top = []

    def profiles(self, node: yaml.Node, top: Rules) -> tuple[ClientProfile, ...]:
        out = []
        names: dict[str, int] = {}
        users_seen: dict[str, str] = {}
        sources_seen: dict[tuple[int, int, int], tuple[str, int]] = {}
        for item in self.sequence(node, "clients"):
            keys = self.mapping(item, PROFILE_KEYS, "a client profile")
            name = self.scalar(keys["name"][1]) if "name" in keys else None
            if not isinstance(name, str) or not name:
                self.problem(item, "every client profile needs a `name`")
                continue
            if name in names:
                self.problem(keys["name"][1],
                             f"client profile {_q(name)} is defined twice (first at line {names[name]})")
                continue
            names[name] = item.start_mark.line + 1
            credentials = []
            if "users" in keys:
                for user, (user_node, spec_node) in self._users(keys["users"][1]).items():
                    if user in users_seen:
                        self.problem(user_node,
                                     f"user {_q(user)} is already in profile {_q(users_seen[user])}: a username "
                                                "selects exactly one profile, so this entry could never be used")
                        continue
                    users_seen[user] = name
                    verifier = self._verifier(user, spec_node)
                    if verifier:
                        credentials.append((user, verifier))
            sources = self.private_networks(keys["sources"][1], "sources") if "sources" in keys else AddressSet()
            if "sources" in keys:
                self._same_sources(keys["sources"][1], name, sources_seen)
            for inherited in ("allow", "deny"):
                if inherited not in keys:
                    self.inherits[inherited].add(name)
            if "users" not in keys and "sources" not in keys:
                self.problem(item, f"client profile {_q(name)} matches nobody: give it `users` or `sources`")
            if "limits" in keys:
                self._global_limits(keys["limits"][1], name)
            rule_keys = {k: v for k, v in keys.items() if k in RULE_KEYS}
            out.append(ClientProfile(
                name=name, rules=self.rules(rule_keys, top, top_level=False),
                usernames=frozenset(u for u, _ in credentials), credentials=tuple(credentials),
                sources=sources, origin=self.origin(item),
            ))
        return tuple(out)

    def _same_sources(self, node: yaml.Node, profile: str, seen: dict[tuple[int, int, int], tuple[str, int]]) -> None:
        """A source network already given to another profile: ties go to the
        first profile, so the second could never be matched from there."""
        if not isinstance(node, yaml.SequenceNode):
            return
        for item in node.value:
            value = self.scalar(item)
            if not isinstance(value, str):
                continue
            try:
                entry = AddressSet.entry(_split_cidr_port(value)[0])
            except PatternError:
                continue  # reported by private_networks()
            key = (entry.version, entry.prefixlen, entry.network)
            first = seen.setdefault(key, (profile, item.start_mark.line + 1))
            if first[0] != profile:
                self.problem(item,
                             f"sources entry {_q(value)} is also in client profile {_q(first[0])} (line {first[1]}): "
                                   f"a client from there always matches {_q(first[0])}, the first profile, so this "
                                   "entry never matches; give each network to one profile")

    def _global_limits(self, node: yaml.Node, profile: str) -> None:
        if not isinstance(node, yaml.MappingNode):
            return
        for key_node, _ in node.value:
            key = self.scalar(key_node)
            if key in GLOBAL_LIMITS:
                when = ("it counts every connection as it is accepted"
                        if key in ("max_total_connections", "ipv6_client_prefix") else
                        "it applies to the HTTP/2 connection before its requests are read" if key.startswith("h2_") else
                        "it applies while the request head is read")
                self.problem(key_node,
                             f"limits.{key} is global: set it in the top-level `limits`, not in client profile "
                                       f"{_q(profile)} ({when}, before the client is known)")

    def _users(self, node: yaml.Node) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        if not isinstance(node, yaml.MappingNode):
            self.problem(node, "users must map each username to {password_hash: ...} or {password_file: ...}")
            return {}
        out = {}
        for key_node, value_node in node.value:
            user = self.scalar(key_node)
            if not isinstance(user, str) or not user or ":" in user:
                self.problem(key_node, f"{_q(user)} is not a valid username (no ':' allowed)")
                continue
            out[user] = (key_node, value_node)
        return out

    def _verifier(self, user: str, node: yaml.Node) -> str | None:
        spec = self.mapping(node, USER_KEYS, f"user {_q(user)}")
        if len(spec) != 1:
            if isinstance(node, yaml.MappingNode):
                self.problem(node, f"user {_q(user)} needs exactly one of password_hash or password_file (never a "
                                   "plain password)")
            return None
        key, (_, value_node) = next(iter(spec.items()))
        value = self.scalar(value_node)
        if not isinstance(value, str):
            self.problem(value_node, f"{key} must be a string")
            return None
        if key == "password_hash":
            wrong = _check_verifier(value)
            if wrong:
                self.problem(value_node, f"password_hash for {_q(user)}: {wrong}")
                return None
            return value
        if self.read_secret is None:
            return "file:" + value  # checked when loaded from a file
        try:
            secret = self.read_secret(value)
        except OSError as e:
            self.problem(value_node, f"password_file for {_q(user)}: cannot read {_q(value)} ({e.strerror or e})")
            return None
        except FileRefused as e:
            self.problem(value_node, f"password_file for {_q(user)}: cannot read {_q(value)}: {e}")
            return None
        except UnicodeDecodeError:
            self.problem(value_node, f"password_file for {_q(user)}: {_q(value)} is not UTF-8 text")
            return None
        if not secret:
            self.problem(value_node, f"password_file for {_q(user)}: {_q(value)} is empty")
            return None
        return secret_verifier(secret)


_NOT_SCALAR = object()
class _Unread(enum.Enum):
    """A credential file that could not be read (a problem was reported)."""
    NOT_READ = "not read"


_NOT_READ = _Unread.NOT_READ


def _internal_suffix(name: str) -> str | None:
    """The internal suffix (`local`, `internal`, ...) that `name` is or ends
    in, if any: then every subdomain of `name` is an internal name."""
    labels = name.split(".")
    for i in range(len(labels)):
        suffix = ".".join(labels[i:])
        if suffix in INTERNAL_SUFFIXES:
            return suffix
    return None


def _wholly_non_public(cidr: str) -> NonPublicRange | None:
    """The first non-public range of a CIDR none of whose addresses is public
    (the ranges may chain), or None if any address in it is public."""
    net = parse_cidr(cidr)
    start, first_range = net.first, None
    while start <= net.last:
        holding = [r for r in (IPV4_NON_PUBLIC if net.version == 4 else IPV6_NON_PUBLIC) if r.first <= start <= r.last]
        if not holding:
            return None
        first_range = first_range or holding[0]
        start = max(r.last for r in holding) + 1
    return first_range


def _opens_any(opened: AddressSet, cidr: str) -> bool:
    """Whether a private_networks entry opens any address of this CIDR."""
    net = parse_cidr(cidr)
    bits = 32 if net.version == 4 else 128
    for e in opened.entries:
        if e.version != net.version:
            continue
        first = e.network << (bits - e.prefixlen)
        last = first + (1 << (bits - e.prefixlen)) - 1
        if first <= net.last and net.first <= last:
            return True
    return False


def parse_upstream_proxy_url(text: str) -> tuple[str, int]:
    """`http://HOST:PORT` -> (host, port): host a name or a canonical IP.
    ValueError says what is wrong (for `upstream_proxy.url`)."""
    if any(c.isspace() or ord(c) < 0x20 for c in text):
        raise ValueError("contains spaces or control characters")
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError:
        raise ValueError("is not a URL such as 'http://corp-proxy:3128'") from None
    scheme = parts.scheme.lower()
    if scheme in ("https", "socks5", "socks5h", "socks4"):
        raise ValueError(f"is a {scheme}:// parent; Sluice speaks only plain http:// to a parent proxy (CONNECT, "
                         "so https stays end to end): write http://HOST:PORT")
    if scheme != "http" or not parts.hostname:
        raise ValueError("must be http://HOST:PORT, e.g. 'http://corp-proxy:3128'")
    if parts.username is not None or parts.password is not None:
        raise ValueError("carries credentials; they never go in the policy: give upstream_proxy.credentials as "
                         "{file: PATH} or {env: NAME} holding user:password")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError("must be only http://HOST:PORT (no path, query or fragment)")
    if port is None:
        raise ValueError("has no port: write the parent's port, e.g. 'http://corp-proxy:3128'")
    if not 0 < port < 65536:
        raise ValueError("has a port outside 1-65535")
    host = parts.hostname
    try:
        return canonical_ip(host), port
    except ValueError:
        pass
    if len(host) > 253 or not _DNS_NAME.fullmatch(host):
        raise ValueError("has a host that is neither an IP address nor a DNS name")
    return host.rstrip("."), port


def _split_cidr_port(text: str) -> tuple[str, str | None]:
    text = text.strip()
    if text.startswith("["):  # [2001:db8::/64]:8080
        inner, _, rest = text[1:].partition("]")
        return inner, rest[1:] if rest.startswith(":") else (rest or None)
    if text.count(":") == 1:  # IPv4 with a port
        cidr, port = text.split(":")
        return cidr, port
    return text, None


def _nameserver(text: object) -> tuple[str, int]:
    import ipaddress

    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{_q(text)} is not a nameserver (write an IP, optionally with :port)")
    text = text.strip()
    host, port = text, 53
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":") or not rest[1:].isdigit():
                raise ValueError(f"{_q(text)} has a bad port")
            port = int(rest[1:])
    elif text.count(":") == 1:
        host, p = text.split(":")
        if not p.isdigit():
            raise ValueError(f"{_q(text)} has a bad port")
        port = int(p)
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise ValueError(f"{_q(text)}: a nameserver must be an IP address, not a name") from None
    if not 0 < port < 65536:
        raise ValueError(f"{_q(text)} has a bad port")
    return host, port


_YAML = "tag:yaml.org,2002:"
# Tags a policy may carry. Everything else (!!python/..., !!binary, !!set,
# application tags like !foo, the << merge key) is refused, never constructed.
_SAFE_TAGS = frozenset(_YAML + t for t in ("null", "bool", "int", "float", "str", "seq", "map", "timestamp"))
# Scalars whose construction can fail (explicit `!!int abc`, a date like 2001-13-45).
_CHECKED_SCALARS = frozenset(_YAML + t for t in ("null", "bool", "int", "float", "timestamp"))


def _scan(root: yaml.Node, file: str, what: str = "policy") -> list[Problem]:
    """Walk the node tree as a constructor would expand it (aliases counted
    each time, so an alias bomb stops at MAX_NODES) and refuse unsafe tags and
    scalars that cannot be constructed, before any value is read."""
    problems: list[Problem] = []
    checker = yaml.SafeLoader("")
    seen: set[int] = set()  # report each node once, however often it is aliased
    count = 0
    stack = [root]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_NODES:
            return [Problem(file, 1, 1,
                            f"the {what} expands to more than {MAX_NODES} YAML nodes (an alias bomb?); refusing it")]
        if id(node) not in seen:
            seen.add(id(node))
            mark = node.start_mark
            if node.tag not in _SAFE_TAGS:
                if node.tag == _YAML + "merge":
                    message = "YAML merge keys (<<) are not supported; write the keys out"
                else:
                    tag = "!!" + node.tag[len(_YAML):] if node.tag.startswith(_YAML) else node.tag
                    message = f"the YAML tag {_q(tag)} is not allowed in a {what}"
                problems.append(Problem(file, mark.line + 1, mark.column + 1, message))
            elif node.tag in _CHECKED_SCALARS and isinstance(node, yaml.ScalarNode):
                try:
                    checker.yaml_constructors[node.tag](checker, node)
                except Exception as e:  # PyYAML raises IndexError, KeyError, AttributeError... here too
                    kind = node.tag[len(_YAML):]
                    problems.append(Problem(file, mark.line + 1, mark.column + 1,
                                            f"{_q(node.value)} is not a valid {kind} ({_scrub(e, node.value)})"))
        if isinstance(node, yaml.SequenceNode):
            stack.extend(node.value)
        elif isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                stack.append(k)
                stack.append(v)
    return problems


def compose_checked(text: str, file: str, what: str = "policy", *, null_is_empty: bool = True) -> yaml.Node:
    """YAML text -> node tree, safely (SafeLoader, nothing constructed yet);
    syntax errors, deep nesting and emptiness raise PolicyInvalid, and then
    `_scan` refuses tags, merge keys and alias bombs in the tree."""
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        line, col = (mark.line + 1, mark.column + 1) if mark else (1, 1)
        raise PolicyInvalid([Problem(file, line, col,
                                     f"YAML syntax: {_yaml_message(e.problem or e.context)}")]) from None
    except yaml.YAMLError as e:
        raise PolicyInvalid([Problem(file, 1, 1, f"YAML: {_yaml_message(str(e))}")]) from None
    except RecursionError:
        raise PolicyInvalid([Problem(file, 1, 1,
                                     f"the {what} nests lists or mappings too deeply; refusing it")]) from None
    # nothing, `---` or `~`
    if root is None or (null_is_empty and isinstance(root, yaml.ScalarNode) and root.tag == _YAML + "null"):
        hint = "; it needs at least `version: 1`" if what == "policy" else ""
        raise PolicyInvalid([Problem(file, 1, 1, f"the {what} is empty{hint}")])
    return root


def load_policy_text(text: str, file: str = "<policy>", read_secret: Callable[[str], str] | None = None,
                     environ: Mapping[str, str] | None = None) -> Policy:
    """Parse and validate; raise PolicyInvalid with every problem found, and
    never anything else: whatever the text, the caller gets a policy or problems.
    `read_secret` reads password and credential files, `environ` gives
    credentials' environment variables; without them those values are not
    read (credential values are then `Secret`s that were never read)."""
    try:
        return _load_policy_text(text, file, read_secret, environ)
    except PolicyInvalid:
        raise
    except Exception as e:  # a gap in validation must not crash a reload or a check
        raise PolicyInvalid([Problem(file, 1, 1,
                                     f"the policy could not be read ({type(e).__name__}: {_clean(str(e))})")]) from None


def _load_policy_text(text: str, file: str, read_secret: Callable[[str], str] | None,
                      environ: Mapping[str, str] | None = None) -> Policy:
    reader = _Reader(file, read_secret, environ)
    if len(text.encode("utf-8", "surrogatepass")) > MAX_POLICY_BYTES:
        raise PolicyInvalid([Problem(file, 1, 1, f"the policy is larger than {MAX_POLICY_BYTES // 2**20} MiB; refusing "
                                                 "to parse it")])
    root = compose_checked(text, file)
    problems = _scan(root, file)
    if problems:
        raise PolicyInvalid(sorted(problems, key=lambda p: (p.line, p.col)))

    keys = reader.mapping(root, TOP_KEYS, "the policy")
    if "version" not in keys:
        if isinstance(root, yaml.MappingNode):
            reader.problem(root, "the policy needs `version: 1` at the top")
    else:
        version = reader.scalar(keys["version"][1])
        if isinstance(version, bool) or not isinstance(version, int) or version != 1:
            reader.problem(keys["version"][1], _version_problem(version))
    rule_keys = {k: v for k, v in keys.items() if k in RULE_KEYS}
    top = reader.rules(rule_keys, Rules())
    dns = reader.dns(keys["dns"][1]) if "dns" in keys else DnsSettings()
    clients = reader.profiles(keys["clients"][1], top) if "clients" in keys else ()
    reader.never_match_at_top(clients)
    require_client = False
    if "require_client" in keys:
        value = reader.scalar(keys["require_client"][1])
        if not isinstance(value, bool):
            reader.problem(keys["require_client"][1], f"require_client must be true or false, not {_q(value)}")
        else:
            require_client = value
            if value and not clients:
                reader.problem(keys["require_client"][0],
                               "require_client is true but no `clients` are defined: every client would be refused")
    reader.credentials_intercepted(top, clients, require_client)
    reader.rules_intercepted(top, clients, require_client)
    proxy_addresses = reader.proxy_addresses(keys["proxy_addresses"][1]) if "proxy_addresses" in keys else frozenset()
    state = read_state(reader, keys["state"][1]) if "state" in keys else None
    if reader.problems:
        raise PolicyInvalid(sorted(reader.problems, key=lambda p: (p.line, p.col)))
    return Policy(version=1, rules=top, dns=dns, clients=clients, require_client=require_client, source=file,
                  proxy_addresses=proxy_addresses, state=state)


def load_policy_file(path: str | Path) -> Policy:
    """Read and validate a policy file; `password_file` paths are relative to it."""
    return read_policy_file(path)[0]


class FileRefused(ValueError):
    """read_regular_file: the path does not lead to a regular file within the size limit."""


_FILE_KINDS = (
    (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"),
)


def read_regular_file(path: str | Path, limit: int) -> bytes:
    """The bytes of the regular file `path` leads to (symlinks followed), at most
    `limit` of them. Anything else raises FileRefused without reading a byte:
    the open is non-blocking, so a FIFO cannot hang it (a thread blocked opening
    a FIFO could never be cancelled), and the type is checked on the opened fd,
    so a path swapped after a check cannot slip a device in. OSError as usual."""
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_KINDS if test(st.st_mode)), "not a plain file")
            raise FileRefused(f"it is {kind}, not a regular file (symlinks followed); refusing to read it")
        if st.st_size > limit:
            raise FileRefused(f"it is {st.st_size} bytes, over the {size_text(limit)} limit; refusing to read it")
        chunks, total = [], 0
        while total <= limit:  # read limit+1 at most: a file growing past fstat's size is still caught
            chunk = os.read(fd, min(limit + 1 - total, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > limit:
            raise FileRefused(f"it grew past the {size_text(limit)} limit while being read; refusing it")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_policy_bytes(path: str | Path, what: str = "policy") -> bytes:
    """The one way Sluice reads a policy (or cases) file: read_regular_file
    within MAX_POLICY_BYTES, every failure a PolicyInvalid at FILE:1:1."""
    name = str(path)
    try:
        return read_regular_file(path, MAX_POLICY_BYTES)
    except FileRefused as e:
        raise PolicyInvalid([Problem(name, 1, 1, f"cannot read the {what}: {e}")]) from None
    except OSError as e:
        raise PolicyInvalid([Problem(name, 1, 1, f"cannot read the {what}: {e.strerror or e}")]) from None


def read_policy_file(path: str | Path) -> tuple[Policy, bytes]:
    """The validated policy and the exact bytes it was read from (one read).
    Blocking file I/O: the proxy calls it off its event loop."""
    path = Path(path)
    name = str(path)
    raw = read_policy_bytes(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PolicyInvalid([Problem(name, 1, 1,
                                     f"the policy is not UTF-8 text ({e.reason} at byte {e.start})")]) from None

    def read_secret(secret_path: str) -> str:
        p = Path(secret_path)
        if not p.is_absolute():
            p = path.parent / p
        return read_regular_file(p, MAX_SECRET_BYTES).decode("utf-8").strip("\r\n")

    return load_policy_text(text, name, read_secret, os.environ), raw
