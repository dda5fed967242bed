"""Every example in the docs is checked (issue 10, item 3).

Every ```yaml block in README.md, docs/policy.md and config/examples/README.md
is one of:

- a policy (no marker): it must load with the real loader and pass
  `sluice policy check --strict` (no problem, no warning);
- marked `<!-- invalid example: TEXT -->` on the line before it: a deliberate
  counter-example, which must fail to load with a problem containing TEXT;
- marked `<!-- cases for PATH -->`: a cases file, which must pass
  `sluice policy test PATH` as written.

A block that is none of these fails the test, naming FILE:LINE. The
`sluice policy ...` command lines in the docs' shell blocks are run too: they
must name files that exist and end as a policy command ends (0, or 3 for a
refusal from `explain`), never with a usage error.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from sluice.policy.loader import PolicyInvalid, compose_checked, load_policy_text
from sluice.policy_cli import policy_warnings

ROOT = Path(__file__).resolve().parents[2]
DOCS = ["README.md", "docs/policy.md", "config/examples/README.md"]

_FENCE = re.compile(r"^```([A-Za-z0-9_-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*(invalid example|cases for)\s*:?\s*(.*?)\s*-->\s*$")


@dataclass(frozen=True)
class Block:
    doc: str
    line: int  # of the first line inside the fence
    lang: str
    text: str
    marker: tuple[str, str] | None  # ("invalid example", TEXT) or ("cases for", PATH)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(doc: str) -> list[Block]:
    return blocks_of(ROOT / doc, doc)


def blocks_of(path: Path, doc: str) -> list[Block]:
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1).lower(), i + 1
        end = start
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        assert end < len(lines), f"{doc}:{i + 1}: a code block that never ends"
        previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
        marker = _MARKER.match(previous.strip())
        out.append(Block(doc, start + 1, lang, "\n".join(lines[start:end]) + "\n",
                         (marker.group(1), marker.group(2)) if marker else None))
        i = end + 1
    return out


YAML_BLOCKS = [b for doc in DOCS for b in blocks(doc) if b.lang in ("yaml", "yml")]


@dataclass
class Result:
    code: int
    out: str
    err: str


@pytest.fixture
def cli(capsys):
    """The `sluice` command's main(), in-process: cli(["policy", "check", path]) -> Result."""
    from sluice.cli import main

    def run(args: list) -> Result:
        capsys.readouterr()
        try:
            code = main([str(a) for a in args])
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 2
        captured = capsys.readouterr()
        return Result(code, captured.out, captured.err)

    return run


def _in_doc(block: Block, problem) -> str:
    """A problem in a block, at its line in the document."""
    return f"{block.doc}:{block.line + problem.line - 1}:{problem.col}: {problem.message}"


def _secret(path: str) -> str:
    return "a long random secret"  # password_file contents live outside the docs


def test_the_docs_have_yaml_examples_and_the_main_one_is_a_policy():
    assert len(YAML_BLOCKS) >= 3
    main = next(b for b in YAML_BLOCKS if b.doc == "docs/policy.md")
    assert main.marker is None and main.text.startswith("version: 1")


@pytest.mark.parametrize("block", YAML_BLOCKS, ids=[b.where for b in YAML_BLOCKS])
def test_every_yaml_block_is_checked(block, cli, tmp_path):
    check_block(block, cli, tmp_path)


def check_block(block: Block, cli, tmp_path: Path) -> None:
    if block.marker is None:
        try:
            policy = load_policy_text(block.text, block.where, read_secret=_secret)
        except PolicyInvalid as e:
            found = "\n".join(_in_doc(block, p) for p in e.problems)
            pytest.fail(f"{block.where}: this YAML block is not a valid policy (mark a deliberate counter-example "
                        f"with <!-- invalid example: ... -->):\n{found}", pytrace=False)
        warnings = policy_warnings(policy, compose_checked(block.text, block.where))
        assert not warnings, "\n".join(_in_doc(block, w) for w in warnings)
        return
    kind, arg = block.marker
    if kind == "invalid example":
        assert arg, f"{block.where}: say which problem the counter-example shows: <!-- invalid example: TEXT -->"
        with pytest.raises(PolicyInvalid) as info:
            load_policy_text(block.text, block.where, read_secret=_secret)
        assert any(arg in p.message for p in info.value.problems), (arg, info.value.problems)
        return
    policy = ROOT / arg
    assert policy.is_file(), f"{block.where}: <!-- cases for {arg} -->: no such policy"
    cases = tmp_path / "cases.yaml"
    cases.write_text(block.text, encoding="utf-8")
    result = cli(["policy", "test", policy, cases])
    assert result.code == 0, f"{block.where}:\n{result.out}{result.err}"


@pytest.mark.parametrize(
    ("text", "marker", "fails"),
    [
        ("version: 1\nallow: [example.org]\n", None, False),
        ('version: 1\nallow: ["**"]\n', None, True),  # docs/policy.md's main example before issue 10
        ("version: 1\nmethods: [GET, CONNECT]\n", None, True),  # loads, but claims methods inside tunnels
        ('version: 1\nallow: ["*.internal"]\n', ("invalid example", "can never match"), False),
        ('version: 1\nallow: ["*.internal"]\n', ("invalid example", "is not a port"), True),
        ("version: 1\n", ("invalid example", "anything"), True),  # a counter-example that loads
        ("- url: https://example.com/\n  expect: refuse\n", ("cases for", "config/examples/coding-agent.yaml"), False),
        ("- url: https://example.com/\n  expect: allow\n", ("cases for", "config/examples/coding-agent.yaml"), True),
        ("- url: http://8.8.8.8/\n  expect: allow\n", ("cases for", "config/examples/nope.yaml"), True),
    ],
)
def test_the_block_checker_can_fail(text, marker, fails, cli, tmp_path):
    block = Block("doc.md", 1, "yaml", text, marker)
    if not fails:
        check_block(block, cli, tmp_path)
        return
    with pytest.raises((AssertionError, pytest.fail.Exception)):
        check_block(block, cli, tmp_path)


def test_markers_are_read_from_the_line_before_the_fence(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("text\n\n<!-- invalid example: can never match -->\n```yaml\nversion: 1\n```\n\n```yml\na: 1\n```\n"
                   "```sh\nsluice policy check x.yaml\n```\n", encoding="utf-8")
    found = blocks_of(doc, "doc.md")
    assert [(b.line, b.lang, b.marker) for b in found] == [
        (5, "yaml", ("invalid example", "can never match")), (9, "yml", None), (12, "sh", None)]


def _policy_commands() -> list[tuple[str, list[str]]]:
    found = []
    for doc in DOCS:
        for block in blocks(doc):
            if block.lang not in ("sh", "bash", "console"):
                continue
            for offset, line in enumerate(block.text.splitlines()):
                command = line.split("#", 1)[0].strip()
                if not command.startswith("sluice policy ") or "hash-password" in command:
                    continue
                words = shlex.split(command)[1:]
                # Templates (FILE, [--client NAME], CASES.yaml) are syntax, not runnable examples.
                if any(w.isupper() or w.startswith("[") or "CASES" in w for w in words):
                    continue
                if words[1] == "explain" and "--resolve" not in words:
                    continue  # would resolve names live; tests never send a DNS query
                found.append((f"{doc}:{block.line + offset}", words))
    return found


POLICY_COMMANDS = _policy_commands()


def test_the_docs_show_runnable_policy_commands():
    assert len(POLICY_COMMANDS) >= 5


@pytest.mark.parametrize(("where", "words"), POLICY_COMMANDS, ids=[w for w, _ in POLICY_COMMANDS])
def test_every_policy_command_in_the_docs_runs(where, words, cli, monkeypatch, tmp_path):
    # `policy init` writes its file: in a scratch directory, never into the checkout.
    monkeypatch.chdir(tmp_path if words[1] == "init" else ROOT)
    result = cli(words)
    allowed = (0, 3) if words[1] == "explain" else (0,)
    assert result.code in allowed, f"{where}: sluice {' '.join(words)}\n{result.out}{result.err}"
