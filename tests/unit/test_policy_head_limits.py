"""The request-head limits in the policy: defaults, units, top level only."""

from __future__ import annotations

import pytest

from sluice.policy.loader import PolicyInvalid, load_policy_text
from sluice.policy.model import Limits


def load(text: str):
    return load_policy_text("version: 1\n" + text, "p.yaml")


def test_defaults():
    limits = load("").rules.limits
    assert (limits.max_header_bytes, limits.max_header_count, limits.header_timeout) == (64 * 1024, 100, 10.0)
    assert limits == Limits()


def test_top_level_values_and_units():
    limits = load("limits:\n  max_header_bytes: 16KiB\n  max_header_count: 40\n  header_timeout: 2500ms\n").rules.limits
    assert (limits.max_header_bytes, limits.max_header_count, limits.header_timeout) == (16 * 1024, 40, 2.5)


def test_profiles_inherit_the_top_level_head_limits():
    policy = load("limits:\n  max_header_count: 40\nclients:\n  - name: ci\n    sources: ['10.0.0.0/8']\n")
    assert policy.clients[0].rules.limits.max_header_count == 40


@pytest.mark.parametrize("value, message", [
    ("1.5", "is not a count"),
    ("'100'", "is not a count"),
    ("10KiB", "is not a count"),
    ("true", "is not a count"),
    ("0", "greater than zero"),
    ("-3", "greater than zero"),
])
def test_bad_header_counts(value, message):
    with pytest.raises(PolicyInvalid) as e:
        load(f"limits:\n  max_header_count: {value}\n")
    assert "limits.max_header_count" in str(e.value) and message in str(e.value)


@pytest.mark.parametrize("key, value", [("max_header_bytes", "lots"), ("max_header_bytes", "0"),
                                        ("header_timeout", "0s"), ("header_timeout", "soon")])
def test_bad_sizes_and_durations(key, value):
    with pytest.raises(PolicyInvalid) as e:
        load(f"limits:\n  {key}: {value}\n")
    assert f"limits.{key}" in str(e.value)


@pytest.mark.parametrize("key, value",
                         [("max_header_bytes", "8KiB"), ("max_header_count", "10"), ("header_timeout", "5s")])
def test_a_profile_may_not_set_head_limits(key, value):
    text = (f"clients:\n  - name: ci\n    sources: ['10.0.0.0/8']\n    limits:\n      idle_timeout: 5s\n      {key}: "
            f"{value}\n")
    with pytest.raises(PolicyInvalid) as e:
        load(text)
    assert len(e.value.problems) == 1
    problem = e.value.problems[0]
    assert (problem.line, problem.col) == (7, 7)
    assert f"limits.{key} is global" in problem.message
    assert "top-level `limits`" in problem.message and "'ci'" in problem.message


def test_a_profile_may_still_set_other_limits():
    policy = load("clients:\n  - name: ci\n    sources: ['10.0.0.0/8']\n    limits:\n      idle_timeout: 5s\n")
    assert policy.clients[0].rules.limits.idle_timeout == 5.0
