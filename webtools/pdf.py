"""A PDF's text, page by page, in a killable worker process (pypdf).

fetch hands a PDF to a model whole, and also as text a model without PDF
input can read: each page's text after a marker line `--- page 3 of 12 ---`.

PDF parsers have had endless loops, recursion and decompression bombs, and
every PDF here is hostile, so the parsing runs in a child process
(`python -m sluice.webtools.pdf`) with its own limits, never in the caller:
- time: the call's deadline (whatever the fetch left of it); at the
  deadline the child is killed, and the pages it finished are kept;
- CPU: RLIMIT_CPU of the same number of seconds (plus one);
- memory: RLIMIT_AS of WORKER_MEMORY bytes (a parse that needs more ends
  with MemoryError, or is killed, and the pages finished are kept);
- pages: at most `max_pages` (MAX_PAGES) are read;
- characters: at most `max_chars` of text with the markers (the caller's
  read cap), cut at the cap.
pypdf's own bounds hold inside the child too (75 MB of output per stream
filter, 10,000-element content-stream arrays, its recursion guards).

The child reports as it goes, one JSON object a line: first the page count
and title, then each page's text, then how it ended; so a kill loses only the
page being read. `incomplete` says why the text stops early: page_cap,
char_cap, deadline, memory, encrypted (a password is needed) or unreadable
(pypdf could not parse it). A PDF whose pages were all read and gave no text
and paints images is `scanned`: images of pages with no text layer.

pypdf rather than pdfminer.six: on PDFs built with reportlab (a 3-page and a
60-page article, a two-column layout, a 40-row table) both extracted every
word in order (word F1 1.000), and pypdf took 51-365 ms where pdfminer.six
took 343-3,927 ms (10.8x on the 60-page article); pypdf is pure Python with no
required dependencies.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass

MAX_PAGES = 2_000
WORKER = ["-m", "sluice.webtools.pdf"]  # the child's arguments to the interpreter (then the limits)
WORKER_MEMORY = 768 * 1024 * 1024
# What a page's text keeps: C0 controls other than tab and newline go (a PDF's
# strings are bytes in any font encoding; NULs and escapes are noise to a reader).
_DROP = {c: None for c in range(32) if c not in (9, 10)} | {0x7F: None}
_INCOMPLETE = ("page_cap", "char_cap", "deadline", "memory", "encrypted", "unreadable")


@dataclass(frozen=True)
class PdfText:
    text: str  # every page read, each after its `--- page N of M ---` marker; "" when none had text
    pages: int | None  # the PDF's page count (None: not even that could be read)
    pages_read: int  # pages whose text is in `text`
    title: str | None  # the document information's /Title (raw: the caller sanitises it)
    incomplete: str | None  # why the text stops before the end (one of _INCOMPLETE), or None
    pages_failed: int = 0  # pages pypdf could not parse (their text is empty)
    image_pages: int = 0  # pages with no text that paint an image

    @property
    def scanned(self) -> bool:
        """Every page was read, none had a text layer, and pages paint images: a scan."""
        return (bool(self.pages) and self.pages_read == self.pages and self.incomplete is None
                and not self.pages_failed and not self.text and self.image_pages > 0)


def marker(page: int, pages: int) -> str:
    return f"--- page {page} of {pages} ---"


def extract(data: bytes, *, seconds: float, max_chars: int, max_pages: int = MAX_PAGES,
            memory: int = WORKER_MEMORY) -> PdfText:
    """The text of `data`, read by a child process within `seconds` (wall and CPU).
    Never raises for what the PDF holds; every limit ends in `incomplete`."""
    if seconds <= 0:
        return PdfText("", None, 0, None, "deadline")
    command = [sys.executable, *WORKER, str(max_pages), str(max(max_chars, 0)), str(memory),
               str(int(seconds) + 1)]
    started = time.monotonic()
    try:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                 close_fds=True, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except OSError:
        return PdfText("", None, 0, None, "unreadable")
    timed_out = False
    try:
        out, _ = child.communicate(data, timeout=max(seconds - (time.monotonic() - started), 0.01))
    except subprocess.TimeoutExpired:
        timed_out = True
        child.kill()
        out, _ = child.communicate()  # what it wrote before the kill is kept
    return _assemble(out, timed_out=timed_out, returncode=child.returncode, max_chars=max_chars)


def _assemble(out: bytes, *, timed_out: bool, returncode: int | None, max_chars: int) -> PdfText:
    pages, title, incomplete, finished = None, None, None, False
    texts: list[str] = []
    failed = images = 0
    for line in out.splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            break  # the line the kill cut short
        if not isinstance(item, dict):
            break
        if "pages" in item and pages is None:
            pages = item["pages"] if isinstance(item["pages"], int) and item["pages"] >= 0 else None
            title = item.get("title") if isinstance(item.get("title"), str) else None
        elif "page" in item and isinstance(item.get("text"), str):
            texts.append(item["text"])
            failed += item.get("failed") is True
            images += item.get("image") is True
        elif item.get("end") in _INCOMPLETE:
            incomplete = item["end"]
        elif item.get("end") == "done":
            finished = True
    if incomplete is None and not finished:
        incomplete = "deadline" if timed_out else ("memory" if returncode not in (0, None) else "unreadable")
    if pages is None:
        return PdfText("", None, 0, title, incomplete or "unreadable")
    if texts and failed == len(texts) and incomplete is None:
        incomplete = "unreadable"  # no page could be parsed: not a scan, a PDF pypdf cannot read
    parts = [f"{marker(i, pages)}\n{t}" for i, t in enumerate(texts, 1)]
    text = "\n\n".join(parts) if any(t.strip() for t in texts) else ""
    if len(text) > max_chars:  # the child keeps to the cap; this holds it whatever the child wrote
        text, incomplete = text[:max_chars], "char_cap"
    return PdfText(text, pages, len(texts), title, incomplete, failed, images)


# ---------------------------------------------------------------- the child

def _emit(item: dict) -> None:
    sys.stdout.write(json.dumps(item, ensure_ascii=False) + "\n")
    sys.stdout.flush()


def _limit(memory: int, cpu_seconds: int) -> None:
    import resource

    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_seconds, cpu_seconds))
    try:  # Linux: die with the parent (PR_SET_PDEATHSIG, SIGKILL), as the HTML worker does
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # elsewhere RLIMIT_CPU still ends it


def _paints_image(page) -> bool:
    """Whether the page's resources hold an image XObject (a scan's page is one)."""
    try:
        xobjects = page["/Resources"]["/XObject"]
        return any(xobjects[name].get("/Subtype") == "/Image" for name in list(xobjects)[:64])
    except Exception:  # noqa: BLE001 - no resources, or broken ones: no image
        return False


def _child(max_pages: int, max_chars: int) -> None:
    import io
    import logging

    logging.disable(logging.CRITICAL)  # pypdf warns about every oddity; stderr is discarded anyway
    data = sys.stdin.buffer.read()
    try:
        import pypdf

        reader = pypdf.PdfReader(io.BytesIO(data), strict=False)
        if reader.is_encrypted:
            try:
                opened = reader.decrypt("")  # many "encrypted" PDFs have an empty user password
            except Exception:  # noqa: BLE001 - an unsupported cipher is a PDF we cannot read
                opened = 0
            if not opened:
                _emit({"end": "encrypted"})
                return
        count = len(reader.pages)
        try:
            title = reader.metadata.title if reader.metadata is not None else None
        except Exception:  # noqa: BLE001 - a broken info dictionary costs the title only
            title = None
        _emit({"pages": count, "title": str(title)[:4096] if title else None})
        room = max_chars
        for index in range(min(count, max_pages)):
            try:
                text = reader.pages[index].extract_text() or ""
            except MemoryError:
                raise
            except Exception:  # noqa: BLE001 - one broken page (a bomb, a loop pypdf caught) is that page's text only
                _emit({"page": index + 1, "text": "", "failed": True})
                continue
            text = text.translate(_DROP).strip()
            if not text and _paints_image(reader.pages[index]):
                _emit({"page": index + 1, "text": "", "image": True})
                continue
            room -= len(marker(index + 1, count)) + 3  # the marker and the blank line between pages
            if len(text) > room:
                _emit({"page": index + 1, "text": text[:max(room, 0)]})
                _emit({"end": "char_cap"})
                return
            room -= len(text)
            _emit({"page": index + 1, "text": text})
        _emit({"end": "page_cap" if count > max_pages else "done"})
    except MemoryError:
        _emit({"end": "memory"})
    except Exception:  # noqa: BLE001 - not a PDF pypdf can read: the caller says so
        _emit({"end": "unreadable"})


if __name__ == "__main__":
    _pages, _chars, _memory, _cpu = (int(a) for a in sys.argv[1:5])
    _limit(_memory, _cpu)
    _child(_pages, _chars)
