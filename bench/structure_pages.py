"""Pages built to hold each structure the structure check looks for (bench.structure).

Each page is site chrome (a menu, a footer) around an article written the way
real pages are: tab-indented markup, tables without <th>, a layout table
around the article, MathML, a refrain the page really repeats, figures with
captions, code, nested lists, links. Each comes with its reference (the
article's visible text) and with checks of facts the kinds do not cover
(a formula's TeX, how often a refrain appears, a caption right after its image).
"""

from __future__ import annotations

from collections.abc import Callable

_PROSE = ("The council met on Tuesday to discuss the river budget, and the members agreed that the "
          "water works would need more money next year, as the report had warned in the spring.")

_MENU = ('<nav><ul><li><a href="/news">News section of the site</a></li><li><a href="/sport">Sport section '
         'of the site</a></li><li><a href="/weather">Weather pages for the region</a></li></ul></nav>')
_FOOTER = '<footer><p>&copy; 2026 Example News. <a href="/privacy">Our privacy notice for readers</a></p></footer>'


def _page(title: str, article: str, *, wrap: str = "article") -> str:
    return (f"<!doctype html><html><head><title>{title}</title></head><body>\n\t{_MENU}\n"
            f"\t<{wrap}>\n\t\t<h1>\n\t\t\t{title}</h1>\n{article}\n\t</{wrap}>\n\t{_FOOTER}\n</body></html>")


def _p(text: str = _PROSE, indent: int = 2) -> str:
    tab = "\t" * indent
    return f"{tab}<p>\n{tab}\t{text}\n{tab}</p>\n"


TABLE_NO_TH = _page("Water prices by district", _p() + """
\t\t<table>
\t\t\t<tr><td>North district</td><td>three euros</td></tr>
\t\t\t<tr><td>South district</td><td>four euros</td></tr>
\t\t\t<tr><td>East district</td><td>five euros</td><td>new tariff</td></tr>
\t\t</table>
""" + _p())

TABLE_TH = _page("Budget lines for the year", _p() + """
\t\t<table><thead><tr><th>Budget line</th><th>Amount this year</th></tr></thead>
\t\t<tbody><tr><td>River dredging works</td><td>two million</td></tr>
\t\t<tr><td>School roof repairs</td><td>one million</td></tr></tbody></table>
""" + _p())

INDENTED = _page("How the vote went", _p(indent=4) + """
\t\t\t\t<h2>
\t\t\t\t\tWho voted for the plan</h2>
\t\t\t\t<ul>
\t\t\t\t\t<li>
\t\t\t\t\t\tThe members of the green group</li>
\t\t\t\t\t<li>
\t\t\t\t\t\tTwo members of the liberal group
\t\t\t\t\t\t<ul><li>
\t\t\t\t\t\t\tOne of them after a long debate</li></ul></li>
\t\t\t\t</ul>
\t\t\t\t<div>
\t\t\t\t\tThe mayor said the vote was a good day for the city and its river.
\t\t\t\t\t<div>
\t\t\t\t\t\tShe thanked the members who had worked on the plan all year long.</div></div>
\t\t\t\t<ol>
\t\t\t\t\t<li>First step of the plan is the survey</li>
\t\t\t\t\t<li>Second step of the plan is the works<ol>
\t\t\t\t\t\t<li>Works begin on the north bank</li></ol></li>
\t\t\t\t</ol>
""" + _p(indent=4))

LAYOUT = ("<!doctype html><html><head><title>An old page laid out with a table</title></head><body>"
          "<table width='100%'><tr><td width='180' valign='top'>"
          "<a href='/'>Home page of the club</a><br><a href='/about'>About the club and its history</a></td>"
          "<td valign='top'><h1>The rowing club turns one hundred</h1>"
          + "".join(f"<p>{_PROSE} Paragraph {i} of the article.</p>" for i in range(4))
          + "<h2>A century on the water</h2>"
          + "".join(f"<p>{_PROSE} Later paragraph {i}.</p>" for i in range(3))
          + "</td></tr></table></body></html>")

MATH = _page("Solving quadratic equations", """
\t\t<p>When <math alttext="a \\ne 0"><mi>a</mi><mo>&#8800;</mo><mn>0</mn></math>, there are two solutions to
\t\t<math display="block"><semantics><mrow><mi>a</mi><msup><mi>x</mi><mn>2</mn></msup><mo>+</mo><mi>b</mi><mi>x</mi><mo>+</mo><mi>c</mi><mo>=</mo><mn>0</mn></mrow>
\t\t<annotation encoding="application/x-tex">ax^2 + bx + c = 0</annotation></semantics></math>
\t\tand they are given by the formula below, which every student learns at school in the second year.</p>
\t\t<p>The simplest case is <math><mi>x</mi><mo>=</mo><mn>1</mn></math>, found by hand in a minute or two by anyone.</p>
""" + _p())

REFRAIN = "Row, row, row your boat gently down the stream, merrily down the stream we go."
REPEATS = _page("The words of the song", "".join(
    _p(REFRAIN) + _p(f"Verse {i} tells of the river, the bank and the boat that carries us home.") for i in range(3)))

CAPTION = "The new footbridge over the river, seen from the north bank at dawn."
FIGURES = _page("A bridge for walkers", _p() + f"""
\t\t<figure>
\t\t\t<a href="/photos/bridge"><img src="/img/bridge.jpg" alt="A footbridge"></a>
\t\t\t<figcaption>{CAPTION}</figcaption>
\t\t</figure>
""" + _p())

CODE = _page("Reading the sensor data", _p() + """
\t\t<pre><code class="language-python">def level(readings):
    \"\"\"The river level, averaged.\"\"\"
    return sum(readings) / len(readings)
</code></pre>
\t\t<p>Run it with <code>python level.py</code> and read <a href="/docs/sensors">the sensor documentation pages</a> first.</p>
""" + _p())


def _caption_follows_image(md: str) -> bool:
    paras = [p.strip() for p in md.split("\n\n")]
    return any(p.startswith("![A footbridge](") and i + 1 < len(paras) and paras[i + 1] == CAPTION
               for i, p in enumerate(paras))


# name -> (html, extra checks: description -> predicate on the markdown)
PAGES: dict[str, tuple[str, dict[str, Callable[[str], bool]]]] = {
    "table without th": (TABLE_NO_TH, {}),
    "table with th": (TABLE_TH, {}),
    "tab-indented lists, headings, prose": (INDENTED, {}),
    "layout table": (LAYOUT, {"article not in a table": lambda md: "|" not in md}),
    "MathML": (MATH, {"alttext kept": lambda md: "a \\ne 0" in md,
                      "TeX annotation kept": lambda md: "ax^2 + bx + c = 0" in md,
                      "text content kept": lambda md: "x=1" in md}),
    "repeated paragraphs": (REPEATS, {"refrain kept three times": lambda md: md.count(REFRAIN) == 3}),
    "figure with caption": (FIGURES, {"caption right after its image": _caption_follows_image}),
    "code and links": (CODE, {}),
}


def reference(html: str) -> str:
    """The article's visible text: everything but the menu and the footer."""
    from lxml import html as lxml_html

    root = lxml_html.document_fromstring(html)
    for el in list(root.iter("nav", "footer", "title")):
        el.getparent().remove(el)
    return " ".join(root.itertext())
