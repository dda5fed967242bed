"""The HTTP/2 limits in the policy (limits.h2_stream_buffer_bytes,
limits.h2_max_concurrent_streams): defaults, units, top level only."""

from __future__ import annotations

import pytest

from sluice.policy.loader import PolicyInvalid, load_policy_text


def load(text: str):
    return load_policy_text("version: 1\n" + text, "p.yaml")


def test_defaults():
    limits = load("").rules.limits
    assert (limits.h2_stream_buffer_bytes, limits.h2_max_concurrent_streams) == (1024 * 1024, 100)


def test_top_level_values_and_units():
    limits = load("limits:\n  h2_stream_buffer_bytes: 256KiB\n  h2_max_concurrent_streams: 16\n").rules.limits
    assert (limits.h2_stream_buffer_bytes, limits.h2_max_concurrent_streams) == (256 * 1024, 16)


@pytest.mark.parametrize("key, value, message", [
    ("h2_stream_buffer_bytes", "lots", "limits.h2_stream_buffer_bytes"),
    ("h2_stream_buffer_bytes", "0", "limits.h2_stream_buffer_bytes"),
    ("h2_max_concurrent_streams", "0", "greater than zero"),
    ("h2_max_concurrent_streams", "1.5", "is not a count"),
    ("h2_max_concurrent_streams", "4294967296", "more than HTTP/2 can announce"),
])
def test_bad_values(key, value, message):
    with pytest.raises(PolicyInvalid) as e:
        load(f"limits:\n  {key}: {value}\n")
    assert message in str(e.value)


@pytest.mark.parametrize("key, value", [("h2_stream_buffer_bytes", "2MiB"), ("h2_max_concurrent_streams", "10")])
def test_a_profile_may_not_set_them(key, value):
    text = f"clients:\n  - name: ci\n    sources: ['10.0.0.0/8']\n    limits:\n      {key}: {value}\n"
    with pytest.raises(PolicyInvalid) as e:
        load(text)
    assert len(e.value.problems) == 1
    message = e.value.problems[0].message
    assert f"limits.{key} is global" in message and "top-level `limits`" in message and "HTTP/2" in message
