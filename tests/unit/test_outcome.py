"""One exchange outcome (addons/outcome.py): which refusal wins, what the
client is answered and what the audit line says, for every order of the
ways addons change it, as plain data. The expectation is written as the
precedence the docstring states (by which operations happened), not as the
methods' steps."""

from __future__ import annotations

import itertools
import pathlib
import re

import pytest

from sluice.outcome import Outcome
from sluice.policy.decide import Decision
from sluice.policy.reasons import Reason, Refusal

GATE = Refusal(Reason.HOST_DENIED, "the gate refused it")
QUOTA = Refusal(Reason.RATE_LIMITED, "over the request rate")
REPORTED = Refusal(Reason.TOO_MANY_TUNNELS, "over max_tunnels, in report mode")
CAP1 = Refusal(Reason.RESPONSE_TOO_LARGE, "the first cap")
CAP2 = Refusal(Reason.REQUEST_TIMEOUT, "a later cap")
FAILED = Refusal(Reason.INTERNAL_ERROR, "Sluice failed")
MITM = Refusal(Reason.BAD_REQUEST, "mitmproxy answered 400")

OPERATIONS = {
    "refuse": lambda v: v.refuse(QUOTA),
    "report": lambda v: v.refuse(REPORTED, report=True),
    "cut1": lambda v: v.cut(CAP1),
    "cut2": lambda v: v.cut(CAP2),
    "fail": lambda v: v.fail(FAILED),
    "answered": lambda v: v.answered(MITM, 400),
    "sent502": lambda v: v.sent(502),
}


def _expected(refused: bool, ops: tuple[str, ...], started: bool, response_status: int | None):
    """The precedence, stated by which operations happened (and, for two
    cuts, which came first)."""
    if "answered" in ops:  # 1. mitmproxy's own answer: nothing else stands
        decision_refusal, would, cap, wire = MITM, None, None, 400
    else:
        decision_refusal = GATE if refused else (QUOTA if "refuse" in ops else None)  # 3. the first refusal
        would = REPORTED if "report" in ops else None
        cuts = [op for op in ops if op in ("cut1", "cut2")]
        cap = FAILED if "fail" in ops else ({"cut1": CAP1, "cut2": CAP2}[cuts[0]] if cuts else None)  # 2., 4.
        wire = 502 if "sent502" in ops else None
    audit = decision_refusal or cap
    answer = cap or decision_refusal
    status = wire or (audit.status if cap is not None and not started else response_status)
    return audit, answer, would, status


SEQUENCES = [ops for n in range(4) for ops in itertools.permutations(OPERATIONS, n)]


@pytest.mark.parametrize("refused", [False, True], ids=["allowed", "refused"])
@pytest.mark.parametrize("started", [False, True], ids=["before-response", "response-started"])
def test_every_order_of_refusals_caps_and_answers_follows_one_precedence(refused, started):
    assert len(SEQUENCES) == 1 + 7 + 42 + 210
    for ops in SEQUENCES:
        outcome = Outcome("a.example", 443, Decision(not refused, None, GATE if refused else None, port=443), None,
                          None)
        outcome.response_started = started
        for op in ops:
            OPERATIONS[op](outcome)
        for response_status in (200, None):
            got = (outcome.refusal, outcome.answer, outcome.decision.would_refuse, outcome.status(response_status))
            assert got == _expected(refused, ops, started, response_status), ops
        assert outcome.decision.allowed is (outcome.decision.refusal is None), ops


def test_the_methods_say_whether_they_took():
    outcome = Outcome("a.example", 80, Decision(True, None, None, port=80), None, None)
    assert outcome.cut(CAP1) is True and outcome.cut(CAP2) is False and outcome.cap is CAP1
    assert outcome.refuse(REPORTED, report=True) is False and outcome.decision.allowed
    assert outcome.refuse(QUOTA) is True and outcome.refuse(GATE) is False and outcome.decision.refusal is QUOTA
    outcome.answered(MITM, None)  # answered by the flow's response, sent after the hook
    assert outcome.status(403) == 403 and outcome.refusal is MITM and outcome.cap is None
    assert outcome.cut(CAP2) is False and outcome.refuse(QUOTA) is False


ADDONS = pathlib.Path(__file__).resolve().parents[2] / "addons"
WRITES = re.compile(r"\.(cap|decision|wire_status|mitmproxy_answered)\s*=(?!=)")


def test_no_addon_writes_the_outcome_but_through_its_methods():
    offenders = [f"{path.name}:{n}: {line.strip()}"
                 for path in sorted(ADDONS.glob("*.py")) if path.name != "outcome.py"
                 for n, line in enumerate(path.read_text().splitlines(), 1) if WRITES.search(line)]
    assert offenders == []
