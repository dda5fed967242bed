"""Shared fixtures for Sluice's tests.

Integration fixtures (everything that binds or dials a test address) all
depend on the session fixture `netns`, which FAILS the run unless it is inside
the private network namespace made by `scripts/in-netns.sh` (`make test`).
Runs that deselect them with `-m 'not netns'` never touch these fixtures.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from harness import FakeDNS, NetServers, SluiceProcess, netns_problem  # noqa: E402
from harness import sluice as _sluice_mod  # noqa: E402
from harness.servers import TLS_NAMES  # noqa: E402

# Names every integration test may rely on. Tests add their own, unique names.
BASE_RECORDS = {
    "public.example": {"a": ["8.8.8.8"]},
    "example.com": {"a": ["8.8.8.8"]},
    "one.example": {"a": ["1.1.1.1"]},
    "v6.example": {"aaaa": ["2606:4700:4700::1111"]},
    "dual.example": {"a": ["8.8.8.8"], "aaaa": ["2606:4700:4700::1111"]},
    # Internal names point at canaries: if the proxy ever looked one up and
    # dialled it, the canary would see it (and the reason would be wrong).
    "localhost": {"a": ["127.0.0.1"], "aaaa": ["::1"]},
    "foo.localhost": {"a": ["127.0.0.1"]},
    "metadata.google.internal": {"a": ["169.254.169.254"]},
    "metadata": {"a": ["169.254.169.254"]},
    "kubernetes.default.svc": {"a": ["10.0.0.1"]},
}


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="run the collected tests in reverse order (a test that passes only after another one "
                          "depends on state that one left: find it with this)")


def pytest_collection_modifyitems(config, items):
    if config.getoption("--reverse"):
        items.reverse()


@pytest.fixture(scope="session")
def netns():
    """Fail (never skip) unless we are inside the private test namespace."""
    problem = netns_problem()
    if problem:
        pytest.fail(problem, pytrace=False)


@pytest.fixture(scope="session")
def fake_dns(netns):
    server = FakeDNS("127.0.0.53", 53)
    for name, rec in BASE_RECORDS.items():
        server.set(name, a=rec.get("a", ()), aaaa=rec.get("aaaa", ()), ttl=300)
    server.start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def tls_ca(tmp_path_factory):
    """A trustme CA and a server certificate for the TLS origins."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert(*TLS_NAMES)
    d = tmp_path_factory.mktemp("tls")
    cafile = d / "ca.pem"
    ca.cert_pem.write_to_path(str(cafile))

    return SimpleNamespace(ca=ca, cert=cert, cafile=str(cafile))


@pytest.fixture(scope="session")
def net(netns, tls_ca):
    """Origins (8.8.8.8, 1.1.1.1, [2606:4700:4700::1111]; TLS on :443) and canaries."""
    import ssl

    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    tls_ca.cert.configure_cert(server_ctx)
    servers = NetServers(server_ctx).start()
    yield servers
    servers.stop()


@pytest.fixture(scope="session")
def sluice_home(tmp_path_factory):
    """HOME for proxy subprocesses (mitmproxy's confdir), shared by the session."""
    return tmp_path_factory.mktemp("sluice-home")


@pytest.fixture(scope="module")
def sluice_factory(netns, fake_dns, net, tmp_path_factory, sluice_home):
    """Start `sluice proxy` subprocesses; all stop (SIGTERM) at module end.

        proxy = sluice_factory(policy=default_policy(ports=[80]), socks=True)
    """
    procs: list[SluiceProcess] = []

    def start(policy=None, *, socks: bool = False, name: str = "sluice", extra_args=(), ready_timeout=20.0):
        proc = SluiceProcess(
            tmp_path_factory.mktemp(name),
            policy,
            socks=socks,
            name=name,
            extra_args=tuple(extra_args),
            home=sluice_home,
            ready_timeout=ready_timeout,
        )
        procs.append(proc)
        return proc.start()

    yield start
    for proc in procs:
        proc.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.failed and _sluice_mod.LIVE:
        for proc in list(_sluice_mod.LIVE):
            state = "running" if proc.alive() else f"EXITED rc={proc.proc.returncode if proc.proc else None}"
            report.sections.append(
                (f"{proc.name} ({proc.proxy_url}, {state}) stderr, last 80 lines", proc.stderr_text(tail=80))
            )
