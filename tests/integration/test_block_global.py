"""What README says next to "listen on 0.0.0.0" (issue 10, item 14):
mitmproxy's `block_global` stays on, so a client connecting from a globally
routable address is cut off (a warning on stderr); private and loopback
clients are served; `--set block_global=false` admits the public client."""

from __future__ import annotations

import socket
import time

import pytest

from harness import default_policy
from harness.clients import _Reader, read_response

pytestmark = pytest.mark.netns

PUBLIC_CLIENT = "8.8.8.8"  # a "public" address of the test namespace (on lo)
PRIVATE_CLIENT = "10.0.0.1"


def request_from(proxy, source: str) -> bytes:
    with socket.create_connection(proxy.address, timeout=10, source_address=(source, 0)) as s:
        s.sendall(b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\nConnection: close\r\n\r\n")
        try:
            return s.recv(65536)
        except ConnectionResetError:
            return b""


def test_a_client_from_a_public_address_is_cut_off_by_default(sluice_factory):
    proxy = sluice_factory(default_policy(), name="blockglobal")
    mark = proxy.stderr_mark()
    assert request_from(proxy, PUBLIC_CLIENT) == b""
    deadline = time.monotonic() + 5
    while "killed by block_global" not in proxy.stderr_since(mark) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert f"Client connection from {PUBLIC_CLIENT} killed by block_global option" in proxy.stderr_since(mark)
    assert request_from(proxy, PRIVATE_CLIENT).startswith(b"HTTP/1.1 200")
    assert request_from(proxy, "127.0.0.1").startswith(b"HTTP/1.1 200")


def test_block_global_false_admits_it(sluice_factory):
    proxy = sluice_factory(default_policy(), name="noblockglobal", extra_args=("--set", "block_global=false"))
    with socket.create_connection(proxy.address, timeout=10, source_address=(PUBLIC_CLIENT, 0)) as s:
        s.sendall(b"GET http://public.example/ HTTP/1.1\r\nHost: public.example\r\nConnection: close\r\n\r\n")
        assert read_response(_Reader(s)).status == 200
