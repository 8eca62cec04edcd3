"""The page keeps up (issue 19: "1,000 events/s ... without the page falling behind or the tab's
memory growing without bound"): synthetic runs at 1,000 events/s into a real hub, `busctl ui`,
and the page in a real headless Chromium, sampled once a second: the newest event the page
shows is recent, the DOM stays the same size, the runs it keeps are bounded, and (60 s run) the
JS heap after a garbage collection does not keep growing. 5 s in the normal run; the issue's
minute (60 s) behind the `slow` marker."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from tests.support import Proc, busctl, py, tight_timing, until
from tests.ui.browser import Browser, find_chromium

pytestmark = pytest.mark.anyio

PUBLISHER = str(Path(__file__).with_name("soak_publisher.py"))
RATE = 1_000
MAX_DOM = 5_000       # elements: live lanes + 20 finished drawn, whatever happened before
MAX_RUNS = 1_300      # app.js MAX_KEPT_RUNS x 1.25, plus the runs still open
SAMPLE = ("JSON.stringify({seq: state.shownSeq, ts: state.shownTs, now: Date.now() / 1000, "
          "dom: document.getElementsByTagName('*').length, runs: state.runs.size})")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


def heap(browser: Browser) -> int:
    browser.call("HeapProfiler.collectGarbage")
    return int(browser.call("Runtime.getHeapUsage")["usedSize"])


async def soak(tmp_path: Path, seconds: float) -> dict[str, Any]:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    procs: list[Proc] = []
    browser: Browser | None = None
    try:
        procs.append(hub := Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir",
                                        str(tmp_path / "hub"))))
        endpoint = str(hub.wait_ready()["endpoint"])
        procs.append(ui := Proc(busctl("ui", "--hub", endpoint, "--port", "0")))
        url = str(ui.wait_ready()["url"])
        browser = Browser(binary, tmp_path / "profile")
        browser.open(url)
        await until(lambda: browser.evaluate("document.getElementById('status').textContent")
                    == "live", 15, "the page's event stream")
        procs.append(pub := Proc(py(PUBLISHER, endpoint, str(RATE), str(seconds))))
        pub.wait_ready(15)
        t0 = time.monotonic()
        samples: list[dict[str, Any]] = []
        heaps: list[tuple[float, int]] = []
        while pub.popen.poll() is None:
            await anyio.sleep(1.0)  # the sampling interval of the measurement, not a wait
            sample = json.loads(browser.evaluate(SAMPLE))
            sample["t"] = time.monotonic() - t0
            samples.append(sample)
            if seconds >= 20 and len(samples) % 3 == 0:
                heaps.append((sample["t"], heap(browser)))
        assert pub.popen.wait(10) == 0, pub.output()
        done = json.loads(pub.wait_line(lambda s: s.startswith('{"done"')))["done"]
        head = json.loads(subprocess.run(busctl("status", "--hub", endpoint, "--json"),
                                         capture_output=True, text=True, timeout=20,
                                         check=True).stdout)["seq"]
        # the last event drawn soon after the load stops: the page was not behind
        start = time.monotonic()
        await until(lambda: browser.evaluate("state.shownSeq") >= head - 5, 10,
                    "the page showing the newest event")
        catch_up = time.monotonic() - start
        browser.screenshot(tmp_path / "soak.png")
        return {"samples": samples, "heaps": heaps, "done": done, "catch_up": catch_up,
                "seconds": seconds}
    finally:
        if browser is not None:
            browser.close()
        for proc in reversed(procs):
            proc.stop()


def check(result: dict[str, Any]) -> None:
    samples = result["samples"]
    assert result["done"] >= RATE * result["seconds"] * 0.8  # the load was really there
    loaded = [s for s in samples[2:] if s["ts"]]  # after the first redraws
    lags = [s["now"] - s["ts"] for s in loaded]
    # A page that cannot keep up falls further behind every second (at 1,000 events/s, tens of
    # seconds by the end); one that keeps up stays within the redraw interval plus the stream's
    # latency, which on a busy 2-core machine (load 14 seen) reaches ~2.3 s. Quiet machine: 1 s.
    bound = 1.0 if tight_timing() else 5.0
    assert loaded and max(lags) < bound, lags  # the newest event shown is recent
    third = max(1, len(lags) // 3)
    assert sorted(lags[-third:])[third // 2] <= sorted(lags[:third])[third // 2] + bound / 2, lags
    assert result["catch_up"] < bound, result["catch_up"]
    assert max(s["dom"] for s in samples) < MAX_DOM, [s["dom"] for s in samples]
    assert max(s["runs"] for s in samples) <= MAX_RUNS, [s["runs"] for s in samples]
    print(f"soak {result['seconds']:g}s: {result['done']} events, lag max "
          f"{max(lags):.3f}s, DOM max {max(s['dom'] for s in samples)}, runs kept max "
          f"{max(s['runs'] for s in samples)}, heaps {result['heaps']}")


async def test_the_page_keeps_up_for_5_seconds(tmp_path: Path) -> None:
    check(await soak(tmp_path, 5.0))


@pytest.mark.slow
async def test_the_page_keeps_up_for_a_minute_and_memory_is_bounded(tmp_path: Path) -> None:
    result = await soak(tmp_path, 60.0)
    check(result)
    heaps = result["heaps"]
    # the run store fills within ~10 s (1,000 runs of 12 events at 1,000 events/s, five open at
    # a time: ~1,000 runs by 8 s); after that the heap after a collection stays flat
    settled = [h for t, h in heaps if t >= 8]
    assert len(settled) >= 2 and settled[-1] < settled[0] * 1.5 + 5_000_000, heaps
