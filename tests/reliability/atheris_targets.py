"""Coverage-guided fuzz targets for atheris (libFuzzer), run by
test_rel_fuzz.py::test_atheris in a subprocess (libFuzzer exits the process
when it is done):

    python atheris_targets.py loader|hosts CORPUS_DIR -runs=N -max_total_time=S ...

loader: arbitrary bytes -> policy.loader.load_policy_text returns a Policy or
        raises PolicyInvalid with problems the loader itself found (not its
        catch-all safety net); anything else is a crash.
hosts:  arbitrary host text and port -> policy.decide.check_request returns a
        Decision, never raises; an allowed IP literal is always public, and
        an allowed name always still needs DNS.
Pure functions only: nothing here opens a socket.
"""

from __future__ import annotations

import sys
from pathlib import Path

import atheris

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

with atheris.instrument_imports(include=["policy", "yaml"]):
    from sluice.policy.decide import Destination, check_request
    from sluice.policy.hosts import IPHost, NameHost
    from sluice.policy.loader import PolicyInvalid, load_policy_text
    from sluice.policy.model import Policy, Rules
    from sluice.policy.ranges import classify


# The loader's safety net turns an unexpected exception into this problem: a
# gap in validation, reported here as a crash.
SAFETY_NET = "the policy could not be read ("


def loader(data: bytes) -> None:
    text = data.decode("utf-8", "replace")
    try:
        result = load_policy_text(text, "fuzz.yaml")
    except PolicyInvalid as e:
        if not e.problems:
            raise AssertionError("PolicyInvalid without a problem") from None
        gaps = [p for p in e.problems if p.message.startswith(SAFETY_NET)]
        if gaps:
            raise AssertionError(f"validation gap: {gaps[0]}") from None
        return
    if not isinstance(result, Policy):
        raise AssertionError(f"load_policy_text returned {type(result)}")


RULES = Rules()


def hosts(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    port = fdp.PickValueInList([80, 443, 8080, 0, 65536, -1])
    host = fdp.ConsumeUnicodeNoSurrogates(fdp.remaining_bytes())
    decision = check_request(RULES, Destination(host=host, port=port, scheme="http", method="GET"))
    if not decision.allowed:
        if decision.refusal is None:
            raise AssertionError(f"refused without a refusal: {host!r}")
        return
    if isinstance(decision.host, IPHost):
        if classify(decision.host.address) is not None:
            raise AssertionError(f"{host!r} was allowed as the non-public address {decision.host.address}")
    elif isinstance(decision.host, NameHost):
        if not decision.needs_dns:
            raise AssertionError(f"the name {host!r} was allowed without a lookup")
    else:
        raise AssertionError(f"allowed without a host: {host!r} -> {decision}")


def main() -> None:
    target = {"loader": loader, "hosts": hosts}[sys.argv[1]]
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
