"""A parent proxy (`upstream_proxy`) that is Sluice itself would loop: each
request would come back in as a new client and be sent to the parent again.
`sluice policy check` cannot know the listen address; the proxy refuses such
a policy at start (exit 2, the problem's line) and at reload (the last good
policy kept, as for any bad reload). In process: tests/unit/test_upstream_proxy_loop_units.py."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from harness import default_policy, free_port
from harness.clients import clean_env, curl
from harness.sluice import sluice_executable
from harness.wait import wait_until

pytestmark = pytest.mark.netns


def write_looped(path, url: str) -> int:
    """Write a policy whose parent is `url`; the line the problem names (its url's)."""
    text = yaml.safe_dump(default_policy(upstream_proxy={"url": url}), sort_keys=False)
    path.write_text(text)
    return next(n for n, line in enumerate(text.splitlines(), 1) if url in line)


@pytest.mark.parametrize("listen, parent", [
    ("127.0.0.1", "127.0.0.1"),  # its own listen address
    ("0.0.0.0", "8.8.8.8"),  # an address of this host (8.8.8.8 is on lo here) on the listen port
    ("0.0.0.0", "localhost"),
])
def test_a_policy_whose_parent_is_the_proxy_itself_stops_it_at_start(netns, tmp_path, listen, parent):
    port = free_port()
    path = tmp_path / "policy.yaml"
    line = write_looped(path, f"http://{parent}:{port}")
    out = subprocess.run([sluice_executable(), "proxy", "--policy", str(path), "--listen", f"{listen}:{port}",
                          "--admin", "off"], capture_output=True, text=True, timeout=60, env=clean_env(),
                         cwd=tmp_path)
    assert out.returncode == 2, out
    assert "Traceback" not in out.stderr
    assert out.stderr.splitlines() == [
        "sluice: invalid policy:",
        f"{path}:{line}: upstream_proxy.url http://{parent}:{port} is this proxy itself (its listener "
        f"{listen}:{port}): every request would loop through Sluice; give the parent proxy's own address"], out.stderr


def test_a_reload_pointing_the_parent_at_the_proxy_itself_keeps_the_last_good_policy(sluice_factory, net):
    proxy = sluice_factory(default_policy(), name="loop-reload")
    mark, audit_mark = proxy.stderr_mark(), proxy.audit_mark()
    line = write_looped(proxy.policy_file, f"http://127.0.0.1:{proxy.port}")
    wait_until(lambda: "reload refused" in proxy.stderr_since(mark), what="the reload refused on stderr")
    lines = proxy.stderr_since(mark).splitlines()
    assert lines == [
        f"sluice: error: {proxy.policy_file}:{line}: upstream_proxy.url http://127.0.0.1:{proxy.port} is this proxy "
        f"itself (its listener 127.0.0.1:{proxy.port}): every request would loop through Sluice; give the parent "
        "proxy's own address",
        f"sluice: error: {proxy.policy_file}: reload refused (1 problem(s)); keeping the last good policy "
        "(generation 1)"], lines
    entry = proxy.wait_audit(lambda e: e.get("event") == "reload", since=audit_mark)
    assert entry["decision"] == "failed" and "is this proxy itself" in entry["detail"], entry
    # Still the last good policy: direct, no loop.
    got = curl("-x", proxy.proxy_url, "http://8.8.8.8/after-refused-reload")
    assert got.status == 200, got
