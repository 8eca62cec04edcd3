"""Hostile inputs to the built-in tools: SSRF through fetch_url, backtracking regexes in
search_files, and huge single-line files in read_file.

Network rule: only loopback ever receives traffic. A refusal must happen before connecting, so
refusals aim at a *tripwire*: a listening loopback socket nobody accepts on, where any connection
attempt would wait in the backlog, and the test checks the backlog is empty afterwards. Other
internal addresses (10.x, 169.254.169.254, multicast…) are only ever refused, never allowed
through; the allow-list's effect on them is checked on the address decision itself.
"""

from __future__ import annotations

import http.server
import ipaddress
import json
import os
import socket
import ssl
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.bus.messages import ToolCallRequest, ToolResult
from agent_bus.bus.paths import ensure_state_dir
from agent_bus.tools import Tool, run_tool
from agent_bus.tools.builtin import fetch_url, read_file, search_files
from agent_bus.tools.builtin._files import READ_CHUNK_CHARS, SEARCH_TIME_LIMIT
from agent_bus.tools.builtin._netguard import ALLOW_ENV, parse_allow_list, pick_address
from tests.tools.fixtures.procs import call as bus_call
from tests.tools.fixtures.procs import executor, until, workers

pytestmark = pytest.mark.anyio


async def call(t: Tool, ws: Path, **args: Any) -> ToolResult:
    req = ToolCallRequest(call_id="c", name=t.name, arguments=json.dumps(args))
    return await run_tool(t, req, workspace=ws)


# --- loopback servers --------------------------------------------------------------------------


class Tripwire:
    """A listening socket that never accepts: a connection attempt would sit in its backlog."""

    def __init__(self, family: socket.AddressFamily, host: str) -> None:
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.bind((host, 0))
        self.sock.listen(16)
        self.sock.setblocking(False)
        self.port: int = self.sock.getsockname()[1]

    def touched(self) -> bool:
        try:
            conn, _ = self.sock.accept()
        except BlockingIOError:
            return False
        conn.close()
        return True


class _Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        query = urllib.parse.parse_qs(url.query)
        self.server.paths.append(url.path)  # type: ignore[attr-defined]
        if url.path in ("/redirect", "/loop"):
            self.send_response(302)
            self.send_header("Location", query["to"][0] if url.path == "/redirect" else "/loop")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        body = (self.headers["Host"] if url.path == "/host" else f"hello from {url.path}").encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/plain")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


class _Server(http.server.ThreadingHTTPServer):
    def __init__(self, family: socket.AddressFamily, host: str) -> None:
        self.address_family = family
        self.paths: list[str] = []
        super().__init__((host, 0), _Handler)


@pytest.fixture
def web() -> Iterator[dict[str, Any]]:
    """HTTP servers on 127.0.0.1 (`a`, `b`) and ::1 (`v6`), plus tripwires on both."""
    servers = {"a": _Server(socket.AF_INET, "127.0.0.1"), "b": _Server(socket.AF_INET, "127.0.0.1"),
               "v6": _Server(socket.AF_INET6, "::1")}
    threads = [threading.Thread(target=s.serve_forever, daemon=True) for s in servers.values()]
    trips = {"trip": Tripwire(socket.AF_INET, "127.0.0.1"), "trip6": Tripwire(socket.AF_INET6, "::1")}
    for thread in threads:
        thread.start()
    try:
        yield {**servers, **trips, **{f"{k}_port": s.server_address[1] for k, s in servers.items()},
               **{f"{k}_port": t.port for k, t in trips.items()}}
    finally:
        for s in servers.values():
            s.shutdown()
            s.server_close()
        for t in trips.values():
            t.sock.close()


@pytest.fixture
def no_allow_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ALLOW_ENV, raising=False)


# The loopback forms of the issue; `{port}` is the IPv4 port, `{port6}` the IPv6 one.
LOOPBACK_FORMS = [
    ("127.0.0.1:{port}", "a loopback address"),
    ("localhost:{port}", "a loopback address"),
    ("[::1]:{port6}", "a loopback address"),
    ("[::ffff:127.0.0.1]:{port}", "a loopback address"),
    ("2130706433:{port}", "a loopback address"),
    ("0x7f000001:{port}", "a loopback address"),
    ("127.1:{port}", "a loopback address"),
    ("0.0.0.0:{port}", "an unspecified address"),
]


# --- SSRF: refused by default ------------------------------------------------------------------


@pytest.mark.parametrize(("form", "kind"), LOOPBACK_FORMS)
async def test_fetch_url_refuses_every_loopback_form_before_connecting(
    web: dict[str, Any], tmp_path: Path, no_allow_list: None, form: str, kind: str
) -> None:
    url = "http://" + form.format(port=web["trip_port"], port6=web["trip6_port"]) + "/x"
    result = await call(fetch_url, tmp_path, url=url)
    assert result.is_error
    assert result.text.startswith("Error: Refused to connect: `"), result.text
    assert kind in result.text
    assert f"to `{ALLOW_ENV}` in the worker's environment" in result.text
    assert not web["trip"].touched() and not web["trip6"].touched()


@pytest.mark.parametrize(("host", "kind"), [
    ("10.0.0.1", "private"), ("10.255.7.9", "private"), ("172.16.0.1", "private"),
    ("192.168.1.1", "private"), ("169.254.169.254", "link-local"), ("100.64.0.1", "non-public"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("240.0.0.1", "reserved"),
    ("0.0.0.0", "unspecified"), ("[fd00::1]", "private"), ("[fe80::1]", "link-local"),
    ("[ff02::1]", "multicast"), ("[::ffff:10.0.0.1]", "private"),
    ("[::ffff:169.254.169.254]", "link-local"), ("[64:ff9b::a9fe:a9fe]", "link-local"),
    # issue 28 item 7: IPv4 addresses embedded in IPv6 ranges (6to4 is `is_global` on 3.11)
    ("[2002:7f00:1::]", "loopback"), ("[2002:a9fe:a9fe::1]", "link-local"),
    ("[64:ff9b::7f00:1]", "loopback"), ("[64:ff9b:1::a00:1]", "local-use NAT64"),
    ("[::7f00:1]", "loopback"), ("[2001:0:4136:e378:8000:63bf:80ff:fffe]", "loopback"),
])
async def test_fetch_url_refuses_internal_addresses(
    tmp_path: Path, no_allow_list: None, host: str, kind: str
) -> None:
    # IP literals resolve locally, and the refusal comes before any socket is opened.
    with anyio.fail_after(2):
        result = await call(fetch_url, tmp_path, url=f"http://{host}/latest/meta-data/")
    assert result.is_error and result.text.startswith("Error: Refused to connect: `"), result.text
    assert f"{kind} address" in result.text


async def test_a_redirect_to_loopback_is_refused_at_the_hop(
    web: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `a` stands for an external site: allowed; the address it redirects to is not.
    monkeypatch.setenv(ALLOW_ENV, f"127.0.0.1:{web['a_port']}")
    start = f"http://127.0.0.1:{web['a_port']}/redirect?to="
    for target in (f"http://127.0.0.1:{web['trip_port']}/admin",
                   f"http://localhost:{web['trip_port']}/admin",
                   f"http://[::ffff:127.0.0.1]:{web['trip_port']}/admin",
                   f"http://2130706433:{web['trip_port']}/admin"):
        url = start + urllib.parse.quote(target)
        result = await call(fetch_url, tmp_path, url=url)
        assert result.is_error, result.text
        assert result.text.startswith(f"Error: `{url}` redirected to `{target}`: Refused to connect:")
        assert "a loopback address" in result.text
        assert not web["trip"].touched()
    assert web["a"].paths == ["/redirect"] * 4


# --- SSRF: allowed by the allow-list -----------------------------------------------------------


@pytest.mark.parametrize(("form", "kind"), LOOPBACK_FORMS)
async def test_the_allow_list_admits_each_loopback_form(
    web: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str, kind: str
) -> None:
    port, port6 = web["a_port"], web["v6_port"]
    monkeypatch.setenv(ALLOW_ENV, f"127.0.0.1:{port}, [::1]:{port6},0.0.0.0:{port}")
    result = await call(fetch_url, tmp_path, url="http://" + form.format(port=port, port6=port6) + "/ok")
    assert result.text == "hello from /ok" and not result.is_error
    # the allowance is for that port only
    other = form.format(port=web["trip_port"], port6=web["trip6_port"])
    refused = await call(fetch_url, tmp_path, url=f"http://{other}/ok")
    assert refused.is_error and "Refused to connect" in refused.text
    assert not web["trip"].touched() and not web["trip6"].touched()


async def test_redirects_between_allowed_hosts_are_followed(
    web: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ALLOW_ENV, f"127.0.0.1:{web['a_port']},localhost:{web['b_port']}")
    hop = urllib.parse.quote(f"http://localhost:{web['b_port']}/host")
    result = await call(fetch_url, tmp_path, url=f"http://127.0.0.1:{web['a_port']}/redirect?to={hop}")
    # reached `b` at the checked address, with the Host header of the name
    assert result.text == f"localhost:{web['b_port']}"
    relative = await call(fetch_url, tmp_path,
                          url=f"http://127.0.0.1:{web['a_port']}/redirect?to=/plain")
    assert relative.text == "hello from /plain"
    again = f"http://127.0.0.1:{web['a_port']}/redirect?to=/redirect%3Fto%3D/x"
    twice = await call(fetch_url, tmp_path,
                       url=f"http://127.0.0.1:{web['a_port']}/redirect?to=" + urllib.parse.quote(again))
    assert twice.text == "hello from /x" and not twice.is_error
    loop = f"http://127.0.0.1:{web['a_port']}/loop"
    looping = await call(fetch_url, tmp_path, url=loop)
    assert looping.text == f"Error: `{loop}` redirected more than 5 times; fetch the final URL"
    assert web["a"].paths.count("/loop") == 6
    away = await call(fetch_url, tmp_path,
                      url=f"http://127.0.0.1:{web['a_port']}/redirect?to=file:///etc/passwd")
    assert away.is_error and "fetch_url only follows http(s) URLs" in away.text


def test_the_allow_list_decides_for_internal_addresses_without_traffic() -> None:
    ip = ipaddress.ip_address
    rules = parse_allow_list("10.0.0.0/8, 169.254.169.254:80, 224.0.0.0/4, 0.0.0.0, "
                             "metadata.internal, ::ffff:192.168.0.0/112")
    assert pick_address("10.1.2.3", 443, [ip("10.1.2.3")], rules) == ip("10.1.2.3")
    assert pick_address("h", 80, [ip("::ffff:10.9.9.9")], rules) == ip("10.9.9.9")
    assert pick_address("169.254.169.254", 80, [ip("169.254.169.254")], rules) == ip("169.254.169.254")
    assert pick_address("239.1.1.1", 80, [ip("239.1.1.1")], rules) == ip("239.1.1.1")
    assert pick_address("0.0.0.0", 80, [ip("0.0.0.0")], rules) == ip("0.0.0.0")
    assert pick_address("METADATA.internal.", 80, [ip("127.0.0.9")], rules) == ip("127.0.0.9")
    assert pick_address("x", 80, [ip("192.168.3.4")], rules) == ip("192.168.3.4")
    # a public IPv4 address behind 6to4 is public
    assert pick_address("x", 80, [ip("2002:808:808::1")], []) == ip("2002:808:808::1")
    # a public address wins over a refused one in the same answer
    assert pick_address("x", 80, [ip("10.0.0.1"), ip("8.8.8.8")], []) == ip("8.8.8.8")
    with pytest.raises(Exception, match=r"`169.254.169.254` is a link-local address"):
        pick_address("169.254.169.254", 81, [ip("169.254.169.254")], rules)
    with pytest.raises(Exception, match=r"`evil.example` resolves to 127.0.0.1, a loopback"):
        pick_address("evil.example", 80, [ip("127.0.0.1")], rules)


@pytest.mark.parametrize(("entry", "why"), [
    ("10.0.0.0/33", "expected a host name, an IP address or a network"),
    ("[::1", "write an IPv6 address with a port as `[::1]:8080`"),
    ("localhost:99999", "the port must be a number from 1 to 65535, got `99999`"),
    ("local host", "expected a host name"),
])
async def test_a_bad_allow_list_entry_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, entry: str, why: str
) -> None:
    monkeypatch.setenv(ALLOW_ENV, f"localhost,{entry}")
    result = await call(fetch_url, tmp_path, url="http://localhost:9/")
    assert result.is_error
    assert result.text.startswith(f"Error: Invalid entry `{entry}` in `{ALLOW_ENV}`: {why}")


async def test_https_is_sent_to_the_checked_address_with_the_name_as_sni(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The TLS handshake carries the URL's name, though the socket goes to the resolved IP.

    (The certificate is self-signed, so verification then fails: what matters is the SNI.)
    """
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
                    "-subj", "/CN=localhost", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True, timeout=30)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    names: list[str | None] = []
    context.sni_callback = lambda _sock, name, _ctx: names.append(name)  # type: ignore[assignment,misc,return-value]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve_one() -> None:
        conn, _ = listener.accept()
        with conn:
            try:
                context.wrap_socket(conn, server_side=True).close()
            except (ssl.SSLError, OSError):  # the client rejects our self-signed certificate
                pass

    server = threading.Thread(target=serve_one, daemon=True)
    server.start()
    monkeypatch.setenv(ALLOW_ENV, f"localhost:{port}")
    try:
        result = await call(fetch_url, tmp_path, url=f"https://localhost:{port}/")
    finally:
        server.join(10)
        listener.close()
    assert result.is_error and "CERTIFICATE_VERIFY_FAILED" in result.text
    assert names == ["localhost"]


# --- search_files: backtracking patterns -------------------------------------------------------


@pytest.fixture
def evil(tmp_path: Path) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir()
    # `(a+)+$` against this backtracks 2^40 times per start position in Python's `re`.
    (ws / "evil.txt").write_text(("a" * 40 + "b\n") * 50 + "hello\n")
    return ws


async def test_a_catastrophic_pattern_runs_in_linear_time(evil: Path) -> None:
    t0 = time.monotonic()
    for pattern in ("(a+)+$", "(a|aa)+$", "(a*)*c$", "^(a+)+$"):
        result = await call(search_files, evil, pattern=pattern)
        assert result.text == f"No matches for `{pattern}`", result.text
    assert time.monotonic() - t0 < SEARCH_TIME_LIMIT / 2  # far from the limit: no backtracking


async def test_patterns_re2_lacks_run_on_python_re(evil: Path) -> None:
    assert (await call(search_files, evil, pattern=r"(l)\1")).text == "evil.txt:51: hello"
    assert (await call(search_files, evil, pattern=r"hel(?=lo)")).text == "evil.txt:51: hello"
    assert (await call(search_files, evil, pattern=r"(?<!x)lo\Z")).text == "evil.txt:51: hello"
    bad = await call(search_files, evil, pattern=r"(?<=a+)x")
    assert bad.is_error and bad.text.startswith("Error: Invalid regular expression `(?<=a+)x`:")


async def test_the_re_process_searches_only_confined_files(tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    (tmp_path / "secret.txt").write_text("hello secret\n")
    (ws / "escape").symlink_to(tmp_path / "secret.txt")
    (ensure_state_dir(ws / "state") / "topology.json").write_text("hello state\n")
    (ws / "ok.txt").write_text("hello ok\n")
    for pattern in (r"(l)\1", "hello"):  # the `re` process, and RE2 in the worker
        assert (await call(search_files, ws, pattern=pattern)).text == "ok.txt:1: hello ok"


def children(pid: int) -> set[int]:
    found = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        found |= {int(c) for c in (task / "children").read_text().split()}
    return found


async def test_cancelling_a_backtracking_search_kills_its_process(evil: Path) -> None:
    before = children(os.getpid())
    req = ToolCallRequest(call_id="c", name="search_files",
                          arguments=json.dumps({"pattern": "(a+)+$(?<=a)"}))

    async def search() -> None:
        await run_tool(search_files, req, workspace=evil)

    async with anyio.create_task_group() as tg:
        tg.start_soon(search)
        spawned = await until(lambda: children(os.getpid()) - before, what="the `re` process")
        tg.cancel_scope.cancel()
    await until(lambda: not (children(os.getpid()) & spawned), timeout=5,
                what=f"the `re` process {spawned} to be killed")


# --- read_file: long lines ---------------------------------------------------------------------


async def test_a_long_line_is_cut_with_a_way_to_read_on(tmp_path: Path) -> None:
    line = "".join(f"{i:05d}" for i in range(60_000))  # 300,000 characters, > the 256 KiB cap
    (tmp_path / "min.js").write_text(line + "\nsecond\n")
    first = await call(read_file, tmp_path, path="min.js")
    assert first.text == (line[:2000] + "…[line 1 cut: showing characters 1-2000 of 300000; call "
                          "read_file with offset=1, limit=1, column=2001 to read on]\nsecond\n")
    more = await call(read_file, tmp_path, path="min.js", limit=1, column=2001)
    assert more.text.startswith(line[2000:4000] + "…[line 1 cut: showing characters 2001-4000")
    assert more.text.endswith("\n[Showing lines 1-1; more follow: call read_file with offset=2]")
    tail = await call(read_file, tmp_path, path="min.js", limit=1, column=299_001)
    assert tail.text.startswith(line[299_000:] + "…[line 1 cut: showing characters 299001-300000 "
                                "of 300000]\n")
    assert (await call(read_file, tmp_path, path="min.js", offset=2)).text == "second\n"


async def test_line_ends_split_by_the_read_chunk(tmp_path: Path) -> None:
    x = b"x" * (READ_CHUNK_CHARS - 1)  # the chunk limit falls right after the "\r"
    (tmp_path / "crlf.txt").write_bytes(x + b"\r\nnext\r\n\rold mac\n")
    assert (await call(read_file, tmp_path, path="crlf.txt", offset=2)).text == "next\r\n\rold mac\n"
    one = await call(read_file, tmp_path, path="crlf.txt", offset=2, limit=1)
    assert one.text == "next\r\n\n[Showing lines 2-2; more follow: call read_file with offset=3]"
    assert (await call(read_file, tmp_path, path="crlf.txt", offset=3)).text == "\rold mac\n"
    assert (await call(read_file, tmp_path, path="crlf.txt", offset=4)).text == "old mac\n"
    (tmp_path / "cr.txt").write_bytes(x + b"\ry\n")  # a lone "\r" ends line 1 at the limit
    assert (await call(read_file, tmp_path, path="cr.txt", offset=2)).text == "y\n"


# --- the acceptance runs: a real worker on a real hub ------------------------------------------


def peak_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise AssertionError("no VmHWM in /proc/<pid>/status")


async def test_worker_keeps_serving_while_a_backtracking_search_runs_out(hub: dict, evil: Path) -> None:
    async with workers(hub["endpoint"], 1, "--workspace", str(evil), tools="agent_bus.tools.builtin") as [w], \
            executor(hub["endpoint"]) as tools:
        t0 = time.monotonic()
        assert (await tools.execute(bus_call("read_file", "warm", path="evil.txt", offset=51))).text == "hello\n"
        baseline = time.monotonic() - t0
        outcome: list[ToolResult] = []
        finished = anyio.Event()
        async with anyio.create_task_group() as tg:
            async def search() -> None:
                outcome.append(await tools.execute(bus_call("search_files", "evil", pattern="(a+)+$(?<=a)")))
                finished.set()

            started = time.monotonic()
            tg.start_soon(search)
            await until(lambda: children(w.pid), what="the worker's `re` process")
            served = 0
            while not finished.is_set():  # other calls, on the same worker, meanwhile
                t1 = time.monotonic()
                quick = await tools.execute(bus_call("search_files", f"q{served}", pattern="(a+)+$"))
                assert quick.text == "No matches for `(a+)+$`"
                assert time.monotonic() - t1 < max(2.0, 20 * baseline)
                served += 1
                with anyio.move_on_after(0.1):  # about ten calls a second, until the search ends
                    await finished.wait()
        took = time.monotonic() - started
        [result] = outcome
        assert result.is_error and result.text.startswith(
            f"Error: search_files stopped at its {SEARCH_TIME_LIMIT:g}s time limit before finding")
        assert SEARCH_TIME_LIMIT - 0.5 < took < SEARCH_TIME_LIMIT + 3
        assert served >= 5, served
        await until(lambda: not children(w.pid), timeout=5, what="the `re` process to be reaped")
        status = await tools.peer.status()
        assert "tool.search_files" in {s.name for s in status.services}
        assert w.popen.poll() is None


async def test_worker_reads_a_200_mb_line_in_bounded_memory(hub: dict, tmp_path: Path) -> None:
    ws = tmp_path / "ws"
    ws.mkdir()
    size = 200 * 1024 * 1024
    with (ws / "one-line.txt").open("w") as f:
        for i in range(size // (1024 * 1024)):
            f.write(chr(ord("a") + i % 26) * (1024 * 1024))
        f.write("\nend\n")
    async with workers(hub["endpoint"], 1, "--workspace", str(ws), tools="agent_bus.tools.builtin") as [w], \
            executor(hub["endpoint"]) as tools:
        (ws / "small.txt").write_text("x" * 5000 + "\nend\n")  # the same code paths, warmed up
        warm = await tools.execute(bus_call("read_file", "warm", path="small.txt", offset=2))
        assert warm.text == "end\n"
        before = peak_rss_kib(w.pid)
        through = await tools.execute(bus_call("read_file", "through", path="one-line.txt", offset=2))
        assert through.text == "end\n"
        first = await tools.execute(bus_call("read_file", "first", path="one-line.txt"))
        assert first.text == ("a" * 2000 + f"…[line 1 cut: showing characters 1-2000 of {size}; call "
                              "read_file with offset=1, limit=1, column=2001 to read on]\nend\n")
        column = size - 1024 * 1024 + 1  # the last mebibyte, written with the 200th letter
        far = await tools.execute(bus_call("read_file", "far", path="one-line.txt", limit=1,
                                           column=column))
        assert far.text.startswith(chr(ord("a") + 199 % 26) * 2000 + "…[line 1 cut: showing "
                                   f"characters {column}-{column + 1999} of {size}; call read_file")
        grown_kib = peak_rss_kib(w.pid) - before
    assert grown_kib * 1024 < size / 50, f"peak RSS grew {grown_kib} KiB reading a {size}-byte line"
