"""The structure check beside F1: is the reference's structure in the right markdown form?

For each page, the structures of the source HTML whose text the reference
(the labelled article body) contains: headings, list items (their own text,
nested lists apart), code blocks (<pre>), data-table cells and link texts,
each of at least MIN_WORDS words. The converter's markdown is read by a CommonMark
parser (markdown-it-py, with GFM tables), and each structure counts as found
when its words are those of an element of the same kind there: a heading, a
list item, a code block, a table cell, a link's text. Reported per kind: the
share found in form, and the share whose words are in the output at all (so
an extraction miss and a form miss are told apart).

Validity, per page: lines that look like pipe-table rows but that the parser
does not read as a table, and characters of code blocks whose text comes from
no <pre> of the source (prose indented into code).
"""

from __future__ import annotations

import re
from collections import Counter

KINDS = ("heading", "list_item", "code", "table_cell", "link")
# Shorter items are too often in the reference by chance (a menu's "World Cup"
# link on a page whose article says "World Cup"), which would count chrome.
MIN_WORDS = {"heading": 2, "list_item": 4, "code": 1, "table_cell": 2, "link": 3}
_TOKEN = re.compile(r"\w+")
_HEADINGS = ("h1", "h2", "h3", "h4", "h5", "h6")
_NOT_TEXT = ("script", "style", "noscript", "template", "head")
_CELL_BLOCKS = {"p", "div", "ul", "ol", "table", "h1", "h2", "h3", "h4", "h5", "h6", "blockquote", "pre"}
_PIPE_ROW = re.compile(r"^\s*\|.*\|\s*$")


def norm(text: str) -> str:
    return " ".join(_TOKEN.findall((text or "").lower()))


def _own_text(el, skip: tuple[str, ...]) -> str:
    """`el`'s text without the subtrees of the `skip` tags below it."""
    from lxml import etree

    parts, depth = [], 0
    for event, node in etree.iterwalk(el, events=("start", "end")):
        skipped = node is not el and node.tag in skip
        if event == "start":
            if skipped or depth:
                depth += 1
            elif node.text:
                parts.append(node.text)
        else:
            if depth:
                depth -= 1
            if not depth and node is not el and node.tail:
                parts.append(node.tail)
    return "".join(parts)


def source_structures(html: bytes | str) -> dict[str, list[str]]:
    """Normalised texts of the source's structures, by kind (items of at least two words)."""
    from lxml import etree
    from lxml import html as lxml_html

    from sluice.webtools.convert import decode_html

    text = decode_html(html)
    try:
        root = lxml_html.document_fromstring(text.encode("utf-8", "replace"),
                                             parser=lxml_html.HTMLParser(encoding="utf-8", remove_comments=True))
    except (etree.ParserError, ValueError):
        return {k: [] for k in KINDS}
    etree.strip_elements(root, *_NOT_TEXT, with_tail=False)
    found: dict[str, list[str]] = {k: [] for k in KINDS}
    for el in root.iter(*_HEADINGS):
        found["heading"].append(norm(el.text_content()))
    for el in root.iter("li"):
        found["list_item"].append(norm(_own_text(el, ("ul", "ol"))))
    for el in root.iter("pre"):
        found["code"].append(norm(el.text_content()))
    for el in root.iter("td", "th"):
        if any(isinstance(c.tag, str) and c.tag in _CELL_BLOCKS for c in el.iter()):
            continue  # a layout cell, not data
        cell = norm(el.text_content())
        if len(cell) <= 200:
            found["table_cell"].append(cell)
    for el in root.iter("a"):
        if el.get("href"):
            found["link"].append(norm(el.text_content()))
    return {k: [t for t in v if len(t.split()) >= MIN_WORDS[k]] for k, v in found.items()}


def _parser():
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark").enable("table")


def _inline_text(token) -> str:
    return "".join(c.content for c in token.children or () if c.type in {"text", "code_inline", "image"})


def markdown_structures(md: str) -> dict:
    """What a CommonMark/GFM parser reads in `md`: normalised texts by kind, the
    plain text, code texts, and the pipe-looking lines that are not in a table."""
    tokens = _parser().parse(md)
    out: dict[str, list[str]] = {k: [] for k in KINDS}
    code_texts: list[str] = []
    code_blocks = 0
    items: list[list[str]] = []
    covered: set[int] = set()
    plain: list[str] = []
    pending = None  # the kind the next inline token belongs to (heading, cell)
    for tok in tokens:
        if tok.type in {"table_open", "fence", "code_block", "html_block"} and tok.map:
            covered.update(range(*tok.map))
        if tok.type == "heading_open":
            pending = "heading"
        elif tok.type in {"th_open", "td_open"}:
            pending = "table_cell"
        elif tok.type == "list_item_open":
            items.append([])
        elif tok.type == "list_item_close":
            out["list_item"].append(norm(" ".join(items.pop())))
        elif tok.type in {"fence", "code_block"}:
            out["code"].append(norm(tok.content))
            code_texts.append(tok.content)
            code_blocks += tok.type == "code_block"
            plain.append(tok.content)
        elif tok.type == "inline":
            text = _inline_text(tok)
            plain.append(text)
            if pending:
                out[pending].append(norm(text))
                pending = None
            elif items:
                items[-1].append(text)
            link = None
            for child in tok.children or ():
                if child.type == "link_open":
                    link = []
                elif child.type == "link_close" and link is not None:
                    out["link"].append(norm("".join(link)))
                    link = None
                elif link is not None and child.type in {"text", "code_inline", "image"}:
                    link.append(child.content)
    lines = md.split("\n")
    loose_rows = sum(1 for i, line in enumerate(lines) if i not in covered and _PIPE_ROW.match(line))
    return {"kinds": out, "plain": norm(" ".join(plain)), "code_texts": code_texts,
            "indented_code_blocks": code_blocks, "loose_table_rows": loose_rows,
            "tables": sum(1 for t in tokens if t.type == "table_open")}


def check_page(html: bytes | str, reference: str, md: str) -> dict:
    """One page: per kind, (in the reference, found in form, words present at all); validity."""
    ref = f" {norm(reference)} "
    src = source_structures(html)
    got = markdown_structures(md)
    per_kind = {}
    for kind in KINDS:
        wanted = [t for t in src[kind] if f" {t} " in ref]
        forms = "\n".join(f" {t} " for t in got["kinds"][kind])
        plain = f" {got['plain']} "
        per_kind[kind] = (len(wanted), sum(1 for t in wanted if f" {t} " in forms),
                          sum(1 for t in wanted if f" {t} " in plain))
    pre_texts = "\n".join(f" {t} " for t in src["code"])
    prose_in_code = sum(len(c) for c in got["code_texts"] if norm(c) and f" {norm(c)} " not in pre_texts)
    return {"kinds": per_kind, "loose_table_rows": got["loose_table_rows"], "tables": got["tables"],
            "prose_in_code_chars": prose_in_code}


def summarise(pages: list[dict]) -> dict:
    """Shares over all pages' structures (pooled), and the validity totals."""
    total = {k: Counter() for k in KINDS}
    for p in pages:
        for kind, (n, form, present) in p["kinds"].items():
            total[kind].update(n=n, form=form, present=present)
    out = {}
    for kind, c in total.items():
        out[kind] = {"n": c["n"], "in_form": round(c["form"] / c["n"], 3) if c["n"] else None,
                     "present": round(c["present"] / c["n"], 3) if c["n"] else None}
    out["pages"] = len(pages)
    out["tables"] = sum(p["tables"] for p in pages)
    out["loose_table_rows"] = sum(p["loose_table_rows"] for p in pages)
    out["pages_with_loose_table_rows"] = sum(1 for p in pages if p["loose_table_rows"])
    out["prose_in_code_chars"] = sum(p["prose_in_code_chars"] for p in pages)
    out["pages_with_prose_in_code"] = sum(1 for p in pages if p["prose_in_code_chars"])
    return out
