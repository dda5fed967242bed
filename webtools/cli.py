"""`sluice fetch | source-read | read | request | sitemap | search ... [--json]`.

Each prints the model-facing text (default) or the result dict (`--json`),
and exits 1 on an error (the message, or the error dict with --json). The
text carries no terminal escape sequence or control character (tab and
newline aside: webtools.sanitize.for_terminal); the JSON writes C1
controls, bidi and zero-width characters as \\u escapes. The
environment configures them as for any caller: SLUICE_PROXY (or
HTTPS_PROXY/HTTP_PROXY/ALL_PROXY), SLUICE_CA_CERT, SLUICE_OWNER,
SLUICE_SOURCES; search also SLUICE_SEARCH_PROVIDER and the providers' keys/URLs.
"""

from __future__ import annotations

import argparse
import json
import sys

from sluice.webtools import sanitize

COMMANDS = ("fetch", "source-read", "read", "request", "sitemap", "search")
EXIT_ERROR = 1


def add_parsers(sub) -> None:
    """Add the web tool subcommands to the `sluice` parser's subparsers."""
    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true",
                       help="print the result dict as JSON instead of the model-facing text")

    p = sub.add_parser("fetch", help="web tool: read a page through the proxy as markdown, one window at a time",
                       description="Fetch URL through the Sluice proxy (SLUICE_PROXY) and print one window of it as "
                                   "markdown in its envelope; images and PDFs as base64 with --json. Exit 1 on an "
                                   "error.")
    p.add_argument("url", metavar="URL")
    p.add_argument("--offset", type=int, default=0, metavar="N", help="first character of the window (default 0)")
    p.add_argument("--max-chars", type=int, default=40000, metavar="N", help="window size (default 40000)")
    p.add_argument("--render", action="store_true", help="load the page in headless Chromium (its scripts run), "
                   "through the proxy only; needs the render extra")
    p.add_argument("--screenshot", action="store_true", help="with --render: a PNG of the viewport (its base64 "
                   "in --json's screenshot_data)")
    common(p)

    p = sub.add_parser("source-read", help="web tool: another window of a page fetched earlier, from the store",
                       description="Print a window of a source fetched earlier by this owner (SLUICE_OWNER), from the "
                                   "source store (SLUICE_SOURCES), with no network request.")
    p.add_argument("source_id", metavar="ID")
    p.add_argument("--offset", type=int, default=0, metavar="N")
    p.add_argument("--max-chars", type=int, default=40000, metavar="N")
    common(p)

    p = sub.add_parser("read", help="web tool: a page's whole visible text and its sha256")
    p.add_argument("url", metavar="URL")
    common(p)

    p = sub.add_parser("request", help="web tool: one GET, the text or JSON body with status and sha256")
    p.add_argument("url", metavar="URL")
    p.add_argument("--method", default="GET", metavar="M", help="GET, the only method")
    p.add_argument("--header", action="append", default=[], metavar="'NAME: VALUE'", dest="headers",
                   help="accept or accept-language, repeatable")
    common(p)

    p = sub.add_parser("sitemap", help="web tool: the entries of an XML sitemap or sitemap index")
    p.add_argument("url", metavar="URL")
    common(p)

    p = sub.add_parser("search", help="web tool: search the web through the proxy (Serper, Brave, Tavily, Firecrawl, "
                                      "SearXNG, DuckDuckGo)",
                       description="Search the web through the Sluice proxy. The provider is --provider, else "
                                   "SLUICE_SEARCH_PROVIDER, else the first configured of SERPER_API_KEY, "
                                   "BRAVE_SEARCH_API_KEY, TAVILY_API_KEY, FIRECRAWL_API_KEY/FIRECRAWL_URL, "
                                   "SEARXNG_URL, else DuckDuckGo. Keys come from the environment (or VAR_FILE), never "
                                   "from "
                                   "arguments. Exit 1 on an error.")
    p.add_argument("query", metavar="QUERY", nargs="+", help="the words to search for")
    p.add_argument("--count", type=int, default=10, metavar="N", help="how many results, 1 to 20 (default 10)")
    p.add_argument("--provider", default=None, metavar="P",
                   help="serper, brave, tavily, firecrawl, searxng, duckduckgo or none")
    common(p)


def dispatch(args) -> int:
    from sluice.webtools.tools import call, render

    command = args.command
    if command == "fetch":
        name, kwargs = "fetch", {"url": args.url, "offset": args.offset, "max_chars": args.max_chars}
        if getattr(args, "render", False) or getattr(args, "screenshot", False):
            kwargs.update(render=args.render, screenshot=args.screenshot)
    elif command == "source-read":
        name, kwargs = "source_read", {"source_id": args.source_id, "offset": args.offset, "max_chars": args.max_chars}
    elif command == "request":
        headers = {}
        for line in args.headers:
            key, sep, value = line.partition(":")
            if not sep:
                print(f"sluice: --header takes 'NAME: VALUE' (got {line!r})", file=sys.stderr)
                return 2
            headers[key.strip()] = value.strip()
        name, kwargs = "request", {"url": args.url, "method": args.method, "headers": headers}
    elif command == "search":
        name, kwargs = "search", {"query": " ".join(args.query), "count": args.count, "provider": args.provider}
    else:
        name, kwargs = command, {"url": args.url}
    result = call(name, kwargs)  # the same argument bounds as over MCP
    failed = "error" in result
    if args.json:
        print(json_for_terminal(result))
    else:
        print(sanitize.for_terminal(render(name, result)), file=sys.stderr if failed else sys.stdout)
    return EXIT_ERROR if failed else 0


def json_for_terminal(result: dict) -> str:
    return sanitize.json_for_terminal(json.dumps(result, ensure_ascii=False, indent=2))


# `sluice mcp` and `sluice tools schema`: the agent integration, both made
# from the tool table (webtools.tools.TOOLS).
AGENT_COMMANDS = ("mcp", "tools")


def tool_list(spec: str):
    """argparse type of --tools: the named tools, or a usage error (exit 2)."""
    from sluice.webtools.tools import select

    try:
        return select(spec)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_tools_flag(p: argparse.ArgumentParser, what: str) -> None:
    from sluice.webtools.tools import TOOLS

    p.add_argument("--tools", type=tool_list, default=None, metavar="NAMES",
                   help=f"{what} only these tools, comma-separated (e.g. web_fetch,web_search; of "
                        f"{', '.join(t.mcp_name for t in TOOLS.values())}; default: all)")


def add_agent_parsers(sub) -> None:
    """Add `mcp` and `tools schema` to the `sluice` parser's subparsers."""
    p = sub.add_parser("mcp", help="serve the web tools to an agent over MCP (stdio)",
                       description="Serve the web tools (web_fetch, web_source_read, web_read, web_request, "
                                   "web_sitemap, ...) over MCP on stdin/stdout until the client closes stdin. "
                                   "Every request goes through the proxy in SLUICE_PROXY (or HTTPS_PROXY/"
                                   "HTTP_PROXY/ALL_PROXY); SLUICE_CA_CERT, SLUICE_SOURCES as for the CLI tools.")
    p.add_argument("--owner", default=None, metavar="NAME",
                   help="owner of the sources this server captures and may read back (default: $SLUICE_OWNER, "
                        "else a random one for this server, printed on stderr)")
    add_tools_flag(p, "serve (list and answer)")

    p = sub.add_parser("tools", help="the web tools' function-calling definitions",
                       description="Print the web tools' definitions for a model API.")
    tsub = p.add_subparsers(dest="tools_command", required=True, metavar="SUBCOMMAND")
    s = tsub.add_parser("schema", help="print the function-calling definitions (JSON) of the web tools",
                        description="Print a JSON array of function-calling definitions of every web tool (or "
                                    "only those --tools names), "
                                    "generated from the same table as the MCP server: openai (Chat Completions "
                                    "tools: type function, name, description, parameters) or anthropic (Messages "
                                    "API tools: name, description, input_schema). Parameters are JSON Schema with "
                                    "additionalProperties: false.")
    s.add_argument("--format", choices=("openai", "anthropic"), required=True)
    add_tools_flag(s, "print")


def dispatch_agent(args) -> int:
    if args.command == "mcp":
        from sluice.webtools.mcp_server import run

        return run(args.owner, args.tools)
    from sluice.webtools.schema import dumps

    print(dumps(args.format, args.tools))
    return 0
