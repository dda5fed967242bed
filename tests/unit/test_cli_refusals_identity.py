"""The real `sluice` command on issue 10's policy changes (items 6, 8, 8b):
`version: "1"` names the type, unsalted sha256: hashes are refused,
`sluice policy hash-password` makes what the loader takes, and the
`refusal_note` key is checked and ends `explain`'s message."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SLUICE = str(Path(sys.executable).parent / "sluice")


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([SLUICE, *args], input=stdin, capture_output=True, text=True, timeout=60)


@pytest.fixture
def policy(tmp_path):
    def write(text: str) -> str:
        path = tmp_path / "policy.yaml"
        path.write_text(text)
        return str(path)
    return write


def test_a_quoted_version_is_named_as_a_string(policy):
    path = policy('version: "1"\nallow: [a.example]\n')
    result = run("policy", "check", path)
    assert result.returncode == 1, result
    assert f"{path}:1:10: version is the string '1'; write the number 1 without quotes (`version: 1`)" in result.stderr
    assert "this Sluice reads version 1" not in result.stderr + result.stdout


def test_an_unsalted_sha256_hash_is_refused_and_hash_password_is_accepted(policy):
    sha = "sha256:" + "ab" * 32
    path = policy(f'version: 1\nclients:\n  - name: a\n    users: {{bot: {{password_hash: "{sha}"}}}}\n')
    result = run("policy", "check", path)
    assert result.returncode == 1, result
    assert "password_hash for 'bot': unsalted 'sha256:' hashes are not accepted" in result.stderr
    assert "sluice policy hash-password" in result.stderr

    made = run("policy", "hash-password", stdin="correct horse\n")
    assert made.returncode == 0 and made.stdout.startswith("pbkdf2_sha256$200000$"), made
    path = policy(f'version: 1\nclients:\n  - name: a\n    users: {{bot: {{password_hash: '
                  f'"{made.stdout.strip()}"}}}}\n')
    assert run("policy", "check", path).returncode == 0


def test_refusal_note_is_checked(policy):
    assert run("policy", "check", policy('version: 1\nrefusal_note: "Ask #egress for access."\n')).returncode == 0
    bad = run("policy", "check",
              policy('version: 1\nclients:\n  - {name: a, sources: [10.0.0.0/8], refusal_note: [x]}\n'))
    assert bad.returncode == 1 and "refusal_note must be text" in bad.stderr, bad


def test_explain_shows_the_profiles_note_at_the_end_of_the_message(policy):
    path = policy("""\
version: 1
allow: [a.example]
refusal_note: "Top: ask #egress."
clients:
  - {name: ci, sources: [10.0.0.0/8], refusal_note: "CI: open an EGRESS ticket."}
""")
    result = run("policy", "explain", "--policy", path, "--client", "ci", "--resolve", "b.example=8.8.8.8",
                 "http://b.example/")
    assert result.returncode == 3, result
    out = json.loads(result.stdout)
    assert out["reason"] == "host_not_allowed" and out["message"].endswith(" CI: open an EGRESS ticket."), out
    assert "Top:" not in out["message"] and "EGRESS" not in out["detail"]
