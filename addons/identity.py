"""Who is asking: Proxy-Authorization Basic credentials or the source address,
matched to a client profile by policy.clients.match_client.

Password verifiers (PBKDF2) are deliberately slow, so successful and failed
checks are remembered (keyed by a hash of the password, never the password).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections import OrderedDict

from mitmproxy import connection

from policy.clients import ClientMatch, match_client, verify_password
from policy.model import Policy

PROXY_AUTHORIZATION = "Proxy-Authorization"
VERIFY_CACHE_ENTRIES = 4096


def parse_basic(header: str | None) -> tuple[str, str] | None:
    """(username, password) from a `Basic` Proxy-Authorization value, else None."""
    if not header:
        return None
    scheme, _, value = header.strip().partition(" ")
    if scheme.lower() != "basic" or not value:
        return None
    try:
        decoded = base64.b64decode(value.strip(), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    user, sep, password = decoded.partition(":")
    return (user, password) if sep else None


class ClientIdentifier:
    def __init__(self) -> None:
        self._verified: OrderedDict[tuple[str, str], bool] = OrderedDict()

    def _verify(self, verifier: str, password: str) -> bool:
        key = (verifier, hashlib.sha256(password.encode()).hexdigest())
        known = self._verified.get(key)
        if known is None:
            known = verify_password(verifier, password)
            self._verified[key] = known
            while len(self._verified) > VERIFY_CACHE_ENTRIES:
                self._verified.popitem(last=False)
        return known

    async def match(self, policy: Policy, client: connection.Client, authorization: str | None) -> ClientMatch:
        source = client.peername[0] if client.peername else None
        if source and source.startswith("::ffff:"):
            source = source[7:]  # dual-stack sockets report IPv4 clients as mapped
        credentials = parse_basic(authorization)
        if authorization and credentials is None:
            credentials = ("", "")  # present but unreadable: treat as wrong credentials
        username, password = credentials if credentials else (None, None)
        return match_client(policy, source, username, password, verify=self._verify)
