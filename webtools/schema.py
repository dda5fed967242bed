"""Function-calling definitions of the web tools, generated from the tool table.

`sluice tools schema --format openai|anthropic` prints `definitions(format)`;
the MCP server (webtools.mcp_server) lists the same names, descriptions and
parameter schemas. Nothing here names a tool: every entry of
`tools.TOOLS` appears, so a tool added to the table appears in the MCP
server and in both formats without a change here.

- `description(tool)`: the table's model-facing description, whole: the
  error codes it names (`error_codes`) are the ones a model can act on; the
  others (setup: proxy, TLS, store, keys) explain themselves in their
  message. Each description is at most MAX_DESCRIPTION_CHARS and the
  printed anthropic schema at most MAX_SCHEMA_BYTES (a unit test checks
  both on the full table): these definitions ride on every model turn.
- `parameters(tool)`: JSON Schema of the arguments, `additionalProperties:
  false` (tools.json_schema).
- `definitions("openai")`: a Chat Completions `tools` array,
  `[{"type": "function", "function": {"name", "description", "parameters"}}]`;
  `definitions("anthropic")`: a Messages API `tools` array,
  `[{"name", "description", "input_schema"}]`. The names are the MCP names
  (`web_fetch`, ...), which the descriptions use to refer to each other.
  `definitions(fmt, tools)` gives only the tools named (`tools.select`,
  `sluice tools schema --tools web_fetch,web_search`); `dumps` is the
  printed text.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable

from sluice.webtools.errors import ERRORS
from sluice.webtools.tools import TOOLS, Tool, json_schema

FORMATS = ("openai", "anthropic")

_WORD = re.compile(r"\b[a-z]+_[a-z_]+\b")  # snake_case words; the codes among them are the keys of ERRORS

# The budget a model carries on every turn (issue 25): each description, and
# the whole `sluice tools schema --format anthropic` output as printed.
MAX_DESCRIPTION_CHARS = 700
MAX_SCHEMA_BYTES = 7000


def error_codes(tool: Tool) -> list[str]:
    """The error codes `tool`'s description names, in that order: the ones a
    model can act on. Any other code still explains itself in its message."""
    return [c for c in dict.fromkeys(_WORD.findall(tool.description)) if c in ERRORS]


def description(tool: Tool) -> str:
    """The model-facing description: the table's, as it is."""
    return tool.description.strip()


def parameters(tool: Tool) -> dict:
    return copy.deepcopy(json_schema(tool))


def definition(tool: Tool, fmt: str) -> dict:
    if fmt == "openai":
        return {"type": "function",
                "function": {"name": tool.mcp_name, "description": description(tool), "parameters": parameters(tool)}}
    if fmt == "anthropic":
        return {"name": tool.mcp_name, "description": description(tool), "input_schema": parameters(tool)}
    raise ValueError(f"unknown format {fmt!r} (one of {', '.join(FORMATS)})")


def definitions(fmt: str, tools: Iterable[Tool] | None = None) -> list[dict]:
    """The given tools (default: every tool of the table), in table order, in the given format."""
    return [definition(tool, fmt) for tool in (TOOLS.values() if tools is None else tools)]


def dumps(fmt: str, tools: Iterable[Tool] | None = None) -> str:
    """What `sluice tools schema` prints (the text MAX_SCHEMA_BYTES bounds)."""
    return json.dumps(definitions(fmt, tools), ensure_ascii=False, indent=2)
