"""What a model costs: `[models.x]` prices, the genai-prices table (offline), local servers, unknown.

No test touches the network: genai-prices ships its table inside the package, and the provider
URLs below are only compared, never called (a model at the provider's own URL is costed before
any request is made).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import msgspec
import pytest

from agent_bus.agents.gateway.engine import LlmEngine, ModelConfig
from agent_bus.agents.gateway.fakellm import FakeLLMServer, ScriptLike
from agent_bus.agents.gateway.providers.prices import ConfiguredPrices, is_local_host, price_model
from agent_bus.agents.gateway.wire import ModelStats
from agent_bus.bus.messages import Usage
from agent_bus.commands.observe import _cost_text
from tests.gateway.conftest import engine_for, request

pytestmark = pytest.mark.anyio
StartServer = Callable[[ScriptLike], FakeLLMServer]
NONE = ConfiguredPrices()
USAGE = Usage(input=1000, output=100)


def test_a_hosted_model_is_costed_from_the_price_table() -> None:
    pytest.importorskip("genai_prices", reason="the `prices` extra is not installed")
    pricing = price_model("openai", "gpt-4o-mini", base_url="", configured=NONE)
    assert pricing.known and pricing.source.startswith("genai-prices ")
    # $0.15/M in, $0.60/M out
    assert pricing.cost(USAGE) == pytest.approx(0.00021)
    same_host = price_model("openai", "gpt-4o-mini", base_url="https://api.openai.com/v1/",
                            configured=NONE)
    assert same_host.cost(USAGE) == pytest.approx(0.00021)


def test_cached_tokens_are_priced_at_the_cache_rate() -> None:
    pytest.importorskip("genai_prices", reason="the `prices` extra is not installed")
    pricing = price_model("openai", "gpt-4o-mini", base_url="", configured=NONE)
    # our `input` excludes cached tokens; 1,000 fresh at $0.15/M + 1,000 cached at $0.075/M
    assert pricing.cost(Usage(input=1000, cache_read=1000)) == pytest.approx(0.000225)


def test_an_unknown_model_is_unknown_not_free() -> None:
    pytest.importorskip("genai_prices", reason="the `prices` extra is not installed")
    pricing = price_model("openai", "my-finetune-7", base_url="", configured=NONE)
    assert not pricing.known
    assert "`my-finetune-7`" in pricing.source and "input_price/output_price" in pricing.source


def test_configured_prices_win_over_the_table() -> None:
    pricing = price_model("openai", "gpt-4o-mini", base_url="",
                          configured=ConfiguredPrices(input=1.0, output=2.0))
    assert pricing.known and pricing.source.startswith("[models] prices")
    assert pricing.cost(USAGE) == pytest.approx((1000 * 1.0 + 100 * 2.0) / 1e6)


@pytest.mark.parametrize("url", ["http://127.0.0.1:8081/v1", "http://localhost:11434/v1",
                                 "http://[::1]:8000/v1", "http://192.168.1.20:8000/v1",
                                 "http://gpu-box.local:8000/v1"])
def test_a_self_hosted_server_costs_nothing(url: str) -> None:
    pricing = price_model("openai", "gpt-4o-mini", base_url=url, configured=NONE)
    assert pricing.known and pricing.cost(USAGE) == 0.0 and "no charge" in pricing.source


def test_a_third_party_host_has_no_price_known() -> None:
    pricing = price_model("openai", "gpt-4o-mini", base_url="https://openrouter.example/api/v1",
                          configured=NONE)
    assert not pricing.known and "openrouter.example" in pricing.source
    assert not is_local_host("openrouter.example") and not is_local_host("8.8.8.8")


def test_without_the_extra_the_status_says_how_to_install_it() -> None:
    # A fresh interpreter where `genai_prices` cannot be imported, as without the extra.
    code = ("import sys; sys.modules['genai_prices'] = None\n"
            "from agent_bus.agents.gateway.providers.prices import ConfiguredPrices, price_model\n"
            "p = price_model('openai', 'gpt-4o-mini', base_url='', configured=ConfiguredPrices())\n"
            "print(p.known, p.source)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         check=True).stdout
    assert out.startswith("False ") and "agent-bus[prices]" in out


async def test_the_engine_reports_priced_and_unknown_models_in_its_stats() -> None:
    models = [ModelConfig(alias="hosted", provider="openai", model="gpt-4o-mini"),
              ModelConfig(alias="proxy", provider="openai", model="gpt-4o-mini",
                          base_url="https://llm-proxy.example/v1")]
    async with LlmEngine(models, env={}) as engine:
        stats = engine.stats().models
    assert not stats["proxy"].priced and "llm-proxy.example" in stats["proxy"].price
    assert stats["hosted"].price  # the table's entry, or how to install it
    assert _cost_text(_as_received(stats["proxy"])).startswith("unknown (no price known")


async def test_a_local_server_costs_zero_over_real_http(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {"text": "a", "usage": {"input": 1000, "output": 100}}}])
    async with engine_for(srv, model="gpt-4o-mini") as engine:
        message = await engine.complete(request())
        stats = engine.stats().models["fake-openai"]
    assert message.usage.input == 1000 and message.usage.cost == 0.0
    assert stats.priced and "127.0.0.1" in stats.price
    assert _cost_text(_as_received(stats)) == "$0.0000"


async def test_configured_prices_cost_a_local_model_over_real_http(fake_server: StartServer) -> None:
    srv = fake_server([{"reply": {"text": "a", "usage": {"input": 1000, "output": 100}}}])
    async with engine_for(srv, input_price=3.0, output_price=15.0) as engine:
        message = await engine.complete(request())
        stats = engine.stats().models["fake-openai"]
    assert message.usage.cost == pytest.approx((1000 * 3 + 100 * 15) / 1e6)
    assert stats.priced and stats.usage.cost == pytest.approx(message.usage.cost)
    assert _cost_text(_as_received(stats)) == "$0.0045"


def _as_received(stats: ModelStats) -> ModelStats:
    """What `busctl status` sees: the stats as they arrive over the bus (through msgpack)."""
    return msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=ModelStats)
