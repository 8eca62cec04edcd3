"""What a model's tokens cost: the `[models.x]` prices, else a maintained price table, else unknown.

    pricing = price_model("openai", "gpt-4o-mini", base_url="", configured=None)
    pricing.cost(Usage(input=1000, output=100))   # 0.00021 (USD)
    pricing.known, pricing.source                   # True, "genai-prices 0.2.3 (openai gpt-4o-mini)"

Sources, first that applies:
1. prices given in `[models.x]` (`input_price`, `output_price`, per million tokens): always win;
2. a server on this machine or the local network costs nothing per token (known, 0);
3. the provider's own API (OpenAI's or Anthropic's base URL) with a model the `genai-prices`
   package knows (the optional extra `agent-bus[prices]`; its table ships inside the package, so
   the lookup works offline — we never call its network refresh);
4. anything else (an unknown model, a third-party host, the extra not installed): **unknown**, said
   as such (`known=False`, the source says why and how to fix it) instead of a cost of 0.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from importlib import import_module
from importlib.metadata import PackageNotFoundError, version
from typing import Any
from urllib.parse import urlsplit

import msgspec

from agent_bus.bus.messages import Usage

#: The hosts of the providers' own APIs: only there does a public price list apply.
PROVIDER_HOSTS: dict[str, str] = {"openai": "api.openai.com", "anthropic": "api.anthropic.com"}
LOCAL_HOSTNAMES = frozenset({"localhost", "localhost.localdomain", "host.docker.internal"})

CostFunction = Callable[[Usage], float]


def _free(usage: Usage) -> float:
    return 0.0


@dataclass(frozen=True)
class Pricing:
    """How one model is costed. `source` says where the price came from, or why there is none."""

    known: bool
    source: str
    cost: CostFunction = _free


class ConfiguredPrices(msgspec.Struct, frozen=True):
    """USD per million tokens, from `[models.x]`; cache prices default to the input price."""

    input: float | None = None
    output: float | None = None
    cache_read: float | None = None
    cache_write: float | None = None

    @property
    def given(self) -> bool:
        return self.input is not None or self.output is not None

    def cost(self, usage: Usage) -> float:
        input_price = self.input or 0.0
        total = usage.input * input_price + usage.output * (self.output or 0.0)
        total += usage.cache_read * (self.cache_read if self.cache_read is not None else input_price)
        total += usage.cache_write * (self.cache_write if self.cache_write is not None else input_price)
        return total / 1_000_000


def price_model(provider: str, model: str, *, base_url: str, configured: ConfiguredPrices) -> Pricing:
    """The pricing of `model` served at `base_url` ("" = the provider's own API). Never raises."""
    if configured.given:
        return Pricing(True, f"[models] prices: ${configured.input or 0:g}/M in, "
                             f"${configured.output or 0:g}/M out", configured.cost)
    host = (urlsplit(base_url).hostname or "") if base_url else PROVIDER_HOSTS.get(provider, "")
    if is_local_host(host):
        return Pricing(True, f"a server on this machine or network ({host}): no charge per token")
    if host != PROVIDER_HOSTS.get(provider):
        return Pricing(False, f"no price known for a model served by {host or base_url!r}; set "
                              "input_price/output_price in its [models.x] table")
    if not model:
        return Pricing(False, "no price known until the model name is known")
    return _table_pricing(provider, model)


def is_local_host(host: str) -> bool:
    """Loopback, private (RFC 1918/4193), link-local or `localhost`: a self-hosted server."""
    if host.lower() in LOCAL_HOSTNAMES or host.lower().endswith(".local"):
        return True
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.is_loopback or address.is_private or address.is_link_local


def _table_pricing(provider: str, model: str) -> Pricing:
    try:
        prices = import_module("genai_prices")
    except ImportError:
        return Pricing(False, f"no price known for {provider} `{model}`: install the price table "
                              "(pip install 'agent-bus[prices]') or set input_price/output_price "
                              "in its [models.x] table")
    table = f"genai-prices {_version()}"
    try:
        found = _calc(prices, provider, model, Usage())
    except LookupError:
        return Pricing(False, f"no price known: {table} does not list {provider} `{model}`; set "
                              "input_price/output_price in its [models.x] table")
    def cost(usage: Usage) -> float:
        try:
            return float(_calc(prices, provider, model, usage).total_price)
        except (LookupError, ValueError, ArithmeticError):  # a table entry our usage cannot fit
            return 0.0

    return Pricing(True, f"{table} ({provider} {found.model.id})", cost)


def _calc(prices: Any, provider: str, model: str, usage: Usage) -> Any:
    # genai-prices counts cached tokens inside `input_tokens`; our `input` excludes them.
    return prices.calc_price(
        prices.Usage(input_tokens=usage.input + usage.cache_read + usage.cache_write,
                     cache_read_tokens=usage.cache_read, cache_write_tokens=usage.cache_write,
                     output_tokens=usage.output),
        model_ref=model, provider_id=provider)


def _version() -> str:
    try:
        return version("genai-prices")
    except PackageNotFoundError:
        return "(unknown version)"


__all__ = ["ConfiguredPrices", "Pricing", "is_local_host", "price_model"]
