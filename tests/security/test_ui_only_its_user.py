"""The web view answers only its user (issue 44, break 2): another local user who finds the port
of `busctl ui` on 127.0.0.1 gets no byte of the stream, the page or its API, whatever Host it
sends; its owner opens it with the link `busctl ui` prints, and the token behind that link is in
no argument, environment, ready line or status output.

Real processes: a hub on an ipc:// socket in a 0700 folder (closed to other users, as `busctl up`
makes it), an owner's prompt published into it, `busctl ui --port 0`. The other user is a plain
HTTP client with the right Host header and, as root, `curl` run as uid 65534 by `setpriv`."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.parse
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from agent_bus.bus import events as ev
from agent_bus.bus.client import connect
from agent_bus.bus.messages import TextPart, UserMessage
from tests.cli.conftest import start_up
from tests.support import Proc, busctl
from tests.ui.owner import open_link

pytestmark = pytest.mark.anyio

SECRET = f"the owner's prompt {uuid.uuid4().hex}"
#: Every route the server has, a few it has not, and token guesses.
ROUTES = ["/events", "/", "/index.html", "/events?since=0", "/app.js", "/app.css",
          "/experiment?name=e", "/favicon.ico", "/?token=", "/?token=guess-guess-guess-guess",
          "/events?token="]
OTHER = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture
def ui(tmp_path: Path) -> Iterator[dict[str, Any]]:
    """A hub holding the owner's prompt and a `busctl ui` on it; yields the UI's ready line."""
    folder = tmp_path / "run"
    folder.mkdir(mode=0o700)
    endpoint = f"ipc://{folder}/hub"
    procs: list[Proc] = []
    try:
        procs.append(hub := Proc(busctl("hub", "--hub", endpoint, "--state-dir",
                                        str(tmp_path / "state"))))
        hub.wait_ready()
        anyio.run(publish_secret, endpoint)
        procs.append(view := Proc(busctl("ui", "--hub", endpoint, "--port", "0")))
        ready = view.wait_ready()
        ready["proc"] = view
        ready["hub"] = endpoint
        yield ready
    finally:
        for proc in reversed(procs):
            proc.stop()


async def publish_secret(endpoint: str) -> None:
    async with connect(endpoint, name="owner") as peer:
        await peer.publish(ev.MessageStart(message=UserMessage(content=[TextPart(text=SECRET)])),
                           agent="assistant", run="r1", confirm=True)


def page(ready: dict[str, Any]) -> str:
    """The server's own address (`url` itself was that before the fix)."""
    return str(ready.get("page", ready["url"])).rstrip("/")


def fetch(client: httpx.Client, url: str, headers: dict[str, str]) -> tuple[int, bytes]:
    """Status and what the server sends within 2 s (an open `/events` never ends by itself)."""
    body = b""
    deadline = time.monotonic() + 2.0
    with client.stream("GET", url, headers=headers) as answer:
        try:
            for chunk in answer.iter_bytes():
                body += chunk
                if SECRET.encode() in body or time.monotonic() > deadline:
                    break
        except httpx.ReadTimeout:
            pass
        return answer.status_code, body


def test_another_local_user_reads_nothing_from_any_route(ui: dict[str, Any]) -> None:
    base = page(ui)
    port = urllib.parse.urlsplit(base).port
    hosts = [f"127.0.0.1:{port}", f"localhost:{port}", "127.0.0.1"]
    with httpx.Client(timeout=httpx.Timeout(5.0, read=2.0), follow_redirects=True) as client:
        for route in ROUTES:
            for host in hosts:
                status, body = fetch(client, base + route, {"Host": host})
                assert status in (401, 403), (route, host, status, body[:300])
                assert SECRET.encode() not in body and b"data:" not in body, (route, body[:300])
                assert b"<script" not in body and b"EventSource" not in body, (route, body[:300])


@pytest.mark.skipif(os.getuid() != 0 or not (shutil.which("setpriv") and shutil.which("curl")),
                    reason="needs root, setpriv and curl to run a client as a second user")
def test_a_second_uid_with_curl_reads_nothing(ui: dict[str, Any]) -> None:
    base = page(ui)
    port = urllib.parse.urlsplit(base).port
    for route in ROUTES:
        out = subprocess.run([*OTHER, "curl", "-sS", "-N", "--max-time", "3", "-H",
                              f"Host: 127.0.0.1:{port}", "-w", "\n%{http_code}", base + route],
                             capture_output=True, timeout=30, cwd="/")
        body, _, code = out.stdout.rpartition(b"\n")
        assert code in (b"401", b"403"), (route, out.returncode, code, out.stdout[:300])
        assert SECRET.encode() not in body and b"data:" not in body, (route, body[:300])
    # nor can it read the owner's way in: the token file and the link's page
    for path in (ui["token_file"], urllib.parse.urlsplit(ui["url"]).path):
        read = subprocess.run([*OTHER, "cat", path], capture_output=True, timeout=30, cwd="/")
        assert read.returncode != 0 and not read.stdout, path


def test_the_owner_reads_it_and_the_token_is_nowhere_else(ui: dict[str, Any]) -> None:
    base = page(ui)
    token = Path(ui["token_file"]).read_text().strip()
    assert len(token) >= 32
    assert oct(Path(ui["token_file"]).stat().st_mode & 0o777) == "0o600"
    with httpx.Client(timeout=httpx.Timeout(5.0, read=2.0)) as client:
        # the owner's token, as a bearer: the stream holds the prompt (so there was data to steal)
        status, body = fetch(client, base + "/events", {"Authorization": f"Bearer {token}"})
        assert status == 200 and SECRET.encode() in body
        # the link's way: ?token= once gives an HttpOnly, SameSite=Strict cookie and no data
        swap = client.get(base + f"/?token={token}")
        assert swap.status_code in (200, 303) and SECRET.encode() not in swap.content
        cookie = swap.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie, cookie
        client.cookies.clear()  # httpx keeps it: each request below says what it carries
        jar = {"Cookie": cookie.split(";")[0]}
        status, body = fetch(client, base + "/events", jar)
        assert status == 200 and SECRET.encode() in body
        # a near miss is refused, and a rebinding page with the cookie still is (Host check)
        near = token[:-1] + ("y" if token.endswith("x") else "x")
        assert fetch(client, base + "/events", {"Authorization": f"Bearer {near}"})[0] == 401
        assert fetch(client, base + "/events", {"Cookie": jar["Cookie"][:-1] + near[-1]})[0] == 401
        assert fetch(client, base + "/events", {**jar, "Host": "attacker.example"})[0] == 421
    # the token is in no argument, environment, ready line, output or status of the bus
    proc: Proc = ui["proc"]
    for leak in (f"/proc/{proc.pid}/cmdline", f"/proc/{proc.pid}/environ"):
        assert token not in Path(leak).read_bytes().decode(errors="replace"), leak
    assert token not in json.dumps({k: v for k, v in ui.items() if k != "proc"})
    assert token not in proc.output()
    status = subprocess.run(busctl("status", "--json", "--hub", ui["hub"]), capture_output=True,
                            text=True, timeout=30)
    assert status.returncode == 0 and token not in status.stdout + status.stderr


def test_busctl_up_hands_the_ui_a_token_file_never_the_token(tmp_path: Path) -> None:
    """`[ui]` under `busctl up`: $BUSCTL_UI_TOKEN_FILE reaches the child as a path; the token is
    in no environment, argument, log or console line, and the printed link opens the page."""
    token = f"owner-chosen-{uuid.uuid4().hex}"
    secret = tmp_path / "ui.token"
    secret.write_text(token + "\n")
    secret.chmod(0o600)
    project = tmp_path / "project"
    project.mkdir()
    state = tmp_path / "state"
    (project / "team.toml").write_text(f'[hub]\nstate_dir = "{state}"\n[ui]\nport = 0\n')
    up, _ = start_up(project, "-c", "team.toml", env={"BUSCTL_UI_TOKEN_FILE": str(secret)})
    try:
        link = up.wait_line(lambda s: s.startswith("ui "), 10).split()[1]
        assert '<script src="/app.js"></script>' in open_link(link)
        procs = up.wait_line(lambda s: s.startswith("processes "), 10)
        match = re.search(r"\bui\[(\d+)\]", procs)
        assert match is not None, procs
        pid = int(match[1])
        environ = Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace")
        assert f"BUSCTL_UI_TOKEN_FILE={secret}" in environ and token not in environ
        assert token not in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
        page = link_page(link)
        with httpx.Client(timeout=5.0) as client:
            assert client.get(page, headers={"Authorization": f"Bearer {token}"}).status_code == 200
            assert client.get(page).status_code == 401
    finally:
        up.stop(timeout=10)
    assert token not in up.output()
    logs = [p.read_text(errors="replace") for p in (state / "logs").glob("*.log")]
    assert logs and not any(token in text for text in logs)


def link_page(link: str) -> str:
    """The view's own address, from the launcher page behind the printed link."""
    text = Path(urllib.parse.urlsplit(link).path).read_text()
    target = re.search(r'<a href="(http://[^"?]+)', text)
    assert target is not None, text
    return target[1]
