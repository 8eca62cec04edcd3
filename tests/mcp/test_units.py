"""The bridge's pure mappings: MCP input schemas made provider-safe, MCP results to ToolResult."""

from __future__ import annotations

import base64
import json

import pytest

from agent_bus.bus.messages import ImagePart, TextPart
from agent_bus.tools import ToolDefinitionError, check_provider_schema
from agent_bus.tools.mcp import parse_mcp_command, provider_safe, to_tool_result

mt = pytest.importorskip("mcp.types")


def test_refs_and_defs_are_inlined_and_objects_closed() -> None:
    schema = {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "Args", "type": "object",
        "properties": {"where": {"$ref": "#/$defs/Place"},
                       "when": {"$ref": "#/definitions/When", "description": "at"}},
        "required": ["where"],
        "$defs": {"Place": {"title": "Place", "type": "object",
                            "properties": {"city": {"type": "string"}}}},
        "definitions": {"When": {"type": "string", "enum": ["now", "later"]}},
    }
    flat = provider_safe(schema, "t")
    assert "$ref" not in json.dumps(flat) and check_provider_schema(flat) == []
    assert flat["properties"]["where"] == {"type": "object", "additionalProperties": False,
                                           "properties": {"city": {"type": "string"}}}
    assert flat["properties"]["when"] == {"type": "string", "enum": ["now", "later"],
                                          "description": "at"}
    assert provider_safe(None, "t") == {"type": "object", "properties": {},
                                        "additionalProperties": False}


@pytest.mark.parametrize("schema, expected", [
    ({"properties": {"n": {"$ref": "#/$defs/Node"}},
      "$defs": {"Node": {"properties": {"next": {"$ref": "#/$defs/Node"}}}}}, "recursive"),
    ({"properties": {"n": {"$ref": "#/$defs/Missing"}}}, "not define"),
])
def test_unusable_schemas_are_refused_naming_the_tool(schema: dict, expected: str) -> None:
    with pytest.raises(ToolDefinitionError, match=expected) as info:
        provider_safe(schema, "bad_tool")
    assert "bad_tool" in str(info.value)


def test_results_map_text_images_audio_resources_and_structured_content() -> None:
    png = b"\x89PNG\r\n\x1a\nxx"
    result = mt.CallToolResult(content=[
        mt.TextContent(type="text", text="hi"),
        mt.ImageContent(type="image", data=base64.b64encode(png).decode(), mime_type="image/png"),
        mt.AudioContent(type="audio", data=base64.b64encode(b"1234").decode(),
                        mime_type="audio/wav"),
        mt.EmbeddedResource(type="resource", resource=mt.TextResourceContents(
            uri="file:///a.txt", text="inside")),
    ], structured_content={"k": 1}, is_error=False)
    mapped = to_tool_result(result)
    assert mapped.content == [TextPart("hi"), ImagePart(png, "image/png"),
                              TextPart("[audio audio/wav, 4 bytes]"), TextPart("inside")]
    assert mapped.details == {"k": 1} and not mapped.is_error
    only_structured = to_tool_result(mt.CallToolResult(content=[], structured_content={"a": 2}))
    assert json.loads(only_structured.text) == {"a": 2}
    failed = to_tool_result(mt.CallToolResult(content=[mt.TextContent(type="text", text="no")],
                                              is_error=True))
    assert failed.is_error and failed.text == "no"


def test_mcp_flag_parsing_names_the_flag() -> None:
    spec = parse_mcp_command("python -m mcp_server_git --repository '/tmp/a b'")
    assert (spec.command, spec.args, spec.label()) == (
        "python", ["-m", "mcp_server_git", "--repository", "/tmp/a b"], "mcp_server_git")
    for bad in ("", "python 'unclosed"):
        with pytest.raises(ValueError, match="--mcp"):
            parse_mcp_command(bad)


def test_a_topology_mcp_server_needs_a_command_or_a_url() -> None:
    from agent_bus.agents.launch.topology import TopologyError, parse_topology

    base = '[[agents]]\nname = "a"\n[[workers]]\nname = "m"\ntools = []\n[[workers.mcp]]\n'
    topo = parse_topology((base + 'url = "http://127.0.0.1:9/mcp"\nprefix = "x_"\n').encode(),
                          "t.toml", as_json=False)
    assert topo.workers[0].mcp[0].url == "http://127.0.0.1:9/mcp"
    for bad in ('args = ["a"]\n', 'command = "srv"\nurl = "http://h/mcp"\n'):
        with pytest.raises(TopologyError, match=r"workers\[0\]\.mcp\[0\].*`command`.*`url`"):
            parse_topology((base + bad).encode(), "t.toml", as_json=False)


def test_a_tool_name_no_model_api_takes_is_left_out_by_the_bridge(
        caplog: pytest.LogCaptureFixture) -> None:
    from agent_bus.tools.mcp import McpBridge, McpServerSpec

    bridge = McpBridge(McpServerSpec(command="srv", prefix="fs."), host=None)  # type: ignore[arg-type]
    schema = {"type": "object", "properties": {}}
    assert bridge._info(mt.Tool(name="read", input_schema=schema)) is None  # `fs.read`
    assert "tool name 'fs.read' is not accepted" in caplog.text
    fine = McpBridge(McpServerSpec(command="srv", prefix="fs_"), host=None)  # type: ignore[arg-type]
    info = fine._info(mt.Tool(name="read", input_schema=schema))
    assert info is not None and info.name == "fs_read"
