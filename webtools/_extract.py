"""Main-content extraction for webtools.convert: lxml pre-reduction, trafilatura, own fallback.

Chosen by measurement (bench/extraction.py, README "Web tools: extraction
quality and speed"). The steps:

1. parse with libxml2's HTML parser (comments and processing instructions
   dropped, no network, nesting limit lifted; every pass below is iterative;
   a tag keeps at most _MAX_ATTRIBUTES attributes, as libxml2's duplicate
   check is quadratic);
2. drop text a reader cannot see (webtools._hidden, counted), what is never
   content (scripts, styles, templates, form controls, frames, SVG), then
   page chrome by structure only (nav,
   aside, footer, page-level header, navigation/banner/... roles) and consent
   banners; resolve links against the page; carry <pre> blocks out as
   placeholders (fenced by us, blank lines and language kept);
3. trafilatura extracts the main content of that reduced tree as markdown;
4. when it finds next to nothing, Sluice's own reducer runs on a fresh parse:
   full chrome removal by class/id, readability-style block scoring with a
   link-density discount, sibling gathering, link-list pruning, html2text;
5. a page with more than _EXTRACT_MAX_CHARS of text, or more elements (or
   total depth) than trafilatura handles in linear time, skips extraction (it
   is mostly content, and extraction would cost several times html2text).

Links are resolved by Sluice only (_resolve_links), within bounds: a target
or <base href> over MAX_URL_CHARS is dropped, and resolution adds at most the
page's own length; the markdown is then cut at the caller's bound.
"""

from __future__ import annotations

import re
import secrets
from urllib.parse import urljoin

import html2text
from lxml import etree
from lxml import html as lxml_html

from sluice.webtools import _hidden

# --- parsing ---------------------------------------------------------------

_XML_DECL = re.compile(r"^\s*<\?xml[^>]*>", re.IGNORECASE)
_WS = re.compile(r"\s+")
_BAD_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffe\uffff]")


# libxml2 checks each attribute of a tag against all the ones before it
# (quadratic: one tag of 40,000 attributes took 47 s through the pipeline), so
# a tag with more than _MAX_ATTRIBUTES keeps its first ones plus any of the
# attributes that decide visibility, links and structure. The tokenizer is one
# left-to-right pass of possessive patterns (no backtracking): linear.
_MAX_ATTRIBUTES = 128
_ATTRIBUTE = (r"""[\t\n\f\r /]*+([^\t\n\f\r />][^\t\n\f\r />=]*+)"""
              r"""(?:[\t\n\f\r ]*+=[\t\n\f\r ]*+(?:"[^"]*+"|'[^']*+'|[^\t\n\f\r >]++))?+""")
_TAG_NAME = re.compile(r"<[A-Za-z][^\t\n\f\r />]*+")
_START_TAG = re.compile(_TAG_NAME.pattern + r"(?:" + _ATTRIBUTE + r")*+")
_ONE_ATTRIBUTE = re.compile(_ATTRIBUTE)
_KEPT_ATTRIBUTES = frozenset({"hidden", "aria-hidden", "style", "class", "id", "href", "src", "role", "type",
                              "charset", "content", "http-equiv", "media", "itemprop"})


def _cap_attributes(m: re.Match) -> str:
    tag = m.group(0)
    if len(tag) <= 2 * _MAX_ATTRIBUTES:  # too short to hold more attributes than the cap
        return tag
    name_end = _TAG_NAME.match(tag).end()
    attrs = list(_ONE_ATTRIBUTE.finditer(tag, name_end))
    if len(attrs) <= _MAX_ATTRIBUTES:
        return tag
    seen = set()
    kept = []
    for i, a in enumerate(attrs):
        name = a.group(1).lower()
        if name in seen:
            continue  # a repeated attribute is ignored by the parser anyway
        if i < _MAX_ATTRIBUTES or name in _KEPT_ATTRIBUTES:
            seen.add(name)
            kept.append(a.group(0))
    return tag[:name_end] + "".join(kept)


def _parse(text: str):
    """An lxml HtmlElement root, or None when there is nothing to parse."""
    text = _BAD_CHARS.sub(" ", _XML_DECL.sub("", text, count=1))
    text = _START_TAG.sub(_cap_attributes, text)
    if not text.strip():
        return None
    # huge_tree lifts libxml2's nesting limit (256), past which it drops the rest
    # of the document; every pass here is iterative, and trafilatura's recursion
    # failing on a very deep tree falls back to them.
    parser = lxml_html.HTMLParser(encoding="utf-8", remove_comments=True, remove_pis=True,
                                  no_network=True, recover=True, default_doctype=False, huge_tree=True)
    try:
        root = lxml_html.document_fromstring(text.encode("utf-8", "replace"), parser=parser)
    except (etree.ParserError, etree.XMLSyntaxError, ValueError):
        return None
    return root


def _collapse(s: str) -> str:
    return _WS.sub(" ", s).strip()


# The title as produced (result dicts cut it further, webtools.sanitize).
_TITLE_MAX_CHARS = 4096


def _title(root) -> str | None:
    for el in root.iter("title"):
        t = _collapse(el.text_content()[: 4 * _TITLE_MAX_CHARS])[:_TITLE_MAX_CHARS]
        if t:
            return t
    return None


# --- cleaning --------------------------------------------------------------

_NEVER_CONTENT = {"script", "style", "noscript", "template", "svg", "math", "canvas", "iframe", "frame",
                  "frameset", "object", "embed", "applet", "audio", "video", "source", "track", "map",
                  "input", "button", "select", "textarea", "option", "datalist", "dialog", "meta", "link",
                  "base", "head"}
_CHROME_TAGS = {"nav", "aside", "footer", "menu"}
_BLOCK = {"address", "article", "aside", "blockquote", "br", "dd", "details", "dialog", "div", "dl", "dt",
          "fieldset", "figcaption", "figure", "footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header",
          "hr", "li", "main", "nav", "ol", "p", "pre", "section", "summary", "table", "tbody", "td", "tfoot",
          "th", "thead", "tr", "ul", "caption", "center", "body", "html", "option", "title", "img"}

_NEGATIVE = re.compile(
    r"(?:^|[\s_\-])(?:cookie|consent|gdpr|banner|newsletter|subscri|signup|sign-up|social|share|sharing|"
    r"sidebar|side-bar|widget|related|recommend|promo|sponsor|advert|ads?|adsense|breadcrumbs?|menu|navbar|"
    r"nav|navigation|masthead|topbar|footer|foot|header-nav|skip|popup|modal|overlay|tooltip|toolbar|"
    r"pagination|pager|paywall|outbrain|taboola|disqus|comments?|comment-list|respond|reply-form|tags|"
    r"tag-list|byline-share|author-bio|print|login|shopping-cart|cart-drawer|hidden|visually-hidden|"
    r"sr-only|screen-reader)(?:$|[\s_\-])",
    re.IGNORECASE)
_POSITIVE = re.compile(
    r"(?:^|[\s_\-])(?:article|content|main|post|entry|story|text|body|blog|prose|markdown|documentation|"
    r"docs?|message|thread|product|description)(?:$|[\s_\-]|\w)", re.IGNORECASE)
_CHROME_ROLES = {"navigation", "banner", "contentinfo", "complementary", "search", "menu", "menubar",
                 "dialog", "alertdialog", "toolbar", "tablist"}
def _attrs(el) -> str:
    return f"{el.get('class') or ''} {el.get('id') or ''}"


def _drop(el) -> None:
    """Remove `el` and its subtree, keeping its tail text in place."""
    parent = el.getparent()
    if parent is None:
        return
    tail = el.tail
    if tail and tail.strip():
        prev = el.getprevious()
        if prev is not None:
            prev.tail = (prev.tail or "") + tail
        else:
            parent.text = (parent.text or "") + tail
    parent.remove(el)


def _protected(root) -> set:
    """Elements holding an <article>, <main> or role=main: never dropped as chrome by class name."""
    keep: set = set()
    for el in root.iter("article", "main"):
        _mark_up(el, keep)
    for el in root.xpath("//*[@role='main' or @itemprop='articleBody']"):
        _mark_up(el, keep)
    return keep


def _mark_up(el, keep: set) -> None:
    while el is not None and el not in keep:
        keep.add(el)
        el = el.getparent()


# The light pre-reduction before trafilatura: structural chrome and consent
# banners only. Dropping more by class name here measured worse (it removes
# content trafilatura would have kept); the full pattern is for the fallback.
_CONSENT = re.compile(r"(?:^|[\s_\-])(?:cookies?|consent|gdpr|cookiebanner|cc-banner)(?:$|[\s_\-])", re.IGNORECASE)


def _clean(root, *, chrome: bool, negative: re.Pattern = _NEGATIVE) -> None:
    """Drop never-content elements (and page chrome when `chrome`), top-down, in one pass."""
    keep = _protected(root) if chrome else set()
    stack = [root]
    while stack:
        el = stack.pop()
        for child in list(el):
            tag = child.tag
            if not isinstance(tag, str):  # comment, PI, entity
                _drop(child)
                continue
            tag = tag.lower()
            if tag in _NEVER_CONTENT:
                _drop(child)
                continue
            if tag == "img":
                src = child.get("src") or ""
                if src.startswith("data:") or not src:
                    _drop(child)
                continue
            if chrome and child not in keep:
                role = (child.get("role") or "").lower()
                if tag in _CHROME_TAGS or role in _CHROME_ROLES:
                    _drop(child)
                    continue
                if tag == "header" and el.tag in {"body", "html"}:
                    _drop(child)
                    continue
                attrs = _attrs(child)
                if attrs.strip() and negative.search(attrs) and not _POSITIVE.search(attrs) \
                        and tag not in {"body", "html", "pre", "code", "table", "tbody", "tr", "td", "th"}:
                    _drop(child)
                    continue
            stack.append(child)


# --- structure the extractors would lose ------------------------------------

_TEX = re.compile(r"tex", re.IGNORECASE)
_MATH_SKIP = {"annotation", "annotation-xml"}


def _math_text(math) -> str:
    """A formula as text: its `alttext`, else its TeX annotation (both as `$…$`), else its text content."""
    alt = _collapse(math.get("alttext") or "")
    if alt:
        return f"${alt}$"
    for ann in math.iter("annotation"):
        if _TEX.search(ann.get("encoding") or ""):
            tex = _collapse(ann.text_content())
            if tex:
                return f"${tex}$"
    parts = []
    skip = 0
    for event, el in etree.iterwalk(math, events=("start", "end")):
        inside = el is not math
        if event == "start":
            if skip or el.tag in _MATH_SKIP:
                skip += 1
            elif el.text:
                parts.append(el.text)
        else:
            if skip:
                skip -= 1
            if not skip and inside and el.tail:
                parts.append(el.tail)
    return _collapse("".join(parts))


def _replace_with_text(el, text: str) -> None:
    """Put `text` (then `el`'s tail) where `el` was, and remove `el`."""
    parent = el.getparent()
    if parent is None:
        return
    text = text + (el.tail or "")
    prev = el.getprevious()
    if prev is not None:
        prev.tail = (prev.tail or "") + text
    else:
        parent.text = (parent.text or "") + text
    parent.remove(el)


def _maths(body) -> None:
    """Each <math> becomes its text, inline (MathML is otherwise never content and vanished:
    "When , there are two solutions to and they are")."""
    for math in [el for el in body.iter("math") if el.getparent() is not None]:
        # An outer <math> already replaced takes its inner ones with it.
        if any(a.tag == "math" for a in math.iterancestors()):
            continue
        _replace_with_text(math, _math_text(math))


# A table is for layout, not data, when a cell holds what a data cell never
# does: a heading, an article or section, a nested table, two or more
# paragraphs or lists, or more text than a long sentence or two.
_LAYOUT_ROLES = {"presentation", "none"}
_CELL_BLOCKS = {"p", "div", "ul", "ol", "dl", "blockquote", "pre", "form"}
_CELL_SECTIONS = {"h1", "h2", "h3", "h4", "h5", "h6", "article", "section", "main", "table", "header"}
_CELL_MAX_TEXT = 800
_TABLE_PARTS = {"thead", "tbody", "tfoot", "tr", "td", "th", "caption", "colgroup", "col"}


def _layout_tables(body) -> None:
    """Tables used for layout are read as their content: the table, its rows and
    cells become plain blocks (a layout table flattened a whole article into one
    row). One pass, whatever the nesting: each element is charged to the cell of
    its nearest table, then the layout tables' own parts are renamed."""
    tables: list[dict] = []
    frames: list[tuple[dict | None, dict | None]] = []  # per open element: (its table, its cell)
    for event, el in etree.iterwalk(body, events=("start", "end")):
        if event == "end":
            frames.pop()
            if el.tail and frames and frames[-1][1] is not None:
                frames[-1][1]["text"] += len(el.tail.strip())
            continue
        tag = el.tag if isinstance(el.tag, str) else ""
        table, cell = frames[-1] if frames else (None, None)
        if tag == "table":
            if cell is not None:
                table["layout"] = True  # a table nested in a cell: the outer one is for layout
            rec = {"el": el, "layout": (el.get("role") or "").lower() in _LAYOUT_ROLES, "parts": [], "cells": []}
            tables.append(rec)
            frames.append((rec, None))
        elif table is not None and cell is None and tag in _TABLE_PARTS:
            table["parts"].append(el)
            if tag in {"td", "th"}:
                cell = {"blocks": 0, "text": len(el.text.strip()) if el.text else 0}
                table["cells"].append(cell)
            frames.append((table, cell))
        else:
            if cell is not None:
                if tag in _CELL_SECTIONS:
                    table["layout"] = True
                elif tag in _CELL_BLOCKS:
                    cell["blocks"] += 1
                if el.text:
                    cell["text"] += len(el.text.strip())
            frames.append((table, cell))
    for rec in tables:
        if not (rec["layout"] or any(c["blocks"] >= 2 or c["text"] > _CELL_MAX_TEXT for c in rec["cells"])):
            continue
        rec["el"].tag = "div"
        for part in rec["parts"]:
            part.tag = "div"
            for attr in ("colspan", "rowspan"):
                part.attrib.pop(attr, None)


def _prepare(body) -> None:
    """What trafilatura and html2text would lose or misread, made plain first (after
    hidden text is dropped, before never-content is)."""
    _maths(body)
    _layout_tables(body)


# --- scoring ---------------------------------------------------------------

_PARAGRAPHS = {"p", "pre", "blockquote", "td", "dd", "li", "h2", "h3", "h4"}
_CONTAINERS = {"div", "article", "section", "main", "td", "body", "blockquote", "ul", "ol", "table", "tbody",
               "form", "center", "span", "font", "dl", "header"}


def _measure(root) -> tuple[dict, dict]:
    """Per element: characters of text in its subtree, and of those inside links (one bottom-up pass)."""
    text_len: dict = {}
    link_len: dict = {}
    order = [el for el in root.iter() if isinstance(el.tag, str)]
    for el in reversed(order):  # descendants before ancestors
        n = len(el.text.strip()) if el.text else 0
        links = 0
        for child in el:
            if not isinstance(child.tag, str):
                continue
            n += text_len.get(child, 0)
            links += link_len.get(child, 0)
            if child.tail:
                n += len(child.tail.strip())
        if el.tag == "a":
            links = n
        text_len[el] = n
        link_len[el] = links
    return text_len, link_len


def _main_node(root, text_len: dict, link_len: dict):
    scores: dict = {}
    for el in root.iter(*_PARAGRAPHS):
        n = text_len.get(el, 0)
        if n < 25:
            continue
        if link_len.get(el, 0) > 0.6 * n:
            continue
        text = el.text_content() if n < 20000 else ""
        s = 1.0 + text.count(",") + text.count("，") + min(n // 100, 3)
        parent = el.getparent()
        depth = 0
        while parent is not None and depth < 3:
            scores[parent] = scores.get(parent, 0.0) + s / (1, 2, 3)[depth]
            parent = parent.getparent()
            depth += 1
    if not scores:
        return None
    best, best_score = None, 0.0
    for el, s in scores.items():
        n = text_len.get(el, 0) or 1
        density = link_len.get(el, 0) / n
        attrs = _attrs(el)
        if _POSITIVE.search(attrs):
            s *= 1.25
        if el.tag in {"article", "main"} or el.get("role") == "main" or el.get("itemprop") == "articleBody":
            s *= 1.5
        s *= 1.0 - min(density, 1.0)
        if s > best_score:
            best, best_score = el, s
    return best, best_score, scores


def _gather(best, best_score: float, scores: dict, text_len: dict, link_len: dict) -> list:
    """The best node plus siblings that belong with it (readability's sibling step)."""
    parent = best.getparent()
    if parent is None:
        return [best]
    threshold = max(10.0, best_score * 0.2)
    out = []
    for sib in parent:
        if not isinstance(sib.tag, str):
            continue
        if sib is best:
            out.append(sib)
            continue
        n = text_len.get(sib, 0)
        density = link_len.get(sib, 0) / n if n else 1.0
        if scores.get(sib, 0.0) * (1 - density) >= threshold:
            out.append(sib)
        elif sib.tag == "p" and ((n > 80 and density < 0.25)
                                 or (0 < n <= 80 and density == 0 and "." in (sib.text_content()))):
            out.append(sib)
        elif sib.tag in {"pre", "table", "ul", "ol", "h2", "h3", "h4", "blockquote", "figure"} and n and density < 0.3:
            out.append(sib)
    return out


def _prune(nodes: list, text_len: dict, link_len: dict) -> None:
    """Inside the chosen content: drop link lists and link-dense boxes (related links, tag clouds)."""
    for node in nodes:
        victims = []
        for el in node.iter("div", "ul", "ol", "section", "table", "dl", "p", "span"):
            n = text_len.get(el, 0)
            links = link_len.get(el, 0)
            if n == 0:
                if el.tag in {"div", "section", "span", "p"} and not len(el.xpath(".//img|.//table|.//pre")):
                    victims.append(el)
                continue
            if el.tag == "table" and links < 0.5 * n:
                continue
            if links > 0.5 * n and n < 1000 and el.tag != "p":
                victims.append(el)
        for el in victims:
            if el.getparent() is not None:
                _drop(el)


# --- markdown --------------------------------------------------------------

def _h2t() -> html2text.HTML2Text:
    h = html2text.HTML2Text(baseurl="")
    h.body_width = 0
    h.unicode_snob = True
    h.ignore_images = False
    h.images_to_alt = False
    h.ignore_emphasis = False
    h.protect_links = False
    h.wrap_links = False
    h.wrap_list_items = False
    h.skip_internal_links = True
    h.ignore_mailto_links = False
    h.single_line_break = False
    h.mark_code = False
    h.pad_tables = False
    return h


_BACKTICKS = re.compile(r"`{3,}")
_LANG = re.compile(r"(?:language|lang|highlight)-([A-Za-z0-9_+#.\-]{1,24})")
_BLANKS = re.compile(r"\n{3,}")


def _fence_code(nodes: list) -> dict[str, str]:
    """Replace each <pre> by a placeholder paragraph; return placeholder → fenced code block."""
    blocks: dict[str, str] = {}
    nonce = secrets.token_hex(6)
    for node in nodes:
        for pre in list(node.iter("pre")):
            if pre.getparent() is None and pre is not node:
                continue
            code = pre.text_content().strip("\n")
            if not code.strip():
                continue
            lang = ""
            for el in (pre, *pre.iter("code")):
                m = _LANG.search(el.get("class") or "")
                if m:
                    lang = m.group(1)
                    break
            # One backtick more than the longest run inside (one regex pass,
            # not a loop that grows the fence by one and searches again).
            longest = max((len(run) for run in _BACKTICKS.findall(code)), default=0)
            fence = "`" * max(3, longest + 1)
            key = f"SLUICECODE{nonce}X{len(blocks)}"
            blocks[key] = f"{fence}{lang}\n{code}\n{fence}"
            repl = lxml_html.Element("p")
            repl.text = key
            repl.tail = pre.tail
            parent = pre.getparent()
            if parent is None:  # the node itself is a <pre>
                continue
            parent.replace(pre, repl)
        _figures(node, blocks, nonce)
    return blocks


_FIGURE_INLINE = {"a", "picture", "span", "div"}
_URL_UNSAFE = str.maketrans({" ": "%20", "(": "%28", ")": "%29", "<": "%3C", ">": "%3E"})
_ALT_MAX_CHARS = 500


def _image_markdown(img) -> str:
    alt = _collapse(img.get("alt") or "")[:_ALT_MAX_CHARS]
    alt = alt.replace("\\", "\\\\").replace("[", "\\[").replace("]", "\\]")
    return f"![{alt}]({img.get('src').translate(_URL_UNSAFE)})"


def _figures(node, blocks: dict[str, str], nonce: str) -> None:
    """Each figure's images become placeholders (markdown images once the extractor
    is done, which would drop them) with the caption as the paragraph after them
    (trafilatura dropped figures whole, caption included)."""
    for fig in list(node.iter("figure")):
        if fig.getparent() is None:
            continue
        imgs = [img for img in fig.iter("img") if img.get("src")]
        if not imgs:
            continue
        for img in imgs:
            # The placeholder replaces the image's wrapper (a link, a <picture>) when the
            # image is all it holds: a placeholder inside a link's text would break it.
            target = img
            while target.getparent() is not None and target.getparent() is not fig \
                    and target.getparent().tag in _FIGURE_INLINE and len(target.getparent()) == 1 \
                    and not (target.getparent().text or "").strip():
                target = target.getparent()
            key = f"SLUICECODE{nonce}X{len(blocks)}"
            blocks[key] = _image_markdown(img)
            repl = lxml_html.Element("p")
            repl.text = key
            repl.tail = target.tail
            target.getparent().replace(target, repl)
        fig.tag = "div"
        for cap in fig.iter("figcaption"):
            cap.tag = "div" if any(isinstance(c.tag, str) and c.tag in _BLOCK for c in cap) else "p"


_PLACEHOLDER = re.compile(r"SLUICECODE[0-9a-f]{12}X[0-9]+")


_LIST_ITEM = re.compile(r"([-*+]|[0-9]{1,9}[.)])(?:[ \t]+|$)")
_FENCE_LINE = re.compile(r"(`{3,}|~{3,})")
_TABLE_ROW = re.compile(r"( *)\|.*\|[ \t]*$")
_CELL_SPLIT = re.compile(r"(?<!\\)\|")
_DELIMITER_CELL = re.compile(r":?-+:?")


def _normalise(md: str) -> str:
    """The extractor's markdown made valid CommonMark/GFM for what it holds: no
    line indented into a code block (the page's tab indentation came through on
    list items, headings and prose: only <pre> becomes code, and those are still
    placeholders here), list items nested at their parent's content column, and
    every pipe table with its delimiter row. One pass over the lines."""
    lines: list[str] = []
    items: list[tuple[int, int]] = []  # open list items: (source indent, output content column)
    fence = ""  # a fence the extractor wrote itself: its lines are kept as they are
    blank = True
    for line in md.split("\n"):
        if fence:
            lines.append(line)
            if line.strip().startswith(fence) and not line.strip().strip(fence[0]):
                fence = ""
            continue
        expanded = line.expandtabs(4)
        text = expanded.lstrip(" ")
        indent = len(expanded) - len(text)
        if not text:
            lines.append("")
            blank = True
            continue
        m = _FENCE_LINE.match(text)
        if m:
            fence, items, blank = m.group(1), [], False
            lines.append(text)
            continue
        m = _LIST_ITEM.match(text)
        if m:
            while items and items[-1][0] >= indent:
                items.pop()
            column = items[-1][1] if items else 0
            marker = m.group(1)
            items.append((indent, column + len(marker) + 1))
            lines.append((" " * column + marker + " " + text[m.end():]).rstrip())
        else:
            if indent == 0 and blank:
                items = []
            elif blank:
                while items and items[-1][0] >= indent:
                    items.pop()
            column = items[-1][1] if items and indent > 0 else 0
            lines.append(" " * column + text)
        blank = False
    return "\n".join(_valid_tables(lines))


def _cells(row: str) -> list[str]:
    inner = row.strip()[1:-1]
    return [c.strip() for c in _CELL_SPLIT.split(inner)]


def _valid_tables(lines: list[str]) -> list[str]:
    """Each run of `| … |` lines as a GFM table: the first row the header, padded to
    the widest row, then the delimiter row (13 of 20 tables on real pages had none:
    a renderer showed no table); delimiter rows elsewhere in the run dropped."""
    out: list[str] = []
    i, n = 0, len(lines)
    fence = ""
    while i < n:
        line = lines[i]
        stripped = line.strip()
        if fence or _FENCE_LINE.match(stripped):
            out.append(line)
            if fence and stripped.startswith(fence) and not stripped.strip(fence[0]):
                fence = ""
            elif not fence:
                fence = _FENCE_LINE.match(stripped).group(1)
            i += 1
            continue
        m = _TABLE_ROW.match(line)
        if not m or stripped == "|":
            out.append(line)
            i += 1
            continue
        indent = m.group(1)
        j = i
        rows = []
        while j < n and (r := _TABLE_ROW.match(lines[j])) and r.group(1) == indent and lines[j].strip() != "|":
            cells = _cells(lines[j])
            if not all(_DELIMITER_CELL.fullmatch(c) for c in cells):
                rows.append(cells)
            j += 1
        if rows:
            width = max(len(r) for r in rows)
            if out and out[-1].strip():
                out.append("")
            header = rows[0] + [""] * (width - len(rows[0]))
            out.append(indent + "| " + " | ".join(header) + " |")
            out.append(indent + "|" + "---|" * width)
            out.extend(indent + "| " + " | ".join(r) + " |" for r in rows[1:])
            if j < n and lines[j].strip():
                out.append("")
        i = j
    return out


def _unfence(md: str, blocks: dict[str, str]) -> str:
    """Each placeholder's first occurrence back to its code block, in one pass
    (a replace per block was quadratic: 50,000 <pre> took 12 s)."""
    if not blocks:
        return md
    used: set[str] = set()

    def block(m: re.Match) -> str:
        key = m.group(0)
        if key in used or key not in blocks:
            return key
        used.add(key)
        return f"\n\n{blocks[key]}\n\n"

    return _PLACEHOLDER.sub(block, md)


def _markdown(nodes: list, blocks: dict[str, str] | None = None) -> str:
    """html2text over `nodes`, whose links _resolve_links has already made absolute."""
    blocks = {**(blocks or {}), **_fence_code(nodes)}
    parts = []
    for node in nodes:
        parts.append(lxml_html.tostring(node, encoding="unicode", method="html", with_tail=False))
    md = _h2t().handle("".join(parts))
    md = _unfence(_normalise(md), blocks)
    md = "\n".join(line.rstrip() for line in md.split("\n"))
    return _BLANKS.sub("\n\n", md).strip() + "\n" if md.strip() else ""


# --- public entry points -----------------------------------------------------

_APP_ROOT = re.compile(r"^(?:root|app|__next|__nuxt|svelte|main-app|application)$", re.IGNORECASE)


def _looks_like_app(root, body_text_len: int, had_scripts: bool) -> bool:
    if not had_scripts:
        return False
    return body_text_len < 200


# A link target (after resolution) or <base href> longer than this is dropped
# (the link's text stays): 20,000 links against a 20,000-character base once
# made 400 MB of markdown from a 340 KB page.
MAX_URL_CHARS = 2048


def _base(root, base_url: str | None) -> str | None:
    for el in root.iter("base"):
        href = (el.get("href") or "").strip()
        if href and len(href) <= MAX_URL_CHARS:
            try:
                return urljoin(base_url or "", href)
            except ValueError:
                return base_url
        break
    return base_url


def _resolve_links(body, base_url: str | None, budget: int, *, fragments: bool = True) -> None:
    """Make link targets and image sources absolute, in place, within bounds.

    A target over MAX_URL_CHARS, or one that does not resolve, loses its
    attribute (the text stays); so does every target once resolution has added
    `budget` characters to the page in all. `fragments=False` leaves "#x"
    targets as they are (html2text skips them as internal links)."""
    grown = 0
    joined: dict[str, str | None] = {}
    for el in body.iter("a", "img", "area"):
        attr = "src" if el.tag == "img" else "href"
        target = el.get(attr)
        if target is None:
            continue
        target = target.strip()
        if not fragments and target.startswith("#"):
            continue
        resolved = target
        if base_url:
            resolved = joined.get(target, "")
            if resolved == "":
                try:
                    resolved = urljoin(base_url, target)
                except ValueError:
                    resolved = None
                if len(joined) < 10_000:
                    joined[target] = resolved
        if resolved is not None and len(resolved) <= MAX_URL_CHARS:
            grown += max(0, len(resolved) - len(target))
            if grown <= budget:
                el.set(attr, resolved)
                continue
        del el.attrib[attr]


def _reduce(body) -> str:
    """Sluice's own reducer (the fallback): full chrome removal, block scoring, html2text."""
    _clean(body, chrome=True)
    text_len, link_len = _measure(body)
    found = _main_node(body, text_len, link_len)
    if found is None:
        nodes = [body]
    else:
        best, best_score, scores = found
        nodes = _gather(best, best_score, scores, text_len, link_len)
        _prune(nodes, text_len, link_len)
    try:
        return _markdown(nodes)
    except Exception:  # html2text on hostile markup: fall back to the text
        return _collapse(" ".join(n.text_content() for n in nodes))


_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)


def _trafilatura(root) -> str:
    """trafilatura's main-content extraction as markdown ("" when it finds none or fails).

    The links are already absolute (_resolve_links), so trafilatura gets no URL
    to join them against again (a second urljoin per link, and unbounded)."""
    import logging

    import trafilatura

    logging.getLogger("trafilatura").setLevel(logging.CRITICAL)
    try:
        md = trafilatura.extract(root, url=None, output_format="markdown", include_links=True,
                                 include_formatting=True, include_tables=True, include_images=False,
                                 include_comments=False, deduplicate=False, with_metadata=False)
    except (Exception, RecursionError):
        return ""
    if not md:
        return ""
    md = _BLANKS.sub("\n\n", _TRAILING_WS.sub("", md)).strip()
    return md + "\n" if md else ""


# Above this many characters of text (after scripts and hidden parts are
# dropped) the page is converted without main-content extraction.
_EXTRACT_MAX_CHARS = 1_000_000
# Nor does a pre-reduced page of more elements than this (trafilatura costs
# ~60 us an element: 20,000 bare links took 1.2 s); a real page has a few
# thousand left after the pre-reduction (the 2 MiB bench page: 6,400).
_EXTRACT_MAX_ELEMENTS = 20_000
_EXTRACT_MAX_DEPTH_SUM = 400_000  # an average depth of 20 at the element cap


def _too_big_to_extract(el) -> bool:
    """More than _EXTRACT_MAX_ELEMENTS elements, or a total depth over
    _EXTRACT_MAX_DEPTH_SUM (trafilatura's justext fallback costs each element
    its depth: 2,000 nested lists took 3 s)."""
    elements = depth = depth_sum = 0
    for event, _el in etree.iterwalk(el, events=("start", "end")):
        if event == "end":
            depth -= 1
            continue
        depth += 1
        elements += 1
        depth_sum += depth
        if elements > _EXTRACT_MAX_ELEMENTS or depth_sum > _EXTRACT_MAX_DEPTH_SUM:
            return True
    return False


def _body(root):
    body = root.find("body")
    return root if body is None else body


def convert(text: str, base_url: str | None, *, max_chars: int):
    """The page as webtools.convert.Converted, its markdown at most `max_chars` characters."""
    from sluice.webtools.convert import Converted

    root = _parse(text)
    if root is None:
        return Converted(title=None, markdown="", needs_javascript=False)
    title = _title(root)
    base_url = _base(root, base_url)
    had_scripts = next(root.iter("script"), None) is not None
    body = _body(root)
    hidden_chars = _hidden.drop_hidden(body)
    _prepare(body)
    _clean(body, chrome=False)
    full_len = len(_collapse(body.text_content()))
    needs_js = _looks_like_app(root, full_len, had_scripts)
    if full_len == 0:
        return Converted(title=title, markdown="", needs_javascript=needs_js, hidden_chars=hidden_chars)
    _clean(body, chrome=True, negative=_CONSENT)
    # trafilatura resolves relative links against the site's root, not the
    # page: resolve them here, against the page (or its <base href>), within
    # bounds: resolution may add at most the page's own length in all.
    _resolve_links(body, base_url, len(text))
    # Code blocks go round the extractor as placeholders: trafilatura drops
    # their blank lines and their language.
    blocks = _fence_code([body])
    if full_len > _EXTRACT_MAX_CHARS or _too_big_to_extract(body):
        # So much text that it is mostly content (a long thread, a full book
        # chapter), or so many elements: extraction would cost several times
        # html2text for little gain, so the pre-reduced page is converted as it is.
        md = _markdown([body], blocks)
    else:
        md = _trafilatura(root)
        if md:
            md = _unfence(_normalise(md), blocks)
            md = _BLANKS.sub("\n\n", md).strip() + "\n"
        if len(md) < 250:
            # trafilatura found nothing, or next to nothing (a short note, a page of
            # links, a table-only page): Sluice's own reducer on a fresh parse, if it
            # finds more.
            fresh = _parse(text)
            if fresh is not None:
                fbody = _body(fresh)
                _hidden.drop_hidden(fbody)
                _prepare(fbody)
                _clean(fbody, chrome=False)
                _resolve_links(fbody, base_url, len(text), fragments=False)
                own = _reduce(fbody)
                if len(own) > len(md):
                    md = own
    cut = len(md) > max_chars
    if cut:
        md = md[:max_chars]
    return Converted(title=title, markdown=md, needs_javascript=needs_js, cut=cut, hidden_chars=hidden_chars)


_INVISIBLE = {"script", "style", "noscript", "template", "head", "title", "meta", "link", "base"}


def visible(text: str) -> tuple[str | None, str, int]:
    """(title, the visible text with whitespace collapsed, characters of hidden text dropped)."""
    root = _parse(text)
    if root is None:
        return None, "", 0
    title = _title(root)
    hidden_chars = _hidden.drop_hidden(_body(root))
    parts: list[str] = []
    skip = 0
    for event, el in etree.iterwalk(root, events=("start", "end")):
        tag = el.tag if isinstance(el.tag, str) else ""
        invisible = tag in _INVISIBLE or not tag or (tag == "input" and (el.get("type") or "").lower() == "hidden")
        if event == "start":
            if skip:
                skip += 1
                continue
            if invisible:
                skip = 1
                continue
            if tag in _BLOCK:
                parts.append(" ")
            if el.text:
                parts.append(el.text)
        else:
            if skip:
                skip -= 1
                if skip == 0 and el.tail:
                    parts.append(el.tail)
                continue
            if tag in _BLOCK:
                parts.append(" ")
            if el.tail:
                parts.append(el.tail)
    return title, _collapse("".join(parts)), hidden_chars
