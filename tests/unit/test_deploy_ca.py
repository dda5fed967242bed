"""One CA for every replica: `sluice ca --ca-dir DIR` makes the files of a
Secret, and a proxy given that directory read-only (a mounted Secret, a
`:ro` bind mount) works from a private writable copy.

Read-only here means really read-only: each case runs in a private mount
namespace (`unshare -m`) where the CA directory is bind-mounted `ro`, as the
kubelet mounts a Secret; root's permission bypass does not apply there."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sluice.cli import main

PROBE = """
import json, os, stat, sys
from sluice.ca import ca_dir, ensure_ca
try:
    d = ca_dir(sys.argv[1])
except ValueError as e:
    print(json.dumps({"error": str(e)})); sys.exit(0)
cert = ensure_ca(d)
print(json.dumps({"dir": str(d), "mode": stat.S_IMODE(os.stat(d).st_mode),
                  "files": {p.name: [p.read_text(), stat.S_IMODE(os.stat(p).st_mode)] for p in d.iterdir()}}))
"""


def read_only_run(directory: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    if shutil.which("unshare") is None or shutil.which("mount") is None:
        pytest.skip("needs unshare and mount (util-linux) for a read-only bind mount")
    user = [] if os.geteuid() == 0 else ["-r"]
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    out = subprocess.run(["unshare", "-m", *user, "sh", "-c", script, "sh", str(directory), sys.executable, "-c",
                          code, *args], capture_output=True, text=True, timeout=60)
    if out.returncode != 0 and "unshare" in out.stderr and "Operation not permitted" in out.stderr:
        pytest.skip(f"no mount namespace here: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr
    return out


def make_ca(tmp_path: Path) -> Path:
    directory = tmp_path / "secret"
    assert main(["ca", "--ca-dir", str(directory)]) == 0
    return directory


def test_sluice_ca_makes_the_files_a_secret_holds(tmp_path, capsys):
    directory = make_ca(tmp_path)
    out = capsys.readouterr().out
    assert "kubectl create secret generic sluice-ca" in out
    key = (directory / "mitmproxy-ca.pem").read_text()
    assert "PRIVATE KEY" in key and "BEGIN CERTIFICATE" in key
    assert (directory / "mitmproxy-ca-cert.pem").read_text() in key


def test_a_read_only_ca_directory_is_used_through_a_private_copy(tmp_path):
    source = make_ca(tmp_path)
    for path in source.iterdir():
        path.chmod(0o444)  # as a Secret mounted with defaultMode 0444 (or 0440 and fsGroup)
    out = read_only_run(source, PROBE, str(source))
    result = json.loads(out.stdout)
    copy = Path(result["dir"])
    assert copy != source and copy.name.startswith("sluice-ca-")
    assert result["mode"] == 0o700
    key_text, key_mode = result["files"]["mitmproxy-ca.pem"]
    assert key_text == (source / "mitmproxy-ca.pem").read_text() and key_mode == 0o600
    assert result["files"]["mitmproxy-ca-cert.pem"][0] == (source / "mitmproxy-ca-cert.pem").read_text()
    assert not copy.exists(), "the private copy (with the key) is removed when the process exits"


def test_a_kubernetes_tls_secret_is_accepted(tmp_path):
    made = make_ca(tmp_path)
    raw = (made / "mitmproxy-ca.pem").read_text()
    cert = raw[raw.index("-----BEGIN CERTIFICATE-----"):]
    key = raw[:raw.index("-----BEGIN CERTIFICATE-----")]
    secret = tmp_path / "tls-secret"
    secret.mkdir()
    (secret / "tls.crt").write_text(cert)
    (secret / "tls.key").write_text(key)
    result = json.loads(read_only_run(secret, PROBE, str(secret)).stdout)
    files = result["files"]
    assert files["mitmproxy-ca-cert.pem"][0] == cert
    assert "PRIVATE KEY" in files["mitmproxy-ca.pem"][0] and files["mitmproxy-ca.pem"][0].endswith(cert)


def test_a_read_only_directory_without_a_ca_is_one_clear_error(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = json.loads(read_only_run(empty, PROBE, str(empty)).stdout)
    assert result["error"].startswith(f"the CA directory {empty} is read-only and holds no CA")
    assert "sluice ca --ca-dir DIR" in result["error"]


def test_the_proxy_refuses_to_start_on_a_read_only_directory_without_a_ca(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    code = "import sys; from sluice.cli import main; sys.exit(main(sys.argv[1:]))"
    policy = Path(__file__).resolve().parents[2] / "sluice" / "starter_policy.yaml"
    if shutil.which("unshare") is None:
        pytest.skip("needs unshare")
    user = [] if os.geteuid() == 0 else ["-r"]
    script = 'mount --bind "$1" "$1" && mount -o remount,bind,ro "$1" && shift && exec "$@"'
    out = subprocess.run(["unshare", "-m", *user, "sh", "-c", script, "sh", str(empty), sys.executable, "-c", code,
                          "proxy", "--policy", str(policy), "--listen", "127.0.0.1:0", "--ca-dir", str(empty)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == [
        f"sluice: the CA directory {empty} is read-only and holds no CA (mitmproxy-ca.pem, or tls.crt and tls.key); "
        "create one with `sluice ca --ca-dir DIR` and mount that directory"]
