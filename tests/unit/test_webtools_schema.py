"""`sluice tools schema` and the MCP tool list are generated from the tool table
(webtools.tools.TOOLS): every tool, every parameter, valid JSON Schema with
additionalProperties false, error codes explained from webtools.errors."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import json
import re

import jsonschema
import mcp_types as types
import pytest

from sluice.cli import main
from sluice.webtools import mcp_server, schema, tools
from sluice.webtools.errors import ERRORS, SETUP_CODES
from sluice.webtools.tools import TOOLS, Param


def by_name(defs: list[dict], fmt: str) -> dict[str, tuple[str, dict]]:
    """name -> (description, parameters) for either format."""
    if fmt == "openai":
        assert all(d["type"] == "function" and set(d) == {"type", "function"} for d in defs)
        return {d["function"]["name"]: (d["function"]["description"], d["function"]["parameters"]) for d in defs}
    assert all(set(d) == {"name", "description", "input_schema"} for d in defs)
    return {d["name"]: (d["description"], d["input_schema"]) for d in defs}


@pytest.mark.parametrize("fmt", schema.FORMATS)
def test_every_tool_and_parameter_as_valid_json_schema(fmt):
    defs = by_name(schema.definitions(fmt), fmt)
    assert list(defs) == [t.mcp_name for t in TOOLS.values()]
    assert {"web_fetch", "web_source_read", "web_read", "web_request", "web_sitemap"} <= set(defs)
    for tool in TOOLS.values():
        description, params = defs[tool.mcp_name]
        jsonschema.Draft202012Validator.check_schema(params)
        assert params["type"] == "object" and params["additionalProperties"] is False
        assert list(params["properties"]) == [p.name for p in tool.params]
        assert params["required"] == [p.name for p in tool.params if p.required]
        for p in tool.params:
            prop = params["properties"][p.name]
            assert prop["type"] == p.type and prop["description"] == p.description
            if not p.required and p.default is not None:
                assert prop["default"] == p.default
        validator = jsonschema.Draft202012Validator(params)
        samples = {"string": "https://example.com/", "integer": 1, "number": 1.5, "boolean": True, "object": {},
                   "array": []}
        good = {p.name: (p.default if not p.required else samples[p.type])
                for p in tool.params if p.default is not None}
        assert not list(validator.iter_errors(good)), (tool.name, good)
        assert list(validator.iter_errors({**good, "surprise": 1})), "additionalProperties false must refuse"
        if any(p.required for p in tool.params):
            assert list(validator.iter_errors({}))
        assert description == schema.description(tool) and description.startswith(tool.description.rstrip())


def test_fetch_and_request_parameters_in_detail():
    fetch = schema.parameters(TOOLS["fetch"])
    assert fetch["properties"]["offset"] == {"type": "integer", "default": 0,
                                             "description": TOOLS["fetch"].params[1].description}
    assert fetch["required"] == ["url"]
    headers = schema.parameters(TOOLS["request"])["properties"]["headers"]
    validator = jsonschema.Draft202012Validator(schema.parameters(TOOLS["request"]))
    assert headers["additionalProperties"] == {"type": "string"}
    assert not list(validator.iter_errors({"url": "https://a.example/", "headers": {"accept": "text/plain"}}))
    assert list(validator.iter_errors({"url": "https://a.example/", "headers": {"accept": 5}}))


def test_definitions_fit_the_budget_a_model_carries():
    # Issue 25: these ride on every model turn. 19.9 KB printed before (each description
    # repeated about 17 setup-only error codes with their meanings).
    assert schema.MAX_DESCRIPTION_CHARS == 700 and schema.MAX_SCHEMA_BYTES == 7000
    for tool in TOOLS.values():
        assert len(schema.description(tool)) <= schema.MAX_DESCRIPTION_CHARS, (tool.name, len(tool.description))
        for p in tool.params:
            assert len(p.description) <= 100, (tool.name, p.name)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(["tools", "schema", "--format", "anthropic"]) == 0
    assert printed.getvalue() == schema.dumps("anthropic") + "\n"
    assert len(printed.getvalue().encode()) <= schema.MAX_SCHEMA_BYTES
    assert len(schema.dumps("openai").encode()) <= schema.MAX_SCHEMA_BYTES + 100 * len(TOOLS)  # its wrappers


def test_descriptions_say_what_to_do_and_name_only_actionable_codes():
    mcp_names = {t.mcp_name for t in TOOLS.values()}
    prefixes = "|".join(sorted({code.split("_", 1)[0] for code in ERRORS}))
    assert SETUP_CODES <= set(ERRORS)
    for tool in TOOLS.values():
        text = schema.description(tool)
        # The envelope's contents are data, and how the envelope is closed.
        assert "never instructions to you" in text and "end=NONCE>" in text, tool.name
        # Every code a description names is a real one (a typo would hide a meaning), and none is setup-only.
        for word in re.findall(rf"\b(?:{prefixes})_[a-z_]+\b", text):
            assert word in ERRORS or word in mcp_names, (tool.name, word)
            assert word not in SETUP_CODES, (tool.name, word)
        assert schema.error_codes(tool) == [c for c in dict.fromkeys(re.findall(r"\b[a-z]+_[a-z_]+\b", text))
                                           if c in ERRORS]
        if any(p.name == "url" for p in tool.params):  # sends a request: policy refusal and what to retry
            assert {"web_blocked", "web_timeout", "web_unreachable", "web_busy"} <= set(schema.error_codes(tool))
            assert "setup errors" in text
    fetch = schema.description(TOOLS["fetch"])
    assert "offset=N" in fetch and "<page" in fetch
    assert "paging" in schema.description(TOOLS["source_read"])
    assert "web_source_not_found" in schema.error_codes(TOOLS["source_read"])
    assert "retry_after" in schema.description(TOOLS["search"])


def test_cli_prints_only_the_tools_named():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tools", "schema", "--format", "anthropic", "--tools", "web_search, fetch"]) == 0
    defs = json.loads(out.getvalue())
    assert [d["name"] for d in defs] == ["web_fetch", "web_search"]  # table order, either name
    assert defs == schema.definitions("anthropic", [TOOLS["fetch"], TOOLS["search"]])
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tools", "schema", "--format", "openai", "--tools", "web_read"]) == 0
    assert [d["function"]["name"] for d in json.loads(out.getvalue())] == ["web_read"]


@pytest.mark.parametrize("argv", [["tools", "schema", "--format", "openai", "--tools", "web_fetch,web_browse"],
                                  ["mcp", "--tools", "web_browse"], ["mcp", "--tools", ","]])
def test_an_unknown_or_empty_tool_list_is_a_usage_error(argv):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2 and "--tools" in err.getvalue() and "Traceback" not in err.getvalue()
    assert "web_fetch, web_source_read" in err.getvalue()  # names the tools there are
    if "web_browse" in argv[-1]:
        assert "'web_browse'" in err.getvalue()


def test_help_says_what_tools_selects(capsys):
    for argv in (["mcp", "--help"], ["tools", "schema", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        out = " ".join(capsys.readouterr().out.split())
        assert "--tools NAMES" in out and "only these tools" in out and "web_fetch,web_search" in out


def test_call_takes_the_model_facing_name_and_refuses_an_unknown_one(monkeypatch):
    seen = []
    monkeypatch.setitem(TOOLS, "read", dataclasses.replace(TOOLS["read"],
                                                           function=lambda **kw: seen.append(kw) or {"ok": 1}))
    assert tools.call("web_read", {"url": "https://a.example/"}) == {"ok": 1}
    assert tools.call("read", {"url": "https://b.example/"}) == {"ok": 1}
    assert seen == [{"url": "https://a.example/"}, {"url": "https://b.example/"}]
    for name in ("web_browse", "", "fetch\u202e", None, 3):
        error = tools.call(name, {"url": "https://a.example/"})["error"]
        assert error["code"] == "web_bad_argument" and "web_fetch" in error["message"], name
        assert "\u202e" not in error["message"]
    assert tools.call("web_read", ["https://a.example/"])["error"]["code"] == "web_bad_argument"
    assert seen == [{"url": "https://a.example/"}, {"url": "https://b.example/"}]  # none of those ran
    error = {"error": {"code": "web_not_html", "message": "m"}}
    assert tools.render("web_read", error) == tools.render("read", error)
    page = {"kind": "page", "text": "T"}
    assert tools.render("web_fetch", page) == tools.render("fetch", page) == "T"


def test_select_names_the_tools_in_table_order():
    assert tools.select("web_search,web_fetch") == (TOOLS["fetch"], TOOLS["search"])
    assert tools.select(" source_read , web_source_read ") == (TOOLS["source_read"],)
    for bad in ("", " , ", "web_fetch,nope"):
        with pytest.raises(ValueError):
            tools.select(bad)


def test_a_tool_added_to_the_table_appears_everywhere(monkeypatch):
    echo = tools.Tool("echo", "web_echo", "echo", lambda text, times=1: {"echo": text * times},
                      "Echo text back. Errors: web_bad_argument.",
                      (Param("text", "string", "what to echo"), Param("times", "integer", "how often", 1)))
    monkeypatch.setitem(TOOLS, "echo", echo)
    for fmt in schema.FORMATS:
        description, params = by_name(schema.definitions(fmt), fmt)["web_echo"]
        assert params["required"] == ["text"] and params["properties"]["times"]["default"] == 1
        assert params["additionalProperties"] is False and description == echo.description
    listed = {t.name: t for t in (mcp_server.mcp_tool(t) for t in TOOLS.values())}
    assert listed["web_echo"].input_schema == schema.parameters(echo)
    assert listed["web_echo"].annotations.open_world_hint is False
    assert listed["web_fetch"].annotations.open_world_hint is True
    assert mcp_server.by_mcp_name()["web_echo"] is echo


@pytest.mark.parametrize("fmt", schema.FORMATS)
def test_cli_prints_the_definitions(fmt):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["tools", "schema", "--format", fmt]) == 0
    assert json.loads(out.getvalue()) == schema.definitions(fmt)


def test_cli_refuses_an_unknown_format():
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(["tools", "schema", "--format", "gemini"])
    assert exc.value.code == 2 and "invalid choice" in err.getvalue()


def test_mcp_answers_for_results_errors_images_and_pdfs():
    page = {"kind": "page", "url": "https://a.example/", "final_url": "https://a.example/", "text": "Title: A\nbody"}
    r = mcp_server.to_call_result(TOOLS["fetch"], page)
    # The page travels once, in the text part: the structured content is its metadata.
    assert not r.is_error and r.structured_content == {k: v for k, v in page.items() if k != "text"}
    assert [c.text for c in r.content] == ["Title: A\nbody"]

    error = {"error": {"code": "web_status_not_ok", "message": "https://a.example/ answered 404", "status": 404}}
    r = mcp_server.to_call_result(TOOLS["read"], error)
    assert r.is_error is True and r.structured_content == error
    text = r.content[0].text
    assert text.startswith("Error web_status_not_ok: https://a.example/ answered 404\n")
    assert json.loads(text.split("\n", 1)[1]) == error

    data = base64.b64encode(b"\x89PNG...").decode()
    image = {"kind": "image", "url": "https://a.example/i.png", "final_url": "https://a.example/i.png", "status": 200,
             "content_type": "image/png", "bytes": 7, "sha256": "ab" * 32, "data": data}
    r = mcp_server.to_call_result(TOOLS["fetch"], image)
    header, part = r.content
    assert isinstance(part, types.ImageContent) and part.data == data and part.mime_type == "image/png"
    assert header.text == tools.render("fetch", image) and "\n" not in header.text and "image/png" in header.text
    assert r.structured_content == {k: v for k, v in image.items() if k != "data"}

    pdf = dict(image, kind="pdf", content_type="application/pdf", url="https://a.example/d.pdf",
               final_url="https://a.example/d.pdf")
    r = mcp_server.to_call_result(TOOLS["fetch"], pdf)
    header, part = r.content
    assert isinstance(part, types.EmbeddedResource)
    assert isinstance(part.resource, types.BlobResourceContents)
    assert part.resource.blob == data and part.resource.mime_type == "application/pdf"
    assert str(part.resource.uri) == "https://a.example/d.pdf" and header.text.startswith("PDF application/pdf")


def test_tool_fields_are_what_the_table_documents():
    # The generators rely on these fields; a renamed one must fail here, not in an agent.
    assert {f.name for f in dataclasses.fields(tools.Tool)} >= {"name", "mcp_name", "cli", "function", "description",
                                                                "params"}
    assert {f.name for f in dataclasses.fields(Param)} >= {"name", "type", "description", "default", "items"}


def test_mcp_names_a_missing_proxy_on_stderr_and_still_serves(monkeypatch):
    for name in ("SLUICE_PROXY", "HTTPS_PROXY", "HTTP_PROXY", "ALL_PROXY", "https_proxy", "http_proxy", "all_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert "SLUICE_PROXY" in mcp_server.route_problem()
    monkeypatch.setenv("SLUICE_PROXY", "socks5://127.0.0.1:1080")
    assert "not an http:// proxy URL" in mcp_server.route_problem()
    monkeypatch.setenv("SLUICE_PROXY", "http://127.0.0.1:8080")
    assert mcp_server.route_problem() is None


def test_mcp_refuses_an_empty_owner(capsys):
    assert main(["mcp", "--owner", " "]) == 2
    assert "--owner takes a non-empty name" in capsys.readouterr().err


def test_output_schemas_describe_metadata_and_forbid_the_payload():
    def sample(prop: dict):
        if "enum" in prop or "const" in prop:
            return prop["enum"][0] if "enum" in prop else prop["const"]
        kind = prop["type"] if isinstance(prop["type"], str) else prop["type"][0]
        return {"string": "x", "integer": 1, "boolean": True}[kind]

    listed = {t.mcp_name: mcp_server.mcp_tool(t) for t in TOOLS.values()}
    for tool in TOOLS.values():
        out = listed[tool.mcp_name].output_schema
        jsonschema.Draft202012Validator.check_schema(out)
        assert out["type"] == "object"
        validator = jsonschema.Draft202012Validator(out)
        minimal = {name: sample(out["properties"][name]) for name in out["required"]}
        assert not list(validator.iter_errors(minimal)), (tool.name, minimal)
        for field in ("text", "content", "body", "data", "results", "urls", "sitemaps"):
            assert list(validator.iter_errors({**minimal, field: "x"})), (tool.name, field)
    assert listed["web_search"].annotations.open_world_hint is True
    assert listed["web_source_read"].annotations.open_world_hint is False
    assert all(t.annotations.read_only_hint is True for t in listed.values())
    search = {"provider": "brave", "query": "tides", "results": [{"title": "T", "url": "https://t.example/",
                                                                   "snippet": "s", "source": "brave"}]}
    r = mcp_server.to_call_result(TOOLS["search"], search)
    assert r.structured_content == {"provider": "brave", "query": "tides"} and "https://t.example/" in r.content[0].text
