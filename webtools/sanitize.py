"""The one sanitiser for web-derived values Sluice prints in its own voice (pure).

Everything outside an envelope is Sluice's text: header lines (title, URL,
status, content type, paging note), error messages and search result fields.
A value that came from the web (a title, a URL, a Location header, a
provider's message, a content type) goes through `clean` before it lands in a
result dict, so a page cannot start a new line that looks like Sluice's, hide
text with bidi or zero-width characters, or fill a result with a megabyte of
title; and `sha256`/the dict cover exactly what is returned.

- `clean(value, limit)`: control characters (C0, DEL, C1), line and paragraph
  separators (U+2028/9, U+0085) become spaces; bidi controls (U+202A–E,
  U+2066–9, U+200E/F, U+061C), zero-width characters (U+200B–D, U+2060–4,
  U+FEFF, U+180E) and other invisible format characters are removed;
  whitespace runs become one space; the result is cut to `limit`
  characters with "…".
- `media_type(content_type)`: the `type/subtype` of a Content-Type, lower
  case, only when both are RFC 9110 tokens; else "".
- `for_terminal(text)`: for the CLI: terminal escape sequences (CSI, OSC,
  DCS, ...), C0 controls other than tab and newline, DEL and C1 controls
  removed.
- `json_for_terminal(text)`: JSON text (json.dumps with ensure_ascii=False)
  with the characters it leaves as they are that a terminal acts on or
  hides (DEL, C1, separators, bidi, zero-width) written as \\uXXXX escapes:
  the same JSON value.
"""

from __future__ import annotations

import re

TITLE_CHARS = 300
URL_CHARS = 2048
MESSAGE_CHARS = 4096
FIELD_CHARS = 2048

# Becomes a space: C0, DEL, C1 (U+0085 NEL among them), U+2028/U+2029.
_BREAKING = "\x00-\x1f\x7f-\x9f\u2028\u2029"
# Removed: bidi embeddings/overrides/isolates and marks, zero-width and other
# invisible format characters (soft hyphen, word joiner, invisible operators,
# BOM, Mongolian vowel separator, interlinear annotation, tag characters).
_INVISIBLE = ("\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f"
              "\ufeff\ufff9-\ufffb\U000e0000-\U000e007f")
_BREAKING_RE = re.compile(f"[{_BREAKING}]")
_INVISIBLE_RE = re.compile(f"[{_INVISIBLE}]")
_SPACES_RE = re.compile(r"\s+")
_UNSAFE_RE = re.compile(f"[{_BREAKING}{_INVISIBLE}]")


def clean(value, limit: int | None = None) -> str:
    """`value` as one line of visible text, at most `limit` characters."""
    if value is None:
        return ""
    if not isinstance(value, str):
        value = str(value)
    if limit is not None and len(value) > 4 * limit + 64:
        value = value[: 4 * limit + 64]  # bound the work: what follows only shrinks it
    text = _INVISIBLE_RE.sub("", _BREAKING_RE.sub(" ", value))
    text = _SPACES_RE.sub(" ", text).strip()
    if limit is not None and len(text) > limit:
        text = text[: max(limit - 1, 0)].rstrip() + "…"
    return text


def clean_optional(value, limit: int | None = None) -> str | None:
    """`clean`, keeping None (and an empty result) as None."""
    if value is None:
        return None
    return clean(value, limit) or None


def is_clean(value: str) -> bool:
    """True when `value` has no character `clean` would change in place
    (controls, separators, bidi or zero-width characters)."""
    return not _UNSAFE_RE.search(value)


_TOKEN = r"[!#$%&'*+.^_`|~0-9A-Za-z-]+"
_MEDIA_TYPE_RE = re.compile(f"({_TOKEN})/({_TOKEN})")


def media_type(content_type) -> str:
    """`type/subtype` of a Content-Type value (parameters dropped), or ""
    when it is not two RFC 9110 tokens."""
    if not isinstance(content_type, str):
        return ""
    head = content_type.split(";", 1)[0].strip()
    if len(head) > 255:
        return ""
    m = _MEDIA_TYPE_RE.fullmatch(head)
    return head.lower() if m else ""


# ESC followed by: CSI (ESC [ … final byte), OSC/DCS/SOS/PM/APC (ESC ] … BEL
# or ST, at most 4096 characters: an unterminated one loses only its
# introducer, its payload stays as plain text), or any one other character
# (two-byte sequences such as ESC c). The 8-bit forms (C1) go with the
# controls below.
_ESCAPES_RE = re.compile(
    r"\x1b\[[0-?]{0,64}[ -/]{0,8}[@-~]?"
    r"|\x1b[\]PX^_][^\x07\x1b]{0,4096}(?:\x07|\x1b\\)"
    r"|\x1b.?"
    r"|\x9b[0-?]{0,64}[ -/]{0,8}[@-~]?",
    re.DOTALL,
)
_TERMINAL_CONTROLS_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def for_terminal(text: str) -> str:
    """`text` with no terminal escape sequence or control character left
    (tab and newline kept)."""
    return _TERMINAL_CONTROLS_RE.sub("", _ESCAPES_RE.sub("", text))


# Inside JSON these can only be in strings, where \uXXXX is the same value.
_JSON_UNSAFE_RE = re.compile(f"[\x7f-\x9f\u2028\u2029{_INVISIBLE}]")


def json_for_terminal(text: str) -> str:
    """JSON text with DEL, C1, separators, bidi and zero-width characters escaped."""
    def escape(m: re.Match) -> str:
        return "".join(f"\\u{u:04x}" for u in _utf16(m.group()))
    return _JSON_UNSAFE_RE.sub(escape, text)


def _utf16(ch: str) -> list[int]:
    code = ord(ch)
    if code < 0x10000:
        return [code]
    code -= 0x10000
    return [0xD800 + (code >> 10), 0xDC00 + (code & 0x3FF)]
