"""Built-in tools: workspace confinement, file tools, run_shell and fetch_url."""

import gzip
import http.server
import json
import os
import threading
import tracemalloc
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.bus.messages import ImagePart, ToolCallRequest, ToolResult
from agent_bus.tools import Tool, check_provider_schema, run_tool
from agent_bus.tools.builtin import (
    BUILTIN_TOOLS,
    fetch_url,
    list_dir,
    read_file,
    run_shell,
    search_files,
    write_file,
)
from agent_bus.tools.sandbox import SandboxPolicy
from tests.support import until

pytestmark = pytest.mark.anyio

#: These tests follow a shell's children by the pids it prints: outside a PID namespace.
#: run_shell's own namespace (bubblewrap) is tested in tests/security/test_sandbox.py.
PROCESS_GROUP_SHELL = SandboxPolicy(mode="off")

PNG = b"\x89PNG\r\n\x1a\n" + b"\0" * 16


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    root = tmp_path / "ws"
    (root / "src" / "pkg").mkdir(parents=True)
    (root / "src" / "a.py").write_text("import os\nprint('hello')\n")
    (root / "src" / "pkg" / "b.txt").write_text("hello world\nbye\n")
    (root / "notes.md").write_text("".join(f"line {i}\n" for i in range(1, 11)))
    (root / "pic.png").write_bytes(PNG)
    (root / "blob.bin").write_bytes(b"ab\0cd")
    (tmp_path / "secret.txt").write_text("top secret hello\n")
    (root / "escape").symlink_to(tmp_path / "secret.txt")
    (root / "escape_dir").symlink_to(tmp_path)
    return root


async def call(t: Tool, ws: Path, allow_shell: bool = False, **args: Any) -> ToolResult:
    req = ToolCallRequest(call_id="c", name=t.name, arguments=json.dumps(args))
    return await run_tool(t, req, workspace=ws, allow_shell=allow_shell, policy=PROCESS_GROUP_SHELL)


def test_every_builtin_schema_is_provider_ready() -> None:
    assert len(BUILTIN_TOOLS) == 6
    for t in BUILTIN_TOOLS:
        assert check_provider_schema(t.parameters) == [], t.name
        assert t.info.parameters["type"] == "object"
        assert t.description, t.name
        assert "$ref" not in json.dumps(t.parameters)


# --- confinement ---------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["../secret.txt", "src/../../secret.txt", "/etc/passwd", "escape", "escape_dir/secret.txt"])
@pytest.mark.parametrize(
    ("t", "extra"),
    [(read_file, {}), (write_file, {"content": "x"}), (list_dir, {}), (search_files, {"pattern": "x"})],
)
async def test_file_tools_refuse_paths_outside_the_workspace(
    ws: Path, t: Tool, extra: dict[str, Any], path: str
) -> None:
    result = await call(t, ws, path=path, **extra)
    assert result.is_error
    assert result.text.startswith(f"Error: Path `{path}` resolves to `")
    assert f"outside the workspace `{ws.resolve()}`" in result.text
    assert (ws.parent / "secret.txt").read_text() == "top secret hello\n"


async def test_absolute_path_inside_workspace_is_fine(ws: Path) -> None:
    result = await call(read_file, ws, path=str(ws / "src" / "a.py"))
    assert result.text == "import os\nprint('hello')\n"


# --- read / write / list / search ----------------------------------------------------------


async def test_read_file_ranges_and_continuation_note(ws: Path) -> None:
    assert (await call(read_file, ws, path="notes.md", offset=3, limit=2)).text == (
        "line 3\nline 4\n\n[Showing lines 3-4; more follow: call read_file with offset=5]"
    )
    assert (await call(read_file, ws, path="notes.md", offset=9)).text == "line 9\nline 10\n"
    past = (await call(read_file, ws, path="notes.md", offset=50)).text
    assert past.startswith("[offset 50 is past the end of the file: it has "), past
    last = (ws / "notes.md").read_text().splitlines()[-1]
    assert past.rstrip("\n").endswith("]\n" + last), past  # and its last line, as read_file shows it


async def test_read_file_images_binaries_dirs_and_missing(ws: Path) -> None:
    assert (await call(read_file, ws, path="pic.png")).content == [ImagePart(PNG, "image/png")]
    binary = await call(read_file, ws, path="blob.bin")
    assert binary.is_error and "looks like a binary file" in binary.text
    directory = await call(read_file, ws, path="src")
    assert directory.text == "Error: `src` is a directory; use list_dir to see its contents"
    missing = await call(read_file, ws, path="nope.txt")
    assert missing.text == "Error: `nope.txt` does not exist in the workspace"
    bad = await call(read_file, ws, path="notes.md", offset=0)
    assert bad.text == "Error: Invalid arguments for read_file: Expected `int` >= 1 - at `$.offset`"


async def test_write_file_creates_parents(ws: Path) -> None:
    result = await call(write_file, ws, path="new/dir/out.txt", content="héllo")
    assert result.text == "Wrote 6 bytes to new/dir/out.txt" and not result.is_error
    assert (ws / "new" / "dir" / "out.txt").read_text() == "héllo"


async def test_list_dir(ws: Path) -> None:
    result = await call(list_dir, ws)
    assert result.text.splitlines() == [
        "blob.bin  (5 bytes)",
        "escape@",
        "escape_dir@",
        "notes.md  (71 bytes)",
        f"pic.png  ({len(PNG)} bytes)",
        "src/",
    ]
    assert (await call(list_dir, ws, path="src/pkg")).text == "b.txt  (16 bytes)"
    assert (await call(list_dir, ws, path="notes.md")).is_error


async def test_search_files(ws: Path) -> None:
    result = await call(search_files, ws, pattern=r"hel+o")
    # the symlink `escape` (pointing outside) and the binary file are skipped
    assert result.text.splitlines() == ["src/a.py:2: print('hello')", "src/pkg/b.txt:1: hello world"]
    only_txt = await call(search_files, ws, pattern="hello", glob="*.txt")
    assert only_txt.text == "src/pkg/b.txt:1: hello world"
    one_file = await call(search_files, ws, pattern="^import", path="src/a.py")
    assert one_file.text == "src/a.py:1: import os"
    assert (await call(search_files, ws, pattern="zzz")).text == "No matches for `zzz`"
    bad = await call(search_files, ws, pattern="(unclosed")
    assert bad.is_error and bad.text.startswith("Error: Invalid regular expression `(unclosed`:")


# --- run_shell -----------------------------------------------------------------------------


async def test_run_shell_is_refused_unless_allowed(ws: Path) -> None:
    result = await call(run_shell, ws, command="touch pwned")
    assert result.is_error
    assert result.text.startswith("Error: Shell commands are disabled on this worker")
    # issue 34 item 7: the refusal names the real flag and topology key
    assert "--shell" in result.text and "shell = true" in result.text, result.text
    assert "allow_shell" not in result.text
    assert not (ws / "pwned").exists()


async def test_run_shell_output_exit_code_and_cwd(ws: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MY_API_KEY", "sk-123")
    ok = await call(run_shell, ws, True, command='pwd; echo err >&2; echo "key=$MY_API_KEY"')
    assert ok.text == f"{ws.resolve()}\nerr\nkey=\n[exit code 0]"
    assert not ok.is_error and ok.details == {"exit_code": 0, "timed_out": False, "truncated": False}
    failed = await call(run_shell, ws, True, command="exit 3")
    assert failed.is_error and failed.text == "(no output)\n[exit code 3]"


async def test_run_shell_truncates_output(ws: Path) -> None:
    result = await call(run_shell, ws, True, command="head -c 200000 /dev/zero | tr '\\0' a")
    assert result.text.startswith("a" * 1000)
    assert "[output truncated: 97600 more bytes not shown]\n[exit code 0]" in result.text
    assert result.details["truncated"] is True


def pid_gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (killed, not yet reaped by init) is dead too
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


async def wait_gone(pid: int) -> None:
    await until(lambda: pid_gone(pid), 5, f"process {pid} to be gone")


async def test_run_shell_timeout_kills_background_children(ws: Path) -> None:
    result = await call(run_shell, ws, True, command="sleep 30 & echo $!; sleep 30", timeout=0.3)
    pid = int(result.text.splitlines()[0])
    assert result.is_error and result.text.endswith("[Command timed out after 0.3s and was killed]")
    await wait_gone(pid)


async def test_run_shell_exit_kills_leftover_background_jobs(ws: Path) -> None:
    with anyio.fail_after(5):
        result = await call(run_shell, ws, True, command="sleep 30 & echo $!")
    assert not result.is_error
    await wait_gone(int(result.text.splitlines()[0]))


async def test_cancelling_run_shell_kills_the_process_group(ws: Path) -> None:
    pids: list[int] = []
    got_pid = anyio.Event()

    def on_progress(partial: ToolResult) -> None:
        pids.extend(int(tok) for tok in partial.text.split())
        got_pid.set()

    req = ToolCallRequest(call_id="c", name="run_shell", arguments='{"command": "sleep 30 & echo $!; wait"}')
    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:

            async def runner() -> None:
                await run_tool(run_shell, req, workspace=ws, allow_shell=True, on_progress=on_progress,
                               policy=PROCESS_GROUP_SHELL)

            tg.start_soon(runner)
            await got_pid.wait()
            assert not pid_gone(pids[0])
            tg.cancel_scope.cancel()
    await wait_gone(pids[0])


# --- fetch_url -----------------------------------------------------------------------------


def _gzip_stream(zeros: int) -> bytes:
    """gzip of `zeros` zero bytes, compressed piece by piece (never the whole input in memory)."""
    packer = zlib.compressobj(9, zlib.DEFLATED, zlib.MAX_WBITS | 16)
    step = b"\0" * (1 << 22)
    return b"".join([*(packer.compress(step) for _ in range(zeros // len(step))), packer.flush()])


BOMB_BYTES = 64 << 20  # decoded; the 1,827-byte bomb was 2 GiB, 16 s to build here
_BOMB = gzip.compress(_gzip_stream(BOMB_BYTES), 9)
_TEXT = b"line of text\n" * 10_000


class _Handler(http.server.BaseHTTPRequestHandler):
    encoded: dict[str, tuple[str, bytes]] = {
        "/bomb": ("gzip, gzip", _BOMB),
        "/deflate-gzip": ("gzip, deflate", zlib.compress(gzip.compress(_TEXT))),
        "/raw-deflate": ("deflate", zlib.compress(_TEXT)[2:-4]),
        "/br": ("br", b"not decoded"),
    }
    routes: dict[str, tuple[int, str, bytes]] = {
        "/text": (200, "text/plain; charset=utf-8", "héllo".encode()),
        "/json": (200, "application/json", b'{"a": 1}'),
        "/image": (200, "image/png", PNG),
        "/big": (200, "text/plain", b"x" * (1024 * 1024 + 10)),
    }

    def do_GET(self) -> None:
        status, ctype, body = self.routes.get(self.path, (404, "text/plain", b"nope"))
        if self.path in self.encoded:
            status, ctype = 200, "text/plain"
        encoding, body = self.encoded.get(self.path, ("", body))
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        if encoding:
            self.send_header("Content-Encoding", encoding)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


@pytest.fixture
def allow_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test servers live on loopback, which fetch_url refuses unless allowed."""
    monkeypatch.setenv("BUSCTL_FETCH_ALLOW", "127.0.0.1")


async def test_fetch_url(server: str, tmp_path: Path, allow_loopback: None) -> None:
    assert (await call(fetch_url, tmp_path, url=f"{server}/text")).text == "héllo"
    assert (await call(fetch_url, tmp_path, url=f"{server}/json")).text == '{"a": 1}'
    image = await call(fetch_url, tmp_path, url=f"{server}/image")
    assert image.is_error and image.text == (
        f"Error: `{server}/image` returned `image/png`, not text; fetch_url only returns text responses"
    )
    missing = await call(fetch_url, tmp_path, url=f"{server}/missing")
    assert missing.is_error and missing.text == f"Error: `{server}/missing` returned HTTP 404 Not Found"
    big = await call(fetch_url, tmp_path, url=f"{server}/big")
    assert big.text == "x" * (1024 * 1024) + "\n[truncated: the body is larger than 1048576 bytes]"


async def test_fetch_url_caps_decoded_bytes_of_a_double_gzip_bomb(
    server: str, tmp_path: Path, allow_loopback: None
) -> None:
    """Issue 28 item 5: the cap counts decoded bytes while streaming, whatever the encodings."""
    assert len(_BOMB) < 100_000
    tracemalloc.start()
    try:
        bomb = await call(fetch_url, tmp_path, url=f"{server}/bomb")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert bomb.text == "\0" * (1024 * 1024) + "\n[truncated: the body is larger than 1048576 bytes]"
    assert peak < BOMB_BYTES // 8, peak  # 4.7 MB here; httpx's decoding held the whole 64 MiB at once
    layered = await call(fetch_url, tmp_path, url=f"{server}/deflate-gzip")
    assert layered.text == _TEXT.decode()
    assert (await call(fetch_url, tmp_path, url=f"{server}/raw-deflate")).text == _TEXT.decode()
    brotli = await call(fetch_url, tmp_path, url=f"{server}/br")
    assert brotli.is_error and "`Content-Encoding: br`, which fetch_url cannot decode" in brotli.text


async def test_fetch_url_rejects_other_schemes_and_dead_hosts(
    tmp_path: Path, allow_loopback: None
) -> None:
    file_url = await call(fetch_url, tmp_path, url="file:///etc/passwd")
    assert file_url.is_error and "Expected `str` matching regex '^https?://' - at `$.url`" in file_url.text
    with anyio.fail_after(10):
        dead = await call(fetch_url, tmp_path, url="http://127.0.0.1:9/")
    assert dead.is_error and dead.text.startswith("Error: Cannot fetch `http://127.0.0.1:9/`: ConnectError")
