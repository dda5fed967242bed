"""`mitmdump -s addons/sluice_addon.py` enforces the same policy as `sluice proxy`."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from harness import free_port
from harness.wait import wait_until

pytestmark = pytest.mark.netns
ROOT = Path(__file__).resolve().parents[2]


def test_mitmdump_with_the_addon_script(tmp_path, net, fake_dns, sluice_home):
    policy = tmp_path / "policy.yaml"
    policy.write_text('version: 1\ndns: {nameservers: ["127.0.0.53"], timeout: 2s}\n')
    audit = tmp_path / "audit.jsonl"
    port = free_port()
    mitmdump = Path(sys.executable).parent / "mitmdump"
    proc = subprocess.Popen(
        [str(mitmdump), "-q", "-s", str(ROOT / "addons" / "sluice_addon.py"), "--listen-host", "127.0.0.1",
         "-p", str(port), "--set", f"sluice_policy={policy}", "--set", f"sluice_audit_log={audit}",
         "--set", "onboarding=false", "--set", f"confdir={sluice_home / 'mitmdump'}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )
    try:
        deadline = time.monotonic() + 20
        with httpx.Client(proxy=f"http://127.0.0.1:{port}", trust_env=False, timeout=5) as c:
            while True:
                try:
                    ok = c.get("http://public.example/")
                    break
                except httpx.ConnectError:
                    assert time.monotonic() < deadline and proc.poll() is None, proc.stderr.read()
                    time.sleep(0.2)
            assert ok.status_code == 200
            refused = c.get("http://169.254.169.254/")
            assert refused.status_code == 403 and refused.headers["sluice-reason"] == "address_not_public"
        assert '"reason":"address_not_public"' in audit.read_text()
        # Sluice's layer choice, swapped in for mitmdump's own NextLayer: TLS to the proxy itself is closed unanswered.
        with socket.create_connection(("127.0.0.1", port), timeout=5) as tls_to_proxy:
            tls_to_proxy.sendall(b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40)
            assert tls_to_proxy.recv(1024) == b""
        wait_until(lambda: '"reason":"client_protocol_refused"' in audit.read_text(),
                   what="the client_protocol_refused audit line")
    finally:
        proc.terminate()
        proc.wait(10)
