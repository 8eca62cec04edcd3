"""`busctl ui` (issue 19, acceptance 1 and the replay half of 2): the page, its event stream, and
the page in a real headless Chromium (the distribution's package; `.ci/run` installs it).

Real processes: hub, gateway (in-test fake model), tool worker, coordinator with `boss` (two
parallel `echo` calls and an `ask_helper` call) and `helper`; `busctl ui --port 0`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import pytest

from agent_bus.agents.client.remote import connect
from tests.coordinator.conftest import Stack, calls, start_stack, text
from tests.store_cluster import Cluster
from tests.support import Proc, busctl, py, until
from tests.ui.browser import Browser, find_chromium
from tests.ui.owner import owner_get

pytestmark = pytest.mark.anyio

AGENTS = """
[[agents]]
name = "boss"
model = "x"
tools = ["slow"]
agents = ["helper"]

[[agents]]
name = "helper"
model = "x"
tools = []
"""

# Two `slow` calls of 0.3 s each, started together: their bars must overlap in time.
SCRIPT = [
    calls(("slow", {"label": "a", "seconds": 0.3}), ("slow", {"label": "b", "seconds": 0.3}),
          ("ask_helper", {"prompt": "What colour is a banana?"})),
    text("Bananas are yellow."),
    text("Done: a, b, yellow."),
]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    s = start_stack(tmp_path_factory.mktemp("ui"), coordinator=("boss", "helper"), agents=AGENTS)
    try:
        yield s
    finally:
        s.close()


async def scripted_run(stack: Stack) -> str:
    stack.script(SCRIPT)
    async with connect(stack.endpoint, name="test-ui") as bus:
        run = await bus.prompt("boss", "use your tools and ask the helper", experiment="exp-ui")
        result = await run.result()
    assert result.final_text == "Done: a, b, yellow."
    return run.run_id


def start_ui(stack: Stack) -> dict[str, Any]:
    """`busctl ui`'s ready line: `url`, the owner's link (a browser opens it); `page` and
    `token_file`, the server and its token (a plain HTTP client uses them: tests/ui/owner.py)."""
    proc = Proc(busctl("ui", "--hub", stack.endpoint, "--port", "0"))
    stack.procs[f"ui-{len(stack.procs)}"] = proc  # stopped with the stack
    return proc.wait_ready()


def read_events(ui: dict[str, Any], until_type: str, run_id: str,
                last_id: str = "") -> list[tuple[int, dict[str, Any]]]:
    """SSE messages from the page's `/events` until `until_type` of `run_id` (socket timeout 15 s:
    a stalled stream fails the test)."""
    out: list[tuple[int, dict[str, Any]]] = []
    with owner_get(ui, "events", 15, {"Last-Event-ID": last_id} if last_id else {}) as stream:
        event_id, name = 0, ""
        for raw in stream:
            line = raw.decode().rstrip("\n")
            if line.startswith("id: "):
                event_id = int(line[4:])
            elif line.startswith("event: "):
                name = line[7:]  # `status`: the hub's polled load, not a logged event
            elif not line:
                name = ""
            elif line.startswith("data: ") and name:
                assert name == "status" and "services" in json.loads(line[6:])
            elif line.startswith("data: "):
                event = json.loads(line[6:])
                out.append((event_id, event))
                if event["type"] == until_type and event["run_id"] == run_id:
                    return out
    raise AssertionError("the event stream ended")


async def test_page_and_stream_replay_then_live_without_holes(stack: Stack) -> None:
    await page_replays_then_goes_live(stack)


async def test_page_replays_then_goes_live_on_a_jetstream_log(tmp_path: Path,
                                                              jetstream: Cluster) -> None:
    """The same with the hub's log in a JetStream stream: the page reads it the same way."""
    s = start_stack(tmp_path, coordinator=("boss", "helper"), agents=AGENTS,
                    store=jetstream.stream_url())
    try:
        await page_replays_then_goes_live(s)
    finally:
        s.close()


async def page_replays_then_goes_live(stack: Stack) -> None:
    before = await scripted_run(stack)         # happened before the page's server started
    ui = start_ui(stack)
    page = owner_get(ui, "").read().decode()
    assert '<script src="/app.js"></script>' in page and "http" not in page.split("<body>")[1]
    assert "EventSource" in owner_get(ui, "app.js").read().decode()

    replayed = read_events(ui, "agent_end", before)
    after = await scripted_run(stack)          # live
    events = read_events(ui, "agent_end", after)
    seqs = [s for s, _ in events]
    assert seqs == sorted(set(seqs)) and all(s == e["seq"] for s, e in events)
    assert seqs == list(range(seqs[0], seqs[-1] + 1))  # no hole (the page gets the full stream)
    assert seqs[:len(replayed)] == [s for s, _ in replayed]
    # a page reconnecting with Last-Event-ID continues after it, with no duplicate
    middle = seqs[len(seqs) // 2]
    resumed = read_events(ui, "agent_end", after, last_id=str(middle))
    assert [s for s, _ in resumed] == [s for s in seqs if s > middle]


class Dom(HTMLParser):
    """The elements of a DOM dump with their attributes, classes and nesting depth."""

    def __init__(self) -> None:
        super().__init__()
        self.nodes: list[dict[str, str]] = []
        self.stack: list[dict[str, str]] = []
        self.text: dict[int, str] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        node = {k: v or "" for k, v in attrs}
        node["tag"] = tag
        node["_parents"] = ",".join(n.get("data-run", "") for n in self.stack if n.get("data-run"))
        self.nodes.append(node)
        if tag not in ("meta", "link", "br", "img", "input"):
            self.stack.append(node)

    def handle_endtag(self, tag: str) -> None:
        if self.stack:
            self.stack.pop()

    def handle_data(self, data: str) -> None:
        if self.stack:
            self.stack[-1]["_text"] = self.stack[-1].get("_text", "") + data


def chromium() -> str:
    path = find_chromium()
    if path is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    return path


async def test_the_page_in_a_real_browser(stack: Stack, tmp_path: Path) -> None:
    binary = chromium()
    url = start_ui(stack)["url"]
    browser = Browser(binary, tmp_path / "profile")
    try:
        browser.open(url)  # the owner's link, before the run: the page draws it live
        await until(lambda: browser.evaluate("document.getElementById('status').textContent")
                    == "live", 10, "the page's event stream")
        run_id = await scripted_run(stack)
        # drawn: the boss's lane with the helper's lane nested in it, and the run's end counted
        ready = (f'!!document.querySelector(\'.lane[data-run="{run_id}"] .children '
                 f'.lane[data-agent="helper"]\') && document.querySelector(\'.lane[data-run='
                 f'"{run_id}"] .stop\').textContent === "stop"')
        await until(lambda: browser.evaluate(ready), 20, "the run drawn in the page")
        browser.evaluate(f'document.querySelector(\'.lane[data-run="{run_id}"]\').click()')
        await until(lambda: browser.evaluate(
            "document.querySelectorAll('#transcript-body .msg[data-role]').length >= 5"), 10,
            "the transcript of the clicked run")
        await until(lambda: browser.evaluate(  # the hub's status is polled once a second
            "[...document.querySelectorAll('#services li')].some((li) => "
            "li.textContent.startsWith('tool.slow: 0/8 busy'))"), 10, "the services' load")
        dump = browser.evaluate("document.documentElement.outerHTML")
        browser.screenshot(tmp_path / "ui.png")
        # the agent filter hides every lane of other agents, and clearing it brings them back
        lanes = "document.querySelectorAll('#timeline .lane').length"
        assert browser.evaluate(lanes) >= 2
        set_filter = ("(k, v) => { const i = document.getElementById('filter-' + k); i.value = v; "
                      "i.dispatchEvent(new Event('input')); }")
        browser.evaluate(f"({set_filter})('agent', 'nobody')")
        assert browser.evaluate(lanes) == 0
        browser.evaluate(f"({set_filter})('agent', '')")
        assert browser.evaluate(lanes) >= 2
        # the type filter: its suggestions are the event types seen; a type keeps the runs that
        # had such an event and, in them, only its bars and transcript entries
        offered = browser.evaluate("[...document.querySelectorAll('#event-types option')]"
                                   ".map((o) => o.value).join(' ')").split()
        assert {"agent_start", "tool_execution_start", "message_update"} <= set(offered)
        count = "(q) => document.querySelectorAll(q).length"
        boss_lane = f'#timeline .lane[data-run="{run_id}"]'
        browser.evaluate(f"({set_filter})('type', 'tool_execution')")
        assert browser.evaluate(f"({count})('{boss_lane}')") == 1
        assert browser.evaluate(f"({count})('#timeline .bar.chat')") == 0
        assert browser.evaluate(f"({count})('{boss_lane} > .track .bar.tool')") == 3
        roles = ("[...document.querySelectorAll('#transcript-body .msg[data-role]')]"
                 ".map((m) => m.dataset.role).join(' ')")
        assert browser.evaluate(roles).split() == ["tool", "tool", "tool"]
        browser.evaluate(f"({set_filter})('type', 'message_update')")
        assert browser.evaluate(f"({count})('{boss_lane} > .track .bar.chat')") == 2
        assert browser.evaluate(f"({count})('#timeline .bar.tool')") == 0
        browser.evaluate(f"({set_filter})('type', 'no_such_type')")
        assert browser.evaluate(lanes) == 0
        browser.evaluate(f"({set_filter})('type', '')")
        assert browser.evaluate(lanes) >= 2
        assert browser.evaluate(roles).split() == ["user", "assistant", "tool", "tool", "tool",
                                                   "assistant"]
    finally:
        browser.close()
    (tmp_path / "dom.html").write_text(dump)
    assert (tmp_path / "ui.png").stat().st_size > 1000

    dom = Dom()
    dom.feed(dump)
    lanes = {n["data-run"]: n for n in dom.nodes if "lane" in n.get("class", "").split()}
    boss = lanes[run_id]
    assert boss["data-agent"] == "boss" and boss["_parents"] == ""
    helper = [n for n in lanes.values()
              if n["data-agent"] == "helper" and n["data-parent"] == run_id]
    assert len(helper) == 1 and helper[0]["_parents"] == run_id  # nested inside boss's lane
    bars = [n for n in dom.nodes if n.get("data-call") and n["_parents"] == run_id]
    slow = [n for n in bars if n["data-tool"] == "slow"]
    assert len(slow) == 2 and {n["data-row"] for n in slow} == {"0", "1"}  # side by side
    (a0, a1), (b0, b1) = [(float(n["data-start"]), float(n["data-end"])) for n in slow]
    assert a0 < b1 and b0 < a1  # they ran at the same time
    assert [n["data-tool"] for n in bars if n["data-tool"] != "slow"] == ["ask_helper"]
    chats = [n for n in dom.nodes if "chat" in n.get("class", "").split()
             and n["_parents"] == run_id]
    assert len(chats) == 2
    helper_chats = [n for n in dom.nodes if "chat" in n.get("class", "").split()
                    and n["_parents"] == f"{run_id},{helper[0]['data-run']}"]
    assert len(helper_chats) == 1
    # totals: every run the hub logged so far in this module, their tokens, the stop reasons
    totals = {n["data-key"]: dom.nodes[i + 2].get("_text", "")  # tr > th, td
              for i, n in enumerate(dom.nodes) if n["tag"] == "tr" and n.get("data-key")}
    assert int(totals["runs"]) >= 2 and int(totals["input"]) > 0 and int(totals["output"]) > 0
    assert totals["stop:stop"] == totals["runs"]
    # the hub's polled status: services with their load and capacity
    items = [n.get("_text", "") for n in dom.nodes if n["tag"] == "li"]
    assert any(i.startswith("tool.slow: 0/8 busy, 0 queued") for i in items), items
    assert totals["exp:exp-ui"].startswith(f"{totals['runs']} runs, ")
    # the model's streamed text is visible in its bar
    assert any("Done: a, b, yellow." in n.get("_text", "") for n in chats)
    roles = [n["data-role"] for n in dom.nodes if n.get("data-role")]
    assert roles == ["user", "assistant", "tool", "tool", "tool", "assistant"]


PUBLISHER = str(Path(__file__).resolve().parents[1] / "fault" / "publisher_proc.py")


def sse_seqs(ui: dict[str, Any], messages: int, timeout: float = 30.0) -> list[int]:
    """SSE ids of the page's stream until `messages` topic messages were among them (socket
    timeout: a stall fails the test)."""
    seqs: list[int] = []
    seen = 0
    with owner_get(ui, "events", timeout) as stream:
        for raw in stream:
            line = raw.decode()
            if line.startswith("id: "):
                seqs.append(int(line[4:]))
            elif line.startswith("data: ") and json.loads(line[6:]).get("type") == "topic_message":
                seen += 1
                if seen == messages:
                    return seqs
    raise AssertionError(f"the stream ended after {seen} topic messages")


def test_stream_across_a_hub_restart_has_no_hole_and_no_duplicate(tmp_path: Path) -> None:
    """Acceptance 2 (the stream the page reads): events before the page, during, and after a
    hub restart, each exactly once, in seq order."""
    endpoint = f"ipc://{tmp_path}/hub.sock"  # the restarted hub binds the same address
    state = tmp_path / "hub"
    procs: list[Proc] = []

    def start(args: list[str]) -> Proc:
        procs.append(Proc(args))
        return procs[-1]

    def hub() -> Proc:
        proc = start(busctl("hub", "--hub", endpoint, "--state-dir", str(state),
                            "--heartbeat-interval", "0.2"))
        proc.wait_ready()
        return proc

    def publish(count: int) -> None:
        start(py(PUBLISHER, endpoint, str(count))).wait_line(
            lambda s: s.startswith('{"done"'), 60)

    try:
        first = hub()
        publish(400)                                   # before the page's server
        ui = start(busctl("ui", "--hub", endpoint, "--port", "0")).wait_ready()
        publish(400)                                   # live
        first.stop()
        hub()                                          # the same log, the same address
        publish(400)                                   # after the restart
        seqs = sse_seqs(ui, 1200)  # every message published, before, during and after
        assert seqs == list(range(1, len(seqs) + 1))  # from the log's start, no hole, no repeat
    finally:
        for proc in reversed(procs):
            proc.stop()
