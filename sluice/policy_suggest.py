"""`sluice policy suggest`: learn mode. Read an audit log's refusals and
report-mode `would_refuse` lines and print a unified diff against the policy
that would allow what was observed:

- a host the allow list refused (tunnels, SOCKS5, requests) gets an `allow`
  entry;
- an intercepted host whose requests were refused by host, method or a
  host-wide rule gets request rules covering every request observed to it
  (allowed ones too, so nothing that worked stops working): one `allow` rule
  per set of methods, with paths generalised (numeric, hex and uuid segments
  become `*`; a segment with many siblings becomes `**`), then
  `deny: {hosts: [H]}` unless a host-only rule already ends the host's rules;
- per client profile (a profile that inherits a list edits the top level's,
  which every profile inheriting it shares; a note says so).

It never opens a non-public address or an internal name, nor undoes an
operator's explicit deny (a `deny` entry, a rule with methods or paths), nor a
path refused for its spelling: those stay refused, one note each on stderr.

The file is edited by inserting text at the positions the YAML parser
reports (never re-dumped), so comments, order and layout stay. `--apply`
writes the result (atomically) and runs `policy check` on it.
"""

from __future__ import annotations

import datetime
import difflib
import json
import os
import re
import sys
import tempfile
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from sluice.policy.decide import intercepts
from sluice.policy.hosts import HostError, IPHost, internal_name, parse_host
from sluice.policy.loader import (
    FileRefused,
    PolicyInvalid,
    compose_checked,
    load_policy_text,
    parse_duration,
    read_regular_file,
)
from sluice.policy.model import Policy, Rules
from sluice.policy.ranges import classify
from sluice.policy.request_rules import PathPattern, PathPatternError, hostile_spelling, normalise_path

EXIT_OK, EXIT_INVALID, EXIT_USAGE = 0, 1, 2
MAX_AUDIT_BYTES = 1 << 30

# Refusals a policy edit may lift; every other reason stays refused.
HOST_REASONS = {"host_not_allowed"}
REQUEST_REASONS = {"host_not_allowed", "method_not_allowed", "rule_denied"}
SIBLINGS = 5  # distinct values of one segment after which the subtree becomes `**`

_NUMERIC = re.compile(r"^\d+$")
_HEX = re.compile(r"^(?=[^g-z]*\d)(?=.*[a-f])[0-9a-f]{7,}$", re.I)
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$", re.I)


class SuggestError(ValueError):
    """A one-line message for the user."""


def generalise_segment(segment: str) -> str:
    return "*" if _NUMERIC.match(segment) or _UUID.match(segment) or _HEX.match(segment) else segment


def generalise_paths(paths: set[str]) -> list[str]:
    """Normalised paths -> path patterns matching all of them: identifier-like
    segments become `*`, and below a segment with more than SIBLINGS distinct
    values everything becomes `**`."""
    trie: dict = {}
    for path in paths:
        node = trie
        parts = path.split("/")[1:]
        for part in parts:
            node = node.setdefault(generalise_segment(part) if part else part, {})
        node[None] = True  # a path ends here
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        children = [k for k in node if k is not None]
        if len(children) > SIBLINGS:
            out.append(f"{prefix}/**")  # `**` matches the prefix itself too
            return
        if None in node and prefix:
            out.append(prefix)
        for child in sorted(children):
            if child == "":
                out.append(prefix + "/")
            else:
                walk(node[child], f"{prefix}/{child}")

    walk(trie, "")
    return sorted(set(out))


@dataclass
class Scope:
    """One rule list's owner: the top level (None) or a client profile."""

    name: str | None
    new_allow: list[str] = field(default_factory=list)  # host names for `allow`
    # host -> {normalised path -> methods}: every request observed to a host that gets rules
    requests: dict[str, dict[str, set[str]]] = field(default_factory=lambda: defaultdict(lambda: defaultdict(set)))
    rule_hosts: list[str] = field(default_factory=list)  # hosts that get request rules, in first-seen order


@dataclass(frozen=True, slots=True)
class Insertion:
    offset: int
    text: str


def read_audit(path: str, since: float | None, profile: str | None, notes: list[str]) -> list[dict]:
    """The decision lines (request, connect, tunnel) of an audit log, for one
    profile if given, from `since` on if given."""
    try:
        raw = read_regular_file(path, MAX_AUDIT_BYTES)
    except FileRefused as e:
        raise SuggestError(f"cannot read the audit log {path}: {e}") from None
    except OSError as e:
        raise SuggestError(f"cannot read the audit log {path}: {e.strerror or e}") from None
    out, bad = [], 0
    for line in raw.decode("utf-8", "replace").splitlines():
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            bad += 1
            continue
        if not isinstance(record, dict) or record.get("event") not in ("request", "connect", "tunnel"):
            continue
        if profile is not None and record.get("profile") != profile:
            continue
        if since is not None and _when(record) < since:
            continue
        out.append(record)
    if bad:
        notes.append(f"{path}: {bad} line(s) are not JSON audit records; skipped")
    return out


def _when(record: dict) -> float:
    try:
        return datetime.datetime.strptime(str(record.get("time")), "%Y-%m-%dT%H:%M:%S.%fZ").replace(
            tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return 0.0


def _rules_of(policy: Policy, profile: str | None) -> Rules:
    if profile is None:
        return policy.rules
    found = policy.profile(profile)
    if found is None:
        raise KeyError(profile)
    return found.rules


def _soft(record: dict) -> str | None:
    """The reason a line was (or would have been) refused, if any."""
    if record.get("decision") == "refuse" or record.get("would_refuse"):
        return record.get("reason")
    return None


def _never_opened(host_text: str) -> str | None:
    """Why a host stays refused whatever the policy says, or None."""
    try:
        host = parse_host(host_text)
    except HostError:
        return "is not a valid host"
    if isinstance(host, IPHost):
        blocked = classify(host.address)
        if blocked is not None:
            return f"is {blocked.name}, not a public address"
        return "is an IP address (name hosts instead)"
    why = internal_name(host.name)
    return f"is {why}" if why else None


def plan(policy: Policy, records: list[dict], notes: list[str]) -> dict[str | None, Scope]:
    """What to add, per scope."""
    scopes: dict[str | None, Scope] = {}
    noted: set[str] = set()

    def note(text: str) -> None:
        if text not in noted:
            noted.add(text)
            notes.append(text)

    hosts_with_rules: dict[str | None, set[str]] = defaultdict(set)
    # First pass: which (scope, host) need a change.
    for record in records:
        reason = _soft(record)
        host, profile = record.get("host"), record.get("profile")
        if reason is None or not isinstance(host, str):
            continue
        try:
            rules = _rules_of(policy, profile)
        except KeyError:
            note(f"profile {profile!r} (in the audit log) is not in the policy; its lines are skipped")
            continue
        where = "the top level" if profile is None else f"client profile {profile!r}"
        why = _never_opened(host)
        if why is not None:
            note(f"{host} stays refused ({reason}): it {why}; suggest never opens non-public addresses or internal "
                 "names")
            continue
        if reason not in REQUEST_REASONS:
            note(f"{host} stays refused ({reason}): not something a policy edit should lift")
            continue
        scope = scopes.setdefault(profile, Scope(profile))
        path = record.get("path") if record.get("event") == "request" else None
        if path is not None and hostile_spelling(path):
            note(f"{record.get('method')} {host}{path} stays refused: its path is spelled ambiguously (rule_denied)")
            continue
        if reason == "rule_denied":
            rule = _rule_at(rules, record.get("rule"))
            if rule is not None and not rule.host_only:
                note(f"{record.get('method')} {host}{path or ''} stays refused by the rule at {rule.origin} "
                     f"({rule.text}); remove or change that rule to allow it")
                continue
        if _allowed_by_rule(rules, host, record):
            continue  # the policy as it is now already allows it (a suggestion applied since)
        if (reason == "host_not_allowed" and rules.allow is not None and host not in scope.new_allow
                and rules.allow.match_host(parse_host(host)) is None):
            scope.new_allow.append(host)
        intercepted = intercepts(rules, host)
        if path is not None and intercepted and host not in hosts_with_rules[profile]:
            hosts_with_rules[profile].add(host)
            scope.rule_hosts.append(host)
        elif path is not None and not intercepted and reason in ("method_not_allowed", "rule_denied"):
            note(f"{record.get('method')} {host}{path} stays refused ({reason}): {host} is not under {where}'s "
                 "`intercept`, so no per-method or per-path rule can be suggested for it; intercept it first")
        elif record.get("event") != "request" and reason == "host_not_allowed" and intercepted:
            # An intercepted tunnel refused at CONNECT: nothing inside was seen.
            pass
    # Second pass: every request observed to a host that gets rules (allowed ones too).
    for record in records:
        profile, host, path = record.get("profile"), record.get("host"), record.get("path")
        if record.get("event") != "request" or host not in hosts_with_rules.get(profile, ()) or not path:
            continue
        reason = _soft(record)
        if reason is not None and reason not in REQUEST_REASONS:
            continue
        if hostile_spelling(path) or _allowed_by_rule(_rules_of(policy, profile), host, record):
            continue
        if reason == "rule_denied":
            rule = _rule_at(_rules_of(policy, profile), record.get("rule"))
            if rule is not None and not rule.host_only:
                continue
        method = str(record.get("method") or "GET").upper()
        normal = normalise_path(path)
        try:
            PathPattern.compile(normal)  # a path no pattern can spell (control characters, a literal '**')
        except PathPatternError:
            notes.append(f"{method} {host}{path[:80]} is left out: no path pattern can name it")
            continue
        scopes[profile].requests[host][normal].add(method)
    return scopes


def _allowed_by_rule(rules: Rules, host: str, record: dict) -> bool:
    """Whether an `allow` request rule of the current policy matches this request."""
    path = record.get("path")
    if record.get("event") != "request" or not path:
        return False
    judged = rules.request_rules.judge(parse_host(host), str(record.get("method") or "GET").upper(), path)
    return judged is not None and judged.hostile is None and judged.rule is not None and judged.rule.action == "allow"


def _rule_at(rules: Rules, origin: object):
    return next((r for r in rules.request_rules.rules if r.origin == origin), None)


def rule_lines(host: str, paths: dict[str, set[str]]) -> list[str]:
    """`allow` rule texts for one host's observed requests: each method's
    paths generalised on their own (a POST seen once does not widen to the
    GETs' subtree), then patterns with the same methods in one rule."""
    by_method: dict[str, set[str]] = defaultdict(set)
    for path, methods in paths.items():
        for method in methods:
            by_method[method].add(path)
    methods_of: dict[str, set[str]] = defaultdict(set)
    for method, method_paths in by_method.items():
        for pattern in generalise_paths(method_paths):
            methods_of[pattern].add(method)
    by_methods: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for pattern, methods in sorted(methods_of.items()):
        by_methods[tuple(sorted(methods))].append(pattern)
    return [f"- allow: {{hosts: [{host}], methods: [{', '.join(methods)}], "
            f"paths: [{', '.join(json.dumps(p) for p in pats)}]}}"
            for methods, pats in sorted(by_methods.items())]


# ---- editing the text --------------------------------------------------------


def _keys(node: yaml.Node | None) -> dict[str, tuple[yaml.Node, yaml.Node]]:
    if not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: (k, v) for k, v in node.value if isinstance(k, yaml.ScalarNode)}


def _line_start_after(text: str, node: yaml.Node) -> int:
    """The offset of the start of the line after the node's last character."""
    end = node.end_mark
    if end.column == 0:
        return end.index
    nl = text.find("\n", end.index)
    return len(text) if nl < 0 else nl + 1


def _line_start(text: str, node: yaml.Node) -> int:
    return node.start_mark.index - node.start_mark.column


def _indent_of_item(text: str, node: yaml.Node) -> str:
    """The indentation of the `- ` that introduces this sequence item."""
    line = text[_line_start(text, node):].split("\n", 1)[0]
    return line[: len(line) - len(line.lstrip())]


def _lines(indent: str, lines: list[str]) -> str:
    return "".join(f"{indent}{line}\n" for line in lines)


def edits(text: str, file: str, policy: Policy, scopes: dict[str | None, Scope], notes: list[str]) -> list[Insertion]:
    root = compose_checked(text, file)
    top = _keys(root)
    profile_nodes: dict[str, yaml.MappingNode] = {}
    clients = top.get("clients", (None, None))[1]
    if isinstance(clients, yaml.SequenceNode):
        for item in clients.value:
            name = _keys(item).get("name", (None, None))[1]
            if isinstance(name, yaml.ScalarNode):
                profile_nodes.setdefault(name.value, item)
    out: list[Insertion] = []
    # Lists a profile inherits are the top level's: merge such scopes into it.
    merged: dict[tuple[str | None, str], list[str]] = defaultdict(list)  # (owner, "allow"|"rules") -> entries
    trailing: dict[str | None, list[str]] = defaultdict(list)
    for name, scope in scopes.items():
        own = _keys(profile_nodes[name]) if name is not None else top
        for key, entries in (("allow", scope.new_allow), ("rules", None)):
            owner = name if key in own or name is None else None
            if owner != name and (entries if key == "allow" else scope.rule_hosts):
                notes.append(f"client profile {name!r} inherits the top level's `{key}`, so the suggestion edits that "
                             "(every profile inheriting it gets it)")
            if key == "allow":
                for host in entries:
                    if host not in merged[(owner, "allow")]:
                        merged[(owner, "allow")].append(host)
            else:
                rules = _rules_of(policy, owner)
                for host in scope.rule_hosts:
                    merged[(owner, "rules")] += rule_lines(host, scope.requests[host])
                    ends = any(r.host_only and r.action == "deny" and r.hosts.match_name(host)
                               for r in rules.request_rules.rules)
                    deny = f"- deny: {{hosts: [{host}]}}"
                    if not ends and deny not in trailing[owner]:
                        trailing[owner].append(deny)
    for (owner, key), entries in merged.items():
        if not entries and not (key == "rules" and trailing[owner]):
            continue
        mapping = root if owner is None else profile_nodes[owner]
        keys = _keys(mapping)
        if key == "allow":
            out += _append_to_list(text, keys["allow"][1], entries, "allow")
        elif "rules" in keys and isinstance(keys["rules"][1], yaml.SequenceNode) and keys["rules"][1].value:
            seq = keys["rules"][1]
            if seq.flow_style:
                raise SuggestError(f"{file}:{seq.start_mark.line + 1}: `rules` is a flow list ([...]); write it as a "
                                   "block list (one '- ' entry a line) for suggest to insert into it")
            indent = _indent_of_item(text, seq.value[0])
            out.append(Insertion(_line_start(text, seq.value[0]), _lines(indent, entries)))  # before the existing rules
            out.append(Insertion(_line_start_after(text, seq.value[-1]), _lines(indent, trailing[owner])))
        else:
            if "rules" in keys:  # `rules:` empty or `rules: []`
                k, v = keys["rules"]
                raise SuggestError(f"{file}:{k.start_mark.line + 1}: `rules` is empty; remove the key (suggest adds "
                                   "it) or give it a first entry")
            indent = " " * mapping.start_mark.column
            block = f"{indent}rules:\n" + _lines(indent + "  ", entries + trailing[owner])
            at = _line_start_after(text, mapping) if owner is not None else len(text)
            prefix = "\n" if at == len(text) and text and not text.endswith("\n") else ""
            out.append(Insertion(at, prefix + block))
    return out


def _append_to_list(text: str, seq: yaml.Node, hosts: list[str], key: str) -> list[Insertion]:
    if not isinstance(seq, yaml.SequenceNode):
        raise SuggestError(f"`{key}` is not a list")
    if seq.flow_style or not seq.value:
        # `allow: [a, b]` (or `[]`): insert before the closing bracket.
        close = seq.end_mark.index - 1
        if text[close] != "]":
            raise SuggestError(f"line {seq.start_mark.line + 1}: cannot find the end of `{key}`")
        sep = ", " if seq.value else ""
        return [Insertion(close, sep + ", ".join(hosts))]
    indent = _indent_of_item(text, seq.value[-1])
    return [Insertion(_line_start_after(text, seq.value[-1]), _lines(indent, [f"- {h}" for h in hosts]))]


def apply_insertions(text: str, insertions: list[Insertion]) -> str:
    for ins in sorted(enumerate(insertions), key=lambda p: (p[1].offset, p[0]), reverse=True):
        text = text[: ins[1].offset] + ins[1].text + text[ins[1].offset:]
    return text


# ---- the command -------------------------------------------------------------


def suggest(policy_path: str, audit_path: str, *, profile: str | None = None, since: str | None = None,
            apply: bool = False, now: float | None = None) -> int:
    from sluice.policy_cli import _load_with_bytes, check

    since_ts = None
    if since is not None:
        try:
            since_ts = (now if now is not None else datetime.datetime.now(datetime.UTC).timestamp()) - \
                parse_duration(since)
        except ValueError as e:
            return _usage(f"--since: {e}")
    loaded = _load_with_bytes(policy_path)
    if loaded is None:
        return EXIT_INVALID
    policy, raw = loaded
    if profile is not None and policy.profile(profile) is None:
        return _usage(f"no client profile named {profile!r} in {policy_path}")
    notes: list[str] = []
    try:
        records = read_audit(audit_path, since_ts, profile, notes)
        text = raw.decode("utf-8")
        scopes = plan(policy, records, notes)
        new_text = apply_insertions(text, edits(text, policy_path, policy, scopes, notes))
    except SuggestError as e:
        print(f"sluice policy suggest: {e}", file=sys.stderr)
        return EXIT_INVALID
    for line in notes:
        print(f"note: {line}", file=sys.stderr)
    if new_text == text:
        print(f"sluice policy suggest: nothing to suggest from {len(records)} audit line(s)", file=sys.stderr)
        return EXIT_OK
    try:
        load_policy_text(new_text, policy_path)
    except PolicyInvalid as e:  # a bug in suggest: never write a policy that does not load
        for problem in e.problems:
            print(f"sluice policy suggest: the suggestion does not load: {problem}", file=sys.stderr)
        return EXIT_INVALID
    sys.stdout.writelines(difflib.unified_diff(text.splitlines(True), new_text.splitlines(True),
                                               fromfile=policy_path, tofile=policy_path))
    if not apply:
        return EXIT_OK
    _write_atomically(Path(policy_path), new_text)
    print(f"sluice policy suggest: wrote {policy_path}; checking it", file=sys.stderr)
    return check(policy_path)


def _write_atomically(path: Path, text: str) -> None:
    mode = path.stat().st_mode & 0o7777
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def _usage(message: str) -> int:
    print(f"sluice policy suggest: error: {message}", file=sys.stderr)
    return EXIT_USAGE
