"""A deciding hook that raises refuses the exchange (mitmproxy would log the
exception and forward the request unchecked)."""

import asyncio

from mitmproxy.test import tflow

from sluice.failsafe import fail_closed
from sluice.outcome import outcome_of


class Broken:
    @fail_closed()
    async def requestheaders(self, flow):
        raise RuntimeError("a bug in a check")

    @fail_closed()
    def request(self, flow):
        raise KeyError("another")


def test_an_exception_in_a_check_refuses_with_internal_error():
    flow = tflow.tflow()
    asyncio.run(Broken().requestheaders(flow))
    assert flow.response is not None and flow.response.status_code == 500
    assert flow.response.headers["Sluice-Reason"] == "internal_error"
    assert outcome_of(flow).decision.refusal.reason == "internal_error"


def test_sync_hooks_fail_closed_too():
    flow = tflow.tflow()
    Broken().request(flow)
    assert flow.response.headers["Sluice-Reason"] == "internal_error"


def test_refusal_bodies_survive_lone_surrogates():
    from sluice.refusals import refusal_response
    from sluice.policy.reasons import Reason, Refusal

    response = refusal_response(Refusal(Reason.METHOD_NOT_ALLOWED, "the method GET\udcd1 is not allowed"))
    assert b"GET\\udcd1" in response.content
