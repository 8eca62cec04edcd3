"""The LLM gateway process: serves `llm` on the hub by calling providers through `LlmEngine`.

Each request's streamed deltas are published as `message_update` events (and each retry as an
`llm_retry` event) under the request's agent, run and experiment, while the model is still
generating; the reply is the finished `AssistantMessage`. API keys stay in this process: the
engine reads them from the environment at call time and redacts them (and any 8-character piece
of them) from every error; every log record of the process goes through the same redactor; and
the process makes itself non-dumpable on Linux, so other processes of the same user cannot read
its environment or memory.
A second service, `gateway.<name>`, answers with the engine's stats (queues, usage totals).
Replay mode (`agents.replay`, `busctl replay`): `llm.replay` loads the recorded replies of an
experiment for another one; that one's `llm` requests are then answered from them, matched by
`request_key` in order, and never reach a model (no match: an error reply naming the key, so the
run diverges visibly). A fork's live requests (`_Replay.live`) go to the model, changed as the
replay says (another model alias; per agent a system prompt, sampling: `LiveOverrides`); in a
fork a request with no logged reply left (a run E never had, e.g. a helper asked something new by
a live turn, or a run whose requests went another way) is live too, and so is the rest of its run.

The requester also gets each delta as a partial reply (`LlmPartial`, with the model in use and
its context window): a requester that aborts (its cancel reaches us only as a cancelled handler,
after which no reply can be sent) still holds everything streamed so far and keeps it as the
aborted message. A delta is what one read of the model's stream brought for one content part
(`MessageBuilder.release`), and the peer sends the partials of one event-loop iteration
as one message, a body each (`IncomingRequest.partial`), so a call costs the hub a few partial
messages and `message_update` events, not one per SSE event. The deltas of the stream's last
read, which end the message, go only as events: the reply follows them at once and holds them
(the first partial is sent even then: it describes the model). A retry
sends `reset` first: what came before is discarded; the `llm_retry` event then says `discarded`
when the failed attempt had streamed deltas, so watchers drop them.

At start the gateway asks each server for what the configuration left out (model name, context
window; see `LlmEngine.discover`) and exits with the reason when the choice is ambiguous.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import NoReturn

import anyio
import msgspec

from agent_bus.agents.gateway.engine import (
    NO_MODEL_ERROR,
    LlmEngine,
    ModelConfig,
    ModelSetupError,
    models_from_env,
)
from agent_bus.agents.gateway.providers.llamacpp import LocalModelError, hosted_models
from agent_bus.agents.gateway.wire import LlmPartial
from agent_bus.agents.replay_wire import REPLAY_SERVICE, ReplayEntry, ReplayLoad, ReplayLoaded, request_key
from agent_bus.bus import events as ev
from agent_bus.bus.client import IncomingRequest, Peer, connect
from agent_bus.bus.errors import RemoteError
from agent_bus.bus.messages import AssistantDelta, AssistantMessage, LlmMessage, LlmRequest, Usage
from agent_bus.bus.procsec import make_undumpable
from agent_bus.bus.redact import log_redaction
from agent_bus.bus.security import CurveClient
from agent_bus.bus.serving import HEADER_ROOM, body_limit

log = logging.getLogger("agents.gateway.process")

LLM_SERVICE = "llm"
REPLAYS_KEPT = 16  # experiments in replay mode held at once
INVALID = "invalid"  # error code: a replay that cannot apply (e.g. an unknown model alias)
LLM_CAPACITY = 256  # requests taken at once; the engine's per-model limits queue the rest

# A `message_update` event carries at most this many characters of a delta (4 bytes each at
# most in UTF-8): a bigger delta is published as several, in order, under the hub's
# `max_event_bytes` (1 MiB by default), which drops a bigger event from the log.
EVENT_DELTA_CHARS = 128 * 1024

_encoder = msgspec.msgpack.Encoder()
_replay_decoder = msgspec.msgpack.Decoder(ReplayLoad)
# Runs whose last request `_Requests` keeps decoded (the most recent calls'): as many as a
# big experiment runs at once (64 thrashed at 1,000 sessions: 3.7% of the gateway's CPU went to
# decoding whole histories again). Memory stays bounded by the other two: the most messages
# those hold together, and the most bytes of their bodies (each kept message is a view into
# its request's body, which it keeps alive).
RUNS_KEPT = 2048
MESSAGES_KEPT = 20_000
BODY_BYTES_KEPT = 64 * 1024 * 1024


class _LazyRequest(LlmRequest):
    """An `llm` request with its messages left encoded (`_Requests` decodes the new ones)."""

    messages: list[msgspec.Raw]  # type: ignore[assignment]


_lazy_decoder = msgspec.msgpack.Decoder(_LazyRequest)
_message_decoder = msgspec.msgpack.Decoder(LlmMessage)
_OTHER_FIELDS = tuple(f.name for f in msgspec.structs.fields(LlmRequest) if f.name != "messages")


class _Requests:
    """Decodes `llm` requests; of a run's history, only what it added since the run's last call.

    Each call carries the run's whole history: decoding it was the gateway's largest cost that
    grows with the run (~200 us at 25 tool-call turns). The messages are compared encoded
    (bytes, in C: a few us) with the run's last request, and the unchanged ones are that
    request's decoded objects, never changed by the gateway (which lets the engine's
    `Histories` recognise them at once and convert only the new ones)."""

    def __init__(self, runs: int = RUNS_KEPT, messages: int = MESSAGES_KEPT,
                 body_bytes: int = BODY_BYTES_KEPT) -> None:
        self._kept, self._most, self._most_bytes = runs, messages, body_bytes
        # run -> (its last request's messages encoded, decoded, and that body's size)
        self._runs: OrderedDict[str, tuple[list[msgspec.Raw], list[LlmMessage], int]] = \
            OrderedDict()
        self._held = 0  # messages in `_runs`
        self._held_bytes = 0  # bytes of the bodies they keep alive

    def decode(self, body: bytes) -> LlmRequest:
        """Raises `msgspec.DecodeError` or `msgspec.ValidationError` for a malformed request."""
        lazy = _lazy_decoder.decode(body)
        raws, run = lazy.messages, lazy.run_id
        seen = self._runs.pop(run, None) if run else None
        same = 0
        if seen is not None:
            self._held -= len(seen[0])
            self._held_bytes -= seen[2]
            old = seen[0]
            if len(old) <= len(raws) and raws[:len(old)] == old:
                same = len(old)
            else:  # an earlier message changed (a compaction): the common start still counts
                while same < len(old) and same < len(raws) and raws[same] == old[same]:
                    same += 1
        messages = seen[1][:same] if seen is not None else []
        messages += [_message_decoder.decode(raw) for raw in raws[same:]]
        if run and len(raws) <= self._most and len(body) <= self._most_bytes:
            self._runs[run] = (raws, messages, len(body))
            self._held += len(raws)
            self._held_bytes += len(body)
            while (len(self._runs) > self._kept or self._held > self._most
                   or self._held_bytes > self._most_bytes):
                dropped = self._runs.popitem(last=False)[1]
                self._held -= len(dropped[0])
                self._held_bytes -= dropped[2]
        return LlmRequest(messages=list(messages),
                          **{name: getattr(lazy, name) for name in _OTHER_FIELDS})


class _OverLimit(Exception):
    """The reply being made would be over the hub's message limit (`size` bytes so far)."""

    def __init__(self, size: int, *, streaming: bool) -> None:
        super().__init__(size)
        self.size, self.streaming = size, streaming


def _event_pieces(delta: AssistantDelta) -> list[AssistantDelta]:
    """`delta` as `message_update` events carry it: cut in `EVENT_DELTA_CHARS` pieces (a reader
    joins a message's deltas in order, so the pieces read as the whole)."""
    text = delta.delta
    if len(text) <= EVENT_DELTA_CHARS:
        return [delta]
    return [msgspec.structs.replace(delta, delta=text[i:i + EVENT_DELTA_CHARS])
            for i in range(0, len(text), EVENT_DELTA_CHARS)]


class GatewaySettings(msgspec.Struct):
    hub: str
    models: list[ModelConfig] = msgspec.field(default_factory=list)  # empty: from the environment
    default_model: str = ""
    name: str = "gateway"
    curve: CurveClient | None = None


class _Replay:
    """One experiment in replay mode: recorded replies by request key, and for a fork where
    each run goes live (after `live_after` model calls, or at a reply the log marks live) and
    what its live requests change (`model`, `overrides` by agent)."""

    def __init__(self, load: ReplayLoad) -> None:
        self.book: dict[str, deque[ReplayEntry]] = {}
        for entry in load.entries:
            self.book.setdefault(entry.key, deque()).append(entry)
        self.live_after = load.live_after
        self.model = load.model
        self.overrides = load.overrides
        # A fork: the replay goes live somewhere (an older client sends no `fork`: its marks say)
        self.fork = load.fork or load.live_after > 0 or any(e.live for e in load.entries)
        self.calls: dict[str, int] = {}  # run id -> model requests seen
        self.live_runs: set[str] = set()  # runs past their fork point (`live` entries)
        self.unmatched = 0  # fork requests with no logged reply, sent live

    def live(self, run_id: str, key: str) -> bool:
        """Count this request of `run_id`; true when it goes to the live model."""
        n = self.calls[run_id] = self.calls.get(run_id, 0) + 1
        if run_id in self.live_runs or 0 < self.live_after < n:
            return True
        entries = self.book.get(key)
        if entries and entries[0].live:  # the fork point: this call and the run's later ones
            entries.popleft()
            self.live_runs.add(run_id)
            return True
        if not entries and self.fork:
            # The fork made a request the log never saw (a helper asked something new, a run
            # that went another way): live, with the rest of its run, whose history is new too.
            # Pure replay answers it with an error reply instead (`Gateway._replayed`).
            self.live_runs.add(run_id)
            self.unmatched += 1
            log.info("fork: run %s made a request the log has no reply for (key %s): live",
                     run_id, key)
            return True
        return False

    def live_request(self, request: LlmRequest) -> LlmRequest:
        if self.model:  # a fork to another model
            request = msgspec.structs.replace(request, model=self.model)
        overrides = self.overrides.get(request.agent)
        return overrides.apply(request) if overrides is not None else request


def stats_service(name: str) -> str:
    return f"gateway.{name}"


def _over_limit(peer: Peer, size: int) -> bool:
    """Whether a reply body of `size` bytes is over the hub's `max_message_bytes` (with room
    for the header): the hub would drop our connection, and every call in flight on it."""
    limit = body_limit(peer)
    return bool(limit) and size > limit


# How long a streamed delta's partial and event wait for company (bus/outbox.py): a watcher
# waits for them, and streams of a few tokens a read rarely share a message worth the wait.
# Against the bus's default 2 ms, 0.5 ms took busctl watch's lag behind the server to about 0.6x
# in the same runs (bench/bench_pace.py --event-linger, 4 streams of a token each 10 ms); a
# model streaming faster still sends at most one flush per linger.
STREAM_LINGER = 0.0005


class _CallRelay:
    """One `llm` call's streaming: each delta to the requester (a partial reply) and to the log
    (`message_update` events), each retry as a `reset` partial and an `llm_retry` event. The
    engine's three callbacks for the call share this state."""

    __slots__ = ("peer", "engine", "req", "request", "publish", "described", "streamed", "sent",
                 "last_read")

    def __init__(self, peer: Peer, engine: LlmEngine, req: IncomingRequest,
                 request: LlmRequest) -> None:
        self.peer, self.engine, self.req, self.request = peer, engine, req, request
        # A compaction's summary is not the run's text: its deltas go only to the requester
        # (`compaction_complete` carries its usage), never as the run's `message_update`s.
        self.publish = request.purpose != "compaction"
        self.described = False  # the first partial, which describes the model, went out
        self.streamed = False  # this attempt streamed something (a retry then discards it)
        self.sent = 0  # bytes of this attempt's partials: about what the reply will weigh
        self.last_read = False  # the message is complete: its last read's deltas come with the reply

    def on_last_read(self) -> None:
        self.last_read = True

    async def on_delta(self, delta: AssistantDelta) -> None:
        self.streamed = True
        # The last read's deltas are in the reply that follows at once: no partial for them
        # (a message less through the hub per call), unless one must describe the model.
        if not self.described or not self.last_read:
            await self._send_partial(delta)
        if self.publish:
            request = self.request
            for piece in _event_pieces(delta):
                await self.peer.publish(ev.MessageUpdate(delta=piece), agent=request.agent,
                                        run=request.run_id, experiment=request.experiment)

    async def _send_partial(self, delta: AssistantDelta) -> None:
        partial = self._described(delta) if not self.described else LlmPartial(delta)
        self.described = True
        body = _encoder.encode(partial)
        self.sent += len(body)
        if _over_limit(self.peer, self.sent):  # the reply could not reach the requester: stop now
            raise _OverLimit(self.sent, streaming=True)
        # The partial first: the peer holds a burst's messages until the loop iteration ends, a
        # request's partials join its first held one and a run's adjacent events go as one
        # message. Event first, a burst (the deltas of one read) went out as event, partials,
        # events: three sends and three hub messages where two do.
        await self.req.partial(body)

    def _described(self, delta: AssistantDelta) -> LlmPartial:
        """The call's first partial: it names the model in use, its provider and window."""
        config = self.engine.model_config(self.request.model)
        if config is None:
            return LlmPartial(delta)
        return LlmPartial(delta, model=config.model, provider=config.provider,
                          context_window=config.context_window)

    async def on_retry(self, attempt: int, delay: float, status: int, error: str,
                       usage: Usage) -> None:
        request = self.request
        config = self.engine.model_config(request.model)
        await self.req.partial(_encoder.encode(LlmPartial(reset=True)))
        discarded = self.streamed and self.publish
        self.streamed, self.sent = False, 0
        await self.peer.publish(
            ev.LlmRetry(attempt=attempt, delay=delay, status=status, error=error,
                        provider=config.provider if config else "", discarded=discarded,
                        usage=usage, model=config.model if config else ""),
            agent=request.agent, run=request.run_id, experiment=request.experiment)


class Gateway:
    """Wires an `LlmEngine` to a peer: one handler per `llm` request."""

    def __init__(self, peer: Peer, engine: LlmEngine) -> None:
        self.peer = peer
        self.engine = engine
        self.replays: dict[str, _Replay] = {}  # by experiment (replay mode)
        self.replayed = 0
        self.requests = _Requests()

    async def handle(self, req: IncomingRequest) -> bytes:
        try:
            request = self.requests.decode(req.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError(f"malformed `llm` request: {exc}", "bad_request") from None
        replay = self.replays.get(request.experiment)
        if replay is not None:
            key = request_key(request.agent, request.messages)
            if not replay.live(request.run_id, key):
                return _encoder.encode(self._replayed(request, key, replay.book))
            request = replay.live_request(request)
        relay = _CallRelay(self.peer, self.engine, req, request)
        try:
            body = _encoder.encode(await self.engine.complete(
                request, relay.on_delta, relay.on_retry, on_last_read=relay.on_last_read))
            if _over_limit(self.peer, len(body)):
                raise _OverLimit(len(body), streaming=False)
        except _OverLimit as over:
            return _encoder.encode(self._too_large(request, over))
        return body

    def _too_large(self, request: LlmRequest, over: _OverLimit) -> AssistantMessage:
        limit = body_limit(self.peer) + HEADER_ROOM  # the hub's max_message_bytes
        config = self.engine.model_config(request.model)
        when = "streamed before the call was stopped" if over.streaming else "in all"
        text = (f"the model's reply is over the hub's message limit of {limit} bytes "
                f"(`max_message_bytes`): {over.size} bytes {when}; ask for smaller pieces (e.g. "
                "write a large file in several tool calls) or raise the hub's max_message_bytes")
        log.warning("call of agent %s, run %s: %s", request.agent, request.run_id, text)
        return AssistantMessage(stop_reason="error", error=text,
                                provider=config.provider if config else "",
                                model=config.model if config else "")

    def _replayed(self, request: LlmRequest, key: str,
                  book: dict[str, deque[ReplayEntry]]) -> AssistantMessage:
        replies = book.get(key)
        if not replies:
            return AssistantMessage(stop_reason="error", error=(
                f"replay of experiment `{request.experiment}`: no recorded reply left for this "
                f"request of agent `{request.agent}` (key {key}); the run diverged from the log"))
        self.replayed += 1
        return replies.popleft().reply

    async def handle_replay(self, req: IncomingRequest) -> bytes:
        try:
            load = _replay_decoder.decode(req.body)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise RemoteError(f"malformed `{REPLAY_SERVICE}` request: {exc}",
                              "bad_request") from None
        unknown = sorted({alias for alias in (load.model, *(o.model or "" for o in
                                                           load.overrides.values()))
                          if alias and self.engine.model_config(alias) is None})
        if unknown:  # refused before the replay starts, not at its first live call
            raise RemoteError(f"model alias {', '.join(unknown)} is not one of this gateway's "
                              f"({', '.join(m.alias for m in self.engine.models)})", INVALID)
        self.replays[load.experiment] = _Replay(load)
        while len(self.replays) > REPLAYS_KEPT:  # the oldest replay goes (dicts keep order)
            del self.replays[next(iter(self.replays))]
        log.info("replaying experiment %s as %s: %d recorded replies", load.source,
                 load.experiment, len(load.entries))
        return _encoder.encode(ReplayLoaded(load.experiment, len(load.entries)))

    def handle_stats(self, req: IncomingRequest) -> bytes:
        """Answered from memory: a plain function, called in the peer's reader (no task)."""
        return _encoder.encode(self.engine.stats())


def build_engine(settings: GatewaySettings, models: list[ModelConfig] | None = None,
                 env: Mapping[str, str] | None = None) -> LlmEngine:
    """`env`: where the keys are looked up (default: this process's environment)."""
    env = os.environ if env is None else env
    models = models if models is not None else settings.models or models_from_env(env)
    return LlmEngine(models, default=settings.default_model or None, env=env, fresh_requests=True)


async def run_gateway(settings: GatewaySettings, *, secrets: Mapping[str, str] | None = None,
                      task_status: anyio.abc.TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
    """Serve until SIGINT/SIGTERM; print one JSON ready line once `llm` is registered.

    `secrets`: variables (API keys) handed over on stdin by `busctl up`, looked up before the
    environment; they never enter this process's environment block (`/proc/PID/environ`).
    `provider = "llamacpp"` models are served by llama.cpp inside this process, started before
    the ready line and stopped after the last request (see `agents.gateway.providers.llamacpp`)."""
    make_undumpable()  # first: keys given in the environment (`busctl gateway`) are there already
    env: Mapping[str, str] = {**os.environ, **secrets} if secrets else os.environ
    try:
        models = settings.models or models_from_env(env)
    except ModelSetupError as exc:
        _exit_setup_error(exc)
    try:
        async with hosted_models(models) as served:
            await _run_engine(settings, build_engine(settings, served, env), task_status)
    except LocalModelError as exc:
        _exit_setup_error(exc)


async def _run_engine(settings: GatewaySettings, engine: LlmEngine,
                      task_status: anyio.abc.TaskStatus[None]) -> None:
    async with engine:
        with log_redaction(lambda text: engine.redactor()(text)):
            try:
                await engine.discover()
            except ModelSetupError as exc:
                _exit_setup_error(exc)
            async with connect(settings.hub, name=settings.name, role="gateway",
                               curve=settings.curve) as peer:
                peer.outbox.linger = min(peer.outbox.linger, STREAM_LINGER)
                await _serve(settings, engine, peer, task_status)


def _exit_setup_error(exc: ModelSetupError | LocalModelError) -> NoReturn:
    """`busctl up` shows a gateway's stderr when it exits before its ready line."""
    print(f"ERROR: {exc}", file=sys.stderr, flush=True)
    raise SystemExit(2)


async def _serve(settings: GatewaySettings, engine: LlmEngine, peer: Peer,
                 task_status: anyio.abc.TaskStatus[None]) -> None:
    gateway = Gateway(peer, engine)
    await peer.serve(LLM_SERVICE, gateway.handle, capacity=LLM_CAPACITY, confirm=False)
    await peer.serve(stats_service(settings.name), gateway.handle_stats, capacity=8, confirm=False)
    await peer.serve(REPLAY_SERVICE, gateway.handle_replay, capacity=4, confirm=False)
    await peer.confirm_registers()  # one round trip for the three: in place, or refused
    aliases = [m.alias for m in engine.models]
    if not aliases:
        print(f"WARNING: {NO_MODEL_ERROR}", file=sys.stderr, flush=True)
    default = engine.model_config("")
    print(json.dumps({"ready": "gateway", "name": settings.name, "models": aliases,
                      "default": default.alias if default else "", "pid": os.getpid(),
                      "model": default.model if default else "",
                      "context_window": default.context_window if default else 0}),
          flush=True)
    task_status.started()
    with anyio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for _ in signals:
            break
    with anyio.move_on_after(2, shield=True):
        await peer.unserve(LLM_SERVICE)
