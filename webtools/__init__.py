"""Sluice's web tools for agents: fetch, source_read, read, request and sitemap, through the proxy, as text.

Every tool is a plain function returning a JSON-able dict, its result or
`{"error": {"code", "message", ...fields}}` (codes and meanings: `errors.ERRORS`,
rendered into the README). `client.py` sends every request through the Sluice
proxy; `fetch.py` (fetch, source_read), `read.py`, `request.py`, `sitemap.py`
are the tools; `convert.py` turns HTML into markdown or visible text;
`pdf.py` reads a PDF's text in a killable child process;
`window.py` windows and the envelope; `store.py` the captured sources;
`sanitize.py` the one sanitiser for every web-derived value printed outside
an envelope (titles, URLs, content types, error messages, search fields).

The tool table, `tools.TOOLS`, is what the CLI, the MCP server and the
function-calling schemas are generated from: `{short name: Tool}` with

    Tool(name="fetch", mcp_name="web_fetch", cli="fetch", function=fetch,
         description="<model-facing description>",
         params=(Param(name, type, description, default=REQUIRED, items=None), ...))

`type` is a JSON Schema type ("string", "integer", "object"); `items` the
schema of an object's values; a Param without a default is required.
`tools.json_schema(tool)` gives the parameters as JSON Schema
(`additionalProperties: false`), `tools.render(name, result)` the model-facing
text of a result (for fetch/source_read the result's own `text`; for an
image or PDF a one-line header to go with the binary part), and
`tools.call(name, arguments)` calls a tool with model-given arguments.
"""
