"""addons/audit.py's line format without a proxy: the time field (formatted
once per second, then reused) and the JSON encoding (one encoder for every
line) give exactly what strftime and json.dumps give, at every boundary."""

from __future__ import annotations

import json
import time

import pytest

from sluice.addons import audit


def _expected(when: float) -> str:
    seconds, ms = divmod(round(when * 1000), 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(seconds)) + f".{ms:03d}Z"


@pytest.mark.parametrize("moments", [
    [0.0, 0.9994, 0.9995, 1.0, 1.0004],  # rounding carries into the next second
    [1764000000.123, 1764000000.9996, 1764000001.0, 1764000000.5],  # and back, out of order
    [1764000000.1, 1764086400.1, 1764000000.2],  # a day apart: the cached second is not reused
])
def test_rfc3339_matches_strftime_across_second_boundaries(moments):
    for when in moments:
        assert audit.rfc3339(when) == _expected(when)


def test_a_line_is_what_json_dumps_gives(capsys):
    log = audit.AuditLog()
    log.write(event="request", host="caf\u00e9.example", detail="lone \udcff surrogate", bytes_in=3, time="T")
    line = capsys.readouterr().out
    fields = {k: None for k in audit.FIELDS} | {"time": "T", "event": "request", "host": "caf\u00e9.example",
                                                "detail": "lone \udcff surrogate", "bytes_in": 3}
    assert line == json.dumps(fields, separators=(",", ":")) + "\n"
    assert line.isascii()
