"""`[ui]` and `[otel]` in the topology: checked at load time (errors name the key), and started by
`busctl up` as supervised children. Real `busctl up` (hub, gateway on the in-test fake model,
worker, coordinator, ui, otel), the page fetched over HTTP, the run's trace received by `Receiver`."""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.agents.launch.topology import TopologyError, parse_topology
from tests.cli.conftest import start_up
from tests.otel.receiver import Receiver
from tests.support import busctl, wait_for
from tests.ui.owner import open_link


@pytest.mark.parametrize(("text", "key"), [
    ("[ui]\nport = 70000\n", "ui.port"),
    ("[ui]\ncolour = 1\n", "ui.colour: unknown key"),
    ('[ui]\nbind = ""\n', "ui.bind"),
    ('[otel]\nendpoint = "ftp://collector"\n', "otel.endpoint"),
    ("[otel]\nmax_spans = 0\n", "otel.max_spans"),
    ('[otel]\nheaders = "k=v"\n', "otel.headers: unknown key"),
    ('[ui]\n[[processes]]\nname = "ui"\ncommand = ["true"]\n', "processes: a process is named 'ui'"),
])
def test_a_bad_section_is_refused_naming_the_key(text: str, key: str) -> None:
    with pytest.raises(TopologyError, match=re.escape(key)):
        parse_topology(text.encode(), "team.toml", as_json=False)


def test_the_sections_become_busctl_children() -> None:
    topo = parse_topology(b'[ui]\nport = 0\n[otel]\nendpoint = "http://127.0.0.1:4318"\n',
                          "team.toml", as_json=False)
    ui, otel = topo.all_processes()
    assert ui.name == "ui" and ui.command == ["busctl", "ui", "--port", "0", "--bind", "127.0.0.1"]
    assert otel.name == "otel" and otel.command[:2] == ["busctl", "otel"]
    assert otel.command[otel.command.index("--endpoint") + 1] == "http://127.0.0.1:4318/v1/traces"
    assert "OTEL_EXPORTER_OTLP_HEADERS" in otel.pass_env  # collector keys: never in the file
    assert parse_topology(b"", "t.toml", as_json=False).all_processes() == []


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver().start()
    try:
        yield r
    finally:
        r.stop()


def test_busctl_up_starts_the_page_and_the_exporter(tmp_path: Path, receiver: Receiver) -> None:
    project = tmp_path / "project"
    project.mkdir()
    with FakeLLMServer({"echo": True}) as srv:
        (project / "team.toml").write_text(f"""
[hub]
state_dir = "{tmp_path / 'state'}"

[models.x]
provider = "openai"
base_url = "{srv.base_url}"
model = "m"
context_window = 32000

[ui]
port = 0

[otel]
endpoint = "http://127.0.0.1:{receiver.port}"
""")
        proc, ready = start_up(project, "-c", "team.toml")
        try:
            line = proc.wait_line(lambda s: s.startswith("ui "), 10)
            url = line.split()[1]
            page = open_link(url)  # the owner's link: the page with the token's cookie
            assert '<script src="/app.js"></script>' in page
            assert re.search(r"\botel\[\d+\]", proc.wait_line(lambda s: s.startswith("processes")))
            run = subprocess.run(busctl("run", "--hub", ready["endpoint"], "--json", "hello"),
                                 capture_output=True, text=True, timeout=60, check=True)
            assert "echo: hello" in run.stdout
            spans = wait_for(lambda: [s for s in receiver.snapshot()
                                      if s.name == "invoke_agent assistant"], 20,
                             "the run's trace from the supervised exporter")
            assert spans[0].attrs["agent_bus.stop_reason"] == "stop"
            chat = wait_for(lambda: [s for s in receiver.snapshot() if s.name == "chat m"], 5,
                            "the chat span")
            assert chat[0].parent_id == spans[0].span_id
        finally:
            proc.stop(timeout=10)
    assert (tmp_path / "state" / "otel.json").exists()  # the resume point, in the state dir
