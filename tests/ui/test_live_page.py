"""The live run page (issue 49, item 8), in a real headless Chromium: a streaming run's transcript
streams its text in; parallel calls of one tool are one wait entry, shown whole; a model bar too
narrow to read shows no label (not a clipped glyph); after the topology is stopped (hub and page
server gone, as `busctl down` does) the greyed topology shows no stale "busy" loads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support import Proc, busctl, py, until
from tests.ui.browser import Browser, find_chromium

pytestmark = pytest.mark.anyio

PUBLISHER = str(Path(__file__).with_name("live_publisher.py"))
STATUS = "document.getElementById('status').textContent"


def lane(run: str) -> str:
    return f"document.querySelector('#timeline > .lane[data-run=\"{run}\"]')"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_the_live_page_streams_waits_labels_and_greys_truthfully(tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    endpoint = f"ipc://{tmp_path}/hub.sock"
    procs: list[Proc] = []
    browser: Browser | None = None

    def start(args: list[str]) -> Proc:
        procs.append(Proc(args))
        return procs[-1]

    try:
        start(busctl("hub", "--hub", endpoint, "--state-dir", str(tmp_path / "hub"))).wait_ready()
        ui = start(busctl("ui", "--hub", endpoint, "--port", "0"))
        url = str(ui.wait_ready()["url"])
        browser = Browser(binary, tmp_path / "profile")
        browser.open(url)
        await until(lambda: browser.evaluate(STATUS) == "live", 15, "the page's event stream")
        runs = start(py(PUBLISHER, endpoint)).wait_ready(30)

        # the wait: one entry for the three parallel calls, with the worker, not cut
        wait = f"{lane(runs['tools'])}?.querySelector('.wait')"
        await until(lambda: "3 × tool fetch on worker-a for " in (browser.evaluate(
            f"{wait}?.textContent || ''")), 15, "the grouped wait, its worker named")
        text = browser.evaluate(f"{wait}.textContent")
        assert text.count("tool fetch") == 1, text
        assert browser.evaluate(f"{wait}.scrollWidth <= {wait}.clientWidth + 1"), text

        # the first model bar: a few pixels on this axis, so no label (its tooltip has it)
        first = f"{lane(runs['tools'])}.querySelector('.bar.chat')"
        assert browser.evaluate(f"{first}.getBoundingClientRect().width") < 24
        assert browser.evaluate(f"{first}.classList.contains('narrow')")
        assert browser.evaluate(f"getComputedStyle({first}).color") == "rgba(0, 0, 0, 0)"
        assert browser.evaluate(f"{first}.title").startswith("model m")

        # the streaming run's transcript has the text so far
        browser.evaluate(f"{lane(runs['stream'])}.click()")
        await until(lambda: "assistant (streaming): The answer streams in" in browser.evaluate(
            "document.getElementById('transcript-body').innerText"), 10, "the streamed text")
        assert "tell me" in browser.evaluate("document.getElementById('transcript-body').innerText")

        # busy while live; after the topology stopped, the last known peers carry no load
        peers = "document.getElementById('peers').innerText"
        await until(lambda: "1/2 busy" in browser.evaluate(peers), 15, "the worker busy")
        for proc in reversed(procs):  # publisher, page server, hub: what `busctl down` stops
            proc.stop()
        await until(lambda: browser.evaluate(STATUS).startswith("hub unreachable since "), 10,
                    "the page saying the hub is unreachable")
        topology = f"{peers} + document.getElementById('services').innerText"
        await until(lambda: "busy" not in browser.evaluate(topology), 2,
                    "the loads gone from the greyed topology (one redraw)")
        shown = browser.evaluate(topology)
        assert "worker-a" in shown and "×2" in shown, shown
        assert browser.evaluate("document.getElementById('side').classList.contains('stale')")
        print(json.dumps({"down": shown}))
    finally:
        if browser is not None:
            browser.close()
        for proc in reversed(procs):
            proc.stop()
