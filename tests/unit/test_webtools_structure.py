"""Markdown that keeps its structure (issue 25 item 6), read back by a CommonMark/GFM parser."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from markdown_it import MarkdownIt

from sluice.webtools.convert import html_to_markdown

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository's bench/ package
from bench import structure, structure_pages  # noqa: E402

PROSE = ("The council met on Tuesday to discuss the river budget, and the members agreed that the water "
         "works would need more money next year, as the report had warned in the spring. ")
P = f"<p>{PROSE * 2}</p>"


def md_of(html: str) -> str:
    return html_to_markdown(html, "https://news.example/a").markdown


def tokens(md: str):
    return MarkdownIt("commonmark").enable("table").parse(md)


def article(inner: str) -> str:
    return f"<html><body><article><h1>A headline for the page</h1>{P}{inner}{P}</article></body></html>"


def test_a_table_without_th_gets_its_delimiter_row():
    md = md_of(article("<table><tr><td>North district</td><td>three</td></tr>"
                       "<tr><td>South district</td><td>four</td><td>new tariff</td></tr></table>"))
    toks = tokens(md)
    assert [t.type for t in toks].count("table_open") == 1
    got = structure.markdown_structures(md)
    assert got["loose_table_rows"] == 0
    assert {"north district", "south district", "new tariff"} <= set(got["kinds"]["table_cell"])


def test_tab_indented_prose_lists_and_headings_are_never_code():
    html = article("\n\t\t\t\t<h2>\n\t\t\t\t\tWho voted for the plan</h2>\n\t\t\t\t<ul>\n\t\t\t\t\t<li>\n"
                   "\t\t\t\t\t\tThe members of the green group</li></ul>\n\t\t\t\t<div>\n\t\t\t\t\tThe mayor said"
                   " the vote was a good day.\n\t\t\t\t\t<div>\n\t\t\t\t\t\tShe thanked the members who worked on"
                   " it all year.</div></div>")
    md = md_of(html)
    types = [t.type for t in tokens(md)]
    assert "code_block" not in types and "fence" not in types
    got = structure.markdown_structures(md)
    assert "who voted for the plan" in got["kinds"]["heading"]
    assert "the members of the green group" in got["kinds"]["list_item"]
    assert "she thanked the members who worked on it all year" in got["plain"]


def test_nested_ordered_list_is_nested_at_the_parent_content_column():
    md = md_of(article("<ol><li>First step of the plan</li><li>Second step of the plan<ol>"
                       "<li>Works begin on the north bank</li></ol></li></ol>"))
    toks = tokens(md)
    depth, nested = 0, []
    for t in toks:
        if t.type == "ordered_list_open":
            depth += 1
        elif t.type == "ordered_list_close":
            depth -= 1
        elif t.type == "inline" and "north bank" in t.content:
            nested.append(depth)
    assert nested == [2]


def test_only_pre_becomes_code_and_keeps_its_indentation():
    md = md_of(article("<pre><code class='language-python'>def f():\n    return 1\n</code></pre>"))
    fences = [t for t in tokens(md) if t.type == "fence"]
    assert len(fences) == 1 and fences[0].info == "python" and fences[0].content == "def f():\n    return 1\n"


def test_a_layout_table_is_read_as_its_content():
    md = md_of(structure_pages.LAYOUT)
    toks = tokens(md)
    assert "table_open" not in [t.type for t in toks]
    paragraphs = [t.content for t in toks if t.type == "inline" and "Paragraph" in t.content]
    assert len(paragraphs) == 4  # each paragraph its own block, not one table row


def test_a_data_table_with_short_cells_stays_a_table():
    md = md_of(article("<table><tr><th>Budget line</th><th>Amount</th></tr>"
                       "<tr><td><p>River dredging works</p></td><td>two million</td></tr></table>"))
    assert "table_open" in [t.type for t in tokens(md)]


def test_mathml_keeps_its_text_inline():
    md = md_of(structure_pages.MATH)
    assert "When $a \\ne 0$, there are two solutions to $ax^2 + bx + c = 0$" in " ".join(md.split())
    assert "The simplest case is x=1, found" in md


@pytest.mark.parametrize("wrap", ["article", "div"])
def test_identical_paragraphs_the_page_repeats_are_kept(wrap):
    refrain = "Row, row, row your boat gently down the stream, merrily down the stream we go."
    body = "".join(f"<p>{refrain}</p><p>Verse {i} tells of the river and the boat.</p>" for i in range(3))
    html = f"<html><body><{wrap}>{body}{P if wrap == 'article' else ''}</{wrap}></body></html>"
    assert md_of(html).count(refrain) == 3


def test_a_figure_keeps_its_caption_right_after_its_image():
    md = md_of(structure_pages.FIGURES)
    paras = [p.strip() for p in md.split("\n\n")]
    i = next(i for i, p in enumerate(paras) if p.startswith("!["))
    assert paras[i] == "![A footbridge](https://news.example/img/bridge.jpg)"
    assert paras[i + 1] == structure_pages.CAPTION


def test_figure_alt_and_url_cannot_break_the_image_syntax():
    md = md_of(article("<figure><img src='/a b(1).jpg' alt='x](javascript:1) [y'><figcaption>A caption"
                       " of the photo</figcaption></figure>"))
    images = [c for t in tokens(md) if t.type == "inline" for c in t.children if c.type == "image"]
    assert len(images) == 1
    assert images[0].attrs["src"] == "https://news.example/a%20b%281%29.jpg"


@pytest.mark.parametrize("name", list(structure_pages.PAGES))
def test_built_pages_have_valid_tables_no_prose_in_code_and_their_facts(name):
    html, facts = structure_pages.PAGES[name]
    md = md_of(html)
    result = structure.check_page(html, structure_pages.reference(html), md)
    assert result["loose_table_rows"] == 0
    assert result["prose_in_code_chars"] == 0
    assert "code_block" not in [t.type for t in tokens(md)]
    assert [what for what, ok in facts.items() if not ok(md)] == []
    for kind in ("list_item", "code", "table_cell"):
        n, in_form, _present = result["kinds"][kind]
        assert in_form == n, kind


def test_pathological_table_and_list_inputs_normalise_in_linear_time():
    import time

    rows = "<table>" + "<tr><td>a</td><td>b</td></tr>" * 3000 + "</table>"
    lists = "<ul>" * 3000 + "<li>x</li>" + "</ul>" * 3000
    nested_tables = "<table><tr><td>" * 3000 + "x" + "</td></tr></table>" * 3000
    for html in (rows, lists, nested_tables):
        t = time.monotonic()
        html_to_markdown(article(html), "https://news.example/a")
        assert time.monotonic() - t < 5
