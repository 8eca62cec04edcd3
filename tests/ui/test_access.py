"""`busctl ui` answers only its owner, on loopback too (issue 44, break 2; issue 19 asked for the
token off loopback): every route needs the token, which the printed link (a `file://` launcher
in the private runtime folder) hands to the browser once, as a cookie. Real `busctl ui`
processes, real HTTP, and the page in a real headless Chromium opened from the printed link.
tests/security/test_ui_only_its_user.py is the other user's side."""

from __future__ import annotations

import http.client
import json
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support import Proc, busctl, until, wait_for
from tests.ui.browser import Browser, find_chromium
from tests.ui.owner import owner_headers

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


def body(url: str) -> str:
    """The text of a short answer (not `/events`)."""
    parts = urllib.parse.urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=10)
    try:
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""))
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def start(procs: list[Proc], hub: str, *args: str, env: dict[str, str] | None = None) -> dict:
    """`busctl ui` on any free port (a later `--port` in `args` wins); its ready line."""
    proc = Proc(busctl("ui", "--hub", hub, "--port", "0", *args), env=env)
    procs.append(proc)
    return proc.wait_ready()


ROUTES = ("", "app.js", "app.css", "events", "experiment?name=e")


def test_every_route_needs_the_token_on_loopback_too(hub: str, procs: list[Proc]) -> None:
    ready = start(procs, hub)
    assert ready["token"] == "generated" and ready["url"].startswith("file://")
    page = ready["page"]
    for path in ROUTES:
        refused = get(page + path)
        assert refused.status == 401, path
        assert get(page + path, owner_headers(ready)).status == (404 if "experiment" in path
                                                                  else 200), path
    # the link holds no secret; its page (0600, in the private runtime folder) holds the token
    token = owner_headers(ready)["Authorization"].split()[1]
    launcher = Path(urllib.parse.urlsplit(ready["url"]).path)
    assert token not in ready["url"] and f"{page}?token={token}" in launcher.read_text()
    for private in (launcher, Path(ready["token_file"])):
        assert private.stat().st_mode & 0o077 == 0 and private.parent.stat().st_mode & 0o077 == 0


def test_the_files_go_with_the_view(hub: str, procs: list[Proc]) -> None:
    ready = start(procs, hub)
    procs[-1].stop()
    assert not Path(ready["token_file"]).exists()
    assert not Path(urllib.parse.urlsplit(ready["url"]).path).exists()


def test_open_gives_the_browser_the_link_not_the_token(hub: str, procs: list[Proc],
                                                      tmp_path: Path) -> None:
    """`--open`: the browser is started with the launcher's file:// link (its arguments are in
    `ps` for every user), never the address with the token. The browser: a script ($BROWSER)."""
    seen = tmp_path / "argv"
    browser = tmp_path / "browser"
    browser.write_text(f'#!/bin/sh\necho "$@" > {seen}.tmp && mv {seen}.tmp {seen}\n')
    browser.chmod(0o700)
    ready = start(procs, hub, "--open", env={"BROWSER": str(browser)})
    wait_for(seen.exists, 10, "the browser started")
    token = owner_headers(ready)["Authorization"].split()[1]
    assert seen.read_text().strip() == ready["url"] and token not in seen.read_text()


def test_loopback_refuses_a_foreign_host_or_origin(hub: str, procs: list[Proc]) -> None:
    """Issue 28 item 2: a DNS-rebinding page (Host: attacker.example) reads nothing, even with
    the owner's token (a rebinding page has no cookie of the view; the check comes first)."""
    ready = start(procs, hub)
    url, owner = ready["page"], owner_headers(ready)
    port = urllib.parse.urlsplit(url).port
    for host in ("attacker.example", f"attacker.example:{port}", f"127.0.0.1.attacker.example:{port}"):
        assert get(url + "events", {**owner, "Host": host}).status == 421, host
        assert get(url, {**owner, "Host": host}).status == 421, host
        assert get(url + "experiment?name=e", {**owner, "Host": host}).status == 421, host
    for origin in ("http://attacker.example", f"http://attacker.example:{port}", "null",
                   f"https://localhost.attacker.example:{port}"):
        assert get(url + "events", {**owner, "Origin": origin}).status == 403, origin
    for host in (f"localhost:{port}", f"[::1]:{port}", f"127.0.0.1:{port}", "LOCALHOST"):
        assert get(url, {**owner, "Host": host, "Origin": f"http://{host}"}).status == 200, host


def test_any_other_address_needs_the_token_too(hub: str, procs: list[Proc]) -> None:
    ready = start(procs, hub, "--bind", "0.0.0.0")
    assert ready["token"] == "generated" and ready["bind"] == "0.0.0.0"
    base = ready["page"]
    token = owner_headers(ready)["Authorization"].split()[1]
    assert len(token) >= 32 and token not in json.dumps(ready)  # in the file only
    for path in ROUTES:  # nothing without it
        assert get(base + path).status == 401, path
    assert get(base + "?token=wrong" + token[5:]).status == 401
    # the token once in the URL (a browser on another machine): a cookie, and a page that goes
    # on to the same address without it
    first = get(base + "?token=" + token)
    assert first.status == 200 and first.getheader("Referrer-Policy") == "no-referrer"
    cookie = first.getheader("Set-Cookie").split(";")[0]
    assert "HttpOnly" in first.getheader("Set-Cookie") and token in cookie
    # it goes on to the same address, the other parameters kept, and never to another site
    assert 'replace("/experiment?name=e"' in body(base + f"experiment?name=e&token={token}")
    for other in ("//attacker.example/", "/\\attacker.example/"):
        target = body(base.rstrip("/") + other + f"?token={token}").split('replace("')[1]
        assert target[0] == "/" and target[1] not in "/\\", target  # a path of this server
    assert get(base, {"Cookie": cookie}).status == 200
    assert get(base + "app.js", {"Cookie": cookie}).status == 200
    assert get(base + "experiment?name=e", {"Cookie": cookie}).status == 404  # none journaled
    assert get(base, {"Authorization": f"Bearer {token}"}).status == 200
    # events too (the stream stays open: read its status line only)
    assert get(base + "events", {"Cookie": cookie}).status == 200


def test_a_token_file_and_the_ways_a_token_is_refused(hub: str, procs: list[Proc],
                                                     tmp_path: Path) -> None:
    secret = tmp_path / "ui.token"
    secret.write_text("a-long-enough-token-0123\n")
    secret.chmod(0o600)
    ready = start(procs, hub, "--bind", "0.0.0.0", env={"BUSCTL_UI_TOKEN_FILE": str(secret)})
    assert ready["token"] == "given" and "a-long-enough" not in json.dumps(ready)
    assert "a sandboxed tool can read it" in procs[-1].output()  # outside the hidden folders
    assert get(ready["page"]).status == 401
    assert get(ready["page"], {"Authorization": "Bearer a-long-enough-token-0123"}).status == 200
    secret.chmod(0o644)  # open to others: refused, naming the fix
    refused(hub, "chmod 600", "--token-file", str(secret))
    secret.chmod(0o600)
    secret.write_text("short\n")
    refused(hub, "at least 16", "--token-file", str(secret))
    # on the command line (`ps` shows it) or in the environment: refused, the file named
    refused(hub, "shown by `ps`", "--token", "a-long-enough-token-0123")
    refused(hub, "BUSCTL_UI_TOKEN is no longer read",
            env={"BUSCTL_UI_TOKEN": "a-long-enough-token-0123"})


def refused(hub: str, why: str, *args: str, env: dict[str, str] | None = None) -> None:
    """Run a `busctl ui` that must refuse to start, saying `why` and naming --token-file."""
    proc = Proc(busctl("ui", "--hub", hub, "--port", "0", *args), env=env)
    try:
        code = proc.popen.wait(15)
    finally:
        proc.stop()
    out = proc.output()
    assert code in (1, 2) and why in out and "--token-file" in out, (code, out)


async def test_the_page_works_from_the_printed_link_in_a_real_browser(
        hub: str, procs: list[Proc], tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    ready = start(procs, hub)
    browser = Browser(binary, tmp_path / "profile")
    try:
        browser.open(ready["url"])  # as the owner does: the link busctl ui printed
        await until(lambda: browser.evaluate("document.getElementById('status').textContent")
                    == "live", 15, "the page's event stream with the cookie")
        assert browser.evaluate("location.href") == ready["page"]  # the token left the address
        assert browser.evaluate("typeof state") == "object"  # app.js loaded
        assert browser.evaluate("document.cookie") == ""  # HttpOnly: no script reads it
    finally:
        browser.close()


async def test_a_remote_browser_with_the_token_once(hub: str, procs: list[Proc],
                                                    tmp_path: Path) -> None:
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    ready = start(procs, hub, "--bind", "0.0.0.0")
    token = owner_headers(ready)["Authorization"].split()[1]
    browser = Browser(binary, tmp_path / "profile")
    try:
        browser.open(f"{ready['page']}?token={token}")  # typed once, then the cookie
        await until(lambda: browser.evaluate("document.getElementById('status').textContent")
                    == "live", 15, "the page's event stream with the cookie")
        assert browser.evaluate("location.search") == ""  # the token left the address bar
    finally:
        browser.close()


async def test_a_page_of_a_restarted_view_says_to_open_the_new_link(
        hub: str, procs: list[Proc], tmp_path: Path) -> None:
    """The view restarted on its port (`[ui]` under `busctl up`) has a new token: the open page
    is refused and says so, rather than "hub unreachable" forever; the new link opens it."""
    binary = find_chromium()
    if binary is None:
        pytest.skip("no chromium: `.ci/run` installs it (apt-get install -y chromium)")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = str(probe.getsockname()[1])
    first = start(procs, hub, "--port", port)
    browser = Browser(binary, tmp_path / "profile")
    status = "document.getElementById('status').textContent"
    try:
        browser.open(first["url"])
        await until(lambda: browser.evaluate(status) == "live", 15, "the page live")
        procs[-1].stop()
        second = start(procs, hub, "--port", port)
        await until(lambda: "open the link it printed" in (browser.evaluate(status) or ""), 20,
                    "the page saying the view refuses it")
        browser.open(second["url"])
        await until(lambda: browser.evaluate(status) == "live", 15, "the new link's page live")
    finally:
        browser.close()
