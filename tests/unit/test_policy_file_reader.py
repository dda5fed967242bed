"""The policy file is read safely: regular files only (a FIFO or a device is
refused without blocking), within the size limit, and no message ever echoes
more than a short, escaped snippet of what the file holds."""

from __future__ import annotations

import os
import re
import threading

import pytest

from sluice.policy import loader
from sluice.policy.loader import MAX_POLICY_BYTES, PolicyInvalid, load_policy_file, load_policy_text, read_regular_file

# A shadow-style line: what a policy path pointed at /etc/shadow would hold.
HASH = "Yp1" + "AbCdEfGhIjKlMnOpQrStUvWxYz0123456789./" * 2 + "zZ"
SHADOW_LINES = [f"root:$6$saltsalt${HASH}:19000:0:99999:7:::", "daemon:*:19000:0:99999:7:::"]
SHADOW = "".join(line + "\n" for line in SHADOW_LINES)


def secret_fragments() -> list[str]:
    """Text that must never appear in any output: the hash (or any 24-char
    piece of it), each line, each line without its trailing colons."""
    pieces = [HASH[i:i + 24] for i in range(0, len(HASH) - 24)]
    return pieces + SHADOW_LINES + [line.rstrip(":") for line in SHADOW_LINES] + ["saltsalt"]


def assert_no_secret(text: str) -> None:
    for fragment in secret_fragments():
        assert fragment not in text, f"{fragment!r} leaked into: {text}"


def problems_of(path) -> list:
    """load_policy_file(path)'s problems, run in a thread so a regression that
    blocks (opening a FIFO) fails the test instead of hanging the suite."""
    out: list = []

    def run() -> None:
        try:
            load_policy_file(path)
            out.append([])
        except PolicyInvalid as e:
            out.append(e.problems)

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(60)  # a hang guard, not a speed check
    assert not worker.is_alive(), f"reading {path} blocked"
    return out[0]


@pytest.mark.parametrize("via_symlink", [False, True])
def test_a_fifo_is_refused_without_blocking(tmp_path, via_symlink):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    path = fifo
    if via_symlink:
        path = tmp_path / "policy.yaml"
        path.symlink_to(fifo)
    (problem,) = problems_of(path)
    assert (problem.file, problem.line, problem.col) == (str(path), 1, 1)
    assert problem.message == ("cannot read the policy: it is a FIFO, not a regular file (symlinks followed); refusing "
                               "to read it")


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom", "/dev/null"])
def test_a_character_device_is_refused(tmp_path, device):
    path = tmp_path / "policy.yaml"
    path.symlink_to(device)
    (problem,) = problems_of(path)
    assert problem.message == ("cannot read the policy: it is a character device, not a regular file (symlinks "
                               "followed); refusing to read it")
    (problem,) = problems_of(device)
    assert "it is a character device, not a regular file" in problem.message


def test_a_directory_is_refused(tmp_path):
    (problem,) = problems_of(tmp_path)
    assert problem.message.startswith("cannot read the policy: it is a directory, not a regular file")


def test_an_oversized_file_is_refused_without_reading_it(tmp_path, monkeypatch):
    path = tmp_path / "big.yaml"
    with open(path, "wb") as f:
        f.truncate(MAX_POLICY_BYTES + 1)  # sparse: costs no disk
    reads: list[int] = []
    real_read = os.read
    monkeypatch.setattr(loader.os, "read", lambda fd, n: reads.append(n) or real_read(fd, n))
    (problem,) = problems_of(path)
    assert problem.message == (
        f"cannot read the policy: it is {MAX_POLICY_BYTES + 1} bytes, over the 4 MiB limit; refusing to read it")
    assert reads == []


def test_a_file_growing_past_the_limit_is_caught_by_reading_at_most_limit_plus_one(tmp_path, monkeypatch):
    path = tmp_path / "grows.yaml"
    path.write_bytes(b"x" * 1000)
    real_fstat = os.fstat

    def stale_fstat(fd):  # fstat saw the file before it grew
        st = real_fstat(fd)
        return os.stat_result((st.st_mode, st.st_ino, st.st_dev, st.st_nlink, st.st_uid, st.st_gid, 10,
                               st.st_atime, st.st_mtime, st.st_ctime))

    read_total: list[int] = []
    real_read = os.read

    def counting_read(fd, n):
        data = real_read(fd, n)
        read_total.append(len(data))
        return data

    monkeypatch.setattr(loader.os, "fstat", stale_fstat)
    monkeypatch.setattr(loader.os, "read", counting_read)
    with pytest.raises(loader.FileRefused, match="grew past the 100 bytes limit"):
        read_regular_file(path, 100)
    assert sum(read_total) == 101


def test_a_regular_file_and_a_symlink_to_one_still_load(tmp_path):
    real = tmp_path / "real.yaml"
    real.write_text("version: 1\nallow: [example.com]\n")
    link = tmp_path / "policy.yaml"
    link.symlink_to(real)
    assert load_policy_file(link).rules.allow.match_name("example.com")
    assert read_regular_file(link, 100) == real.read_bytes()


def test_a_password_file_that_is_a_fifo_is_a_problem_not_a_hang(tmp_path):
    os.mkfifo(tmp_path / "pw")
    path = tmp_path / "policy.yaml"
    path.write_text("version: 1\nclients:\n  - name: ci\n    users:\n      alice: {password_file: pw}\n")
    (problem,) = problems_of(path)
    assert (problem.line, problem.col) == (5, 30)
    assert problem.message == ("password_file for 'alice': cannot read 'pw': it is a FIFO, not a regular file "
                               "(symlinks followed); refusing to read it")


def test_cli_check_and_test_refuse_a_fifo(cli, write, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    result = cli(["policy", "check", tmp_path / "fifo"])
    assert result.code == 1
    assert result.err.startswith(f"{tmp_path / 'fifo'}:1:1: cannot read the policy: it is a FIFO, not a regular file")
    policy = write("p.yaml", "version: 1\nallow: [example.com]\n")
    result = cli(["policy", "test", policy, tmp_path / "fifo"])
    assert result.code == 1
    assert f"{tmp_path / 'fifo'}:1:1: cannot read the cases file: it is a FIFO, not a regular file" in result.err
    result = cli(["policy", "explain", "--policy", "/dev/zero", "https://example.com/"])
    assert result.code == 1 and "/dev/zero:1:1: cannot read the policy: it is a character device" in result.err


def test_a_shadow_file_is_never_echoed(cli, write):
    path = write("policy.yaml", SHADOW)
    result = cli(["policy", "check", path])
    assert result.code == 1
    assert_no_secret(result.out + result.err)
    # ...while still saying what is wrong, and where.
    assert (f"{path}:1:1: unknown key of 116 characters starting 'root' in the policy "
            "(not shown; is this a policy file?)") in result.err
    assert f"{path}:2:1: unknown key of 26 characters starting 'daemon' in the policy" in result.err
    with pytest.raises(PolicyInvalid) as info:
        load_policy_file(path)
    assert_no_secret(str(info.value))


def test_plausible_unknown_keys_are_still_quoted_with_a_hint():
    with pytest.raises(PolicyInvalid) as info:
        load_policy_text("version: 1\nalow: [a.example]\nlimits: {idle_timout: 5s}\n'al low': 1\n")
    messages = [p.message for p in info.value.problems]
    assert "unknown key 'alow' in the policy; did you mean 'allow'?" in messages
    assert any(m.startswith("unknown key 'idle_timout' in limits; did you mean 'idle_timeout'?") for m in messages)
    assert "unknown key of 6 characters starting 'al' in the policy; did you mean 'allow'?" in messages


def one_message(text: str) -> str:
    with pytest.raises(PolicyInvalid) as info:
        load_policy_text(text)
    return "\n".join(p.message for p in info.value.problems)


def quoted_parts(message: str) -> list[str]:
    return re.findall(r"'(?:[^'\\]|\\.)*'|\"(?:[^\"\\]|\\.)*\"", message)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('version: 1\naction: "\\e[31m' + "A" * 200 + '"\n', "action must be 'enforce' or 'report', not '\\x1b[31mAAA"),
        ("version: 1\nallow: [\"https://" + "C" * 300 + "\"]\n", "in allow: 'https://CCC"),
        ("version: 1\nallow: *" + "B" * 300 + "\n", "YAML syntax: found undefined alias 'BBB"),
        ("version: 1\nlimits: {connect_timeout: " + "D" * 300 + "}\n", "limits.connect_timeout: 'DDD"),
        ("version: 1\nmethods: [\"G\\u202eET" + "E" * 300 + "\"]\n", "methods: 'G\\u202eETEEE"),
        ("version: 1\nclients:\n  - name: ci\n    users: {\"F:" + "F" * 300 + "\": {password_hash: x}}\n",
         "'F:FFF"),
        ("version: 1\nprivate_networks: [\"" + "9" * 300 + "/8\"]\n", "private_networks: '999"),
        ("version: 1\ndns: {nameservers: [\"" + "n" * 300 + "\"]}\n", "dns.nameservers: 'nnn"),
    ],
)
def test_messages_quote_only_a_short_escaped_snippet(text, says):
    message = one_message(text)
    assert says in message, message
    assert message.isprintable() or all(line.isprintable() for line in message.splitlines())
    for quoted in quoted_parts(message):
        assert len(quoted) <= loader.SNIPPET_CHARS + 3, (quoted, message)  # quotes and the "…"
    assert "…" in message
    for letter in "ABCDEFxn":
        assert letter * (loader.SNIPPET_CHARS + 1) not in message


def test_a_huge_integer_is_described_not_printed():
    message = one_message("version: " + "7" * 5000 + "\n")
    assert message.startswith("'" + "7" * 40 + "…' is not a valid int (Exceeds the limit")
    assert "7" * 41 not in message and len(message) < 300
    assert loader._q(int("7" * 4000) * 10**1000) == "(a number too long to show)"


def test_short_values_are_quoted_exactly_as_before():
    assert loader._q("enforc") == "'enforc'"
    assert loader._q(12) == "12"
    assert loader._q("it's") == '"it\'s"'
    assert loader._q("x" * 100) == "'" + "x" * 40 + "…'"
    escaped = loader._q("\x00" * 50)
    assert len(escaped) <= 43 and "\x00" not in escaped and escaped.endswith("…'")
