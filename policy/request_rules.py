"""Request rules (`rules:`): allow or deny requests by host, method, path and
query, first match wins. Pure: no I/O.

A request's path is normalised once (`normalise_path`) and that normalised
path is both what the rules match and what the proxy forwards, so an origin
can never see a path other than the one a rule judged. Path spellings that
origins disagree about (`%2F`, `%5C`, `%2E%2E`, a backslash, `;`) are not
normalised but refused (`hostile_spelling`) on every host a rule names.

Rules are indexed by host (`RuleSet.for_host`): a decision walks only the
rules that can name the request's host, in policy order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from urllib.parse import parse_qsl

from sluice.policy.hosts import IPHost, NameHost
from sluice.policy.matchers import HostMatcher, covers_pattern

# RFC 3986 2.3: percent-encodings of these are equivalent to the characters.
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
_PERCENT = re.compile(r"%([0-9A-Fa-f]{2})")
# Spellings origins (and the frameworks behind them) decode differently: an
# encoded slash or backslash, an encoded `..`, a raw backslash, and `;`
# (path parameters, which some servers strip before routing).
_HOSTILE = (("%2f", "an encoded slash (%2F)"), ("%5c", "an encoded backslash (%5C)"),
            ("%2e%2e", "an encoded dot-dot (%2E%2E)"), ("\\", "a backslash"), (";", "a semicolon (;)"))
MAX_AUDIT_PATH = 512  # characters of a path in an audit line


def hostile_spelling(path: str) -> str | None:
    """What makes this path (no query) ambiguous to origins, or None."""
    if "%" not in path and "\\" not in path and ";" not in path:
        return None
    lowered = path.lower()
    for needle, what in _HOSTILE:
        if needle in lowered:
            return what
    return None


def split_target(target: str) -> tuple[str, str | None]:
    """A request target (origin-form `path?query`) as (path, query or None)."""
    path, sep, query = target.partition("?")
    return path, (query if sep else None)


def _decode_unreserved(path: str) -> str:
    def one(m: re.Match[str]) -> str:
        char = chr(int(m.group(1), 16))
        return char if char in _UNRESERVED else "%" + m.group(1).upper()
    return _PERCENT.sub(one, path)


def _remove_dot_segments(segments: list[str]) -> list[str]:
    out: list[str] = []
    for seg in segments:
        if seg == ".":
            continue
        if seg == "..":
            if out:
                out.pop()
            continue
        out.append(seg)
    return out


def normalise_path(path: str) -> str:
    """The path (no query) as rules match it and the proxy forwards it:
    percent-encoded unreserved characters decoded (other encodings in upper
    case), `//` collapsed, dot segments resolved. A path that does not start
    with `/` (`*` of `OPTIONS *`) is returned unchanged."""
    if not path.startswith("/"):
        return path
    if "%" not in path and "//" not in path and "/." not in path:
        return path  # already normal (the common case)
    decoded = _decode_unreserved(path)
    parts = decoded.split("/")[1:]
    trailing = parts[-1] in ("", ".", "..")  # `/a/`, `/a/.` and `/a/..` end in a slash
    segments = _remove_dot_segments([p for p in parts if p != ""])
    text = "/" + "/".join(segments)
    if trailing and segments:
        text += "/"
    return text


class PathPatternError(ValueError):
    """A `paths` entry that is malformed or can never match a normalised path."""


@dataclass(frozen=True, slots=True)
class PathPattern:
    """`*` is one (non-empty) segment, `**` any number of segments (none
    included), `*` inside a segment any characters but `/`; the rest is
    literal and case-sensitive."""

    text: str
    regex: re.Pattern[str] = field(compare=False)

    @classmethod
    def compile(cls, text: object) -> PathPattern:
        if not isinstance(text, str) or not text:
            raise PathPatternError("a path pattern must be a non-empty string starting with '/', such as '/repos/**'")
        if not text.startswith("/"):
            raise PathPatternError(f"{text!r} must start with '/'")
        if "?" in text or "#" in text:
            raise PathPatternError(f"{text!r}: a path pattern has no query or fragment; match parameters with `query:`")
        hostile = hostile_spelling(text)
        if hostile:
            raise PathPatternError(f"{text!r} contains {hostile}, which Sluice refuses in paths, so it can never match")
        if any(c.isspace() or not c.isprintable() for c in text):
            raise PathPatternError(f"{text!r} contains spaces or control characters; percent-encode them")
        segments = text.split("/")[1:]
        trailing = len(segments) > 1 and segments[-1] == ""
        body = segments[:-1] if trailing else segments
        if any(s == "" for s in body[:-1]) or any(s in (".", "..") for s in body):
            raise PathPatternError(f"{text!r} is not normalised (no '//', '.' or '..' segments): paths are matched "
                                   f"after normalisation, so it could never match")
        if _decode_unreserved(text) != text:
            raise PathPatternError(f"{text!r} percent-encodes characters that need none; write "
                                   f"{_decode_unreserved(text)!r} (paths are matched decoded)")
        regex = "^"  # dropped below: patterns are used with fullmatch
        for seg in body:
            if seg == "**":
                regex += "(?:/[^/]*)*"
            elif seg == "*":
                regex += "/[^/]+"
            elif "**" in seg:
                raise PathPatternError(f"{text!r}: '**' must be a whole segment ('/a/**/b')")
            else:
                regex += "/" + "[^/]*".join(re.escape(p) for p in seg.split("*"))
        if trailing:
            regex += "/"
        if regex == "^":
            regex += "/"
        return cls(text, re.compile(regex[1:]))

    def matches(self, path: str) -> bool:
        return self.regex.fullmatch(path) is not None


@dataclass(frozen=True, slots=True)
class QueryGlob:
    """One `query:` entry: the parameter must be present and every value it
    has must match the glob (`*` any characters)."""

    name: str
    glob: str
    regex: re.Pattern[str] = field(compare=False)

    @classmethod
    def compile(cls, name: str, glob: str) -> QueryGlob:
        return cls(name, glob, re.compile(".*".join(re.escape(p) for p in glob.split("*")), re.S))


@dataclass(frozen=True, slots=True)
class RequestRule:
    action: str  # "allow" | "deny"
    hosts: HostMatcher = field(compare=False)
    hosts_text: tuple[str, ...]
    methods: frozenset[str] | None = None  # None: any method
    paths: tuple[PathPattern, ...] | None = None  # None: any path
    query: tuple[QueryGlob, ...] | None = None  # None: any query
    origin: str = ""  # FILE:LINE
    line: int = 0  # of the entry, and its column: for `policy check` warnings
    column: int = 0
    _summary: str = field(default="", init=False, repr=False, compare=False)

    @property
    def host_only(self) -> bool:
        """Decides CONNECTs too: nothing in it needs the request inside."""
        return self.methods is None and self.paths is None and self.query is None

    def __post_init__(self) -> None:
        # Built once: decisions name the rule without formatting it again.
        object.__setattr__(self, "_summary", self._format())

    @property
    def text(self) -> str:
        """The rule as one short line, for messages."""
        return self._summary

    def _format(self) -> str:
        parts = [f"hosts: [{', '.join(self.hosts_text)}]"]
        if self.methods is not None:
            parts.append(f"methods: [{', '.join(sorted(self.methods))}]")
        if self.paths is not None:
            parts.append(f"paths: [{', '.join(p.text for p in self.paths)}]")
        if self.query is not None:
            parts.append("query: {" + ", ".join(f"{q.name}: {q.glob}" for q in self.query) + "}")
        return f"{self.action}: {{{', '.join(parts)}}}"

    def matches(self, method: str, path: str, query: str | None) -> bool:
        if self.methods is not None and method not in self.methods:
            return False
        if self.paths is not None and not any(p.regex.fullmatch(path) for p in self.paths):
            return False
        return self.query_matches(query)

    def query_matches(self, query: str | None) -> bool:
        if self.query is None:
            return True
        pairs = parse_qsl(query or "", keep_blank_values=True)
        for q in self.query:
            values = [v for k, v in pairs if k == q.name]
            if not values or not all(q.regex.fullmatch(v) for v in values):
                return False
        return True


class _Scan:
    """The rules one host and method can meet, in order, with every path
    pattern in one alternation (fullmatch tries them in order, so the group
    that matched names the first rule whose path matches)."""

    __slots__ = ("rules", "regex", "group_rule")

    def __init__(self, rules: list[RequestRule]) -> None:
        self.rules = rules
        alternatives, self.group_rule = [], [0]  # group numbers start at 1
        for k, rule in enumerate(rules):
            for pattern in rule.paths if rule.paths is not None else (None,):
                alternatives.append(f"({pattern.regex.pattern if pattern is not None else '.*'})")
                self.group_rule.append(k)
        self.regex = re.compile("|".join(alternatives), re.S)

    def first(self, path: str, query: str | None) -> RequestRule | None:
        m = self.regex.fullmatch(path)
        if m is None:
            return None
        assert m.lastindex is not None  # each alternative is a group, so a match has one
        k = self.group_rule[m.lastindex]
        rule = self.rules[k]
        if rule.query_matches(query):
            return rule
        # A query condition failed (rare): the rest in order, one by one.
        for rule in self.rules[k + 1:]:
            if (rule.paths is None or any(p.regex.fullmatch(path) for p in rule.paths)) and rule.query_matches(query):
                return rule
        return None


@dataclass(frozen=True, slots=True)
class RuleMatch:
    """What the rules made of one request (or CONNECT)."""

    rule: RequestRule | None  # the first matching rule (with `hostile`: the first naming the host)
    path: str | None  # the normalised path (no query), for requests; with `hostile`, the raw one
    hostile: str | None = None  # why the path is refused before any rule is matched


class RuleSet:
    """The rules in order, indexed by host pattern."""

    __slots__ = ("rules", "_exact", "_suffix", "_everything", "_ip_rules", "_by_host", "_scans")
    CACHE_ENTRIES = 4096  # hosts (and host+method scans) remembered; then the cache starts again

    def __init__(self, rules: tuple[RequestRule, ...] = ()) -> None:
        self.rules = rules
        self._exact: dict[str, list[int]] = {}
        # suffix -> (indices matching the suffix itself, indices matching its subdomains)
        self._suffix: dict[str, tuple[list[int], list[int]]] = {}
        self._everything: list[int] = []
        self._ip_rules: list[int] = []  # rules naming IP addresses or CIDRs: few, scanned
        self._by_host: dict[str, tuple[int, ...]] = {}
        self._scans: dict[tuple[tuple[int, ...], str], _Scan] = {}
        for i, rule in enumerate(rules):
            m = rule.hosts
            if m.everything is not None:
                self._everything.append(i)
            for name in m.exact:
                self._exact.setdefault(name, []).append(i)
            for name in m.apex_and_subdomains:
                own, subs = self._suffix.setdefault(name, ([], []))
                own.append(i)
                subs.append(i)
            for name in m.subdomains:
                self._suffix.setdefault(name, ([], []))[1].append(i)
            if m.addresses:
                self._ip_rules.append(i)

    def __bool__(self) -> bool:
        return bool(self.rules)

    def __len__(self) -> int:
        return len(self.rules)

    def for_host(self, host: NameHost | IPHost) -> list[RequestRule]:
        """The rules whose `hosts` match this host, in policy order."""
        return [self.rules[i] for i in self._indices(host)]

    def _indices(self, host: NameHost | IPHost) -> tuple[int, ...]:
        key = host.name if isinstance(host, NameHost) else host.address
        found = self._by_host.get(key)
        if found is None:
            if len(self._by_host) >= self.CACHE_ENTRIES:
                self._by_host.clear()
            found = self._by_host[key] = self._lookup(host)
        return found

    def _lookup(self, host: NameHost | IPHost) -> tuple[int, ...]:
        found: list[int] = list(self._everything)
        if isinstance(host, NameHost):
            name = host.name
            found += self._exact.get(name, ())
            own = self._suffix.get(name)
            if own:
                found += own[0]
            dot = name.find(".")
            while dot >= 0:
                entry = self._suffix.get(name[dot + 1:])
                if entry:
                    found += entry[1]
                dot = name.find(".", dot + 1)
        else:
            found += [i for i in self._ip_rules if self.rules[i].hosts.addresses.match_address(host.address)]
        return tuple(sorted(set(found)))

    def _scan(self, indices: tuple[int, ...], method: str) -> _Scan:
        key = (indices, method)
        scan = self._scans.get(key)
        if scan is None:
            if len(self._scans) >= self.CACHE_ENTRIES:
                self._scans.clear()
            rules = [self.rules[i] for i in indices]
            scan = self._scans[key] = _Scan([r for r in rules if r.methods is None or method in r.methods])
        return scan

    def judge(self, host: NameHost | IPHost, method: str | None, target: str | None) -> RuleMatch | None:
        """None when no rule names the host. For a request (method and
        target known): the first rule matching its method, normalised path
        and query, or a hostile path. For a tunnel (no target): the first
        rule with only `hosts`."""
        indices = self._indices(host)
        if not indices:
            return None
        if target is None:
            return RuleMatch(next((self.rules[i] for i in indices if self.rules[i].host_only), None), None)
        raw_path, query = split_target(target)
        hostile = hostile_spelling(raw_path)
        if hostile:
            return RuleMatch(self.rules[indices[0]], raw_path, hostile)
        path = normalise_path(raw_path)
        return RuleMatch(self._scan(indices, (method or "").upper()).first(path, query), path)


# ---- what `policy check` warns about ---------------------------------------


def _path_covers(wide: PathPattern, narrow: PathPattern) -> bool:
    """Whether `wide` surely matches every path `narrow` matches (a sound
    under-approximation: equal, `/**`, or a literal prefix followed by `/**`)."""
    if wide.text == narrow.text or wide.text == "/**":
        return True
    if wide.text.endswith("/**"):
        prefix = wide.text[:-3]
        if "*" not in prefix:
            return narrow.text == prefix or narrow.text.startswith(prefix + "/")
    return False


def shadows(earlier: RequestRule, later: RequestRule) -> bool:
    """Whether `earlier` matches every request `later` matches, so `later`
    never decides."""
    if not all(covers_pattern(earlier.hosts, text) for text in later.hosts_text):
        return False
    if earlier.methods is not None and (later.methods is None or not later.methods <= earlier.methods):
        return False
    if earlier.paths is not None:
        if later.paths is None or not all(any(_path_covers(w, n) for w in earlier.paths) for n in later.paths):
            return False
    if earlier.query is not None:
        if later.query is None or \
                not {(q.name, q.glob) for q in earlier.query} <= {(q.name, q.glob) for q in later.query}:
            return False
    return True


def rule_warnings(rules: RuleSet) -> list[tuple[RequestRule, str]]:
    """(rule, message) for rules an earlier one shadows, and for path
    patterns that differ from an earlier one only by case."""
    out: list[tuple[RequestRule, str]] = []
    for j, later in enumerate(rules.rules):
        for earlier in rules.rules[:j]:
            if shadows(earlier, later):
                out.append((later, f"the rule at {later.origin} ({later.text}) never decides: the earlier rule at "
                                   f"{earlier.origin} ({earlier.text}) matches every request it matches"))
                break
    seen: dict[str, tuple[str, RequestRule]] = {}
    for rule in rules.rules:
        for pattern in rule.paths or ():
            first = seen.setdefault(pattern.text.lower(), (pattern.text, rule))
            if first[0] != pattern.text:
                out.append((rule, f"path pattern {pattern.text!r} ({rule.origin}) differs from {first[0]!r} "
                                  f"({first[1].origin}) only by case; paths match case-sensitively, so they match "
                                  "different paths (write the case the origin uses)"))
    return out
