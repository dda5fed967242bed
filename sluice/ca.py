"""The interception CA: where it lives, creating it, and `sluice ca`.

Only destinations the policy lists under `intercept` are decrypted; agents
then need this CA's certificate (never its key) in their trust store.

One CA for every replica: create it once (`sluice ca --ca-dir DIR`), store
the directory's files in a Kubernetes Secret (or any read-only mount) and
give every proxy `--ca-dir` pointing at the mount. mitmproxy writes a
dhparam file beside the CA, and Sluice keeps the directory owner-only, so a
read-only CA directory is copied at start into a private writable directory
(under $TMPDIR, mode 0700, removed at exit) and the proxy uses the copy. A
kubernetes.io/tls Secret (tls.crt and tls.key, e.g. from cert-manager) is
accepted too.
"""

from __future__ import annotations

import atexit
import os
import shutil
import stat
import sys
import tempfile
from pathlib import Path

from mitmproxy.certs import CertStore

BASENAME = "mitmproxy"  # the file names mitmproxy's TLS addon looks for in confdir
DEFAULT_CA_DIR = "~/.sluice/ca"
KEY_FILE = f"{BASENAME}-ca.pem"  # private key followed by the certificate
CERT_FILE = f"{BASENAME}-ca-cert.pem"
DHPARAM_FILE = f"{BASENAME}-dhparam.pem"
# What a read-only CA directory may hold, and what is copied from it.
COPIED = (KEY_FILE, CERT_FILE, DHPARAM_FILE)


def given_ca_dir(explicit: str | None) -> Path:
    """The directory named by --ca-dir, $SLUICE_CA_DIR or the default."""
    return Path(os.path.expanduser(explicit or os.environ.get("SLUICE_CA_DIR") or DEFAULT_CA_DIR))


def ca_dir(explicit: str | None) -> Path:
    """The CA directory the proxy gives mitmproxy: the given one, or a
    private writable copy of it when it is read-only (a mounted Secret).

    Raises ValueError with a one-line reason when the directory is not this
    user's to read, or a read-only directory holds no CA or cannot be copied."""
    given = given_ca_dir(explicit)
    problem = unreadable_problem(given)
    if problem is not None:
        raise ValueError(problem)
    if not given.is_dir() or os.access(given, os.W_OK):
        return given
    return working_copy(given)


def unreadable_problem(directory: Path) -> str | None:
    """Why this process cannot read the CA in `directory`, naming the fix;
    None when it can (or there is nothing there yet to read).

    The usual cause: a CA made on the host with `sluice ca` is the host
    user's and owner-only (0700, key 0600), then mounted into the image,
    which runs as another uid."""
    unreadable = None
    try:
        info = directory.stat()
    except FileNotFoundError:
        return None
    except PermissionError:
        return (f"the CA directory {directory} cannot be reached by this process (uid {os.getuid()}): a directory "
                "above it is closed to this user; mount the CA somewhere this user may read")
    if not stat.S_ISDIR(info.st_mode):
        return None
    if not os.access(directory, os.R_OK | os.X_OK):
        unreadable = directory
    else:
        for name in (KEY_FILE, CERT_FILE, "tls.key", "tls.crt"):
            path = directory / name
            if path.exists() and not os.access(path, os.R_OK):
                unreadable, info = path, path.stat()
                break
    if unreadable is None:
        return None
    uid, gid = os.getuid(), os.getgid()
    what = "the CA directory" if unreadable == directory else "the CA file"
    return (f"{what} {unreadable} is owned by {info.st_uid}:{info.st_gid} with mode "
            f"{stat.S_IMODE(info.st_mode):04o}, and this process runs as {uid}:{gid}, so it cannot read the CA: "
            f"give the directory to this user before mounting it (`sudo chown -R {uid}:{gid} DIR`, or create it "
            f"with `sudo sluice ca --ca-dir DIR --owner {uid}:{gid}`), keeping it owner-only (0700, key 0600)")


def parse_owner(text: str) -> tuple[int, int]:
    """`--owner UID[:GID]` (numbers: the image's user need not exist here); GID defaults to UID."""
    uid_text, _, gid_text = text.partition(":")
    try:
        uid, gid = int(uid_text), int(gid_text or uid_text)
    except ValueError:
        raise ValueError(f"--owner {text!r}: give a numeric UID or UID:GID (the image runs as 10001:10001)") from None
    if not (0 <= uid < 2**32 - 1 and 0 <= gid < 2**32 - 1):
        raise ValueError(f"--owner {text!r}: not a valid UID:GID")
    return uid, gid


def give_to(directory: Path, uid: int, gid: int) -> None:
    """Make the CA directory and its files uid:gid's; modes stay owner-only.
    Symbolic links are neither followed nor changed."""
    os.chown(directory, uid, gid, follow_symlinks=False)
    for path in directory.iterdir():
        if not path.is_symlink():
            os.chown(path, uid, gid, follow_symlinks=False)


def working_copy(source: Path) -> Path:
    """Copy the CA in the read-only directory `source` into a new private
    directory (removed at exit) and return it."""
    key_file = source / KEY_FILE
    tls_key, tls_cert = source / "tls.key", source / "tls.crt"
    if not key_file.is_file() and not (tls_key.is_file() and tls_cert.is_file()):
        raise ValueError(
            f"the CA directory {source} is read-only and holds no CA ({KEY_FILE}, or tls.crt and tls.key); "
            f"create one with `sluice ca --ca-dir DIR` and mount that directory")
    try:
        copy = Path(tempfile.mkdtemp(prefix="sluice-ca-"))  # mode 0700
    except OSError as e:
        raise ValueError(f"the CA directory {source} is read-only and no private copy can be made under "
                         f"{tempfile.gettempdir()} ({e.strerror or e}); give the proxy a writable TMPDIR") from None
    atexit.register(shutil.rmtree, copy, True)
    old_umask = os.umask(0o077)
    try:
        if key_file.is_file():
            for name in COPIED:
                if (source / name).is_file():
                    (copy / name).write_bytes((source / name).read_bytes())
        else:  # a kubernetes.io/tls Secret: mitmproxy wants key and certificate in one file
            key, cert = tls_key.read_bytes(), tls_cert.read_bytes()
            (copy / KEY_FILE).write_bytes(key.rstrip(b"\n") + b"\n" + cert)
            (copy / CERT_FILE).write_bytes(cert)
        if not (copy / CERT_FILE).exists():  # only the combined file given: the certificate is its PEM block
            raw = (copy / KEY_FILE).read_bytes()
            start = raw.find(b"-----BEGIN CERTIFICATE-----")
            if start < 0:
                raise ValueError(f"{key_file} holds no certificate (it must be the private key followed by the "
                                 "certificate)")
            (copy / CERT_FILE).write_bytes(raw[start:])
    except OSError as e:
        raise ValueError(f"cannot copy the CA from {source}: {e.strerror or e}") from None
    finally:
        os.umask(old_umask)
    return copy


def ensure_ca(directory: Path) -> Path:
    """Create the CA if missing; the directory and key files are owner-only.
    A read-only directory that already holds the CA is left as it is."""
    cert = directory / CERT_FILE
    if cert.exists() and directory.is_dir() and not os.access(directory, os.W_OK):
        return cert
    if not cert.exists():
        CertStore.create_store(directory, BASENAME, 2048, organization="Sluice", cn="Sluice egress proxy CA")
    os.chmod(directory, 0o700)
    for key_file in (KEY_FILE, f"{BASENAME}-ca.p12"):
        if (directory / key_file).exists():
            os.chmod(directory / key_file, 0o600)
    return cert


MOUNT_ADVICE = """\
# Agent containers trust it by mounting the certificate (never the key), e.g.
#   Debian/Ubuntu: /usr/local/share/ca-certificates/sluice.crt, then update-ca-certificates
#   or per tool:   SSL_CERT_FILE / REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE / NODE_EXTRA_CA_CERTS=/etc/sluice/ca.pem
# Kubernetes: put it in a ConfigMap and mount it read-only at one of those paths.
# One CA for every replica: kubectl create secret generic sluice-ca --from-file=DIR/mitmproxy-ca.pem
#   --from-file=DIR/mitmproxy-ca-cert.pem, mounted read-only and given as --ca-dir (see docs/deploy.md)."""


def show(explicit: str | None, owner: str | None = None) -> int:
    directory = given_ca_dir(explicit)
    try:
        uid_gid = parse_owner(owner) if owner is not None else None
    except ValueError as e:
        print(f"sluice: {e}", file=sys.stderr)
        return 2
    try:
        cert = ensure_ca(directory)
    except OSError as e:
        print(f"sluice: cannot create the CA in {directory}: {e.strerror or e}", file=sys.stderr)
        return 2
    if uid_gid is not None:
        try:
            give_to(directory, *uid_gid)
        except OSError as e:
            uid, gid = uid_gid
            print(f"sluice: cannot give the CA directory {directory} to {uid}:{gid} ({e.strerror or e}): only root "
                  f"may; run `sudo chown -R {uid}:{gid} {directory}` (the CA is made and stays owner-only)",
                  file=sys.stderr)
            return 2
    print(f"# Sluice interception CA certificate: {cert}")
    print(f"# Private key (keep it on the proxy only): {directory / KEY_FILE}")
    if uid_gid is not None:
        print(f"# Owned by {uid_gid[0]}:{uid_gid[1]}, mode 0700 (key 0600): mount it for a proxy running as that user")
    print(MOUNT_ADVICE)
    print(cert.read_text(), end="")
    return 0
