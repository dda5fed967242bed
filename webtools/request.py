"""request(url, method="GET", headers={}): one GET, the text or JSON body as it is.

Only GET (`web_method_not_allowed` otherwise); only `accept` and
`accept-language` may be set (`web_header_not_allowed` names any other: never
credentials), each one line of printable ASCII of at most 1000 characters. A
status outside 2xx is a result, not an error: check `status`.
Text and JSON bodies only (`web_not_text` otherwise, from the headers, before
the body is read). `bytes` and `sha256` are over the body after
decompression; a body over the result cap (100,000 bytes) is
`web_body_too_large` with `bytes` and `sha256` and no body.
"""

from __future__ import annotations


from sluice.webtools.client import Fetched, ReadPlan, WebClient, call_client
from sluice.webtools.errors import WebError
from sluice.webtools.fetch import decode_text, header_values, is_text_type
from sluice.webtools.sanitize import media_type

ALLOWED_HEADERS = ("accept", "accept-language")
MAX_BODY_BYTES = 100_000
MAX_HEADER_VALUE_CHARS = 1000


def check_headers(headers) -> dict[str, str]:
    if headers is None:
        return {}
    if not isinstance(headers, dict):
        raise WebError("web_bad_argument", "headers must be an object of header names to string values, "
                       'e.g. {"accept": "application/json"}')
    out = {}
    for name, value in headers.items():
        if not isinstance(name, str) or name.strip().lower() not in ALLOWED_HEADERS:
            shown = str(name)[:100]  # never echo a megabyte of name back
            raise WebError("web_header_not_allowed", f"the header {shown!r} may not be set: request sets only accept "
                           "and accept-language, and never sends credentials", header=shown)
        # HTTP header values are ASCII on the wire (RFC 9110 field-vchar; obs-text is not sent).
        if (not isinstance(value, str) or len(value) > MAX_HEADER_VALUE_CHARS
                or not all(" " <= c <= "~" or c == "\t" for c in value)):
            raise WebError("web_bad_argument", f"the value of {name.strip().lower()} must be one line of printable "
                           f"ASCII text (at most {MAX_HEADER_VALUE_CHARS} characters), e.g. \"application/json\" or "
                           "\"en-GB,en;q=0.8\"", argument="headers")
        out[name.strip().lower()] = value
    return out


def request(url: str, method: str = "GET", headers: dict | None = None, *, client: WebClient | None = None,
            max_body_bytes: int = MAX_BODY_BYTES) -> dict:
    try:
        if not isinstance(method, str) or method.strip().upper() != "GET":
            raise WebError("web_method_not_allowed", f"the method {method!r} is not allowed: request sends GET only",
                           method=str(method))
        send = check_headers(headers)

        def classify(f: Fetched) -> ReadPlan | None:
            empty = f.status in (204, 304) or f.headers.get("content-length") == "0"
            if not (is_text_type(f.mime) or (empty and not f.mime)):
                raise WebError("web_not_text", f"{f.final_url} answered {f.status} with a body of type "
                               f"{f.mime or 'none stated'}: request returns text and JSON only",
                               status=f.status, content_type=media_type(f.content_type), url=f.url,
                               final_url=f.final_url)
            # Read up to the transport cap, so an over-cap body still gets its bytes and sha256.
            return ReadPlan(client.limits.text_bytes)

        with call_client(client) as client:
            fetched = client.request(url, classify=classify, headers=send, robots=True)
        cap = min(client.limits.text_bytes, max(max_body_bytes, 0))
        size, digest = len(fetched.body), fetched.sha256
        if size > cap:
            raise WebError("web_body_too_large", f"the body of {fetched.final_url} is {size:,} bytes, more than one "
                           f"result holds ({cap:,}); no body is returned", bytes=size, sha256=digest,
                           status=fetched.status, url=fetched.url, final_url=fetched.final_url)
        return {
            **header_values({"url": fetched.url, "final_url": fetched.final_url, "content_type": fetched.content_type}),
            "status": fetched.status,
            "body": decode_text(fetched.body, fetched.charset),
            "bytes": size,
            "sha256": digest,
        }
    except WebError as e:
        return e.as_dict()
