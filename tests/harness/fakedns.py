"""A programmable fake recursive DNS server (dnspython), UDP and TCP.

It answers as a recursive resolver would: a name with a CNAME gets the whole
chain plus the final records in one answer. Tests program it per name:

    dns.set("public.example", a=["8.8.8.8"], ttl=300)
    dns.set("v6.example", aaaa=["2606:4700:4700::1111"])
    dns.set_cname("alias.example", "public.example")
    dns.set_rcode("nx.example", "NXDOMAIN")          # or "SERVFAIL"
    dns.set_empty("empty.example")                   # NOERROR, no answer
    dns.set_flipping("rebind.example",
                     [{"a": ["8.8.8.8"]}, {"a": ["127.0.0.1"]}],
                     mode="sequence", ttl=0)         # or mode="cycle"
    dns.set_delay("slow.example", 5.0)               # answer late
    dns.queries("public.example", "A")               # how many lookups

Names not programmed get NXDOMAIN. Flipping records advance per (name, type),
so an A and an AAAA query for one resolution both see step N.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import Counter
from dataclasses import dataclass, field

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset

_RCODES = {
    "NOERROR": dns.rcode.NOERROR,
    "NXDOMAIN": dns.rcode.NXDOMAIN,
    "SERVFAIL": dns.rcode.SERVFAIL,
    "REFUSED": dns.rcode.REFUSED,
}


def _norm(name: str) -> str:
    return name.lower().rstrip(".")


@dataclass
class Entry:
    a: list[str] = field(default_factory=list)
    aaaa: list[str] = field(default_factory=list)
    cname: str | None = None
    ttl: int = 300
    rcode: int | None = None
    delay: float = 0.0
    # Flipping: a list of {"a": [...], "aaaa": [...], "cname": str} steps.
    steps: list[dict] | None = None
    mode: str = "sequence"  # "sequence": stay on the last step; "cycle": wrap
    step_counters: Counter = field(default_factory=Counter)


@dataclass
class QueryRecord:
    time: float
    name: str
    qtype: str
    transport: str


class FakeDNS:
    def __init__(self, host: str = "127.0.0.53", port: int = 53):
        self.host = host
        self.port = port
        self._lock = threading.Lock()
        self._entries: dict[str, Entry] = {}
        self._log: list[QueryRecord] = []
        self.default_delay = 0.0  # applies to every name (global "slow mode")
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._udp: socket.socket | None = None
        self._tcp: socket.socket | None = None

    # ------------------------------------------------------------ programming
    def set(self, name: str, a=(), aaaa=(), ttl: int = 300) -> None:
        with self._lock:
            self._entries[_norm(name)] = Entry(a=list(a), aaaa=list(aaaa), ttl=ttl)

    def set_cname(self, name: str, target: str, ttl: int = 300) -> None:
        with self._lock:
            self._entries[_norm(name)] = Entry(cname=_norm(target), ttl=ttl)

    def set_rcode(self, name: str, rcode: str) -> None:
        with self._lock:
            self._entries[_norm(name)] = Entry(rcode=_RCODES[rcode.upper()])

    def set_empty(self, name: str, ttl: int = 300) -> None:
        """NOERROR with no answer records (for every type)."""
        with self._lock:
            self._entries[_norm(name)] = Entry(ttl=ttl)

    def set_flipping(self, name: str, steps: list[dict], mode: str = "sequence", ttl: int = 0) -> None:
        assert mode in ("sequence", "cycle"), mode
        assert steps
        with self._lock:
            self._entries[_norm(name)] = Entry(steps=[dict(s) for s in steps], mode=mode, ttl=ttl)

    def set_delay(self, name: str, seconds: float) -> None:
        """Answer queries for this name (already programmed, or NXDOMAIN) late."""
        with self._lock:
            entry = self._entries.setdefault(_norm(name), Entry(rcode=dns.rcode.NXDOMAIN))
            entry.delay = seconds

    def remove(self, name: str) -> None:
        with self._lock:
            self._entries.pop(_norm(name), None)

    # ------------------------------------------------------------ query log
    def queries(self, name: str | None = None, qtype: str | None = None) -> int:
        """How many queries arrived (for a name, optionally a type like "A")."""
        with self._lock:
            return sum(
                1
                for q in self._log
                if (name is None or q.name == _norm(name)) and (qtype is None or q.qtype == qtype.upper())
            )

    def query_log(self) -> list[QueryRecord]:
        with self._lock:
            return list(self._log)

    def clear_log(self) -> None:
        with self._lock:
            self._log.clear()

    # ------------------------------------------------------------ answering
    def _records_for(self, entry: Entry, qname: str, qtype: int) -> dict:
        """The record set an entry shows for this query (advancing a flip)."""
        if entry.steps is None:
            return {"a": entry.a, "aaaa": entry.aaaa, "cname": entry.cname}
        key = (qname, qtype)
        n = entry.step_counters[key]
        entry.step_counters[key] += 1
        if entry.mode == "cycle":
            step = entry.steps[n % len(entry.steps)]
        else:
            step = entry.steps[min(n, len(entry.steps) - 1)]
        return {"a": step.get("a", []), "aaaa": step.get("aaaa", []), "cname": step.get("cname")}

    def _answer(self, query: dns.message.Message) -> tuple[dns.message.Message, float]:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        if not query.question:
            response.set_rcode(dns.rcode.FORMERR)
            return response, 0.0
        question = query.question[0]
        qtype = question.rdtype
        name = _norm(question.name.to_text())
        delay = self.default_delay
        with self._lock:
            first = self._entries.get(name)
            if first is not None:
                delay = max(delay, first.delay)
            seen: set[str] = set()
            current = name
            for _depth in range(10):
                entry = self._entries.get(current)
                if entry is None:
                    response.set_rcode(dns.rcode.NXDOMAIN)
                    break
                if entry.rcode is not None:
                    response.set_rcode(entry.rcode)
                    break
                records = self._records_for(entry, current, qtype)
                owner = dns.name.from_text(current)
                if records["cname"] and qtype != dns.rdatatype.CNAME:
                    target = records["cname"]
                    response.answer.append(
                        dns.rrset.from_text(owner, entry.ttl, "IN", "CNAME", target + ".")
                    )
                    if target in seen:
                        break
                    seen.add(current)
                    current = target
                    continue
                if qtype == dns.rdatatype.A and records["a"]:
                    response.answer.append(dns.rrset.from_text_list(owner, entry.ttl, "IN", "A", records["a"]))
                elif qtype == dns.rdatatype.AAAA and records["aaaa"]:
                    response.answer.append(
                        dns.rrset.from_text_list(owner, entry.ttl, "IN", "AAAA", records["aaaa"])
                    )
                elif qtype == dns.rdatatype.CNAME and records["cname"]:
                    response.answer.append(
                        dns.rrset.from_text(owner, entry.ttl, "IN", "CNAME", records["cname"] + ".")
                    )
                break
        return response, delay

    def _log_query(self, query: dns.message.Message, transport: str) -> None:
        if not query.question:
            return
        q = query.question[0]
        with self._lock:
            self._log.append(
                QueryRecord(time.monotonic(), _norm(q.name.to_text()), dns.rdatatype.to_text(q.rdtype), transport)
            )

    # ------------------------------------------------------------ servers
    def start(self) -> FakeDNS:
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        udp.bind((self.host, self.port))
        udp.settimeout(0.2)
        tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        tcp.bind((self.host, self.port))
        tcp.listen(64)
        tcp.settimeout(0.2)
        self._udp, self._tcp = udp, tcp
        for target in (self._serve_udp, self._serve_tcp):
            t = threading.Thread(target=target, name=f"fakedns-{target.__name__}", daemon=True)
            t.start()
            self._threads.append(t)
        return self

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=2)
        for s in (self._udp, self._tcp):
            if s is not None:
                s.close()

    def _serve_udp(self) -> None:
        assert self._udp is not None
        while not self._stop.is_set():
            try:
                data, peer = self._udp.recvfrom(65535)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
            except Exception:
                continue
            self._log_query(query, "udp")
            response, delay = self._answer(query)
            wire = response.to_wire(max_size=query.payload if query.edns >= 0 else 512)
            if delay > 0:
                timer = threading.Timer(delay, self._send_udp, (wire, peer))
                timer.daemon = True
                timer.start()
            else:
                self._send_udp(wire, peer)

    def _send_udp(self, wire: bytes, peer) -> None:
        if self._stop.is_set() or self._udp is None:
            return
        try:
            self._udp.sendto(wire, peer)
        except OSError:
            pass

    def _serve_tcp(self) -> None:
        assert self._tcp is not None
        while not self._stop.is_set():
            try:
                conn, _ = self._tcp.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=self._tcp_conn, args=(conn,), daemon=True).start()

    def _tcp_conn(self, conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            with conn:
                while not self._stop.is_set():
                    head = _recv_exact(conn, 2)
                    if head is None:
                        return
                    (length,) = struct.unpack("!H", head)
                    data = _recv_exact(conn, length)
                    if data is None:
                        return
                    query = dns.message.from_wire(data)
                    self._log_query(query, "tcp")
                    response, delay = self._answer(query)
                    if delay > 0:
                        time.sleep(delay)
                    wire = response.to_wire()
                    conn.sendall(struct.pack("!H", len(wire)) + wire)
        except Exception:  # a client that hangs up or sends garbage
            return


def _recv_exact(conn: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf
