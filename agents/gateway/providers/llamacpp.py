"""`provider = "llamacpp"`: the gateway process hosts llama.cpp's own server for a GGUF file.

    async with hosted_models(models) as models:   # llamacpp entries now have a loopback base_url
        engine = LlmEngine(models)

The server is the `xllamacpp` wheel (optional extra `agent-bus[local]`: llama.cpp's server,
prebuilt, nothing to compile). It runs inside the gateway process on a free loopback port and is
then called like any OpenAI-compatible server (streaming, tools, `parallel_tool_calls`), so the
engine needs no special case. It stops when the gateway stops. No model ships with the project:
the configuration names the file (`gguf = PATH`, or `busctl up --model-file PATH.gguf`).

`local_model_problems` is the one place a llamacpp entry is checked; `busctl up` / `config check`
report its problems by key path before anything starts, and the gateway refuses the same ones.
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from agent_bus.bus.errors import ConfigError

if TYPE_CHECKING:
    from agent_bus.agents.gateway.wire import ModelConfig

log = logging.getLogger("agents.gateway.providers.llamacpp")

PROVIDER = "llamacpp"
DEFAULT_N_CTX = 4096  # tokens: a window small machines can hold (the GGUF's own may be 128k)
INSTALL_HINT = "pip install 'agent-bus[local]'"


class LocalModelError(ConfigError):
    """A hosted model cannot start; the text names the `models.<alias>` key and the fix."""


def local_model_problems(alias: str, config: ModelConfig) -> list[str]:
    """What is wrong with a `[models.<alias>]` entry's local-model keys ([] when nothing)."""
    where = f"models.{alias}"
    if config.provider != PROVIDER:
        return ([f"{where}.gguf: only a model with provider = \"{PROVIDER}\" is served from a "
                 f"GGUF file; set provider = \"{PROVIDER}\" or remove `gguf`"]
                if config.gguf else [])
    problems: list[str] = []
    if not config.gguf:
        problems.append(f"{where}.gguf: provider = \"{PROVIDER}\" needs the path of a .gguf "
                        "model file (gguf = \"/path/to/model.gguf\")")
    elif not Path(config.gguf).expanduser().is_file():
        problems.append(f"{where}.gguf: no such file {config.gguf!r}; give the path of a .gguf "
                        "model file (no model ships with agent-bus)")
    template = config.chat_template_file
    if template and not Path(template).expanduser().is_file():
        problems.append(f"{where}.chat_template_file: no such file {template!r}")
    if config.base_url:
        problems.append(f"{where}.base_url: a \"{PROVIDER}\" model is served by the gateway "
                        "itself; remove base_url (or use provider = \"openai\" for a server "
                        "that is already running)")
    if config.n_ctx < 0 or config.threads < 0:
        problems.append(f"{where}.n_ctx / {where}.threads: must be >= 0 (0: the default)")
    if importlib.util.find_spec("xllamacpp") is None:
        problems.append(f"{where}.provider: \"{PROVIDER}\" needs llama.cpp's server, which is "
                        f"not installed: {INSTALL_HINT}")
    return problems


@asynccontextmanager
async def hosted_models(models: Sequence[ModelConfig]) -> AsyncIterator[list[ModelConfig]]:
    """Start a llama.cpp server for each llamacpp model; yield the models with their URLs.

    Raises `LocalModelError` (naming the key) when an entry is wrong or its server cannot start.
    Every server started is stopped on exit, also when a later one fails."""
    async with AsyncExitStack() as stack:
        ready: list[ModelConfig] = []
        for config in models:
            if config.provider != PROVIDER and not config.gguf:
                ready.append(config)
                continue
            problems = local_model_problems(config.alias, config)
            if problems:
                raise LocalModelError(problems[0])
            ready.append(await stack.enter_async_context(_serving(config)))
        yield ready


@asynccontextmanager
async def _serving(config: ModelConfig) -> AsyncIterator[ModelConfig]:
    n_ctx = config.n_ctx or config.context_window or DEFAULT_N_CTX
    started = anyio.current_time()
    # Loading reads the whole file (seconds): off the event loop, so heartbeats keep going.
    # The only reference, in a list: the wheel's server stops when it is collected.
    holder = [await anyio.to_thread.run_sync(_start, config, n_ctx)]
    try:
        url = _base_url(holder[0].listening_address)
        log.info("model `%s`: llama.cpp serving %s at %s (n_ctx %d), loaded in %.1fs",
                 config.alias, config.gguf, url, n_ctx, anyio.current_time() - started)
        yield msgspec.structs.replace(
            config, base_url=url, model=config.model or config.alias, model_from="hosted GGUF",
            context_window=n_ctx,
            context_window_from="n_ctx of the hosted llama.cpp server")
    finally:
        with anyio.move_on_after(10, shield=True):
            await anyio.to_thread.run_sync(holder.clear)  # joins its threads: off the loop


def _start(config: ModelConfig, n_ctx: int) -> Any:
    import xllamacpp

    params = xllamacpp.CommonParams()
    params.model.path = str(Path(config.gguf).expanduser())
    params.model_alias = {config.model or config.alias}
    params.hostnames = ["127.0.0.1"]  # loopback only: the gateway is its one client
    params.port = 0  # a free port, read back from `listening_address`
    params.n_ctx = n_ctx
    params.n_parallel = 1  # one slot holds the whole window; the engine queues the rest
    params.use_jinja = True  # tool calls need the Jinja chat template path
    if config.chat_template_file:
        params.chat_template = Path(config.chat_template_file).expanduser().read_text()
    if config.threads:
        params.cpuparams.n_threads = params.cpuparams_batch.n_threads = config.threads
    try:
        return xllamacpp.Server(params)
    except Exception as exc:  # the wheel raises plain exceptions: name the key and the file
        raise LocalModelError(f"models.{config.alias}.gguf: llama.cpp could not load "
                              f"{config.gguf!r}: {exc}") from exc


def _base_url(address: str) -> str:
    address = address.rstrip("/")
    if not address.startswith("http"):
        address = f"http://{address}"
    return f"{address}/v1"


__all__ = ["DEFAULT_N_CTX", "LocalModelError", "hosted_models", "local_model_problems"]
