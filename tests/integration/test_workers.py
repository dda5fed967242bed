"""`sluice proxy --workers N`: several processes behind one port, one ready
line, the same policy everywhere, SIGHUP reaching every worker."""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
import yaml

from harness import default_policy

pytestmark = pytest.mark.netns


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def test_workers_share_the_port_and_the_policy(sluice_factory):
    proxy = sluice_factory(default_policy(), name="workers",
                           extra_args=("--workers", "3", "--set", "sluice_policy_poll=0"))
    assert proxy.ready_line.endswith("[3 workers]")
    assert len(children_of(proxy.proc.pid)) == 3
    statuses = []
    for _ in range(30):  # a new connection each time: the kernel spreads them
        with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
            statuses.append(c.get("http://public.example/").status_code)
    assert statuses == [200] * 30
    with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
        assert c.get("http://169.254.169.254/").headers["sluice-reason"] == "address_not_public"

    proxy.policy_file.write_text(yaml.safe_dump(default_policy(deny=["public.example"])))
    proxy.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if len([e for e in proxy.audit() if e["event"] == "reload" and e["decision"] == "ok"]) == 3:
            break
        time.sleep(0.1)
    refused = []
    for _ in range(30):
        with httpx.Client(proxy=proxy.proxy_url, trust_env=False, timeout=10) as c:
            refused.append(c.get("http://public.example/").headers.get("sluice-reason"))
    assert refused == ["host_denied"] * 30  # every worker reloaded
    reloads = [e for e in proxy.audit() if e["event"] == "reload" and e["decision"] == "ok"]
    assert len(reloads) == 3


def test_workers_need_a_fixed_port():
    from sluice.cli import main

    assert main(["proxy", "--listen", "127.0.0.1:0", "--workers", "2"]) == 2


def test_a_bad_policy_at_start_is_said_once_and_exits_2(tmp_path):
    """Every worker meets the same bad policy: the supervisor says it once
    and exits 2, as `sluice proxy` does without --workers (it printed the
    problem once per worker and exited 1)."""
    import socket
    import subprocess
    import sys

    bad = tmp_path / "bad.yaml"
    bad.write_text("version: 1\nallow: [\n")
    with socket.socket() as s:  # a free port: the workers need a fixed one
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    done = subprocess.run([sys.executable, "-m", "sluice.cli", "proxy", "--policy", str(bad),
                           "--listen", f"127.0.0.1:{port}", "--workers", "3"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, (done.returncode, done.stderr)
    assert done.stderr.count("invalid policy:") == 1, done.stderr
    assert done.stderr.count("YAML syntax") == 1, done.stderr
