"""`sluice ca`: creates the interception CA with owner-only key files and prints the certificate."""

import os
import stat

import pytest

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


def test_sluice_ca_owner_gives_the_directory_to_the_images_user_keeping_it_owner_only(tmp_path, capsys):
    if os.geteuid() != 0:
        pytest.skip("giving files to another uid needs root (CI runs as root)")
    directory = tmp_path / "ca"
    assert main(["ca", "--ca-dir", str(directory), "--owner", "10001:10002"]) == 0
    assert "# Owned by 10001:10002, mode 0700 (key 0600)" in capsys.readouterr().out
    for path in [directory, *directory.iterdir()]:
        assert (path.stat().st_uid, path.stat().st_gid) == (10001, 10002), path
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(directory / "mitmproxy-ca.pem").st_mode) == 0o600
    # GID defaults to UID; an existing CA is kept and given again.
    first = (directory / "mitmproxy-ca.pem").read_bytes()
    assert main(["ca", "--ca-dir", str(directory), "--owner", "10003"]) == 0
    assert (directory.stat().st_uid, directory.stat().st_gid) == (10003, 10003)
    assert (directory / "mitmproxy-ca.pem").read_bytes() == first


@pytest.mark.parametrize("owner", ["sluice", "10001:x", "-1", ""])
def test_sluice_ca_owner_takes_numbers_only(tmp_path, capsys, owner):
    assert main(["ca", "--ca-dir", str(tmp_path / "ca"), "--owner", owner]) == 2
    err = capsys.readouterr().err
    assert err.startswith("sluice: --owner ") and ("numeric UID or UID:GID" in err or "not a valid" in err), err
    assert len(err.splitlines()) == 1
    assert not (tmp_path / "ca").exists(), "nothing is made on a bad --owner"


def test_sluice_ca_owner_without_the_right_to_chown_names_the_command(tmp_path, capsys, monkeypatch):
    def refused(*args, **kwargs):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr("sluice.ca.os.chown", refused)
    directory = tmp_path / "ca"
    assert main(["ca", "--ca-dir", str(directory), "--owner", "10001"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"sluice: cannot give the CA directory {directory} to 10001:10001 (Operation not permitted): only "
                   f"root may; run `sudo chown -R 10001:10001 {directory}` (the CA is made and stays owner-only)")
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
