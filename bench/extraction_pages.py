"""A deterministic boilerplate-heavy news page of a chosen size (for `bench.extraction`'s speed test).

Shaped like a large real news page: a mega-menu of several hundred links, a
cookie banner, inline scripts and a JSON state blob, a long article (the
only content), a sidebar of related links, a comment section, and a footer
of link columns. The boilerplate (menus, related links, comments, scripts) is
grown until the page reaches the size asked for; the article stays the same.
"""

from __future__ import annotations

import json
import random

_WORDS = ("policy network agent proxy request origin answer server client market city council report "
          "budget river school weather season player match energy price science study health water "
          "transport housing election museum festival history record company product service update").split()


def _sentence(rng: random.Random, n: int | None = None) -> str:
    words = [rng.choice(_WORDS) for _ in range(n or rng.randint(8, 22))]
    return " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", ", as reported."])


def _para(rng: random.Random, sentences: int) -> str:
    return " ".join(_sentence(rng) for _ in range(sentences))


def article(rng: random.Random) -> str:
    parts = ['<article class="story"><h1 class="headline">Council approves the river budget</h1>',
             '<p class="byline">By A. Writer, <time datetime="2024-05-01">May 1, 2024</time></p>',
             '<div class="story-body">']
    for i in range(30):
        if i % 8 == 4:
            parts.append(f"<h2>{_sentence(rng, 5)[:-1]}</h2>")
        text = _para(rng, rng.randint(3, 6))
        if i % 5 == 2:
            text += f' See <a href="/story/{i}">the earlier report</a>.'
        parts.append(f"<p>{text}</p>")
        if i == 12:
            parts.append("<ul>" + "".join(f"<li>{_sentence(rng, 7)}</li>" for _ in range(5)) + "</ul>")
        if i == 20:
            parts.append("<table><tr><th>Item</th><th>Cost</th></tr>"
                         + "".join(f"<tr><td>{rng.choice(_WORDS)}</td><td>{rng.randint(1, 999)}</td></tr>"
                                   for _ in range(6)) + "</table>")
    parts.append("</div></article>")
    return "".join(parts)


def _menu(rng: random.Random, n: int) -> str:
    items = []
    for i in range(n):
        w = rng.choice(_WORDS)
        items.append(f'<li class="menu-item"><a class="menu-link" href="/section/{w}/{i}">{w.title()} {i}</a></li>')
    return '<nav class="mega-menu" role="navigation"><ul class="menu">' + "".join(items) + "</ul></nav>"


def _script(rng: random.Random, n: int) -> str:
    state = {"items": [{"id": i, "title": _sentence(rng, 6), "tags": rng.sample(_WORDS, 3)} for i in range(n)]}
    return ('<script>window.__STATE__ = ' + json.dumps(state) + ';</script>'
            '<script>(function(){var a=document.querySelectorAll(".menu-link");for(var i=0;i<a.length;i++)'
            '{a[i].addEventListener("click",function(e){window.track&&window.track(e.target.href)})}})();</script>')


def _related(rng: random.Random, n: int) -> str:
    cards = "".join(f'<div class="card"><a href="/story/r{i}"><img src="/img/{i}.jpg" alt="">'
                    f'<span class="card-title">{_sentence(rng, 8)}</span></a></div>' for i in range(n))
    return f'<aside class="sidebar related"><h3>Most read</h3>{cards}</aside>'


def _comments(rng: random.Random, n: int) -> str:
    items = "".join(f'<li class="comment"><div class="comment-author">user{i}</div>'
                    f'<div class="comment-body"><p>{_para(rng, 2)}</p></div>'
                    f'<a class="reply" href="#c{i}">Reply</a></li>' for i in range(n))
    return f'<section id="comments" class="comments"><h3>Comments</h3><ol>{items}</ol></section>'


def _footer(rng: random.Random, n: int) -> str:
    cols = "".join(f'<div class="footer-col"><h4>{rng.choice(_WORDS).title()}</h4><ul>'
                   + "".join(f'<li><a href="/f/{c}/{j}">{rng.choice(_WORDS)}</a></li>' for j in range(12))
                   + "</ul></div>" for c in range(n))
    return f'<footer class="site-footer">{cols}<p>&copy; 2024 News Example</p></footer>'


def boilerplate_heavy(size: int, seed: int = 11) -> bytes:
    """UTF-8 bytes of a page of about `size` bytes (at least the article and one of each box)."""
    rng = random.Random(seed)
    body = article(rng)
    head = ('<!doctype html><html lang="en"><head><meta charset="utf-8"><title>Council approves the river '
            'budget | News Example</title><style>' + ".x{color:red}" * 200 + "</style></head><body>")
    banner = ('<div id="cookie-banner" class="cookie-consent">We use cookies to improve your experience. '
              '<button>Accept all</button> <a href="/privacy">Privacy</a></div>')
    scale = 1
    while True:
        r = random.Random(seed + scale)
        page = (head + banner + _menu(r, 40 * scale) + _script(r, 25 * scale)
                + '<div class="layout"><main id="main">' + body + _comments(r, 8 * scale) + "</main>"
                + _related(r, 10 * scale) + "</div>" + _footer(r, 2 * scale)
                + _script(r, 10 * scale) + "</body></html>")
        data = page.encode("utf-8")
        if len(data) >= size:
            return data
        scale = max(scale + 1, int(scale * size / len(data)))
