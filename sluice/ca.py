"""The interception CA: where it lives, creating it, and `sluice ca`.

Only destinations the policy lists under `intercept` are decrypted; agents
then need this CA's certificate (never its key) in their trust store.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from mitmproxy.certs import CertStore

BASENAME = "mitmproxy"  # the file names mitmproxy's TLS addon looks for in confdir
DEFAULT_CA_DIR = "~/.sluice/ca"


def ca_dir(explicit: str | None) -> Path:
    return Path(os.path.expanduser(explicit or os.environ.get("SLUICE_CA_DIR") or DEFAULT_CA_DIR))


def ensure_ca(directory: Path) -> Path:
    """Create the CA if missing; the directory and key files are owner-only."""
    cert = directory / f"{BASENAME}-ca-cert.pem"
    if not cert.exists():
        CertStore.create_store(directory, BASENAME, 2048, organization="Sluice", cn="Sluice egress proxy CA")
    os.chmod(directory, 0o700)
    for key_file in (f"{BASENAME}-ca.pem", f"{BASENAME}-ca.p12"):
        if (directory / key_file).exists():
            os.chmod(directory / key_file, 0o600)
    return cert


MOUNT_ADVICE = """\
# Agent containers trust it by mounting the certificate (never the key), e.g.
#   Debian/Ubuntu: /usr/local/share/ca-certificates/sluice.crt, then update-ca-certificates
#   or per tool:   SSL_CERT_FILE / REQUESTS_CA_BUNDLE / CURL_CA_BUNDLE / NODE_EXTRA_CA_CERTS=/etc/sluice/ca.pem
# Kubernetes: put it in a ConfigMap and mount it read-only at one of those paths."""


def show(explicit: str | None) -> int:
    directory = ca_dir(explicit)
    try:
        cert = ensure_ca(directory)
    except OSError as e:
        print(f"sluice: cannot create the CA in {directory}: {e.strerror or e}", file=sys.stderr)
        return 2
    print(f"# Sluice interception CA certificate: {cert}")
    print(f"# Private key (keep it on the proxy only): {directory / (BASENAME + '-ca.pem')}")
    print(MOUNT_ADVICE)
    print(cert.read_text(), end="")
    return 0
