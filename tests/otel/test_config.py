"""`busctl otel`'s configuration: endpoint from the standard variables, headers, the state file."""

from __future__ import annotations

from pathlib import Path

import pytest

from agent_bus.bus.otel import (
    DEFAULT_ENDPOINT,
    OtelState,
    default_endpoint,
    load_state,
    parse_headers,
    save_state,
)


def test_endpoint_follows_the_otel_variables() -> None:
    assert default_endpoint({}) == DEFAULT_ENDPOINT
    assert default_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318/"}) == \
        "http://c:4318/v1/traces"
    assert default_endpoint({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4318",
                             "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://t/x"}) == "http://t/x"


def test_headers_and_a_bad_one_named() -> None:
    assert parse_headers(["a=1", " b = x=y "]) == {"a": "1", "b": "x=y"}
    with pytest.raises(ValueError, match="--header 'oops': expected KEY=VALUE"):
        parse_headers(["oops"])


def test_state_file_round_trip_and_a_corrupt_one_starts_over(tmp_path: Path) -> None:
    path = tmp_path / "otel.json"
    assert load_state(path) == OtelState()
    save_state(path, OtelState(seq=42, exported_spans=8, dropped_spans=1))
    assert load_state(path) == OtelState(seq=42, exported_spans=8, dropped_spans=1)
    path.write_text("{not json")
    assert load_state(path) == OtelState()
