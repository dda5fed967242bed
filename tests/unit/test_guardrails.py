"""Options that would undo Sluice's guarantees stop it at start-up with a clear message."""

import pytest

from sluice.cli import main


@pytest.mark.parametrize(
    "args,words",
    [
        (["--set", "emudhra=true"], "compromised key"),
        (["--set", "ssl_insecure=true"], "upstream certificate"),
        (["--set", "validate_inbound_headers=false"], "smuggling"),
        (["--mode", "upstream:http://10.0.0.9:3128"], "resolves names again"),
        (["--mode", "dns@5353"], "DNS server mode"),
        (["--set", "no_such_option=1"], "no_such_option"),
    ],
)
def test_unsafe_or_unknown_options_refuse_to_start(args, words, capsys, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\n")
    code = main(["proxy", "--policy", str(policy), "--listen", "127.0.0.1:0", "--ca-dir", str(tmp_path / "ca"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert words in err and "Traceback" not in err


def test_a_bad_policy_refuses_to_start_with_its_problems(capsys, tmp_path):
    policy = tmp_path / "p.yaml"
    policy.write_text("version: 1\nports: [80, 'x']\n")
    code = main(["proxy", "--policy", str(policy), "--listen", "127.0.0.1:0", "--ca-dir", str(tmp_path / "ca")])
    err = capsys.readouterr().err
    assert code == 2 and f"{policy}:2:" in err and "Traceback" not in err
