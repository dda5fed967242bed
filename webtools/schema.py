"""Function-calling definitions of the web tools, generated from the tool table.

`sluice tools schema --format openai|anthropic` prints `definitions(format)`;
the MCP server (webtools.mcp_server) lists the same names, descriptions and
parameter schemas. Nothing here names a tool: every entry of
`tools.TOOLS` appears, so a tool added to the table appears in the MCP
server and in both formats without a change here.

- `description(tool)`: the table's model-facing description, followed by the
  error codes the tool can return with their meanings from `errors.ERRORS`:
  the codes its description names, `web_bad_argument`, and, for a tool that
  takes a `url`, the codes of the route through the proxy (`ROUTE_CODES`).
- `parameters(tool)`: JSON Schema of the arguments, `additionalProperties:
  false` (tools.json_schema).
- `definitions("openai")`: a Chat Completions `tools` array,
  `[{"type": "function", "function": {"name", "description", "parameters"}}]`;
  `definitions("anthropic")`: a Messages API `tools` array,
  `[{"name", "description", "input_schema"}]`. The names are the MCP names
  (`web_fetch`, ...), which the descriptions use to refer to each other.
"""

from __future__ import annotations

import copy
import re

from sluice.webtools.errors import ERRORS
from sluice.webtools.tools import TOOLS, Tool, json_schema

FORMATS = ("openai", "anthropic")

# What any tool that sends a request may answer, whatever its own codes:
# the route through the proxy, the URL check, and the transport caps.
ROUTE_CODES = (
    "web_bad_url", "web_blocked", "web_no_proxy", "web_proxy_unreachable", "web_proxy_auth", "web_timeout",
    "web_unreachable", "web_response_incomplete", "web_tls_error", "web_too_many_redirects", "web_too_large",
    "web_unsupported_encoding",
)
_WORD = re.compile(r"\b[a-z]+_[a-z_]+\b")  # snake_case words; the codes among them are the keys of ERRORS

ERROR_SHAPE = ('An error comes back as {"error": {"code": ..., "message": ..., ...fields}}; '
               "the message says what to do. Codes:")


def error_codes(tool: Tool) -> list[str]:
    """The codes `tool` can return: those its description names (in that
    order), then web_bad_argument, then the route codes if it takes a url."""
    codes = [c for c in dict.fromkeys(_WORD.findall(tool.description)) if c in ERRORS]
    extra = ["web_bad_argument"]
    if any(p.name == "url" for p in tool.params):
        extra += ROUTE_CODES
    return codes + [c for c in extra if c not in codes]


def description(tool: Tool) -> str:
    """The model-facing description with its error codes explained."""
    lines = [tool.description.rstrip(), "", ERROR_SHAPE]
    lines += [f"- {code}: {ERRORS[code]}" for code in error_codes(tool)]
    return "\n".join(lines)


def parameters(tool: Tool) -> dict:
    return copy.deepcopy(json_schema(tool))


def definition(tool: Tool, fmt: str) -> dict:
    if fmt == "openai":
        return {"type": "function",
                "function": {"name": tool.mcp_name, "description": description(tool), "parameters": parameters(tool)}}
    if fmt == "anthropic":
        return {"name": tool.mcp_name, "description": description(tool), "input_schema": parameters(tool)}
    raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")


def definitions(fmt: str) -> list[dict]:
    """Every tool of the table, in table order, in the given format."""
    return [definition(tool, fmt) for tool in TOOLS.values()]
