"""What the gateway's clients import: a model's configuration (`ModelConfig`, the topology file's
`[models.*]` tables) and the `llm` service's partial reply (`LlmPartial`).

Kept apart from `engine` and `process` so the coordinator and `busctl up` read these types
without loading the HTTP stack (httpx and the providers): that import alone costs a fifth of a
second of CPU at every process start.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from agent_bus.bus.messages import AssistantDelta, Usage

# The sampling settings' ranges, shared by the topology file's `[[agents]]` and a fork's overrides
Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
TopP = Annotated[float, msgspec.Meta(gt=0, le=1)]
MaxTokens = Annotated[int, msgspec.Meta(ge=1, le=2**31 - 1)]
Seed = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]

ProviderName = Literal["openai", "anthropic", "llamacpp"]  # llamacpp: hosted, OpenAI-compatible

DEFAULT_BASE_URLS: dict[str, str] = {
    "openai": "https://api.openai.com/v1",
    "anthropic": "https://api.anthropic.com",
}


class ModelConfig(msgspec.Struct, kw_only=True, omit_defaults=True, forbid_unknown_fields=True):
    """One model the gateway can call. Prices are USD per million tokens (None: from the price
    table where one applies, see `agents.gateway.providers.prices`; a local server costs 0).

    `api_key_env` is the NAME of the environment variable holding the key ("" for servers that need
    none). `timeout` bounds the wait for the first byte and between streamed chunks. In a topology
    file the alias is the table's name (`[models.<alias>]`), so it may be left out there."""

    provider: ProviderName
    alias: str = ""
    model: str = ""  # "": the one model the server lists (see `LlmEngine.discover`)
    base_url: str = ""
    api_key_env: str = ""
    context_window: int = 0  # 0: ask the server, else the provider's default
    parallel_tool_calls: bool | None = True  # sent when tools are offered; None: not sent
    # Sampling defaults for requests that set none (an agent's own settings win).
    temperature: float | None = None
    top_p: float | None = None
    max_tokens: int | None = None
    seed: int | None = None
    stop: list[str] = msgspec.field(default_factory=list)
    input_price: float | None = None
    output_price: float | None = None
    cache_read_price: float | None = None
    cache_write_price: float | None = None
    # provider = "llamacpp": the gateway serves this GGUF file itself with llama.cpp's server
    # (see `agents.gateway.providers.llamacpp`); `n_ctx` is its window (0: `context_window`, else 4,096),
    # `threads` its CPU threads (0: llama.cpp's choice), `chat_template_file` a Jinja template
    # that replaces the GGUF's own (some models need one for tool calls).
    gguf: str = ""
    n_ctx: int = 0
    threads: int = 0
    chat_template_file: str = ""
    max_concurrency: int = 8
    requests_per_minute: float | None = None
    connect_timeout: float = 10.0
    timeout: float = 120.0
    # Where `model` and `context_window` came from (shown by `busctl status`); set by the engine.
    model_from: str = ""
    context_window_from: str = ""

    def endpoint(self) -> str:
        return self.base_url or DEFAULT_BASE_URLS.get(self.provider, "")


class LlmPartial(msgspec.Struct, omit_defaults=True, tag_field="role", tag="partial"):
    """One partial reply of an `llm` request: a delta, or `reset` after a failed attempt."""

    delta: AssistantDelta | None = None
    reset: bool = False
    model: str = ""
    provider: str = ""
    context_window: int = 0


# The gateway's answer to a `gateway.<name>` request (`busctl status` reads it).
class ModelStats(msgspec.Struct, kw_only=True):
    alias: str
    provider: str
    model: str
    model_from: str = ""
    context_window: int = 0
    context_window_from: str = ""
    in_flight: int = 0
    queued: int = 0
    max_in_flight: int = 0
    # Whether `usage.cost` means anything: False says "no price known" (not a cost of 0), and
    # `price` says where the price came from or why there is none.
    priced: bool = False
    price: str = ""
    requests: int = 0
    attempts: int = 0
    retries: int = 0
    resent: int = 0  # requests resent on a fresh connection after failing before any byte
    errors: int = 0
    aborted: int = 0
    usage: Usage = msgspec.field(default_factory=Usage)


class EngineStats(msgspec.Struct, kw_only=True):
    """Snapshot of `LlmEngine.stats()`: per model, per agent and per run (most recent runs)."""

    models: dict[str, ModelStats]
    agents: dict[str, Usage]
    runs: dict[str, Usage]
