"""Text a reader cannot see, found and dropped (for webtools._extract; pure, bounded).

Hidden text is a classic injection channel: words a person never sees, which a
model reading the page would. `drop_hidden(body)` removes them from a parsed
page in place and returns how many characters it removed (whitespace runs
counted as one). Hidden means:

- the `hidden` attribute, or `aria-hidden="true"`;
- `display: none`, `opacity: 0`, or `left`/`top` at or below -1000px (the
  element and everything in it);
- `visibility: hidden` (or `collapse`) and `font-size: 0` (the element's own
  text; both are inherited, and a descendant that sets `visibility: visible`
  or a non-zero absolute `font-size` is seen again, as in a browser);

set in a `style` attribute or in the page's own `<style>` elements (and in
their `@media all`/`@media screen` blocks). The `<body>` itself is not judged:
a page hidden whole until a script shows it (anti-flicker) is not hidden text. Stylesheet selectors are the
simple ones: type, `*`, class, id, attribute (`[a]`, `=`, `~=`, `|=`, `^=`,
`$=`, `*=`), compound, descendant and child; a selector with anything else
(pseudo-classes, `+`, `~`) is ignored. Later rules win, `!important` over
normal, a `style` attribute over the stylesheets (specificity is not
weighed). External stylesheets are not fetched, so what they hide is kept.

Bounded, and closed when a bound is hit: stylesheets over _MAX_CSS_CHARS or
with more than _MAX_SELECTORS hiding selectors are not read at all and the
page's whole body counts as hidden; selector matching is one top-down pass
(matches of a selector's leading parts are carried down as counts, never
searched for up the tree) charged against _MATCH_BUDGET, and a page that
exhausts the budget has the rest of its elements treated as hidden. Padding a
stylesheet, then, can hide a page's text from the model, never show hidden
text to it.
"""

from __future__ import annotations

import re

_MAX_CSS_CHARS = 4 * 1024 * 1024  # twice the default text cap: a page's own stylesheets fit
_MAX_SELECTORS = 20_000  # selectors that set a visibility property (only those are kept; ~0.6 s to read)
_MAX_COMPOUNDS = 8  # a longer selector is matched on its last 8 parts (a superset of what it matches)
_MATCH_BUDGET = 400_000  # candidate checks: ~0.5 s; a real page needs a few 10,000s
_OFFSCREEN_PX = -1000.0

_NOT_SHOWN = frozenset({"script", "style", "noscript", "template", "head", "title", "meta", "link", "base"})
_PROPERTIES = frozenset({"display", "visibility", "opacity", "font-size", "left", "top"})

# --- declarations --------------------------------------------------------------

_NUMBER = r"[+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?"
_LENGTH = re.compile(rf"^({_NUMBER})([a-z%]*)$")
_PX_PER = {"px": 1.0, "": 1.0, "pt": 4 / 3, "pc": 16.0, "in": 96.0, "cm": 96 / 2.54, "mm": 96 / 25.4,
           "q": 96 / 101.6, "em": 16.0, "rem": 16.0, "vw": 12.8, "vh": 8.0}  # a 1280x800 window
_RELATIVE_FONT = frozenset({"em", "%", "ex", "ch", "cap", "ic", "lh"})
_FONT_KEYWORDS = frozenset({"xx-small", "x-small", "small", "medium", "large", "x-large", "xx-large",
                            "xxx-large"})  # absolute sizes; smaller/larger are relative to the parent's


def _length(value: str) -> tuple[float, str] | None:
    m = _LENGTH.match(value)
    if not m:
        return None
    try:
        return float(m.group(1)), m.group(2)
    except ValueError:
        return None


def _effect(prop: str, value: str):
    """What one declaration does to visibility: a value per property (see _Style), or None to ignore it."""
    if prop == "display":
        return value == "none"
    if prop == "visibility":
        if value in ("hidden", "collapse"):
            return True
        return False if value == "visible" else None  # inherit/initial/unset: keep what is inherited
    if prop == "opacity":
        n = _length(value)
        return None if n is None else n[0] <= 0
    if prop == "font-size":
        if value in _FONT_KEYWORDS:
            return "set"  # a non-zero size: text is seen again
        if value in ("smaller", "larger", "inherit"):
            return "relative"
        n = _length(value)
        if n is None:
            return None
        number, unit = n
        if number <= 0:
            return "zero"
        return "relative" if unit in _RELATIVE_FONT else "set"
    if prop in ("left", "top"):
        n = _length(value)
        if n is None or n[1] not in _PX_PER:
            return False if value == "auto" else None
        return n[0] * _PX_PER[n[1]] <= _OFFSCREEN_PX
    return None


def _declarations(text: str) -> list[tuple[str, object, bool]]:
    """[(property, effect, important)] for the visibility properties in a declaration block."""
    out = []
    for decl in text.split(";"):
        prop, sep, value = decl.partition(":")
        if not sep:
            continue
        prop = prop.strip().lower()
        if prop not in _PROPERTIES:
            continue
        value = value.strip().lower()
        important = False
        if value.endswith("important"):
            head = value[: -len("important")].rstrip()
            if head.endswith("!"):
                important, value = True, head[:-1].rstrip()
        effect = _effect(prop, value)
        if effect is not None:
            out.append((prop, effect, important))
    return out


# --- selectors ---------------------------------------------------------------------

_IDENT = r"-?[_a-zA-Z\u00a0-\U0010ffff][\w\-\u00a0-\U0010ffff]*"
_SIMPLE = re.compile(
    rf"(?P<tag>{_IDENT}|\*)|#(?P<id>[\w\-\u00a0-\U0010ffff]+)|\.(?P<cls>{_IDENT})"
    rf"""|\[\s*(?P<attr>[\w\-:]+)\s*(?:(?P<op>[~|^$*]?=)\s*(?P<val>"[^"]*"|'[^']*'|[^\]\s]+)\s*)?(?:[iIsS]\s*)?\]"""
    r"|(?P<comb>\s*>\s*|\s+)")


class _Compound:
    __slots__ = ("tag", "id", "classes", "attrs", "key", "cost")

    def __init__(self):
        self.tag = None
        self.id = None
        self.classes: list[str] = []
        self.attrs: list[tuple[str, str | None, str]] = []
        self.key = "*"
        self.cost = 1  # what matching it once is charged against the budget

    def matches(self, el, classes: set) -> bool:
        if self.tag is not None and el.tag != self.tag:
            return False
        if self.id is not None and el.get("id") != self.id:
            return False
        for c in self.classes:
            if c not in classes:
                return False
        for name, op, want in self.attrs:
            got = el.get(name)
            if got is None:
                return False
            if op is None:
                continue
            if op == "=" and got != want:
                return False
            if op == "~=" and want not in got.split():
                return False
            if op == "|=" and not (got == want or got.startswith(want + "-")):
                return False
            if op == "^=" and not (want and got.startswith(want)):
                return False
            if op == "$=" and not (want and got.endswith(want)):
                return False
            if op == "*=" and not (want and want in got):
                return False
        return True


def _selector(text: str) -> tuple[list[_Compound], list[str]] | None:
    """(compounds, combinators between them) for a simple selector, None for anything else."""
    text = text.strip()
    compounds: list[_Compound] = []
    combs: list[str] = []
    current = None
    pos = 0
    while pos < len(text):
        m = _SIMPLE.match(text, pos)
        if not m or m.end() == pos:
            return None  # a pseudo-class, sibling combinator or something else not handled
        pos = m.end()
        if m.group("comb") is not None:
            if current is None:
                return None
            combs.append(">" if ">" in m.group("comb") else " ")
            current = None
            continue
        if current is None:
            current = _Compound()
            compounds.append(current)
        elif m.group("tag") is not None:
            return None  # a type selector after another part: not valid CSS
        if m.group("tag") is not None:
            if m.group("tag") != "*":
                current.tag = m.group("tag").lower()
        elif m.group("id") is not None:
            current.id = m.group("id")
        elif m.group("cls") is not None:
            current.classes.append(m.group("cls"))
        else:
            val = m.group("val")
            if val is not None and val[:1] in "\"'":
                val = val[1:-1]
            current.attrs.append((m.group("attr").lower(), m.group("op"), val))
    if current is None:
        return None  # empty, or ends with a combinator
    if len(compounds) > _MAX_COMPOUNDS:
        compounds, combs = compounds[-_MAX_COMPOUNDS:], combs[-(_MAX_COMPOUNDS - 1):]
    for c in compounds:
        c.classes = list(dict.fromkeys(c.classes))  # .x.x is .x
        c.key = ("#" + c.id) if c.id is not None else ("." + c.classes[0]) if c.classes else (c.tag or "*")
        c.cost = 1 + len(c.classes) + len(c.attrs)
    return compounds, combs


# --- stylesheets ---------------------------------------------------------------------

def _strip_comments(css: str) -> str:
    out = []
    pos = 0
    while True:
        start = css.find("/*", pos)
        if start < 0:
            out.append(css[pos:])
            return "".join(out)
        out.append(css[pos:start])
        end = css.find("*/", start + 2)
        if end < 0:
            return "".join(out)
        pos = end + 2


def _blocks(css: str, start: int, end: int, closes: dict[int, int]):
    """Top-level (prelude, body start, body end) between start and end."""
    pos = start
    while pos < end:
        open_ = css.find("{", pos, end)
        if open_ < 0:
            return
        close = closes.get(open_, end)
        prelude = css[pos:open_]
        semi = prelude.rfind(";")  # statements like @import url(x); before it
        yield prelude[semi + 1:].strip(), open_ + 1, close
        pos = close + 1


_MEDIA_SHOWN = re.compile(r"^@media\s+(?:only\s+)?(?:all|screen)(?:\s*,\s*(?:only\s+)?(?:all|screen))*\s*$", re.I)


class _Sheet:
    """The visibility rules of the page's own stylesheets, indexed by each selector part's key."""

    def __init__(self, css: str):
        self.rules: list[tuple[list[_Compound], list[str], list]] = []
        self.overflow = False  # more hiding selectors than _MAX_SELECTORS: not judged, so closed
        # Comments out; HTML comment markers (CDO/CDC) are whitespace to CSS.
        css = _strip_comments(css[:_MAX_CSS_CHARS]).replace("<!--", " ").replace("-->", " ")
        closes: dict[int, int] = {}
        stack = []
        for m in re.finditer(r"[{}]", css):
            if m.group() == "{":
                stack.append(m.start())
            elif stack:
                closes[stack.pop()] = m.start()
        self._read(css, 0, len(css), closes, depth=0)
        # key -> [(rule index, part index)]
        self.index: dict[str, list[tuple[int, int]]] = {}
        for r, (compounds, _combs, _decls) in enumerate(self.rules):
            for i, c in enumerate(compounds):
                self.index.setdefault(c.key, []).append((r, i))

    def _read(self, css: str, start: int, end: int, closes: dict[int, int], depth: int) -> None:
        for prelude, body_start, body_end in _blocks(css, start, end, closes):
            if self.overflow:
                return
            if prelude.startswith("@"):
                if depth < 4 and _MEDIA_SHOWN.match(prelude):
                    self._read(css, body_start, body_end, closes, depth + 1)
                continue
            body = css[body_start:body_end]
            inner = body.find("{")
            decls = _declarations(body if inner < 0 else body[:inner])
            if not decls:
                continue
            for text in prelude.split(","):
                if len(self.rules) >= _MAX_SELECTORS:
                    self.overflow = True
                    return
                parsed = _selector(text)
                if parsed is not None:
                    self.rules.append((parsed[0], parsed[1], decls))


def _sheet(body) -> _Sheet | None:
    root = body.getroottree().getroot()
    texts = []
    size = 0
    for style in root.iter("style"):
        media = (style.get("media") or "all").strip().lower()
        if media not in ("", "all", "screen") and not _MEDIA_SHOWN.match("@media " + media):
            continue
        text = style.text or ""
        texts.append(text)
        size += len(text)
        if size > _MAX_CSS_CHARS:
            return _OVERFLOW
    css = "\n".join(texts)
    if "{" not in css:
        return None
    sheet = _Sheet(css)
    if sheet.overflow:
        return _OVERFLOW
    return sheet if sheet.rules else None


_OVERFLOW = object()  # stylesheets past the bounds: everything in the body counts as hidden


# --- the pass ------------------------------------------------------------------------

class _Budget(Exception):
    pass


_INLINE: dict[str, list] = {}


def _inline(style: str) -> list:
    decls = _INLINE.get(style)
    if decls is None:
        decls = _declarations(style)
        if len(style) <= 256 and len(_INLINE) < 4096:
            _INLINE[style] = decls
    return decls


def _cascade(decls_in_order: list) -> dict:
    """property -> effect, by (important, position): later wins, !important over normal."""
    best: dict = {}
    for rank, (prop, effect, important) in decls_in_order:
        key = (important, rank)
        if prop not in best or key >= best[prop][0]:
            best[prop] = (key, effect)
    return {prop: effect for prop, (_key, effect) in best.items()}


def find_hidden(body) -> tuple[list, list]:
    """(elements hidden with everything in them, elements whose own text is hidden)."""
    sheet = _sheet(body)
    if sheet is _OVERFLOW:
        return list(body), [body]
    if sheet is None and not body.xpath("boolean(descendant-or-self::*[@style or @hidden or @aria-hidden])"):
        return [], []  # nothing can hide anything (the common case, one C-level search)
    gone: list = []
    muted: list = []
    budget = _MATCH_BUDGET
    counts: dict[tuple[int, int], int] = {}
    inline_rank = 1 << 40
    # stack entries: (element, parent's states, inherited visibility-hidden, inherited font-size zero)
    stack = [(body, frozenset(), False, False, None)]
    exhausted = False
    while stack:
        el, parent_states, vis_hidden, fs_zero, leaving = stack.pop()
        if leaving is not None:  # leaving el: its partial matches stop applying
            for state in leaving:
                counts[state] -= 1
            continue
        tag = el.tag
        if not isinstance(tag, str):
            continue
        if exhausted:
            gone.append(el)
            continue
        if el is not body and (el.get("hidden") is not None
                               or (el.get("aria-hidden") or "").strip().lower() == "true"):
            gone.append(el)
            continue
        tag = tag.lower()
        states: set = set()
        matched: list = []
        if sheet is not None:
            cls_attr = el.get("class")
            classes = set(cls_attr.split()) if cls_attr else set()
            keys = [tag, "*"]
            el_id = el.get("id")
            if el_id is not None:
                keys.append("#" + el_id)
            keys.extend("." + c for c in classes)
            budget -= len(keys)
            for key in keys:
                candidates = sheet.index.get(key, ())
                budget -= len(candidates)
                if budget < 0:
                    break
                for r, i in candidates:
                    compounds, combs, decls = sheet.rules[r]
                    budget -= compounds[i].cost
                    if not compounds[i].matches(el, classes):
                        continue
                    if i > 0:
                        prev = (r, i - 1)
                        if combs[i - 1] == ">":
                            if prev not in parent_states:
                                continue
                        elif not counts.get(prev):
                            continue
                    if i == len(compounds) - 1:
                        matched.append(r)
                    else:
                        states.add((r, i))
            if budget < 0:
                exhausted = True
                gone.append(el)
                continue
        decls = [(r, d) for r in sorted(matched) for d in sheet.rules[r][2]] if matched else []
        style = el.get("style")
        if style:
            decls.extend((inline_rank, d) for d in _inline(style))
        # A hidden <body> is the anti-flicker pattern (hidden until a script
        # shows the page): the whole page, not text hidden inside it.
        effects = _cascade(decls) if decls and el is not body else {}
        if effects.get("display") is True or effects.get("opacity") is True \
                or effects.get("left") is True or effects.get("top") is True:
            gone.append(el)
            continue
        if "visibility" in effects:
            vis_hidden = effects["visibility"]
        fs = effects.get("font-size")
        if fs == "zero":
            fs_zero = True
        elif fs == "set":
            fs_zero = False
        if vis_hidden or fs_zero:
            muted.append(el)
        if states:
            for state in states:
                counts[state] = counts.get(state, 0) + 1
            stack.append((el, None, False, False, states))
        child_states = frozenset(states)
        for child in reversed(el):
            stack.append((child, child_states, vis_hidden, fs_zero, None))
    return gone, muted


_WS = re.compile(r"\s+")


def _chars(text: str | None) -> int:
    return len(_WS.sub(" ", text).strip()) if text else 0


def _subtree_chars(el) -> int:
    """Characters of text a reader would see in `el` were it shown (not its tail)."""
    from lxml import etree

    n = 0
    skipping = None  # the script, style, ... element whose content is not text
    for event, node in etree.iterwalk(el, events=("start", "end")):
        if event == "start":
            if skipping is None:
                if isinstance(node.tag, str) and node.tag.lower() in _NOT_SHOWN:
                    skipping = node
                else:
                    n += _chars(node.text)
            continue
        if skipping is node:
            skipping = None
        if skipping is None and node is not el:
            n += _chars(node.tail)
    return n


def drop_hidden(body) -> int:
    """Remove what a reader cannot see from `body` (in place); the characters removed."""
    gone, muted = find_hidden(body)
    removed = 0
    for el in muted:  # own text only: children are judged on their own
        removed += _chars(el.text)
        el.text = None
        for child in el:
            removed += _chars(child.tail)
            child.tail = None
    for el in gone:
        parent = el.getparent()
        if parent is None:  # the body itself: keep the element, drop its content
            removed += _subtree_chars(el)
            el.text = None
            for child in list(el):
                el.remove(child)
            continue
        removed += _subtree_chars(el)
        tail = el.tail
        prev = el.getprevious()
        if tail:
            if prev is not None:
                prev.tail = (prev.tail or "") + tail
            else:
                parent.text = (parent.text or "") + tail
        parent.remove(el)
    return removed
