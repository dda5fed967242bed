"""A second network namespace joined to the test namespace by a veth pair.

    with AgentNamespace("ag", "10.199.0") as ns:   # 10.199.0.1 here, 10.199.0.2 there
        ns.run(["curl", ...])                       # a command inside it
        ns.wrap(["sluice", "proxy", ...])           # the argv that runs it inside

It models a container (or an agent's sandbox) whose only link is to the test
namespace, its default route pointing there. The test namespace does not
forward (a new namespace's ip_forward is 0), so what comes in over the veth
reaches only the test namespace's own addresses: its origins and canaries on
`lo`, and whatever the test's nftables rules redirect. Nothing can leave the
machine: the test namespace itself has no way out.

Needs `ip`, `unshare` and `nsenter` (iproute2, util-linux), and root or the
user namespace `scripts/in-netns.sh` made.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time


def missing_tools(*extra: str) -> list[str]:
    return [tool for tool in ("ip", "unshare", "nsenter", *extra) if shutil.which(tool) is None]


class AgentNamespace:
    def __init__(self, name: str, prefix: str = "10.199.0"):
        # veth names: at most 15 characters
        self.outer_if = f"{name}-out"[:15]
        self.inner_if = f"{name}-in"[:15]
        self.outer_ip = f"{prefix}.1"
        self.inner_ip = f"{prefix}.2"
        self.holder: subprocess.Popen | None = None

    @property
    def pid(self) -> int:
        assert self.holder is not None
        return self.holder.pid

    def wrap(self, argv: list[str]) -> list[str]:
        """argv run inside the namespace (nsenter execs it: the pid is the command's)."""
        return ["nsenter", "-t", str(self.pid), "-n", *argv]

    def run(self, argv: list[str], timeout: float = 30, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(self.wrap(argv), capture_output=True, text=True, timeout=timeout, **kwargs)

    def _ip(self, *args: str, inside: bool = False) -> None:
        argv = ["ip", *args]
        out = subprocess.run(self.wrap(argv) if inside else argv, capture_output=True, text=True, timeout=10)
        if out.returncode != 0:
            raise RuntimeError(f"{' '.join(argv)}{' (inside)' if inside else ''}: {out.stderr.strip()}")

    def start(self) -> AgentNamespace:
        # A process holding the new namespace open; killed on stop.
        self.holder = subprocess.Popen(["unshare", "-n", "sleep", "infinity"], stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 5
        mine = os.readlink("/proc/self/ns/net")
        while True:  # until `unshare` has moved into its own namespace
            try:
                if os.readlink(f"/proc/{self.pid}/ns/net") != mine:
                    break
            except OSError:
                pass
            if time.monotonic() > deadline or self.holder.poll() is not None:
                self.stop()
                raise RuntimeError("the agent namespace did not come up (unshare -n failed?)")
            time.sleep(0.02)
        try:
            self._ip("link", "add", self.outer_if, "type", "veth", "peer", "name", self.inner_if,
                     "netns", f"/proc/{self.pid}/ns/net")
            self._ip("addr", "add", f"{self.outer_ip}/30", "dev", self.outer_if)
            self._ip("link", "set", self.outer_if, "up")
            self._ip("link", "set", "lo", "up", inside=True)
            self._ip("addr", "add", f"{self.inner_ip}/30", "dev", self.inner_if, inside=True)
            self._ip("link", "set", self.inner_if, "up", inside=True)
            self._ip("route", "add", "default", "via", self.outer_ip, inside=True)
        except Exception:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        subprocess.run(["ip", "link", "del", self.outer_if], capture_output=True, timeout=10)
        if self.holder is not None and self.holder.poll() is None:
            self.holder.kill()
            self.holder.wait(timeout=5)

    def __enter__(self) -> AgentNamespace:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


# The nftables rules docs/deploy.md gives for transparent mode: everything
# TCP the agent sends is redirected to Sluice's transparent listener, and
# nothing else from it is accepted or forwarded. {agent_if} is the gateway's
# end of the agent's link, {port} the listener, {table} the table's name.
TRANSPARENT_RULES = """\
table inet {table} {{
  chain prerouting {{
    type nat hook prerouting priority dstnat; policy accept;
    iifname "{agent_if}" meta l4proto tcp redirect to :{port}
  }}
  chain input {{
    type filter hook input priority filter; policy accept;
    iifname "{agent_if}" tcp dport {port} accept
    iifname "{agent_if}" drop
  }}
  chain forward {{
    type filter hook forward priority filter; policy accept;
    iifname "{agent_if}" drop
  }}
}}
"""


def nft(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(["nft", *args], input=stdin, capture_output=True, text=True, timeout=20)


def redirect_to_sluice(agent: AgentNamespace, port: int, table: str) -> subprocess.CompletedProcess:
    """Load TRANSPARENT_RULES for this agent; undo with nft("delete", "table", "inet", table)."""
    return nft("-f", "-", stdin=TRANSPARENT_RULES.format(table=table, agent_if=agent.outer_if, port=port))


def transparent_gateway(agent: AgentNamespace, workdir, policy: dict, **kwargs):
    """A `sluice proxy --mode transparent` listening on the gateway's end of
    the agent's link (not started)."""
    from harness.sluice import SluiceProcess

    class Gateway(SluiceProcess):
        def command(self) -> list[str]:
            self.host = agent.outer_ip
            return super().command() + ["--mode", "transparent"]

    return Gateway(workdir, policy, **kwargs)
