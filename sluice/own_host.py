"""The proxy's own host: the addresses a dial must never reach (`proxy_loop`).

An agent that names the proxy's host as a destination reaches the proxy
itself, its admin endpoint (/metrics, /policy) and every other service the
host runs, on any port. mitmproxy only recognises its exact listening
address and loopback, and only on its own ports. Here the gate (and the dial
check behind it) refuses every address of this host, on every port, unless
a `private_networks` entry names that address and that port:

- **Which addresses.** The addresses the proxy can be reached at: a
  listener (a proxy mode, or the admin endpoint) bound to a wildcard
  (0.0.0.0, ::) is reachable at every address on the host's interfaces, so
  all of them count; one bound to a single address counts that address.
  Plus the policy's `proxy_addresses`, the operator's list of the host's
  addresses it cannot see on its interfaces (a cloud VM's NAT'd public
  address). A proxy bound to loopback only (a laptop, the test harness)
  therefore does not treat the host's other interface addresses as itself:
  its clients run on this host and reach those addresses without it.
- **Kept current.** The interface addresses are read from the kernel
  (netlink RTM_GETADDR, no packet leaves the host) and read again at most
  once every REFRESH_SECONDS when they are asked for, so an address added
  while the proxy runs is covered within that time.
- Loopback and private addresses are refused anyway (public-only); this
  matters for the host's public addresses and for `private_networks`
  entries that would otherwise open the host's own private address.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
import struct
import threading
import time

from collections.abc import Callable, Iterable
from typing import Any

from sluice.policy.decide import check_own_address
from sluice.policy.hosts import canonical_ip
from sluice.policy.model import Policy, Rules, UpstreamProxy
from sluice.policy.reasons import Refusal

logger = logging.getLogger("sluice.own_host")

REFRESH_SECONDS = 2.0
WILDCARDS = frozenset({"", "0.0.0.0", "::", "::0"})
# The supervisor of `--workers N` serves the admin endpoint; its workers learn its address here.
ADMIN_ENV = "SLUICE_ADMIN_ADDRESS"

# netlink (linux/netlink.h, linux/rtnetlink.h, linux/if_addr.h)
_NETLINK_ROUTE = 0
_RTM_NEWADDR, _RTM_GETADDR = 20, 22
_NLM_F_REQUEST, _NLM_F_DUMP = 0x1, 0x300
_NLMSG_ERROR, _NLMSG_DONE = 2, 3
_IFA_ADDRESS, _IFA_LOCAL = 1, 2


def interface_addresses() -> frozenset[str] | None:
    """Every address on this host's interfaces (this network namespace's),
    canonical; None where netlink is not available (not Linux)."""
    if not hasattr(socket, "AF_NETLINK"):
        return None
    found: set[str] = set()
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, _NETLINK_ROUTE) as s:
        s.settimeout(2.0)
        s.bind((0, 0))
        seq = int(time.monotonic() * 1000) & 0xFFFFFFFF
        ifaddrmsg = struct.pack("=BBBBI", socket.AF_UNSPEC, 0, 0, 0, 0)
        s.sendall(struct.pack("=IHHII", 16 + len(ifaddrmsg), _RTM_GETADDR, _NLM_F_REQUEST | _NLM_F_DUMP, seq, 0)
                  + ifaddrmsg)
        while True:
            data = s.recv(1 << 16)
            if not data:
                return frozenset(found)
            offset = 0
            while offset + 16 <= len(data):
                length, kind, _flags, msg_seq, _pid = struct.unpack_from("=IHHII", data, offset)
                if length < 16:
                    return frozenset(found)
                if msg_seq == seq:
                    if kind == _NLMSG_DONE:
                        return frozenset(found)
                    if kind == _NLMSG_ERROR:
                        raise OSError("netlink RTM_GETADDR failed")
                    if kind == _RTM_NEWADDR:
                        address = _address_of(data[offset + 16: offset + length])
                        if address is not None:
                            found.add(address)
                offset += (length + 3) & ~3


def _address_of(message: bytes) -> str | None:
    """The local address of one RTM_NEWADDR message (IFA_LOCAL, else
    IFA_ADDRESS: on a point-to-point link IFA_ADDRESS is the peer's)."""
    if len(message) < 8:
        return None
    family = message[0]
    attributes: dict[int, bytes] = {}
    offset = 8
    while offset + 4 <= len(message):
        length, kind = struct.unpack_from("=HH", message, offset)
        if length < 4:
            break
        attributes[kind] = message[offset + 4: offset + length]
        offset += (length + 3) & ~3
    raw = attributes.get(_IFA_LOCAL) or attributes.get(_IFA_ADDRESS)
    if family == socket.AF_INET and raw is not None and len(raw) == 4:
        return str(ipaddress.IPv4Address(raw))
    if family == socket.AF_INET6 and raw is not None and len(raw) == 16:
        return canonical_ip(str(ipaddress.IPv6Address(raw)))
    return None


def _is_local_address(ip: str) -> bool:
    """Without netlink: whether the address can be bound (no packet is sent)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


class OwnHost:
    """This process's view of its host's own addresses (one per process).
    The set is rebuilt at most every REFRESH_SECONDS (or when the policy's
    `proxy_addresses` change), so a decision pays one set lookup."""

    def __init__(self, listeners: Callable[[], list[tuple[str, int]]]) -> None:
        self.listeners = listeners
        self._lock = threading.Lock()
        self._own: frozenset[str] = frozenset()
        self._probe = False  # a wildcard listener and no netlink: bind-probe each address
        self._built_at = float("-inf")
        self._built_for: frozenset[str] | None = None
        self._interfaces: frozenset[str] | None = None
        self._extra_listeners: set[tuple[str, int]] = set()
        admin = os.environ.get(ADMIN_ENV)
        if admin:
            host, _, port = admin.rpartition(":")
            if port.isdigit():
                self._extra_listeners.add((host.strip("[]"), int(port)))

    def add_listener(self, host: str, port: int) -> None:
        """A listener mitmproxy does not know about (the admin endpoint)."""
        self._extra_listeners.add((host, port))
        self._built_at = float("-inf")

    def addresses(self, proxy_addresses: frozenset[str]) -> frozenset[str]:
        now = time.monotonic()
        if now - self._built_at >= REFRESH_SECONDS or proxy_addresses is not self._built_for:
            with self._lock:
                self._build(proxy_addresses, now)
        return self._own

    def _build(self, proxy_addresses: frozenset[str], now: float) -> None:
        own = set(proxy_addresses)
        wildcard = False
        for host, _port in [*self.listeners(), *self._extra_listeners]:
            if host in WILDCARDS:
                wildcard = True
                continue
            try:
                own.add(canonical_ip(host))
            except ValueError:
                continue  # "localhost": loopback, refused as non-public anyway
        self._probe = False
        if wildcard:
            try:
                self._interfaces = interface_addresses()
            except OSError as e:  # keep the last good set
                logger.warning(f"sluice: reading this host's interface addresses failed: {e}")
            if self._interfaces is None:
                self._probe = True
            else:
                own |= self._interfaces
        self._own, self._built_at, self._built_for = frozenset(own), now, proxy_addresses

    def refusal(self, rules: Rules, proxy_addresses: frozenset[str], addresses: tuple[str, ...] | list[str],
                port: int) -> Refusal | None:
        """`proxy_loop` for a destination at one of this host's addresses
        (`proxy_addresses`: the live policy's)."""
        own = self.addresses(proxy_addresses)
        if self._probe:
            own = own | {a for a in addresses if _is_local_address(a)}
        return check_own_address(rules, addresses, port, own)


def mitmproxy_listeners(transport_protocol: str | None = None) -> list[tuple[str, int]]:
    """mitmproxy's listening addresses (host, port) in this process (only
    those of modes on `transport_protocol`, "tcp" or "udp", if given)."""
    from mitmproxy import ctx

    master = getattr(ctx, "master", None)
    proxyserver = master.addons.get("proxyserver") if master is not None else None
    if proxyserver is None:
        return []
    return [(str(host), int(port)) for instance in proxyserver.servers
            if transport_protocol is None or instance.mode.transport_protocol == transport_protocol
            for host, port, *_ in instance.listen_addrs]


OWN_HOST = OwnHost(mitmproxy_listeners)


def configured_listeners(options: Any) -> list[tuple[str, int]]:
    """The TCP addresses the proxy's listeners use by mitmproxy's options
    (`mode`, `listen_host`, `listen_port`): fixed ports only (0 is any free one)."""
    from mitmproxy.proxy import mode_specs

    addresses = []
    for spec in options.mode:
        mode = mode_specs.ProxyMode.parse(spec)
        port = mode.listen_port(options.listen_port)
        if port and mode.transport_protocol in ("tcp", "both"):
            addresses.append((mode.listen_host(options.listen_host), port))
    return addresses


def proxy_listeners() -> list[tuple[str, int]]:
    """This process's proxy listeners: the bound ones once mitmproxy has
    opened them, else (a policy loaded at start) the ones its options name."""
    from mitmproxy import ctx

    bound = mitmproxy_listeners("tcp")
    if bound:
        return bound
    options = getattr(getattr(ctx, "master", None), "options", None)
    return configured_listeners(options) if options is not None else []


def listener_at(ip: str, port: int, listeners: Iterable[tuple[str, int]],
                proxy_addresses: frozenset[str] = frozenset()) -> tuple[str, int] | None:
    """The listener of this proxy that a connection to ip:port (an IP
    literal) would reach, if any: one on that port bound to that address, or
    to a wildcard while the address is this host's (loopback, an interface's,
    or the policy's `proxy_addresses`)."""
    ip = canonical_ip(ip)
    for host, listen_port in listeners:
        if listen_port != port:
            continue
        if host in WILDCARDS:
            if ip in proxy_addresses or ipaddress.ip_address(ip).is_loopback or _is_local_address(ip):
                return host, listen_port
            continue
        try:
            if canonical_ip(host) == ip:
                return host, listen_port
        except ValueError:
            if host == "localhost" and ipaddress.ip_address(ip).is_loopback:
                return host, listen_port
    return None


def _parent_addresses(parent: UpstreamProxy) -> list[str]:
    """The parent's addresses known without DNS: its IP literal, or loopback
    for `localhost` names (RFC 6761); a name is checked when it is dialled."""
    host = parent.host.rstrip(".").lower()
    try:
        return [canonical_ip(host)]
    except ValueError:
        return ["127.0.0.1", "::1"] if host == "localhost" or host.endswith(".localhost") else []


def _shown(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def parent_loop_problems(policy: Policy, listeners: list[tuple[str, int]]) -> list[str]:
    """Each `upstream_proxy` (top level or a profile's) that is this proxy
    itself, as one line: sending its traffic there would loop."""
    problems: list[str] = []
    seen: set[tuple[str, int]] = set()
    for rules in [policy.rules, *(profile.rules for profile in policy.clients)]:
        parent = rules.upstream_proxy
        if parent is None or (parent.host, parent.port) in seen:
            continue
        seen.add((parent.host, parent.port))
        for ip in _parent_addresses(parent):
            hit = listener_at(ip, parent.port, listeners, policy.proxy_addresses)
            if hit is not None:
                where = f"{parent.origin}: " if parent.origin else ""
                problems.append(
                    f"{where}upstream_proxy.url {parent.url} is this proxy itself (its listener {_shown(*hit)}): "
                    "every request would loop through Sluice; give the parent proxy's own address")
                break
    return problems


def parent_loop_detail(address: str, port: int, proxy_addresses: frozenset[str]) -> str | None:
    """At a dial: why the parent's resolved address is this proxy itself
    (the text of an upstream_proxy_failed refusal), or None."""
    hit = listener_at(address, port, proxy_listeners(), proxy_addresses)
    if hit is None:
        return None
    return (f"resolves to {_shown(address, port)}, this proxy's own listener {_shown(*hit)}, so the request would "
            "loop through Sluice; the operator must point upstream_proxy at the real parent")
