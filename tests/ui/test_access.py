"""`busctl ui` off loopback needs its token (issue 19: "loopback only unless told otherwise, and
then only with a token"); on loopback it needs none. Real `busctl ui` processes, real HTTP, and
the page in a real headless Chromium carrying the token's cookie."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Proc, busctl, until
from tests.ui.browser import Browser, find_chromium

pytestmark = pytest.mark.anyio


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc = Proc(busctl("hub", "--hub", "tcp://127.0.0.1:0", "--state-dir",
                       str(tmp_path_factory.mktemp("hub"))))
    try:
        yield str(proc.wait_ready()["endpoint"])
    finally:
        proc.stop()


@pytest.fixture
def procs() -> Iterator[list[Proc]]:
    started: list[Proc] = []
    try:
        yield started
    finally:
        for proc in started:
            proc.stop()


class Answer:
    def __init__(self, status: int, headers: dict[str, str]) -> None:
        self.status = status
        self.headers = headers

    def getheader(self, name: str) -> str:
        return self.headers.get(name.lower(), "")


def get(url: str, headers: dict[str, str] | None = None) -> Answer:
    """One GET's status and headers, redirects not followed (the 303 that sets the cookie is
    what we look at); the body is not read (`/events` never ends)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""),
                     headers=headers or {})
        response = conn.getresponse()
        return Answer(response.status, {k.lower(): v for k, v in response.getheaders()})
    finally:
        conn.close()


def start(procs: list[Proc], hub: str, *args: str, env: dict[str, str] | None = None) -> dict:
    proc = Proc(busctl("ui", "--hub", hub, "--port", "0", *args), env=env)
    procs.append(proc)
    return proc.wait_ready()


def test_loopback_needs_no_token(hub: str, procs: list[Proc]) -> None:
    ready = start(procs, hub)
    assert "token" not in ready and "?" not in ready["url"]
    assert get(ready["url"]).status == 200
    assert get(ready["url"] + "app.js").status == 200


def test_loopback_refuses_a_foreign_host_or_origin(hub: str, procs: list[Proc]) -> None:
    """Issue 28 item 2: a DNS-rebinding page (Host: attacker.example) reads nothing."""
    ready = start(procs, hub)
    port = urllib.parse.urlsplit(ready["url"]).port
    for host in ("attacker.example", f"attacker.example:{port}", f"127.0.0.1.attacker.example:{port}"):
        assert get(ready["url"] + "events", {"Host": host}).status == 421, host
        assert get(ready["url"], {"Host": host}).status == 421, host
        assert get(ready["url"] + "experiment?name=e", {"Host": host}).status == 421, host
    for origin in ("http://attacker.example", f"http://attacker.example:{port}", "null",
                   f"https://localhost.attacker.example:{port}"):
        assert get(ready["url"] + "events", {"Origin": origin}).status == 403, origin
    for host in (f"localhost:{port}", f"[::1]:{port}", f"127.0.0.1:{port}", "LOCALHOST"):
        assert get(ready["url"], {"Host": host, "Origin": f"http://{host}"}).status == 200, host


def test_any_other_address_needs_the_generated_token(hub: str, procs: list[Proc]) -> None:
    ready = start(procs, hub, "--bind", "0.0.0.0")
    assert ready["token"] == "generated" and ready["bind"] == "0.0.0.0"
    url = ready["url"]
    token = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["token"][0]
    base = url.split("?")[0]
    assert len(token) >= 24
    for path in ("", "app.js", "events", "experiment?name=e"):  # nothing without it
        refused = get(base + path)
        assert refused.status == 401, path
    assert get(base + "?token=wrong" + token[5:]).status == 401
    # the token once in the URL: a cookie, and a redirect that takes it out of the address bar
    first = get(url)
    assert first.status == 303 and first.getheader("Location") == "/"
    cookie = first.getheader("Set-Cookie").split(";")[0]
    assert "HttpOnly" in first.getheader("Set-Cookie") and token in cookie
    assert get(base, {"Cookie": cookie}).status == 200
    assert get(base + "app.js", {"Cookie": cookie}).status == 200
    assert get(base + "experiment?name=e", {"Cookie": cookie}).status == 404  # none journaled
    assert get(base, {"Authorization": f"Bearer {token}"}).status == 200
    # events too (the stream stays open: read its status line only)
    assert get(base + "events", {"Cookie": cookie}).status == 200


def test_a_given_token_and_a_short_one_refused(hub: str, procs: list[Proc]) -> None:
    token = "a-long-enough-token-0123"
    ready = start(procs, hub, "--bind", "0.0.0.0", env={"BUSCTL_UI_TOKEN": token})
    assert ready["token"] == "given" and token not in json.dumps(ready)  # not printed
    assert get(ready["url"]).status == 401
    assert get(ready["url"], {"Authorization": f"Bearer {token}"}).status == 200
    proc = Proc(busctl("ui", "--hub", hub, "--port", "0", "--bind", "0.0.0.0", "--token", "short"))
    procs.append(proc)
    assert proc.popen.wait(15) == 2 and "--token" in proc.output()


async def test_the_page_works_with_the_token_in_a_real_browser(hub: str, procs: list[Proc],
                                                             tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    url = start(procs, hub, "--bind", "0.0.0.0")["url"]
    browser = Browser(binary, tmp_path / "profile")
    try:
        browser.open(url)  # ?token= once: then the cookie carries the page, its script and stream
        await until(lambda: browser.evaluate("document.getElementById('status').textContent")
                    == "live", 15, "the page's event stream with the cookie")
        assert browser.evaluate("location.search") == ""  # the token left the address bar
        assert browser.evaluate("typeof state") == "object"  # app.js loaded
    finally:
        browser.close()
