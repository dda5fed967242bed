"""A tiny UDP DNS server for the namespace: every name under `.example` has
one A record, 8.8.8.8 (the origin); AAAA answers are empty; anything else is
NXDOMAIN. Sluice's policy points its resolver here."""

from __future__ import annotations

import socket
import threading

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset

ORIGIN_IP = "8.8.8.8"
TTL = 3600  # Sluice clamps it to its max_ttl; the cache stays warm for the run


class FakeDNS:
    def __init__(self, host: str = "127.0.0.53", port: int = 53) -> None:
        self.host, self.port = host, port
        self.queries = 0
        self._stop = threading.Event()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> FakeDNS:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.settimeout(0.2)
        self._sock = sock
        self._thread = threading.Thread(target=self._serve, name="bench-fakedns", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
        if self._sock is not None:
            self._sock.close()

    def _serve(self) -> None:
        assert self._sock is not None
        while not self._stop.is_set():
            try:
                data, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            except OSError:
                return
            try:
                query = dns.message.from_wire(data)
                wire = self._answer(query).to_wire()
                self._sock.sendto(wire, peer)
                self.queries += 1
            except Exception:  # a malformed query is simply not answered
                continue

    @staticmethod
    def _answer(query: dns.message.Message) -> dns.message.Message:
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        if not query.question:
            response.set_rcode(dns.rcode.FORMERR)
            return response
        q = query.question[0]
        name = q.name.to_text(omit_final_dot=True).lower()
        if not (name == "example" or name.endswith(".example")):
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif q.rdtype == dns.rdatatype.A:
            response.answer.append(dns.rrset.from_text(q.name, TTL, "IN", "A", ORIGIN_IP))
        return response
