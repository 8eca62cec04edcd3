"""What a server says about its models: their names and context windows.

Unlike the provider adapters this module talks HTTP itself (a few GETs at gateway start, never
on the request path). Every probe is best effort: a server that does not have an endpoint, times
out or answers garbage simply reports nothing, and the caller falls back to the next source.

    found = await discover(client, "openai", "http://127.0.0.1:8081/v1", model="")
    found.models          # ids from GET /v1/models ([] when not listed)
    found.context_window  # (tokens, "where it came from") or None

Both providers are probed the same way (an Anthropic-compatible local server, such as llama.cpp's
`/v1/messages`, reports its window like its OpenAI side); only Anthropic's own API, whose list
carries no window, is not. Sources of the context window, most specific first: the `/v1/models`
entry of the model (`max_model_len` of vLLM, `context_length`/`context_window` of OpenRouter-style servers,
`meta.n_ctx` of llama.cpp's running server), llama.cpp's `GET /props` (`n_ctx` of the running
server), then the model's training length (`meta.n_ctx_train`), then Ollama's `POST /api/show`.
The running server's `n_ctx` beats the training length: a 32k model served with `--ctx 4096`
answers HTTP 400 past 4,096 tokens.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

PROBE_TIMEOUT = httpx.Timeout(5.0, connect=3.0)
_BODY_LIMIT = 1 << 20  # a model list bigger than 1 MiB is not one we can use


class Discovery(msgspec.Struct, kw_only=True):
    models: list[str] = msgspec.field(default_factory=list)
    context_window: tuple[int, str] | None = None
    reachable: bool = False


async def discover(
    client: httpx.AsyncClient, provider: str, base_url: str, model: str, headers: dict[str, str]
) -> Discovery:
    """Probe `base_url` for its model list and `model`'s context window (the one model listed
    when `model` is "")."""
    found = Discovery()
    # The Anthropic adapter posts to `<base>/v1/messages` whether or not the base ends in /v1:
    # its model list is at `<base>/v1/models` the same way (llama.cpp's serves `meta.n_ctx` there).
    if provider == "anthropic" and not base_url.endswith("/v1"):
        base_url = f"{base_url}/v1"
    listing = await _get_json(client, f"{base_url}/models", headers)
    entries = _entries(listing)
    found.reachable = listing is not None
    found.models = [str(e["id"]) for e in entries if isinstance(e.get("id"), str)]
    if provider == "anthropic" and _root(base_url) == "https://api.anthropic.com":
        return found  # Anthropic's own list carries no window: the provider's default applies
    name = model or (found.models[0] if len(found.models) == 1 else "")
    entry = next((e for e in entries if e.get("id") == name), {})
    found.context_window = (
        _running_window(entry)
        or await _props_window(client, base_url, headers)
        or _trained_window(entry)
        or await _ollama_window(client, base_url, name, headers)
    )
    return found


def _running_window(entry: dict[str, Any]) -> tuple[int, str] | None:
    for field in ("max_model_len", "context_length", "context_window"):
        value = _positive(entry.get(field))
        if value:
            return value, f"server /v1/models {field}"
    meta = entry.get("meta")
    value = _positive(meta.get("n_ctx")) if isinstance(meta, dict) else None
    return (value, "server /v1/models meta.n_ctx") if value else None


def _trained_window(entry: dict[str, Any]) -> tuple[int, str] | None:
    meta = entry.get("meta")
    value = _positive(meta.get("n_ctx_train")) if isinstance(meta, dict) else None
    return (value, "server /v1/models meta.n_ctx_train") if value else None


async def _props_window(
    client: httpx.AsyncClient, base_url: str, headers: dict[str, str]
) -> tuple[int, str] | None:
    props = await _get_json(client, f"{_root(base_url)}/props", headers)
    if not isinstance(props, dict):
        return None
    settings = props.get("default_generation_settings")
    value = _positive(settings.get("n_ctx")) if isinstance(settings, dict) else None
    value = value or _positive(props.get("n_ctx"))
    return (value, "server /props n_ctx (llama.cpp)") if value else None


async def _ollama_window(
    client: httpx.AsyncClient, base_url: str, model: str, headers: dict[str, str]
) -> tuple[int, str] | None:
    if not model:
        return None
    show = await _post_json(client, f"{_root(base_url)}/api/show", {"model": model}, headers)
    if not isinstance(show, dict):
        return None
    params = show.get("parameters")
    if isinstance(params, str):  # "num_ctx 8192\n..." when the Modelfile sets it
        for line in params.splitlines():
            key, _, value = line.partition(" ")
            if key == "num_ctx" and _positive(value.strip()):
                return int(value.strip()), "server /api/show num_ctx (Ollama)"
    info = show.get("model_info")
    if isinstance(info, dict):
        for key, value in info.items():
            if key.endswith(".context_length") and _positive(value):
                return int(value), f"server /api/show {key} (Ollama)"
    return None


def _entries(listing: Any) -> list[dict[str, Any]]:
    data = listing.get("data") if isinstance(listing, dict) else None
    return [e for e in data if isinstance(e, dict)] if isinstance(data, list) else []


def _root(base_url: str) -> str:
    """`http://host:port/v1` -> `http://host:port` (llama.cpp and Ollama serve these at the root)."""
    return base_url[: -len("/v1")] if base_url.endswith("/v1") else base_url


def _positive(value: Any) -> int | None:
    try:
        number = int(value)
    except (TypeError, ValueError):
        return None
    return number if number > 0 else None


async def _get_json(client: httpx.AsyncClient, url: str, headers: dict[str, str]) -> Any:
    return await _fetch(client, "GET", url, headers, None)


async def _post_json(client: httpx.AsyncClient, url: str, body: Any, headers: dict[str, str]) -> Any:
    return await _fetch(client, "POST", url, headers, body)


async def _fetch(client: httpx.AsyncClient, method: str, url: str, headers: dict[str, str], body: Any) -> Any:
    try:
        request = client.build_request(method, url, headers=headers, json=body, timeout=PROBE_TIMEOUT)
        response = await client.send(request)
    except (httpx.HTTPError, UnicodeError, ValueError):  # a bad URL or header: nothing learned
        return None
    if not response.is_success or len(response.content) > _BODY_LIMIT:
        return None
    try:
        return msgspec.json.decode(response.content)
    except msgspec.DecodeError:
        return None


__all__ = ["PROBE_TIMEOUT", "Discovery", "discover"]
