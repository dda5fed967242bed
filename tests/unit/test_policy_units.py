"""The one byte-count formatter (policy/units.py) every message uses."""

import pytest

from sluice.policy.units import size_text


@pytest.mark.parametrize("n,text", [(0, "0 bytes"), (1, "1 bytes"), (1500, "1500 bytes"), (1024, "1 KiB"),
                                    (64 * 1024, "64 KiB"), (2**20, "1 MiB"), (3 * 2**20 + 1024, "3073 KiB"),
                                    (2**30, "1 GiB"), (5 * 2**30, "5 GiB")])
def test_the_largest_unit_that_divides_exactly(n, text):
    assert size_text(n) == text
