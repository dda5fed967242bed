"""Operator docs that must not drift (issue 10, item 14): the Docker example
mounts a directory (a single-file bind mount never sees a rename-over save,
which silently defeats hot reload); block_global is explained where the docs
say to listen on 0.0.0.0; trusting a private upstream CA is documented.
The behaviour behind them is tested in tests/integration (test_block_global,
test_policy_live's rename-over reloads) and in mitmproxy's own tlsconfig."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCKER_DOCS = ["README.md", "docs/policy.md", "Dockerfile"]

# `-v SRC:/etc/sluice/policy.yaml` (or --volume / --mount ... target=...policy.yaml): one file.
SINGLE_FILE_MOUNT = re.compile(r"(-v|--volume)[ =]\S*:/etc/sluice/[^\s:]+\.ya?ml|target=/etc/sluice/[^\s,]+\.ya?ml")
DIRECTORY_MOUNT = re.compile(r"-v \"?\$PWD/\w+:/etc/sluice(:ro)?\"?")


def text(name: str) -> str:
    return (ROOT / name).read_text(encoding="utf-8")


def paragraphs(doc: str) -> list[str]:
    """Bullets and paragraphs (blank-line or bullet separated)."""
    return [p for p in re.split(r"\n\s*\n|\n(?=- )", doc) if p.strip()]


def test_no_doc_mounts_the_policy_as_a_single_file():
    for name in DOCKER_DOCS:
        found = SINGLE_FILE_MOUNT.findall(text(name))
        assert not found, f"{name} mounts a single policy file: {found}"


def test_the_docker_examples_mount_a_directory_and_say_why():
    for name in ("README.md", "Dockerfile"):
        doc = text(name)
        assert DIRECTORY_MOUNT.search(doc), f"{name} has no directory mount of /etc/sluice"
        assert "rename-over save" in doc, f"{name} does not say why a directory"


def test_block_global_is_explained_next_to_listening_on_all_addresses():
    readme = text("README.md")
    where = [p for p in paragraphs(readme) if "0.0.0.0:8080" in p]
    assert where, "README no longer says to listen on 0.0.0.0:8080"
    assert all("block_global" in p and "--set block_global=false" in p for p in where), where


def test_a_private_upstream_ca_is_documented():
    for name in ("README.md", "docs/policy.md"):
        doc = text(name)
        assert "ssl_verify_upstream_trusted_ca=" in doc, name
        assert re.search(r"\*\*replaces\*\*", doc), f"{name} does not say the option replaces the public bundle"
        assert "certifi.where()" in doc, f"{name} does not show how to keep the public CAs too"
