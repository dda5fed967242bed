"""`python -m bench extraction`: main-content extraction quality and conversion speed.

Quality: token-shingle precision/recall/F1 (4-grams of \\w+ tokens, per page
normalised, averaged over pages; the metric of the ScrapingHub
article-extraction-benchmark) against human-labelled article bodies, for
plain html2text, trafilatura, readability-lxml (+ html2text), and Sluice's
pipeline (`sluice.webtools.convert.html_to_markdown`). Sluice's output is
markdown with links kept; it is scored on the text a reader sees (a link
`[text](url)` counts as `text`, an image as its alt text), so URLs are
neither rewarded nor punished.

The data: `bench/extraction/aeb/` is the held-out half (93 pages, the ids
starting 8-f) of the ScrapingHub article-extraction-benchmark (MIT licence,
`bench/extraction/aeb/LICENSE`); the converter was tuned only on the other
half (ids 0-7), which is not vendored (`--dev DIR` scores a checkout of the
upstream repository's html/ and ground-truth.json, restricted to ids 0-7).

Structure (bench.structure): for the headings, list items, code blocks,
table cells and link texts the reference contains, the share found in the
right markdown form once markdown-it-py has parsed Sluice's output, and the
pipe rows outside any table and prose inside code blocks; on the held-out
half and on pages built to hold each structure (bench.structure_pages).

Speed: a deterministic 2 MiB boilerplate-heavy page (`bench.extraction_pages`:
mega-menu, inline scripts and JSON, sidebars, comments, footer around a long
article) converted by plain html2text and by Sluice's pipeline, alternating,
several rounds; MB/s from the median, spread as min-max. Also the throughput
over the whole held-out set.

No network: every input is on disk or generated. trafilatura and
readability-lxml are optional (`pip install trafilatura readability-lxml`);
an extractor that is not installed is reported as such.
"""

from __future__ import annotations

import gzip
import json
import re
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent / "extraction"
HELD_OUT = HERE / "aeb"

# --- the metric ----------------------------------------------------------------

_TOKEN = re.compile(r"\w+")


def shingles(text: str, n: int = 4) -> Counter:
    tokens = _TOKEN.findall(text or "")
    if len(tokens) < n:
        return Counter([tuple(tokens)] if tokens else [])
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def page_counts(true: str, pred: str) -> tuple[float, float, float]:
    """(tp, fp, fn) over shingles, normalised to sum to 1 so long pages weigh no more than short ones."""
    t, p = shingles(true), shingles(pred)
    tp = sum((t & p).values())
    fp = sum((p - t).values())
    fn = sum((t - p).values())
    total = tp + fp + fn
    return (tp / total, fp / total, fn / total) if total else (0.0, 0.0, 0.0)


def scores(counts: list[tuple[float, float, float]]) -> dict[str, float]:
    def prec(tp, fp, fn):
        return 1.0 if fp == fn == 0 else (0.0 if tp == fp == 0 else tp / (tp + fp))

    def rec(tp, fp, fn):
        return 1.0 if fp == fn == 0 else (0.0 if tp == fn == 0 else tp / (tp + fn))

    # As upstream: a page with nothing predicted counts against recall only.
    p = statistics.mean([prec(*c) for c in counts if c[0] + c[1] > 0] or [0.0])
    r = statistics.mean([rec(*c) for c in counts if c[0] + c[2] > 0] or [0.0])
    return {"f1": 2 * p * r / (p + r) if p + r else 0.0, "precision": p, "recall": r}


_IMAGE = re.compile(r"!\[([^\]]*)\]\([^)]*\)")
_LINK = re.compile(r"\[([^\]]*)\]\((?:[^()\s]|\([^()\s]*\))*(?:\s+\"[^\"]*\")?\)")
_AUTOLINK = re.compile(r"<(?:https?|mailto):[^>\s]*>")


def markdown_text(md: str) -> str:
    """What a reader sees of markdown: link and image targets dropped, their text kept."""
    md = _IMAGE.sub(r"\1", md)
    md = _LINK.sub(r"\1", md)
    return _AUTOLINK.sub(" ", md)


# --- the data --------------------------------------------------------------------


def load(directory: Path, only: Callable[[str], bool] = lambda k: True) -> list[tuple[str, bytes, str, str]]:
    """[(id, html bytes, true article body, url)] from a directory laid out like the upstream benchmark."""
    truth = json.loads((directory / "ground-truth.json").read_text(encoding="utf-8"))
    html_dir = directory / "html" if (directory / "html").is_dir() else directory
    out = []
    for key in sorted(truth):
        if not only(key):
            continue
        path = html_dir / f"{key}.html.gz"
        if path.is_file():
            out.append((key, gzip.decompress(path.read_bytes()), truth[key].get("articleBody", ""),
                        truth[key].get("url", "")))
    return out


# --- the extractors ----------------------------------------------------------------


def _decode(html: bytes) -> str:
    from sluice.webtools.convert import decode_html

    return decode_html(html)


def _html2text(html: bytes, url: str) -> str:
    import html2text

    h = html2text.HTML2Text(baseurl=url)
    h.body_width = 0
    return markdown_text(h.handle(_decode(html)))


def _sluice(html: bytes, url: str) -> str:
    from sluice.webtools.convert import html_to_markdown

    return markdown_text(html_to_markdown(html, url).markdown)


def _trafilatura_text(html: bytes, url: str) -> str:
    import trafilatura

    return trafilatura.extract(_decode(html), url=url, favor_precision=False, include_comments=False) or ""


def _trafilatura_markdown(html: bytes, url: str) -> str:
    import trafilatura

    md = trafilatura.extract(_decode(html), url=url, output_format="markdown", include_links=True,
                             include_formatting=True, include_tables=True, include_comments=False)
    return markdown_text(md or "")


def _readability(html: bytes, url: str) -> str:
    import html2text
    from readability import Document

    summary = Document(_decode(html), url=url).summary(html_partial=True)
    h = html2text.HTML2Text(baseurl=url)
    h.body_width = 0
    return markdown_text(h.handle(summary))


EXTRACTORS: dict[str, Callable[[bytes, str], str]] = {
    "html2text (whole page)": _html2text,
    "trafilatura (text)": _trafilatura_text,
    "trafilatura (markdown, links)": _trafilatura_markdown,
    "readability-lxml + html2text": _readability,
    "sluice (markdown, links)": _sluice,
}


def quality(pages, names=None, log=print) -> dict[str, dict]:
    import logging

    logging.disable(logging.CRITICAL)  # trafilatura and readability log per page
    results = {}
    for name, fn in EXTRACTORS.items():
        if names and name not in names:
            continue
        counts, failed = [], 0
        start = time.perf_counter()
        try:
            for _key, html, true, url in pages:
                try:
                    pred = fn(html, url)
                except ImportError:
                    raise
                except Exception:  # an extractor failing on a page scores nothing for it
                    pred, failed = "", failed + 1
                counts.append(page_counts(true, pred))
        except ImportError as e:
            results[name] = {"error": f"not installed ({e.name})"}
            log(f"  {name:<32} not installed")
            continue
        elapsed = time.perf_counter() - start
        r = scores(counts)
        r.update(pages=len(pages), failed=failed, seconds=round(elapsed, 2),
                 mb_per_s=round(sum(len(p[1]) for p in pages) / 1e6 / elapsed, 2))
        results[name] = r
        log(f"  {name:<32} F1 {r['f1']:.3f}  P {r['precision']:.3f}  R {r['recall']:.3f}  "
            f"{r['mb_per_s']:.1f} MB/s")
    return results


# --- structure (bench.structure) ---------------------------------------------------


def _sluice_markdown(html: bytes | str, url: str) -> str:
    from sluice.webtools.convert import html_to_markdown

    return html_to_markdown(html, url).markdown


def structure(pages, log=print) -> dict:
    """The structure check on the held-out pages (reference: the labelled article
    body) and on the built pages (bench.structure_pages), for Sluice's markdown."""
    from bench import structure as S
    from bench import structure_pages as built

    held = S.summarise([S.check_page(html, true, _sluice_markdown(html, url)) for _k, html, true, url in pages])
    checked, facts = [], {}
    for name, (html, checks) in built.PAGES.items():
        md = _sluice_markdown(html, "https://news.example/article")
        checked.append(S.check_page(html, built.reference(html), md))
        for what, ok in checks.items():
            facts[f"{name}: {what}"] = bool(ok(md))
    out = {"held_out": held, "built": S.summarise(checked) | {"facts": facts}}
    for label, r in (("held-out", held), ("built pages", out["built"])):
        shares = "  ".join(f"{k} {r[k]['in_form']:.3f} (n={r[k]['n']})" for k in S.KINDS if r[k]["n"])
        log(f"  {label:<12} in form: {shares}")
        log(f"  {'':<12} tables {r['tables']}, pipe rows outside a table {r['loose_table_rows']} "
            f"({r['pages_with_loose_table_rows']} pages), prose in code blocks {r['prose_in_code_chars']} chars")
    failed = [f for f, ok in facts.items() if not ok]
    log(f"  built-page facts: {len(facts) - len(failed)}/{len(facts)} hold" + (f"; failing: {failed}" if failed else ""))
    return out


def structure_table(result: dict) -> list[str]:
    """Markdown rows for the report: the share in form per kind, and the validity counts."""
    from bench.structure import KINDS

    def cell(r, k):
        return f"{r[k]['in_form']:.3f} ({r[k]['n']})" if r[k]["n"] else "n/a"

    rows = ["| | " + " | ".join(KINDS) + " | pipe rows outside a table | prose in code (chars) |",
            "|---|" + "---:|" * (len(KINDS) + 2)]
    for label, key in (("held-out half", "held_out"), ("built pages", "built")):
        r = result[key]
        rows.append(f"| {label} | " + " | ".join(cell(r, k) for k in KINDS)
                    + f" | {r['loose_table_rows']} | {r['prose_in_code_chars']} |")
    return rows


# --- speed -------------------------------------------------------------------------


def speed(rounds: int = 7, log=print) -> dict:
    import html2text

    from bench.extraction_pages import boilerplate_heavy
    from sluice.webtools.convert import html_to_markdown

    page = boilerplate_heavy(2 * 1024 * 1024)
    text = page.decode("utf-8")

    def plain():
        h = html2text.HTML2Text(baseurl="https://news.example/")
        h.body_width = 0
        return h.handle(text)

    def sluice():
        return html_to_markdown(page, "https://news.example/").markdown

    times: dict[str, list[float]] = {"html2text": [], "sluice": []}
    sizes = {"html2text": len(plain()), "sluice": len(sluice())}  # warm-up, and output sizes
    for i in range(rounds):
        order = (("html2text", plain), ("sluice", sluice)) if i % 2 == 0 else (("sluice", sluice), ("html2text", plain))
        for name, fn in order:
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    mb = len(page) / 1e6
    out = {"page_bytes": len(page), "rounds": rounds}
    for name, ts in times.items():
        med = statistics.median(ts)
        out[name] = {"median_s": round(med, 4), "min_s": round(min(ts), 4), "max_s": round(max(ts), 4),
                     "mb_per_s": round(mb / med, 2), "markdown_chars": sizes[name]}
        log(f"  {name:<10} median {med * 1000:7.1f} ms (min {min(ts) * 1000:.1f}, max {max(ts) * 1000:.1f})  "
            f"{mb / med:6.2f} MB/s  -> {sizes[name]:,} chars of markdown")
    ratios = sorted(a / b for a, b in zip(times["html2text"], times["sluice"], strict=True))
    out["speedup_median"] = round(statistics.median(ratios), 2)
    out["speedup_range"] = [round(ratios[0], 2), round(ratios[-1], 2)]
    log(f"  sluice is {out['speedup_median']:.1f}x html2text's speed "
        f"(same-round ratios {ratios[0]:.1f}-{ratios[-1]:.1f})")
    return out


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m bench extraction", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dev", type=Path, default=None,
                   help="also score the tuning half (ids 0-7) of an upstream checkout at DIR")
    p.add_argument("--only", default=None, help="comma-separated extractor names (substring match)")
    p.add_argument("--rounds", type=int, default=7, help="speed rounds (default: %(default)s)")
    p.add_argument("--no-speed", action="store_true")
    p.add_argument("--no-structure", action="store_true")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results" / "extraction.json")
    args = p.parse_args(argv)
    names = None
    if args.only:
        wanted = [w.strip() for w in args.only.split(",") if w.strip()]
        names = {n for n in EXTRACTORS if any(w in n for w in wanted)}
    result: dict = {}
    held = load(HELD_OUT)
    print(f"held-out: {len(held)} pages of the article-extraction-benchmark", flush=True)
    result["held_out"] = quality(held, names)
    if not args.no_structure:
        print("structure (share in the right markdown form; (n) structures in the reference):", flush=True)
        result["structure"] = structure(held)
    if args.dev:
        dev = load(args.dev, lambda k: k[0] in "01234567")
        print(f"dev (tuning) half: {len(dev)} pages", flush=True)
        result["dev"] = quality(dev, names)
    if not args.no_speed:
        print("2 MiB boilerplate-heavy page, side by side:", flush=True)
        result["speed"] = speed(args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
