"""API keys never leave the gateway: not whole, not cut, not as any 8-character piece.

The fake LLM echoes the caller's key in its errors (`{api_key}` placeholders, as some proxies do):
whole, straddling the point where the error text is cut, and already cut by the server. A real
gateway process holds two keys in its environment; every place the text could reach is searched:
events (subscribe and replay), hub status, the gateway's stats and log, the coordinator's log and
conversation store, the hub's event log files and `busctl export`.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import msgspec
import pytest

from agent_bus.agents.client.remote import connect as connect_agents
from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig
from agent_bus.agents.gateway.fakellm import FakeLLMServer
from agent_bus.bus.client import connect
from agent_bus.bus.messages import AssistantMessage, LlmRequest, RetryPolicy, user_text
from agent_bus.bus.redact import FRAGMENT, MARK, Redactor, clip, log_redaction
from tests.gateway.conftest import FAST_RETRY, RetryLog, request
from tests.support import Proc, busctl, py

pytestmark = pytest.mark.anyio

# Random per run, in a mixed-case alphabet: an 8-character window of them appears by chance in
# nothing else (uuid run ids are lowercase hex). The second key has no recognisable shape, so only
# the known-secret layer of the redactor can catch it.
OPENAI_KEY = "sk-proj-" + secrets.token_urlsafe(36)
PROXY_KEY = "pk" + secrets.token_urlsafe(30)
EXPERIMENT = "leak-exp"
CUT_AT = 500  # where the engine cuts a provider's error text (after redaction)


def fragments(secret: str) -> list[str]:
    return [secret[i : i + FRAGMENT] for i in range(len(secret) - FRAGMENT + 1)]


def leaks(text: str, *keys: str) -> list[str]:
    """The `FRAGMENT`-long pieces of `keys` found in `text` (none, when nothing leaked)."""
    return [piece for key in keys for piece in fragments(key) if piece in text]


def echo_steps(error_kind: str) -> list[dict[str, Any]]:
    """Three retryable failures echoing the key, then a 401 echoing it whole (not retryable)."""
    straddle = "x" * (CUT_AT - len(error_kind) - 2 - 15)  # "kind: " + padding puts the cut 15 chars in
    return [
        {"fail": {"status": 500, "retry_after": "0", "message": straddle + "{api_key} end"}},
        {"fail": {"kind": "stream_error", "message": "upstream saw {api_key:20}...{api_key:-12}"}},
        {"fail": {"kind": "malformed", "data": "{not json, key={api_key}"}},
        {"fail": {"status": 401, "message": "Incorrect API key provided: {api_key}."}},
    ]


# --- the redactor --------------------------------------------------------------------------


def test_redactor_removes_every_piece_of_a_known_key_in_any_escaping() -> None:
    key = "Zq9" + secrets.token_urlsafe(24) + '"\\/'  # quotes and backslashes get escaped
    redact = Redactor([key])
    for text in (key, key[:FRAGMENT], key[5:25], key[-FRAGMENT:], json.dumps(key), repr(key),
                 f"{key[:12]} masked {key[-9:]}", httpx.QueryParams({"key": key}).__str__()):
        assert leaks(redact(f"error: {text} (end)"), key) == [], text
        assert redact(f"error: {text} (end)").startswith("error: ")
    assert redact(f"short {key[:FRAGMENT - 1]}") == f"short {key[:FRAGMENT - 1]}"  # 7 chars: kept
    assert redact("nothing secret here") == "nothing secret here"


@pytest.mark.parametrize(("text", "expected"), [
    ("key sk-abcDEF1234567890xyz rejected", f"key {MARK} rejected"),
    ("sk-ant-api03-AbC_dEf-0123456789 bad", f"{MARK} bad"),
    ("sk-proj-Q1w2E3r4T5y6U7i8O9p0 bad", f"{MARK} bad"),
    ("Authorization: Bearer eyJhbGciOi.J9x-y_z", f"Authorization: Bearer {MARK}"),
    ('{"x-api-key": "abcdef0123456789"}', f'{{"x-api-key": "{MARK}"}}'),
    ("url ?api_key=abcdef0123456789&x=1", f"url ?api_key={MARK}&x=1"),
    ("aws AKIAIOSFODNN7EXAMPLE here", f"aws {MARK} here"),
    ("disk-based scikit-learn sk-12 Bearer of news", "disk-based scikit-learn sk-12 Bearer of news"),
])
def test_redactor_removes_key_shaped_tokens_it_was_never_told(text: str, expected: str) -> None:
    assert Redactor()(text) == expected


def test_clip_redacts_before_it_cuts() -> None:
    key = "Zq9" + secrets.token_urlsafe(30)
    text = "x" * 490 + key  # the cut at 500 falls inside the key
    assert leaks(text[:500], key)  # cutting first would leave a 10-character piece…
    clipped = clip(text, Redactor([key]))
    assert leaks(clipped, key) == [] and clipped == "x" * 490 + MARK  # …redacting first leaves none


def test_log_redaction_covers_any_logger_args_and_tracebacks(caplog: pytest.LogCaptureFixture) -> None:
    key = "Zq9" + secrets.token_urlsafe(30)
    caplog.set_level(logging.INFO)
    with log_redaction(Redactor([key])):
        logging.getLogger("some.library").warning("sent %s", {"headers": {"x": key[:20]}})
        try:
            raise ValueError(f"bad key {key}")
        except ValueError:
            logging.getLogger("other").exception("failed")
    logging.getLogger("after").info("plain %s", key)  # the factory is restored on exit
    assert caplog.text.count(MARK) == 2 and "ValueError: bad key ***" in caplog.text
    assert leaks(caplog.text.split("plain")[0], key) == [] and f"plain {key}" in caplog.text


# --- the fake's quirk ----------------------------------------------------------------------


def test_fake_llm_echoes_the_callers_key_whole_and_cut(fake_server: Any) -> None:
    srv = fake_server([{"fail": {"status": 401, "message": "bad key {api_key} / {api_key:6} / {api_key:-4}"}},
                       {"fail": {"status": 401, "message": "bad key {api_key}"}}])
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    openai = httpx.post(srv.base_url + "/chat/completions", json=body,
                        headers={"authorization": f"Bearer {OPENAI_KEY}"})
    anthropic = httpx.post(srv.base_url + "/messages", json=body, headers={"x-api-key": PROXY_KEY})
    assert openai.json()["error"]["message"] == (
        f"bad key {OPENAI_KEY} / {OPENAI_KEY[:6]} / {OPENAI_KEY[-4:]}")
    assert anthropic.json()["error"]["message"] == f"bad key {PROXY_KEY}"


# --- the engine, in process, over real HTTP ------------------------------------------------


@pytest.mark.parametrize(("provider", "key", "error_kind"), [
    ("openai", OPENAI_KEY, "server_error"), ("anthropic", PROXY_KEY, "api_error")])
async def test_engine_errors_and_logs_hold_no_piece_of_an_echoed_key(
        fake_server: Any, caplog: pytest.LogCaptureFixture, provider: str, key: str,
        error_kind: str) -> None:
    srv = fake_server(echo_steps(error_kind))
    config = ModelConfig(alias="m", provider=provider, model="x",  # type: ignore[arg-type]
                         base_url=srv.base_url, api_key_env="THE_KEY", timeout=5.0)
    retries = RetryLog()
    caplog.set_level(logging.DEBUG)
    async with LlmEngine([config], env={"THE_KEY": key}) as engine:
        msg = await engine.complete(request(retry=FAST_RETRY), on_retry=retries)
    errors = [call[3] for call in retries.calls]
    assert len(srv.requests) == 4 and key in str(srv.requests[0].headers)  # the key was sent
    assert [call[2] for call in retries.calls] == [500, 0, 0]
    assert msg.stop_reason == "error" and f"Incorrect API key provided: {MARK}." in (msg.error or "")
    assert errors[0].count("x") > 400 and MARK in errors[0]  # the key a cut at 500 would have split
    assert all(MARK in text for text in errors[1:])  # each echo was there, and was redacted
    for text in [msg.error or "", *errors, caplog.text]:
        assert leaks(text, key) == [], text


# --- whole processes -----------------------------------------------------------------------


TOPOLOGY = """
[models.oai]
provider = "openai"
model = "m"
base_url = "{base_url}"
api_key_env = "LEAK_OPENAI_KEY"
timeout = 10.0

[models.proxy]
provider = "anthropic"
model = "m"
base_url = "{base_url}"
api_key_env = "LEAK_PROXY_KEY"
timeout = 10.0

[[agents]]
name = "leaky"
model = "oai"
tools = []
"""


@pytest.fixture
def fake() -> Iterator[FakeLLMServer]:
    with FakeLLMServer() as srv:
        yield srv


@pytest.fixture
def topology(fake: FakeLLMServer, tmp_path: Path) -> Path:
    path = tmp_path / "topology.toml"
    path.write_text(TOPOLOGY.format(base_url=fake.base_url))
    return path


@pytest.fixture
def gateway(hub: dict, topology: Path) -> Iterator[Proc]:
    proc = Proc(busctl("gateway", "--hub", hub["endpoint"], "--topology", str(topology), "--name", "gw-leak"),
                env={"LEAK_OPENAI_KEY": OPENAI_KEY, "LEAK_PROXY_KEY": PROXY_KEY})
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


@pytest.fixture
def coordinator(hub: dict, topology: Path, tmp_path: Path, gateway: Proc) -> Iterator[Proc]:
    proc = Proc(busctl("coordinator", "--hub", hub["endpoint"], "--topology", str(topology),
                       "--state-dir", str(tmp_path / "agents"), "--name", "co-leak", "--agent", "leaky"))
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.stop()


async def ask_gateway(endpoint: str, model: str) -> AssistantMessage:
    request = LlmRequest(messages=[user_text("hi")], model=model, agent="direct", run_id=f"direct-{model}",
                         experiment=EXPERIMENT, retry=RetryPolicy(base_delay=0.01, max_delay=0.05))
    async with connect(endpoint, name="leak-client") as peer:
        body = await peer.request("llm", msgspec.msgpack.encode(request), timeout=30)
    return msgspec.msgpack.decode(body, type=AssistantMessage)


async def subscribed_events(endpoint: str) -> tuple[str, str, str]:
    """Every logged event through a subscription replayed from 0, the hub status, the gateway stats."""
    seen: list[bytes] = []
    async with connect(endpoint, name="leak-reader") as peer:
        status = await peer.status()
        stats = await peer.request("gateway.gw-leak", b"", timeout=10)
        async with peer.subscribe(since=0) as sub:
            with anyio.fail_after(15):
                async for envelope in sub:
                    seen.append(msgspec.json.encode(envelope))
                    if envelope.header.seq >= status.seq:
                        break
    assert len(seen) > 10
    return (b"\n".join(seen).decode(), msgspec.json.encode(status).decode(),
            json.dumps(msgspec.msgpack.decode(stats)))


def run_cli(*args: str) -> str:
    done = subprocess.run(busctl(*args), capture_output=True, text=True, timeout=30)
    assert done.returncode == 0, done.stderr
    return done.stdout + done.stderr


def files_under(root: Path) -> list[tuple[str, str]]:
    """(path, raw bytes as latin-1) of every file: SQLite pages and WAL frames included."""
    return [(str(p), p.read_bytes().decode("latin-1")) for p in sorted(root.rglob("*")) if p.is_file()]


async def test_an_echoed_key_reaches_no_event_status_log_store_or_export(
        hub: dict, gateway: Proc, coordinator: Proc, fake: FakeLLMServer, tmp_path: Path) -> None:
    endpoint = hub["endpoint"]
    # Direct `llm` requests: three retries (llm_retry events, gateway warnings), then a 401.
    fake.set_script({"steps": echo_steps("server_error") + echo_steps("api_error"), "echo": True})
    oai = await ask_gateway(endpoint, "oai")
    proxy = await ask_gateway(endpoint, "proxy")
    assert fake.requests[0].headers["authorization"] == f"Bearer {OPENAI_KEY}"
    assert fake.requests[4].headers["x-api-key"] == PROXY_KEY
    for message in (oai, proxy):
        assert message.stop_reason == "error" and f"provided: {MARK}." in (message.error or "")

    # An agent run: its error lands in the coordinator's events and conversation store.
    fake.set_script({"steps": echo_steps("server_error")[::3], "echo": True}, clear_requests=True)
    async with connect_agents(endpoint, name="leak-agent") as bus:
        run = await bus.prompt("leaky", "hello", new_session=True, experiment=EXPERIMENT)
        result = await run.result()
    assert result.stop_reason == "error" and f"provided: {MARK}." in (result.error or "")
    assert len(fake.requests) == 2  # the 500 was retried, the 401 was not

    events, status, stats = await subscribed_events(endpoint)
    replay = run_cli("watch", "--hub", endpoint, "--since", "0", "--no-follow", "--json")
    export = run_cli("export", "--hub", endpoint, "--experiment", EXPERIMENT)
    status_cli = run_cli("status", "--hub", endpoint, "--json")
    assert export.count('"llm_retry"') == 7 and export.count(MARK) >= 9  # the echoes were all there
    coordinator.stop()  # flushes its log and checkpoints the conversation store
    gateway.stop()
    assert gateway.output().count(" failed (") >= 7  # every retry was logged, with its error
    haystacks = [("events", events), ("status", status), ("gateway stats", stats),
                 ("watch replay", replay), ("export", export), ("status cli", status_cli),
                 ("gateway log", gateway.output()), ("coordinator log", coordinator.output()),
                 ("hub log", hub["proc"].output())]
    haystacks += files_under(tmp_path / "agents") + files_under(Path(hub["state"]))
    assert any("conversations.sqlite" in name for name, _ in haystacks)
    for name, text in haystacks:
        assert leaks(text, OPENAI_KEY, PROXY_KEY) == [], f"a piece of a key leaked into {name}"


# --- the gateway's memory and environment --------------------------------------------------

READ_ENVIRON = """
import json, sys
try:
    data = open(f"/proc/{sys.argv[1]}/environ", "rb").read()
except PermissionError as exc:
    print(json.dumps({"read": False, "error": str(exc)}))
else:
    print(json.dumps({"read": True, "has_key": sys.argv[2].encode() in data}))
"""
PAUSE = "import json, os, signal; print(json.dumps({'ready': 1, 'pid': os.getpid()}), flush=True); signal.pause()"


def as_plain_user() -> list[str]:
    """Run a command as an unprivileged user: root reads any process's memory (CAP_SYS_PTRACE),
    so as root the test runs both the gateway and the reader as `nobody`."""
    if os.geteuid() != 0:
        return []
    if shutil.which("setpriv") is None:
        pytest.skip("running as root without `setpriv`: cannot drop to a plain user")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def read_environ(pid: int, user: list[str]) -> dict[str, Any]:
    done = subprocess.run([*user, *py("-c", READ_ENVIRON, str(pid), PROXY_KEY)],
                          capture_output=True, text=True, timeout=20)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_DUMPABLE is Linux-only")
def test_another_process_of_the_same_user_cannot_read_the_gateways_environment(
        hub: dict, fake: FakeLLMServer) -> None:
    user = as_plain_user()
    env = {"OPENAI_BASE_URL": fake.base_url, "OPENAI_API_KEY": PROXY_KEY}
    control = Proc([*user, *py("-c", PAUSE)], env=env)
    gateway = Proc([*user, *busctl("gateway", "--hub", hub["endpoint"], "--name", "gw-nodump")], env=env)
    try:
        control_pid = control.wait_ready()["pid"]
        gateway_pid = gateway.wait_ready()["pid"]
        # the same user reads a plain process's environment, key included: the check can fail…
        assert read_environ(control_pid, user) == {"read": True, "has_key": True}
        # …but not the gateway's
        denied = read_environ(gateway_pid, user)
        assert denied["read"] is False and "Permission denied" in denied["error"]
    finally:
        gateway.stop()
        control.stop()
