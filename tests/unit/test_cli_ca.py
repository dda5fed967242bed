"""`sluice ca`: creates the interception CA with owner-only key files and prints the certificate."""

import os
import stat

from sluice.cli import main


def test_sluice_ca_creates_and_prints_the_certificate(tmp_path, capsys):
    directory = tmp_path / "ca"
    assert main(["ca", "--ca-dir", str(directory)]) == 0
    out = capsys.readouterr().out
    assert f"{directory}/mitmproxy-ca-cert.pem" in out
    assert "-----BEGIN CERTIFICATE-----" in out and "PRIVATE KEY" not in out
    assert "update-ca-certificates" in out  # where an agent container mounts it
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory / "mitmproxy-ca.pem").st_mode) == 0o600
    # a second call reuses the same CA
    first = (directory / "mitmproxy-ca-cert.pem").read_bytes()
    assert main(["ca", "--ca-dir", str(directory)]) == 0
    assert (directory / "mitmproxy-ca-cert.pem").read_bytes() == first


def test_sluice_ca_reports_an_unusable_directory(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["ca", "--ca-dir", str(blocker / "ca")]) == 2
    assert "cannot create the CA" in capsys.readouterr().err
