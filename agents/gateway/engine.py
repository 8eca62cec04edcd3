"""The provider-calling core of the LLM gateway: one `LlmEngine` serves every configured model.

    engine = LlmEngine.from_env()            # or LlmEngine([ModelConfig(...), ...])
    async with engine:
        message = await engine.complete(request, on_delta=..., on_retry=..., abort=abort)

Contract of `complete()` (it never raises for provider trouble, and never hangs past its timeouts):

- returns the finished `AssistantMessage`; any failure is a message with `stop_reason="error"` and
  `error` naming the provider, the HTTP status (when there was one) and the provider's error text;
- retries 429/5xx (`request.retry.retry_statuses`), connection errors, timeouts and streams that
  break midway, from scratch, with exponential backoff and jitter, honouring `Retry-After` and
  `retry-after-ms`; every retry is reported through `on_retry(attempt, delay, status, error,
  usage)` (`attempt` is the 1-based attempt that just failed, `status` 0 when there was no HTTP
  status, `usage` what it billed: the server's figures, or an estimate from what streamed).
  Deltas of a failed attempt were already sent: after `on_retry`, consumers should discard the
  partial message they were building — deltas restart at index 0;
- cancellation: set the `abort` (an `agents.loop.abort.Abort`) to stop the call at once — the
  HTTP stream is closed and the result is a message with `stop_reason="aborted"` holding the
  text/thinking streamed so far (never tool calls, which may be cut off) and its usage (estimated
  when the server had sent none).
  Cancelling the task that runs `complete()` (an anyio cancel scope) also closes the stream at
  once, but then nothing is returned: the cancellation propagates;
- every attempt's usage counts in `stats()`: retried and failed attempts, aborted replies.

API keys are read from the environment variable each model names (`api_key_env`) at call time and
go only into request headers. They never appear in errors, logs, reprs or `stats()`: every error
text is redacted whole (all configured keys, any 8-character piece of them, and key-shaped tokens,
see `bus.redact`) before it is cut to length, so a server that echoes the key leaves no fragment.
"""

from __future__ import annotations

import functools
import inspect
import json
import logging
import os
import random
import re
import ssl
import urllib.request
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import asynccontextmanager, contextmanager
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from types import TracebackType
from typing import Any

import anyio
import httpx
import msgspec

from agent_bus.agents.gateway.http1 import Http1Transport
from agent_bus.agents.gateway.providers import (
    PROVIDERS,
    MessageBuilder,
    Provider,
    ProviderRequest,
    StreamError,
    iter_sse,
)
from agent_bus.agents.gateway.providers.base import DeltaCallback
from agent_bus.agents.gateway.providers.discovery import discover
from agent_bus.agents.gateway.providers.llamacpp import DEFAULT_N_CTX
from agent_bus.agents.gateway.providers.openai import Histories, OpenAIProvider
from agent_bus.agents.gateway.providers.prices import ConfiguredPrices, Pricing, price_model
from agent_bus.agents.gateway.wire import EngineStats, ModelConfig, ModelStats
from agent_bus.agents.loop.abort import Abort
from agent_bus.agents.loop.context import context_exceeded_text, estimate_usage
from agent_bus.bus.errors import ConfigError
from agent_bus.bus.messages import AssistantMessage, LlmRequest, RetryPolicy, Usage
from agent_bus.bus.redact import Redactor, clip
from agent_bus.bus.tracecontext import traceparent

log = logging.getLogger("agents.gateway.engine")

#: (attempt, delay, status, error, usage): `usage` is what the failed attempt billed (estimated
#: when its stream broke before the server sent any; empty when nothing was generated).
RetryCallback = Callable[[int, float, int, str, Usage], "Awaitable[None] | None"]

DEFAULT_OPENAI_MODEL = "gpt-4o-mini"
DEFAULT_ANTHROPIC_MODEL = "claude-sonnet-4-5"
#: The window assumed when neither the configuration nor the server gives one.
DEFAULT_CONTEXT_WINDOWS: dict[str, int] = {"openai": 128_000, "anthropic": 200_000,
                                           "llamacpp": DEFAULT_N_CTX}
DISCOVERY_RETRY = 5.0  # seconds between discovery attempts while a server is not answering
# Phrases of the HTTP 400 a server answers when the prompt does not fit its window: llama.cpp
# (`exceed_context_size_error`), OpenAI/vLLM (`context_length_exceeded`, "maximum context
# length"), Anthropic ("prompt is too long"), Ollama/others ("context length", "context window").
_CONTEXT_ERROR = re.compile(
    r"exceed_context_size|context_length_exceeded|maximum context length|prompt is too long|"
    r"exceeds the available context|context (length|window|size)",
    re.IGNORECASE,
)
# A 400/500 saying the server could not parse the *request* (llama.cpp's "Failed to parse tool
# call arguments as JSON", a JSON body a proxy could not read): the same request fails the same
# way again, so it is not retried. Not "Failed to parse input at pos N": that is llama.cpp failing
# on the model's own output, which the next attempt may write otherwise.
_UNPARSEABLE_REQUEST = re.compile(
    r"tool call arguments as json|(parse|decode) (the |your )?(json|request)|"
    r"invalid json|malformed json|json\.exception\.parse_error",
    re.IGNORECASE,
)
NO_MODEL_ERROR = (
    "no model is configured for the LLM gateway. Set `OPENAI_API_KEY` (optionally `OPENAI_BASE_URL` "
    "and `OPENAI_MODEL`; `OPENAI_BASE_URL` alone is enough for a local server such as Ollama or "
    "vLLM), or `ANTHROPIC_API_KEY` (optionally `ANTHROPIC_MODEL`), or list models in the topology "
    "TOML file, then restart the gateway."
)
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ERROR_BODY_LIMIT = 64 * 1024
_ERROR_TEXT_LIMIT = 1000  # characters of one attempt's error, after redaction
_MAX_TRACKED_RUNS = 1000
_KEY_SHAPES_ONLY = Redactor()


class ModelSetupError(ConfigError):
    """The configuration cannot work as given (e.g. the server lists several models and none was
    chosen); the text says which setting to change."""


class _AttemptFailed(Exception):
    def __init__(
        self,
        message: str,
        *,
        retryable: bool,
        status: int = 0,
        retry_after: float | None = None,
        server_window: int = 0,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.server_window = server_window  # n_ctx a context-exceeded error reported (llama.cpp)

    def redacted(self, redactor: Redactor) -> _AttemptFailed:
        """Redact the whole message, then cut it: a cut first could split a key past recognition."""
        self.message = clip(self.message, redactor, _ERROR_TEXT_LIMIT)
        return self


# --- per-model limits ---------------------------------------------------------------------


class _RateLimiter:
    """At most `per_minute` request starts in any sliding 60 s window."""

    def __init__(self, per_minute: float) -> None:
        self._limit = max(1, int(per_minute))
        self._starts: list[float] = []

    async def acquire(self) -> None:
        while True:
            now = anyio.current_time()
            self._starts = [t for t in self._starts if t > now - 60.0]
            if len(self._starts) < self._limit:
                self._starts.append(now)
                return
            await anyio.sleep(self._starts[0] + 60.0 - now)


class _ModelRuntime:
    def __init__(self, config: ModelConfig, histories: Histories | None = None) -> None:
        self.stats = ModelStats(alias=config.alias, provider=config.provider, model=config.model)
        self.histories = histories
        self.configure(config)
        self.limiter = anyio.CapacityLimiter(max(1, config.max_concurrency))
        self.rate = _RateLimiter(config.requests_per_minute) if config.requests_per_minute else None
        self.timeout = httpx.Timeout(
            connect=config.connect_timeout, read=config.timeout, write=config.timeout, pool=config.timeout
        )
        self.discovered = False
        self.listed: list[str] = []  # the server's model list, for the "choose one" error
        self.next_discovery = 0.0  # monotonic time before which a failed discovery is not retried
        self.discovery_lock = anyio.Lock()

    def configure(self, config: ModelConfig) -> None:
        """Adopt `config` (discovery may fill in the model name and context window)."""
        self.config = config
        self.provider: Provider = PROVIDERS[config.provider](config.endpoint(), config.model)
        self.provider.parallel_tool_calls = config.parallel_tool_calls
        if isinstance(self.provider, OpenAIProvider):
            self.provider.histories = self.histories
        self.stats.model, self.stats.model_from = config.model, config.model_from
        self.stats.context_window = config.context_window
        self.stats.context_window_from = config.context_window_from
        self.pricing = _pricing(config)
        self.stats.priced, self.stats.price = self.pricing.known, self.pricing.source

    @property
    def needs_discovery(self) -> bool:
        return not self.discovered and (not self.config.model or not self.config.context_window)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Wait for the RPM window and a concurrency slot; counts queue depth and in-flight."""
        token = object()
        self.stats.queued += 1
        try:
            if self.rate is not None:
                await self.rate.acquire()
            await self.limiter.acquire_on_behalf_of(token)
        finally:
            self.stats.queued -= 1
        self.stats.in_flight += 1
        self.stats.max_in_flight = max(self.stats.max_in_flight, self.stats.in_flight)
        try:
            yield
        finally:
            self.stats.in_flight -= 1
            self.limiter.release_on_behalf_of(token)

    def cost(self, usage: Usage) -> float:
        """USD; 0.0 also when no price is known (`stats.priced` tells the two apart)."""
        return self.pricing.cost(usage)


class _Call:
    """Mutable state of one `complete()` call: the builder of the attempt in progress."""

    def __init__(self, request: LlmRequest) -> None:
        self.request = request
        self.builder: MessageBuilder | None = None
        self.on_last_read: Callable[[], None] | None = None  # `complete`'s

    def spent(self) -> Usage:
        """What the attempt in progress billed so far: the server's usage, else an estimate
        from what streamed (nothing streamed: nothing)."""
        builder = self.builder
        if builder is None:
            return Usage()
        server, guess = builder.usage, estimate_usage(self.request, builder.content())
        if not server.total:
            return guess
        if guess.output <= server.output:
            return msgspec.structs.replace(server)
        # the server said what it read (Anthropic's message_start) but not yet what it wrote
        total = server.input + guess.output + server.cache_read + server.cache_write
        return msgspec.structs.replace(server, output=guess.output, total=total, estimated=True)


# --- the engine ---------------------------------------------------------------------------


_ssl: list[ssl.SSLContext] = []  # one context for every client the engines make


def _new_client() -> httpx.AsyncClient:
    # Each AsyncClient would load the CA bundle into an SSL context of its own (~30 ms of CPU,
    # 100 ms on a busy machine), and `_ClientPool` makes its clients as a burst of calls
    # arrives: they share one, made once with the same defaults (certifi, SSL_CERT_* vars).
    if not _ssl:
        _ssl.append(httpx.create_ssl_context())
    if environment_names_a_proxy():
        # httpx's own transport applies it (with NO_PROXY) by httpx's rules, exactly as before
        # Http1Transport existed.
        return httpx.AsyncClient(limits=httpx.Limits(max_connections=None), verify=_ssl[0])
    # Http1Transport, not httpcore's: half the gateway's CPU per call (agents/gateway/http1.py).
    return _LeanClient(_ssl[0])


_httpx_log = logging.getLogger("httpx")


class _LeanClient(httpx.AsyncClient):
    """An httpx client over `Http1Transport` whose streamed model calls (`open_stream`) go
    straight to the transport.

    Around its transport, `AsyncClient.send` costs ~95 us of CPU per call (the auth and redirect
    flows, hooks, a stream wrapper, and the cookie jar's urllib shims on every response) and
    `build_request` ~40 us: together ~8% of the gateway's CPU per model call. None of it does
    anything for these calls (no auth, no redirects followed, no hooks) except cookies, which
    `open_stream` keeps: the client's cookies go out, and a response that sets any is stored.
    The request is the one `build_request` makes; other calls (discovery) use httpx as ever."""

    def __init__(self, ssl_context: ssl.SSLContext) -> None:
        self._http1 = Http1Transport(ssl_context)
        super().__init__(transport=self._http1)

    async def open_stream(self, url: httpx.URL, headers: Mapping[str, str], content: bytes,
                          timeout: httpx.Timeout) -> httpx.Response:
        """POST `content`; the response with its body not read yet (as `send(stream=True)`)."""
        if self.is_closed:  # what `send` raises
            raise RuntimeError("Cannot send a request, as the client has been closed.")
        merged = httpx.Headers(self.headers)  # as `build_request`: the client's, then the call's
        merged.update(headers)
        request = httpx.Request("POST", url, headers=merged, content=content,
                                cookies=self.cookies or None,
                                extensions={"timeout": timeout.as_dict()})
        try:
            response = await self._http1.handle_async_request(request)
        except httpx.RequestError as exc:
            exc.request = request  # as `send` does
            raise
        response.request = request
        headers_in = response.headers
        if "set-cookie" in headers_in or "set-cookie2" in headers_in:  # else the jar adds nothing
            self.cookies.extract_cookies(response)
        if _httpx_log.isEnabledFor(logging.INFO):  # the line `send` logs
            _httpx_log.info('HTTP Request: %s %s "%s %d %s"', request.method, request.url,
                            response.http_version, response.status_code, response.reason_phrase)
        return response


def environment_names_a_proxy() -> bool:
    """HTTP(S)_PROXY, ALL_PROXY or another `<scheme>_proxy` is set. NO_PROXY alone (the stdlib
    lists it as the scheme "no") names none: common in CI, it must not cost the lean transport."""
    return any(scheme != "no" for scheme in urllib.request.getproxies_environment())


class _ClientPool:
    """Streams spread over a few httpx clients, the least busy first.

    httpcore's connection pool walks every connection of its client on each request and each
    release, so one client's CPU cost per call grows with the calls in flight on it: measured
    (bench/results/2026-11-30.md, "Scale") 12 ms per call at 100 in flight on one client,
    2.6 ms spread over 8.
    In the gateway at 100 concurrent sessions (`bench_scale.py --gateway-clients`), its CPU per
    model call was 6.8-7.8 ms with one client, 5.3-5.5 ms with 8 (12 streams each), 4.5 ms with
    16 (6 each); the clients share one SSL context, so more of them cost little.
    Those figures are httpcore's; the pool stays for it (a client with a proxy in the
    environment) and was not measured again over Http1Transport, whose idle pool is a list
    per origin. A client gets company only once each has PER_CLIENT streams, up to SIZE clients."""

    SIZE = 16
    PER_CLIENT = 6

    def __init__(self, first: httpx.AsyncClient, *, grow: bool) -> None:
        self._clients = [first]
        self._busy = [0]
        self._grow = grow  # a client handed in by the caller is used alone

    @contextmanager
    def lease(self) -> Iterator[httpx.AsyncClient]:
        index = self._pick()
        self._busy[index] += 1
        try:
            yield self._clients[index]
        finally:
            self._busy[index] -= 1

    def _pick(self) -> int:
        index = min(range(len(self._clients)), key=self._busy.__getitem__)
        if self._busy[index] < self.PER_CLIENT or not self._grow or len(self._clients) >= self.SIZE:
            return index
        self._clients.append(_new_client())
        self._busy.append(0)
        return len(self._clients) - 1

    async def aclose(self, keep: httpx.AsyncClient | None) -> None:
        for client in self._clients:
            if client is not keep:
                await client.aclose()


class LlmEngine:
    """Calls providers for `LlmRequest`s over a few pooled httpx clients, per-model limits, usage
    totals.

    `models`: the configured models; the first (or `default`) answers requests with `model=""`.
    `env`: where API keys are looked up (default `os.environ`). `client`: an httpx client to use
    instead of an owned one (not closed by `aclose()`). `fresh_requests`: no request's messages
    are changed in place after its call (the gateway's, decoded for it or kept from the run's
    last call as they were); a run's history is then converted only where it grew."""

    def __init__(
        self,
        models: Sequence[ModelConfig] = (),
        *,
        default: str | None = None,
        env: Mapping[str, str] | None = None,
        client: httpx.AsyncClient | None = None,
        fresh_requests: bool = False,
    ) -> None:
        # Messages never changed after their call (the gateway's): OpenAI-style models convert
        # only what each run's history added since its last call (`Histories`).
        self._models = {m.alias: _ModelRuntime(m, Histories() if fresh_requests else None)
                        for m in models}
        self._default = default or (models[0].alias if models else "")
        self._env = env if env is not None else os.environ
        self._owns_client = client is None
        self._client = client or _new_client()
        self._pool = _ClientPool(self._client, grow=client is None)
        self._agents: dict[str, Usage] = {}
        self._runs: OrderedDict[str, Usage] = OrderedDict()
        self._redactor = Redactor()
        self._redactor_keys: tuple[str, ...] = ()
        if self._default and self._default not in self._models:
            raise ValueError(
                f"default model `{self._default}` is not configured (have: {', '.join(self._models)})"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, **kwargs: Any) -> LlmEngine:
        """An engine for the models `models_from_env` finds; with none, every call answers an error."""
        source = env if env is not None else os.environ
        return cls(models_from_env(source), env=source, **kwargs)

    def __repr__(self) -> str:
        return f"LlmEngine(models={list(self._models)!r}, default={self._default!r})"

    async def __aenter__(self) -> LlmEngine:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._pool.aclose(keep=None if self._owns_client else self._client)

    @property
    def models(self) -> list[ModelConfig]:
        return [rt.config for rt in self._models.values()]

    def secrets(self) -> tuple[str, ...]:
        """The current values of every configured model's key variable (for redaction only)."""
        names = {rt.config.api_key_env for rt in self._models.values() if rt.config.api_key_env}
        values = {v for v in (self._env.get(n, "").strip() for n in names) if v}
        return tuple(sorted(values))

    def redactor(self) -> Redactor:
        """Redacts every configured key (not only the called model's: a proxy may echo any)."""
        keys = self.secrets()
        if keys != self._redactor_keys:  # keys are read at call time, so they may change
            self._redactor, self._redactor_keys = Redactor(keys), keys
        return self._redactor

    def model_config(self, alias: str = "") -> ModelConfig | None:
        """The model a request with `model=alias` goes to ("" for the default), or None."""
        runtime = self._resolve(alias)
        return None if isinstance(runtime, AssistantMessage) else runtime.config

    def context_window(self, alias: str = "") -> int:
        """The model's context window as configured or discovered (0: not known yet)."""
        config = self.model_config(alias)
        return config.context_window if config else 0

    # --- complete ---------------------------------------------------------------------

    async def complete(
        self,
        request: LlmRequest,
        on_delta: DeltaCallback | None = None,
        on_retry: RetryCallback | None = None,
        *,
        abort: Abort | None = None,
        on_last_read: Callable[[], None] | None = None,
    ) -> AssistantMessage:
        """Run `request` to a finished message (see the module docstring for the contract).

        `on_last_read` is called when the stream's message is complete, just before the deltas
        of its last read go to `on_delta`: those arrive with the finished message (the gateway
        sends them as events only; its requester gets the message at once)."""
        runtime = self._resolve(request.model)
        if isinstance(runtime, AssistantMessage):
            return runtime
        problem = await self._ensure_discovered(runtime)
        if problem:
            return _error_message(runtime.config.provider, "", problem)
        runtime.stats.requests += 1
        call = _Call(request)
        call.on_last_read = on_last_read
        try:
            message = await self._run_abortable(runtime, request, on_delta, on_retry, call, abort)
        except anyio.get_cancelled_exc_class():
            # a hub cancel (the requester aborted) cancels the handler: what streamed was billed
            self._account(runtime, request, self._aborted(runtime, call))
            raise
        self._account(runtime, request, message)
        return message

    # --- discovery -------------------------------------------------------------------------

    async def discover(self) -> None:
        """Ask each server for what the configuration left out: the model name (the one model
        it lists) and the context window. Raises `ModelSetupError` when a server lists several
        models and none was chosen. A server that does not answer yet is asked again at its
        first request (every `DISCOVERY_RETRY` seconds until it answers)."""
        for runtime in self._models.values():
            problem = await self._ensure_discovered(runtime)
            if problem:
                raise ModelSetupError(problem)

    async def _ensure_discovered(self, runtime: _ModelRuntime) -> str:
        """"" when the model is usable, else the error text (several models, none chosen)."""
        if runtime.needs_discovery:
            async with runtime.discovery_lock:
                if runtime.needs_discovery and anyio.current_time() >= runtime.next_discovery:
                    await self._discover(runtime)
        return _choose_model_error(runtime) if not runtime.config.model else ""

    async def _discover(self, runtime: _ModelRuntime) -> None:
        config = runtime.config
        headers = _probe_headers(config, self._env)
        found = await discover(self._client, config.provider, config.endpoint().rstrip("/"),
                               config.model, headers)
        changes: dict[str, Any] = {}
        if not config.model and len(found.models) == 1:
            changes.update(model=found.models[0], model_from="server /v1/models (the only model listed)")
        runtime.listed = found.models
        if not config.context_window and found.context_window:
            window, source = found.context_window
            changes.update(context_window=window, context_window_from=source)
        elif not config.context_window and (found.reachable or not config.base_url):
            changes.update(context_window=DEFAULT_CONTEXT_WINDOWS[config.provider],
                           context_window_from="default (the server does not report it)")
        runtime.discovered = found.reachable or not config.base_url
        runtime.next_discovery = anyio.current_time() + DISCOVERY_RETRY
        if changes:
            runtime.configure(msgspec.structs.replace(config, **changes))
            log.info("model `%s`: %s (%s), context window %d (%s)", config.alias, runtime.config.model,
                     runtime.config.model_from, runtime.config.context_window,
                     runtime.config.context_window_from)

    def _resolve(self, alias: str) -> _ModelRuntime | AssistantMessage:
        if not self._models:
            return _error_message("", "", NO_MODEL_ERROR)
        runtime = self._models.get(alias or self._default)
        if runtime is None:
            runtime = next((rt for rt in self._models.values() if rt.config.model == alias), None)
        if runtime is None:
            known = ", ".join(f"`{a}`" for a in self._models)
            return _error_message("", alias, f"unknown model alias `{alias}`; configured models: {known}")
        return runtime

    async def _run_abortable(
        self,
        runtime: _ModelRuntime,
        request: LlmRequest,
        on_delta: DeltaCallback | None,
        on_retry: RetryCallback | None,
        call: _Call,
        abort: Abort | None,
    ) -> AssistantMessage:
        if abort is None:
            return await self._run(runtime, request, on_delta, on_retry, call)
        with abort.cancels():
            return await self._run(runtime, request, on_delta, on_retry, call)
        return self._aborted(runtime, call)

    def _aborted(self, runtime: _ModelRuntime, call: _Call) -> AssistantMessage:
        runtime.stats.aborted += 1
        builder = call.builder
        usage = call.spent()
        usage.cost = runtime.cost(usage)
        return AssistantMessage(
            content=builder.partial_content() if builder else [],
            stop_reason="aborted",
            usage=usage,
            model=runtime.config.model,
            provider=runtime.config.provider,
            error="request aborted by the caller",
        )

    async def _run(
        self,
        runtime: _ModelRuntime,
        request: LlmRequest,
        on_delta: DeltaCallback | None,
        on_retry: RetryCallback | None,
        call: _Call,
    ) -> AssistantMessage:
        policy = request.retry
        attempts = max(1, policy.max_attempts)
        for attempt in range(1, attempts + 1):
            try:
                return await self._attempt(runtime, request, on_delta, call)
            except _AttemptFailed as failure:
                spent = call.spent()
                spent.cost = runtime.cost(spent)
                call.builder = None
                if not failure.retryable or attempt == attempts:
                    message = self._failed(runtime, failure, attempt)
                    message.usage = spent  # accounted with the message
                    return message
                self._account(runtime, request, AssistantMessage(usage=spent))
                await self._before_retry(runtime, policy, attempt, failure, spent, on_retry)
        raise AssertionError("unreachable: the loop returns on its last attempt")

    async def _before_retry(
        self,
        runtime: _ModelRuntime,
        policy: RetryPolicy,
        attempt: int,
        failure: _AttemptFailed,
        spent: Usage,
        on_retry: RetryCallback | None,
    ) -> None:
        delay = backoff_delay(policy, attempt, failure.retry_after)
        runtime.stats.retries += 1
        log.warning(
            "%s model `%s`: attempt %d failed (%s); retrying in %.2fs",
            runtime.config.provider,
            runtime.config.alias,
            attempt,
            failure.message,
            delay,
        )
        if on_retry is not None:
            await _maybe_await(on_retry(attempt, delay, failure.status, failure.message, spent))
        await anyio.sleep(delay)

    def _failed(self, runtime: _ModelRuntime, failure: _AttemptFailed, attempts: int) -> AssistantMessage:
        runtime.stats.errors += 1
        if failure.server_window and failure.server_window != runtime.config.context_window:
            # The server knows its window better than any default: later runs compact in time.
            runtime.configure(msgspec.structs.replace(
                runtime.config, context_window=failure.server_window,
                context_window_from="server (its context-exceeded error)"))
        config = runtime.config
        tries = f"after {attempts} attempt{'s' if attempts != 1 else ''}"
        text = f"{config.provider} (model `{config.alias}`): {failure.message} ({tries})"
        log.error("%s", text)
        return _error_message(config.provider, config.model, text)

    async def _attempt(
        self, runtime: _ModelRuntime, request: LlmRequest, on_delta: DeltaCallback | None, call: _Call
    ) -> AssistantMessage:
        key = self._api_key(runtime.config)
        http = runtime.provider.build_request(with_sampling(request, runtime.config), key)
        if request.run_id:
            # W3C trace context: a provider that traces joins the run tree's trace under this
            # call's `chat` span (bus.tracecontext; an older peer sends no `trace`: the run's span)
            trace = request.trace
            http.headers.setdefault("traceparent", traceparent(request.run_id) if trace is None
                                    else traceparent(request.run_id, trace.root_run_id, trace.call))
        redactor = self.redactor()
        async with runtime.slot():
            runtime.stats.attempts += 1
            call.builder = MessageBuilder(on_delta, on_last_read=call.on_last_read)
            with _errors_mapped(runtime.config, http.url, redactor):
                return await self._stream(runtime, http, request.retry, call.builder, redactor)

    def _api_key(self, config: ModelConfig) -> str | None:
        name = config.api_key_env
        if not name:
            return None
        if not _ENV_NAME.match(name):
            raise _AttemptFailed(
                "`api_key_env` must be the NAME of an environment variable holding the key, "
                "not the key itself; fix the model configuration",
                retryable=False,
            )
        key = self._env.get(name, "").strip()
        if not key:
            raise _AttemptFailed(
                f"environment variable `{name}` is not set; export it with the API key, or set "
                '`api_key_env = ""` for a server that needs no key',
                retryable=False,
            )
        return key

    async def _stream(
        self,
        runtime: _ModelRuntime,
        http: ProviderRequest,
        policy: RetryPolicy,
        builder: MessageBuilder,
        redactor: Redactor,
    ) -> AssistantMessage:
        content = msgspec.json.encode(http.body)
        with self._pool.lease() as client:
            return await self._send_and_parse(client, runtime, http, content, policy, builder,
                                              redactor)

    async def _send_and_parse(
        self,
        client: httpx.AsyncClient,
        runtime: _ModelRuntime,
        http: ProviderRequest,
        content: bytes,
        policy: RetryPolicy,
        builder: MessageBuilder,
        redactor: Redactor,
    ) -> AssistantMessage:
        try:
            response = await _open(client, runtime, http, content)
        except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
            # Nothing came back, so nothing was generated: typically a pooled connection the
            # server closed after its last stream (llama.cpp). Resend at once on a fresh one,
            # without counting an attempt.
            log.debug("model `%s`: resending on a new connection (%s)", runtime.config.alias, exc)
            runtime.stats.resent += 1
            response = await _open(client, runtime, http, content)
        try:
            if not response.is_success:
                raise await _status_failure(response, policy, redactor)
            _check_content_type(response)
            chunks = _body(response)
            events = iter_sse(chunks, builder.release)
            try:
                message = await runtime.provider.parse_stream(events, builder)
            except Exception:
                await builder.release()  # what the failed read streamed went out, as before
                raise
            # The provider stopped at the end marker, inside the generator: closed here, it
            # costs no task (left to the garbage collector, asyncio's finalizer hook schedules
            # a task per call to close it, and wakes the loop through its self-pipe).
            await events.aclose()
            await _drain(chunks)
            # The last read's deltas, before the message they end. After the drain: the gateway
            # sends them with the reply only, so a cancel must not fall between the two.
            await builder.release(last=True)
        finally:
            if not response.is_closed:  # a body read to its end closed itself: no scope to pay
                with anyio.move_on_after(2, shield=True):
                    await response.aclose()
        message.usage.cost = runtime.cost(message.usage)
        return message

    # --- accounting ----------------------------------------------------------------------

    def _account(self, runtime: _ModelRuntime, request: LlmRequest, message: AssistantMessage) -> None:
        usage = message.usage
        if not usage.total and not usage.cost:
            return
        runtime.stats.usage = runtime.stats.usage + usage
        if request.agent:
            self._agents[request.agent] = self._agents.get(request.agent, Usage()) + usage
        if request.run_id:
            self._runs[request.run_id] = self._runs.get(request.run_id, Usage()) + usage
            self._runs.move_to_end(request.run_id)
            while len(self._runs) > _MAX_TRACKED_RUNS:
                self._runs.popitem(last=False)

    def stats(self) -> EngineStats:
        """A copy of the counters: per model (queue depth, in flight, attempts, usage), per agent, per run."""
        return EngineStats(
            models={a: msgspec.structs.replace(rt.stats) for a, rt in self._models.items()},
            agents=dict(self._agents),
            runs=dict(self._runs),
        )


# --- helpers ------------------------------------------------------------------------------


def _pricing(config: ModelConfig) -> Pricing:
    configured = ConfiguredPrices(config.input_price, config.output_price,
                                  config.cache_read_price, config.cache_write_price)
    return price_model(config.provider, config.model, base_url=config.base_url, configured=configured)


def models_from_env(env: Mapping[str, str]) -> list[ModelConfig]:
    """`openai` from `OPENAI_API_KEY`/`OPENAI_BASE_URL`/`OPENAI_MODEL`, `anthropic` from
    `ANTHROPIC_API_KEY`/`ANTHROPIC_BASE_URL`/`ANTHROPIC_MODEL`. The first found is the default.

    With a base URL and no `*_MODEL`, the model is left "" for `LlmEngine.discover` to fill in;
    `OPENAI_CONTEXT_WINDOW`/`ANTHROPIC_CONTEXT_WINDOW` override the discovered window."""
    models: list[ModelConfig] = []
    for provider, default_model in (("openai", DEFAULT_OPENAI_MODEL), ("anthropic", DEFAULT_ANTHROPIC_MODEL)):
        prefix = provider.upper()
        key_env, base_url = f"{prefix}_API_KEY", env.get(f"{prefix}_BASE_URL", "")
        if not env.get(key_env) and not base_url:
            continue
        model, model_from = env.get(f"{prefix}_MODEL", "").strip(), f"env {prefix}_MODEL"
        if not model and not base_url:  # the provider's own API: its well-known default
            model, model_from = default_model, "default"
        window = _env_window(env, f"{prefix}_CONTEXT_WINDOW")
        models.append(
            ModelConfig(
                **_env_sampling(env, prefix),
                alias=provider,
                provider=provider,  # type: ignore[arg-type]
                model=model,
                model_from=model_from if model else "",
                base_url=base_url,
                api_key_env=key_env if env.get(key_env) else "",
                context_window=window,
                context_window_from=f"env {prefix}_CONTEXT_WINDOW" if window else "",
            )
        )
    return models


def with_sampling(request: LlmRequest, config: ModelConfig) -> LlmRequest:
    """`request` with the model's sampling defaults filled in where the request sets none."""
    changes: dict[str, Any] = {}
    for name in ("temperature", "top_p", "max_tokens", "seed"):
        if getattr(request, name) is None and getattr(config, name) is not None:
            changes[name] = getattr(config, name)
    if not request.stop and config.stop:
        changes["stop"] = list(config.stop)
    return msgspec.structs.replace(request, **changes) if changes else request


_SAMPLING_ENV = {"TEMPERATURE": ("temperature", float), "TOP_P": ("top_p", float),
                 "MAX_TOKENS": ("max_tokens", int), "SEED": ("seed", int)}


def _env_sampling(env: Mapping[str, str], prefix: str) -> dict[str, Any]:
    """`<PREFIX>_TEMPERATURE`, `_TOP_P`, `_MAX_TOKENS`, `_SEED` and `_STOP` (a JSON list of
    strings, or one plain string)."""
    found: dict[str, Any] = {}
    for suffix, (field, kind) in _SAMPLING_ENV.items():
        name, raw = f"{prefix}_{suffix}", env.get(f"{prefix}_{suffix}", "").strip()
        if not raw:
            continue
        try:
            found[field] = kind(raw)
        except ValueError:
            raise ModelSetupError(f"`{name}` must be {'a number' if kind is float else 'an integer'} "
                                  f"(e.g. {'0.2' if kind is float else '42'}), got {raw!r}") from None
    stop = env.get(f"{prefix}_STOP", "")
    if stop.strip():
        found["stop"] = _env_stop(f"{prefix}_STOP", stop)
    return found


def _env_stop(name: str, raw: str) -> list[str]:
    if not raw.lstrip().startswith("["):
        return [raw]
    try:
        value = json.loads(raw)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ModelSetupError(f"`{name}` must be a JSON list of strings (e.g. [\"</end>\"]) or one "
                              f"plain string, got {raw!r}")
    return value


def _env_window(env: Mapping[str, str], name: str) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return 0
    if not raw.isdigit() or int(raw) <= 0:
        raise ModelSetupError(f"`{name}` must be a positive number of tokens (e.g. 8192), got {raw!r}")
    return int(raw)


def backoff_delay(policy: RetryPolicy, attempt: int, retry_after: float | None) -> float:
    """The server's `retry_after` when given (capped at `max_delay`), else exponential with jitter."""
    if retry_after is not None:
        return min(max(retry_after, 0.0), policy.max_delay)
    ceiling = min(policy.max_delay, policy.base_delay * 2.0 ** (attempt - 1))
    return ceiling / 2 + random.uniform(0, ceiling / 2)


def retry_after_seconds(headers: httpx.Headers) -> float | None:
    """`retry-after-ms`, else `Retry-After` as seconds or an HTTP date; None when absent/invalid."""
    ms = headers.get("retry-after-ms")
    if ms:
        try:
            return float(ms) / 1000
        except ValueError:
            pass
    value = headers.get("retry-after")
    if not value:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        when = parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return max(0.0, (when - datetime.now(UTC)).total_seconds())


async def _status_failure(
    response: httpx.Response, policy: RetryPolicy, redactor: Redactor
) -> _AttemptFailed:
    body = await _read_limited(response)
    status = response.status_code
    text = provider_error_text(body, redactor)
    unparseable = status in (400, 500) and _UNPARSEABLE_REQUEST.search(text) is not None
    retryable = status in policy.retry_statuses and not unparseable
    window = 0
    if status in (400, 413) and _CONTEXT_ERROR.search(text):
        # The marker lets the loop compact and retry once instead of failing the run.
        window = _reported_window(body)
        text = context_exceeded_text(window, text)
    return _AttemptFailed(
        f"HTTP {status} from {response.request.url}: {text}",
        retryable=retryable,
        status=status,
        retry_after=retry_after_seconds(response.headers) if retryable else None,
        server_window=window,
    )


def _reported_window(body: bytes) -> int:
    """`n_ctx` of llama.cpp's context-exceeded error body (0 when absent)."""
    try:
        error = msgspec.json.decode(body).get("error")
        return max(0, int(error.get("n_ctx") or 0))
    except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
        return 0


def _choose_model_error(runtime: _ModelRuntime) -> str:
    config = runtime.config
    var = f"{config.provider.upper()}_MODEL"
    where = f"[models.{config.alias}] model = \"...\" in the topology file, or `{var}=`"
    if runtime.listed:
        names = ", ".join(f"`{m}`" for m in runtime.listed[:20])
        more = f" (and {len(runtime.listed) - 20} more)" if len(runtime.listed) > 20 else ""
        return (f"model `{config.alias}`: the server at {config.endpoint()} serves several models "
                f"({names}{more}) and none was chosen; set {where} to one of them")
    return (f"model `{config.alias}`: no model name is configured and the server at "
            f"{config.endpoint()} did not list its models (is it running?); set {where}")


def _probe_headers(config: ModelConfig, env: Mapping[str, str]) -> dict[str, str]:
    key = env.get(config.api_key_env, "").strip() if _ENV_NAME.match(config.api_key_env) else ""
    if not key or not key.isascii() or not key.isprintable():
        return {}  # a malformed key fails the first request with its own clear error
    if config.provider == "anthropic":
        return {"x-api-key": key, "anthropic-version": "2023-06-01"}
    return {"authorization": f"Bearer {key}"}


def _check_content_type(response: httpx.Response) -> None:
    kind = response.headers.get("content-type", "")
    if kind.startswith("application/json"):
        raise _AttemptFailed(
            f"expected a `text/event-stream` reply from {response.request.url}, got `{kind}`: "
            "the server ignored `stream: true`; use a server that supports streaming",
            retryable=False,
            status=response.status_code,
        )


async def _read_limited(response: httpx.Response) -> bytes:
    chunks: list[bytes] = []
    size = 0
    async for chunk in response.aiter_bytes():
        chunks.append(chunk)
        size += len(chunk)
        if size >= _ERROR_BODY_LIMIT:
            break
    return b"".join(chunks)


def provider_error_text(body: bytes, redactor: Callable[[str], str] | None = None) -> str:
    """The `error.message` of an OpenAI/Anthropic error body, else the body text; redacted, then
    cut to 500 characters (without `redactor`, only key-shaped tokens are redacted)."""
    return clip(_error_body_text(body), redactor or _KEY_SHAPES_ONLY)


def _error_body_text(body: bytes) -> str:
    try:
        payload = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body.decode("utf-8", "replace").strip() or "(empty body)"
    error = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(error, dict) and error.get("message"):
        kind = error.get("type")
        return f"{kind}: {error['message']}" if kind else str(error["message"])
    if isinstance(error, str):
        return error
    return body.decode("utf-8", "replace")


@contextmanager
def _errors_mapped(config: ModelConfig, url: str, redactor: Redactor) -> Iterator[None]:
    """The one place where httpx and stream exceptions become `_AttemptFailed` (with the key redacted)."""
    try:
        yield
    except _AttemptFailed as failure:
        raise failure.redacted(redactor) from None
    except StreamError as exc:
        raise _AttemptFailed(f"broken stream from {url}: {exc}", retryable=exc.retryable).redacted(
            redactor
        ) from exc
    except httpx.ConnectTimeout as exc:
        msg = f"could not connect to {url} within {config.connect_timeout}s (connect timeout)"
        raise _AttemptFailed(msg, retryable=True).redacted(redactor) from exc
    except httpx.TimeoutException as exc:
        msg = f"no data from {url} for {config.timeout}s ({type(exc).__name__})"
        raise _AttemptFailed(msg, retryable=True).redacted(redactor) from exc
    except httpx.ConnectError as exc:
        msg = f"cannot reach {url}: {exc or type(exc).__name__}; is the server running and the URL right?"
        raise _AttemptFailed(msg, retryable=True).redacted(redactor) from exc
    except (httpx.LocalProtocolError, httpx.UnsupportedProtocol, UnicodeEncodeError) as exc:
        msg = f"could not send the request to {url} ({type(exc).__name__}: {exc}); check the API key and URL"
        raise _AttemptFailed(msg, retryable=False).redacted(redactor) from exc
    except httpx.TransportError as exc:
        msg = f"connection to {url} failed mid-request ({type(exc).__name__}: {exc})"
        raise _AttemptFailed(msg, retryable=True).redacted(redactor) from exc
    except httpx.HTTPError as exc:
        msg = f"could not send the request to {url} ({type(exc).__name__}: {exc})"
        raise _AttemptFailed(msg, retryable=False).redacted(redactor) from exc


async def _open(client: httpx.AsyncClient, runtime: _ModelRuntime, http: ProviderRequest,
                content: bytes) -> httpx.Response:
    """Send the call's POST; the response, its body still to read."""
    if isinstance(client, _LeanClient):
        return await client.open_stream(_url(http.url), http.headers, content, runtime.timeout)
    req = client.build_request("POST", _url(http.url), headers=http.headers, content=content,
                               timeout=runtime.timeout)
    return await client.send(req, stream=True)


@functools.lru_cache(maxsize=64)
def _url(url: str) -> httpx.URL:
    """Parsed once per endpoint: given a str, httpx parses and checks it on every request
    (half of `build_request`'s ~140 us)."""
    return httpx.URL(url)


def _body(response: httpx.Response) -> AsyncIterator[bytes]:
    """The body's bytes as they arrive: raw (one generator layer per chunk, not httpx's three
    of `aiter_bytes`) unless a content encoding asks for httpx's decoder."""
    if response.headers.get("content-encoding", "identity").strip().lower() == "identity":
        return response.aiter_raw()
    return response.aiter_bytes()


async def _drain(chunks: AsyncIterator[bytes]) -> None:
    """Read what follows the end-of-message marker so the connection can be reused.

    The message is already complete: a server that stalls or drops here only costs its connection."""
    with anyio.move_on_after(1.0):
        try:
            async for _ in chunks:
                pass
        except httpx.HTTPError:
            return


def _error_message(provider: str, model: str, text: str) -> AssistantMessage:
    return AssistantMessage(stop_reason="error", provider=provider, model=model, error=text)


async def _maybe_await(value: object) -> None:
    if inspect.isawaitable(value):
        await value


__all__ = [
    "DEFAULT_CONTEXT_WINDOWS",
    "NO_MODEL_ERROR",
    "ModelSetupError",
    "EngineStats",
    "LlmEngine",
    "ModelConfig",
    "ModelStats",
    "RetryCallback",
    "backoff_delay",
    "models_from_env",
    "provider_error_text",
    "retry_after_seconds",
]
