"""The `sluice` command's polish (issue 10, item 12), run as the real command:
--version; output cut short by its reader ends quietly; --policy FILE for
every subcommand (a positional FILE still works where it did); start-up
errors (a port in use, an audit log that cannot be opened) are one line and
exit 2; `policy check` summarises intercept, limits, strip_request_headers
and says when a whole scheme is unreachable.

No test here sends a packet: the proxy is refused before it listens."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

SLUICE = str(Path(sys.executable).parent / "sluice")
ROOT = Path(__file__).resolve().parents[2]
# the packaged starter: tests never read config/policy.yaml, the user's copy
POLICY = str(ROOT / "sluice" / "starter_policy.yaml")

CASES = """\
- url: http://public.example/
  resolve: {public.example: 93.184.215.14}
  expect: allow
"""


def sluice(*args, home: Path | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(home) if home else "/nonexistent"}
    return subprocess.run([os.environ.get("SLUICE_BIN", SLUICE), *map(str, args)], capture_output=True, text=True,
                          timeout=timeout, env=env, stdin=subprocess.DEVNULL)


def into_closed_pipe(*args) -> subprocess.CompletedProcess:
    """Run with stdout a pipe whose reader is already gone (`| head` that
    has exited): every write to it fails with EPIPE."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        return subprocess.run([os.environ.get("SLUICE_BIN", SLUICE), *map(str, args)], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60, stdin=subprocess.DEVNULL,
                              env={"PATH": "/usr/bin:/bin", "HOME": "/nonexistent"})
    finally:
        os.close(write_end)


def test_version():
    result = sluice("--version")
    assert result.returncode == 0 and result.stderr == ""
    assert result.stdout.startswith(f"sluice {metadata.version('sluice')} (mitmproxy {metadata.version('mitmproxy')}, "
                                    "Python ")


@pytest.fixture
def cases_file(tmp_path) -> Path:
    path = tmp_path / "cases.yaml"
    path.write_text(CASES)
    return path


@pytest.mark.parametrize("args", [
    ("ca", "--ca-dir", "{tmp}/ca"),
    ("policy", "check", POLICY),
    ("policy", "check", "--policy", POLICY),
    ("policy", "test", "--policy", POLICY, "{cases}", "-v"),
    ("policy", "explain", "--policy", POLICY, "--resolve", "example.com=93.184.215.14", "https://example.com/"),
    ("--version",),
    ("--help",),
], ids=["ca", "check", "check-policy", "test", "explain", "version", "help"])
def test_output_cut_short_by_its_reader_ends_quietly(args, tmp_path, cases_file):
    args = [a.format(tmp=tmp_path, cases=cases_file) for a in args]
    result = into_closed_pipe(*args)
    assert result.stderr == "", result.stderr
    assert result.returncode in (0, 141), result.returncode  # 141: as if killed by SIGPIPE (argparse's help: 0)


def test_a_reader_that_stops_after_one_line_sees_that_line(tmp_path):
    # The shell pipeline itself, `sluice ca | head -1`.
    env = {"PATH": f"{Path(SLUICE).parent}:/usr/bin:/bin", "HOME": str(tmp_path)}
    result = subprocess.run(["bash", "-c", "set -o pipefail; sluice ca --ca-dir ca | head -1"], capture_output=True,
                            text=True, timeout=60, env=env, cwd=tmp_path)
    assert result.stdout.startswith("# Sluice interception CA certificate: ")
    assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr, result.stderr


# ---- --policy everywhere ---------------------------------------------------------


def test_check_takes_the_policy_either_way():
    by_flag, positional = sluice("policy", "check", "--policy", POLICY), sluice("policy", "check", POLICY)
    assert by_flag.returncode == positional.returncode == 0
    assert by_flag.stdout == positional.stdout and by_flag.stdout.startswith(f"{POLICY}: OK")


def test_test_takes_the_policy_either_way(cases_file):
    by_flag = sluice("policy", "test", "--policy", POLICY, cases_file)
    positional = sluice("policy", "test", POLICY, cases_file)
    assert by_flag.returncode == positional.returncode == 0, by_flag.stderr
    assert by_flag.stdout == positional.stdout == "1 passed, 0 failed\n"


@pytest.mark.parametrize("args, message", [
    (("policy", "check", "--policy", POLICY, POLICY), "give the policy once: --policy FILE (or FILE)"),
    (("policy", "test", "--policy", POLICY, POLICY, "cases.yaml"),
     "with --policy FILE give only the cases file: sluice policy test --policy FILE CASES"),
    (("policy", "test", "cases.yaml"), "expected a policy and a cases file: sluice policy test --policy FILE CASES"),
])
def test_policy_given_twice_or_cases_missing_is_a_usage_error(args, message):
    result = sluice(*args)
    assert result.returncode == 2 and result.stdout == ""
    assert result.stderr.splitlines()[-1].endswith(f"error: {message}"), result.stderr
    assert "Traceback" not in result.stderr


def test_explain_and_proxy_take_policy_by_flag():
    for command in (("policy", "explain"), ("proxy",)):
        assert "--policy FILE" in sluice(*command, "--help").stdout


# ---- start-up errors: one line, exit 2 ----------------------------------------------


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


def test_a_port_in_use_names_the_address_and_suggests_listen(busy_port, tmp_path):
    result = sluice("proxy", "--policy", POLICY, "--listen", f"127.0.0.1:{busy_port}", "--ca-dir", tmp_path / "ca",
                    home=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"sluice: 127.0.0.1:{busy_port} is already in use (TCP: another process is listening "
                             "there); choose another address with --listen HOST:PORT\n")


def test_a_mode_port_in_use_suggests_another_port_for_that_mode(busy_port, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    result = sluice("proxy", "--policy", POLICY, "--listen", f"127.0.0.1:{free}", "--mode", "regular",
                    "--mode", f"socks5@{busy_port}", "--ca-dir", tmp_path / "ca", home=tmp_path)
    assert result.returncode == 2, result.stderr
    assert result.stderr == (f"sluice: 127.0.0.1:{busy_port} is already in use (TCP: another process is listening "
                             "there); choose another port in --mode socks5@PORT\n")


def test_workers_on_a_port_in_use(busy_port, tmp_path):
    result = sluice("proxy", "--policy", POLICY, "--listen", f"127.0.0.1:{busy_port}", "--workers", "2",
                    "--ca-dir", tmp_path / "ca", home=tmp_path)
    assert result.returncode == 2
    assert result.stderr.startswith(f"sluice: 127.0.0.1:{busy_port} is already in "
                                    "use") and result.stderr.count("\n") == 1


def test_an_audit_log_in_a_missing_directory(tmp_path):
    audit = tmp_path / "no" / "such" / "audit.jsonl"
    result = sluice("proxy", "--policy", POLICY, "--listen", "127.0.0.1:0", "--audit-log", audit,
                    "--ca-dir", tmp_path / "ca", home=tmp_path)
    assert result.returncode == 2
    assert result.stderr == (f"sluice: cannot open the audit log {audit}: No such file or directory (create the "
                             "directory first)\n")


# ---- policy check's summary ---------------------------------------------------------


def test_check_summarises_intercept_limits_stripped_headers_and_unreachable_schemes(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("""\
version: 1
ports: [80, 8443]
intercept: ["**.github.com"]
strip_request_headers: [Cookie]
limits: {tunnel_max_bytes: 100MiB, tunnel_max_seconds: 1h, max_header_bytes: 32KiB, max_response_bytes: 1500}
clients:
  - name: ci
    sources: [10.20.0.0/16]
    ports: [443]
    methods: [GET, HEAD]
""")
    result = sluice("policy", "check", "--policy", path)
    assert result.returncode == 0, result.stderr
    top, _, ci = result.stdout.partition("  client 'ci'")
    assert "  intercepts TLS (methods and headers checked inside HTTPS) for: **.github.com\n" in top
    assert "  strips request headers: cookie\n" in top
    assert ("  limits: connect 10s, request 30s, idle 1m; bodies: request 1MiB, response 1500B; "
            "tunnels: 100MiB each way, 1h\n") in top
    assert "  unreachable: https:// on its default port 443 (not in ports)\n" in top
    assert "http:// on its default port" not in top
    assert "    unreachable: http:// on its default port 80 (not in ports)\n" in ci
    assert ("    unreachable: https:// to hosts not under intercept (CONNECT is not in methods)\n") in ci
    assert result.stdout.endswith("  request heads (every client): at most 32KiB and 100 fields, whole within 10s\n"
                                  "  every client: HTTP/2 at most 100 streams per connection, 1MiB held per stream; "
                                  "IPv6 clients counted per /64\n")


def test_check_summarises_every_quota_and_the_refusal_note(tmp_path):
    path = tmp_path / "p.yaml"
    path.write_text("""\
version: 1
refusal_note: "ask #platform for access"
limits: {max_connections: 20, max_total_connections: 500, max_tunnels: 8, requests_per_second: 2.5, burst: 10,
         bytes_per_hour: 1GiB, max_requests_per_host_per_minute: 60, max_upstreams_per_connection: 4}
clients:
  - name: ci
    sources: [10.20.0.0/16]
    limits: {requests_per_second: 1}
""")
    result = sluice("policy", "check", "--policy", path)
    assert result.returncode == 0, result.stderr
    top, _, ci = result.stdout.partition("  client 'ci'")
    assert ("  quotas: 20 connections per source address; 8 tunnels per client; 2.5 requests/s per client (burst 10); "
            "1GiB per hour per client; 60 requests per host per minute per client; "
            "4 upstream sockets per client connection\n") in top
    assert "  refusals end with the note: 'ask #platform for access'\n" in top
    assert ("    quotas: 20 connections per source address; 8 tunnels per client; 1 requests/s per client "
            "(burst 10);") in ci
    assert "    refusals end with the note: 'ask #platform for access'\n" in ci  # profiles inherit limits and note
    assert "; at most 500 connections in all\n" in result.stdout


def test_check_says_nothing_is_unreachable_for_the_default_policy():
    result = sluice("policy", "check", POLICY)
    assert result.returncode == 0 and "unreachable" not in result.stdout
    assert "tunnels: no byte cap, no time cap" in result.stdout


def test_set_scripts_says_that_sluice_proxy_loads_no_scripts(tmp_path):
    result = sluice("proxy", "--policy", POLICY, "--listen", "127.0.0.1:0", "--admin", "off",
                    "--set", "scripts=mine.py", home=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    line, = result.stderr.splitlines()
    assert line.startswith("sluice: `sluice proxy` loads no mitmproxy scripts") and "mitmdump -s" in line


# One value per limit, unlike its default; a limit added to policy.model.Limits must be added here (and shown).
LIMIT_VALUES = {
    "connect_timeout": "7s", "request_timeout": "37s", "idle_timeout": "47s", "max_response_bytes": "3MiB",
    "max_request_bytes": "5MiB", "tunnel_max_bytes": "7MiB", "tunnel_max_seconds": "2h", "max_header_bytes": "48KiB",
    "max_header_count": 77, "header_timeout": "9s", "h2_stream_buffer_bytes": "3MiB", "h2_max_concurrent_streams": 33,
    "ipv6_client_prefix": 56, "max_connections": 11, "max_total_connections": 222, "max_upstreams_per_connection": 6,
    "max_tunnels": 4, "requests_per_second": 2.5, "burst": 12, "bytes_per_hour": "9GiB",
    "max_requests_per_host_per_minute": 88,
}


def test_check_shows_every_limit_that_is_set(tmp_path, capsys):
    from dataclasses import fields

    from sluice.cli import main
    from sluice.policy.model import Limits

    assert set(LIMIT_VALUES) == {f.name for f in fields(Limits)}, "give the new limit a value here"

    def summary(limits: dict) -> str:
        path = tmp_path / "p.yaml"
        shown = ", ".join(f"{key}: {value}" for key, value in limits.items())
        path.write_text(f"version: 1\nlimits: {{{shown}}}\n")
        assert main(["policy", "check", str(path)]) == 0, capsys.readouterr().err
        return capsys.readouterr().out

    for key, value in LIMIT_VALUES.items():
        base = {"requests_per_second": 2.5} if key == "burst" else {}  # burst needs a rate
        assert summary({**base, key: value}) != summary(base), f"policy check does not show limits.{key}"


def test_make_run_takes_policy_listen_and_admin():
    if shutil.which("make") is None:
        pytest.skip("needs make")
    out = subprocess.run(["make", "-n", "-s", "run", "POLICY=mine.yaml", "LISTEN=127.0.0.1:8181", "ADMIN=off"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    command = ".venv/bin/sluice proxy --policy mine.yaml --listen 127.0.0.1:8181 --admin off"
    assert out.stdout.splitlines()[-1] == command, out.stdout
