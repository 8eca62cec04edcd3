"""`busctl ui` answers "what is running now" (issue 33, acceptance 1), in a real headless Chromium:
live runs first, newest first, each saying what it waits for; finished runs below, a page at a
time; every run on its own time axis; a millisecond tool call still a visible bar; and the
connection state true: the hub stopped, the page says "hub unreachable since HH:MM:SS" within
5 s with the peers greyed, and says "live" again by itself when the hub is back.

The topology (the hub, its peers by role, each with its services' load and a worker's sandbox)
is on the same page. Screenshots (idle, busy: 50 finished runs and 3 live, hub down) are left in the test's tmp_path.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.cli.conftest import start_up
from tests.support import Proc, busctl, py, until
from tests.ui.browser import Browser, find_chromium

pytestmark = pytest.mark.anyio

PUBLISHER = str(Path(__file__).with_name("runs_publisher.py"))
STATUS = "document.getElementById('status').textContent"
# every live lane's box, and the narrowest bar drawn in any lane
GEOMETRY = """JSON.stringify({
  live: [...document.querySelectorAll('#timeline > .lane.live')].map((n) => {
    const b = n.getBoundingClientRect();
    return {run: n.dataset.run, top: b.top, bottom: b.bottom,
            wait: n.querySelector('.wait').textContent,
            tools: [...n.querySelectorAll(':scope > .track.tools .bar')].map(
              (t) => t.getBoundingClientRect().width)};
  }),
  narrowest: Math.min(...[...document.querySelectorAll('#timeline .bar')].map(
    (t) => t.getBoundingClientRect().width)),
  finished: document.querySelectorAll('#timeline > .lane:not(.live)').length,
  ticks: document.querySelectorAll('#timeline > .lane > .axis .tick').length,
  lanes: document.querySelectorAll('#timeline > .lane').length,
})"""


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


async def test_what_runs_now_first_and_the_hub_state_is_true(tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    endpoint = f"ipc://{tmp_path}/hub.sock"  # the restarted hub binds the same address
    procs: list[Proc] = []
    browser: Browser | None = None

    def start(args: list[str]) -> Proc:
        procs.append(Proc(args))
        return procs[-1]

    def hub() -> Proc:
        proc = start(busctl("hub", "--hub", endpoint, "--state-dir", str(tmp_path / "hub")))
        proc.wait_ready()
        return proc

    try:
        first = hub()
        url = str(start(busctl("ui", "--hub", endpoint, "--port", "0")).wait_ready()["url"])
        browser = Browser(binary, tmp_path / "profile")
        browser.open(url)
        await until(lambda: browser.evaluate(STATUS) == "live", 15, "the page's event stream")
        await until(lambda: "nothing is running" in browser.evaluate("document.body.innerText"),
                    5, "the empty page drawn")
        browser.screenshot(tmp_path / "idle.png")

        live = start(py(PUBLISHER, endpoint, "50", "3")).wait_ready(30)["live"]
        await until(lambda: browser.evaluate(
            "document.getElementById('live-head').textContent === 'Running now: 3' && "
            "document.getElementById('finished-head').textContent.startsWith('Finished: 50 ')"),
            15, "50 finished runs and 3 live ones drawn")
        # the tools' worker comes from the hub's status (polled): wait for it to be named
        await until(lambda: "on worker-a for" in browser.evaluate(
            "document.querySelector('#timeline > .lane.live:last-of-type .wait')?.textContent"
            " || document.body.innerText"), 10, "the open tool's worker named")
        geo = json.loads(browser.evaluate(GEOMETRY))
        browser.screenshot(tmp_path / "busy.png")
        # newest first, all three inside the first 900 px screen
        assert [lane["run"] for lane in geo["live"]] == live[::-1], geo
        assert all(0 <= lane["top"] and lane["bottom"] <= 900 for lane in geo["live"]), geo
        assert all(w >= 4 for lane in geo["live"] for w in lane["tools"]) and geo["live"][2]["tools"]
        assert geo["narrowest"] >= 4, geo  # the millisecond calls of the finished runs too
        assert geo["live"][0]["wait"].startswith("waits for model m streaming for "), geo
        assert "tool fetch on worker-a for " in geo["live"][1]["wait"], geo
        assert geo["finished"] == 20 and geo["ticks"] >= 2 * geo["lanes"], geo  # a page; axes
        # a bar's tooltip: name, worker, argument preview, duration
        tip = browser.evaluate("document.querySelector('#timeline > .lane.live "
                               ".bar[data-tool=\"fetch\"]').title")
        assert tip.startswith("fetch on worker-a\n") and "https://x/" in tip and " ms" in tip, tip
        # the wheel over a lane's axis zooms that lane alone; a double click resets it
        ticks = ("[...document.querySelectorAll('#timeline > .lane.live')][1]"
                 ".querySelector('.axis').innerText")
        before = browser.evaluate(ticks)
        browser.evaluate("(() => { const a = [...document.querySelectorAll('#timeline > "
                         ".lane.live')][1].querySelector('.axis'); const b = a.getBoundingClientRect();"
                         " a.dispatchEvent(new WheelEvent('wheel', {deltaY: -600, clientX: b.left"
                         " + 10, clientY: b.top + 2, bubbles: true, cancelable: true})); })()")
        assert browser.evaluate("state.zoom.size") == 1 and browser.evaluate(ticks) != before
        browser.evaluate("[...document.querySelectorAll('#timeline > .lane.live')][1]"
                         ".querySelector('.axis').dispatchEvent(new MouseEvent('dblclick', "
                         "{bubbles: true}))")
        assert browser.evaluate("state.zoom.size") == 0
        # the topology: the worker under the hub, with its service's load and its sandbox
        worker = browser.evaluate("document.querySelector('#peers li.role[data-peer-role=\"worker\"] "
                                  "li.peer[data-peer=\"worker-a\"]')?.innerText")
        assert worker and "sandbox: bwrap" in worker and "tool.fetch 0/2" in worker, worker
        # the experiment view: its done / running / failed counts; a click shows only its runs
        exp = "document.querySelector('#totals tr[data-key=\"exp:exp-b\"]')"
        assert browser.evaluate(f"{exp}.innerText").endswith("0 done, 3 running, 0 failed")
        heads = ("document.getElementById('live-head').textContent + ' / ' + "
                 "document.getElementById('finished-head').textContent")
        browser.evaluate(f"{exp}.click()")
        assert browser.evaluate(heads).startswith("Running now: 3 / Finished: 0 ‹")
        browser.evaluate(f"{exp}.click()")
        assert browser.evaluate(heads).startswith("Running now: 3 / Finished: 50 ")

        first.stop()  # the hub goes away: within 5 s the page says so, peers greyed
        stopped = time.monotonic()
        await until(lambda: browser.evaluate(STATUS).startswith("hub unreachable since "), 5,
                    "the page saying the hub is unreachable")
        took = time.monotonic() - stopped
        assert browser.evaluate("document.getElementById('side').classList.contains('stale')")
        browser.screenshot(tmp_path / "hub-down.png")
        hub()  # back: the page recovers by itself
        await until(lambda: browser.evaluate(STATUS) == "live", 15, "the page live again")
        assert not browser.evaluate("document.getElementById('side').classList.contains('stale')")
        print(f"hub unreachable shown {took:.2f} s after the hub stopped")
    finally:
        if browser is not None:
            browser.close()
        for proc in reversed(procs):
            proc.stop()


async def test_after_busctl_down_the_page_says_the_hub_is_unreachable(tmp_path: Path) -> None:
    """`busctl up` with `[ui]`, the page open, `busctl down`: the page stops saying "live"."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    project = tmp_path / "project"  # the workspace: the hub's state is outside it
    project.mkdir()
    (project / "team.toml").write_text(f'[hub]\nstate_dir = "{tmp_path / "state"}"\n'
                                       "[ui]\nport = 0\n")
    up, _ = start_up(project, "-c", "team.toml")
    browser: Browser | None = None
    try:
        url = up.wait_line(lambda s: s.startswith("ui "), 10).split()[1]
        browser = Browser(binary, tmp_path / "profile")
        browser.open(url)
        await until(lambda: browser.evaluate(STATUS) == "live", 15, "the page's event stream")
        down = subprocess.run(busctl("down", "-c", "team.toml"), cwd=project, timeout=30,
                              capture_output=True, text=True)
        assert down.returncode == 0, down.stderr
        stopped = time.monotonic()
        await until(lambda: browser.evaluate(STATUS).startswith("hub unreachable since "), 5,
                    "the page saying the hub is unreachable after busctl down")
        print(f"after busctl down: {browser.evaluate(STATUS)!r} in "
              f"{time.monotonic() - stopped:.2f} s")
    finally:
        if browser is not None:
            browser.close()
        up.stop(timeout=10)
