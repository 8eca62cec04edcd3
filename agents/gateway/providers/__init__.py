"""LLM provider adapters: build a provider's HTTP request, parse its SSE stream."""

from agent_bus.agents.gateway.providers.anthropic import AnthropicProvider
from agent_bus.agents.gateway.providers.base import (
    MessageBuilder,
    Provider,
    ProviderRequest,
    SseEvent,
    StreamError,
    flatten_schema,
    iter_sse,
)
from agent_bus.agents.gateway.providers.openai import OpenAIProvider

# "llamacpp" is llama.cpp's server hosted by the gateway (agents.gateway.providers.llamacpp): it speaks
# the OpenAI API.
PROVIDERS: dict[str, type[Provider]] = {
    "anthropic": AnthropicProvider, "llamacpp": OpenAIProvider, "openai": OpenAIProvider}

__all__ = [
    "PROVIDERS",
    "AnthropicProvider",
    "MessageBuilder",
    "OpenAIProvider",
    "Provider",
    "ProviderRequest",
    "SseEvent",
    "StreamError",
    "flatten_schema",
    "iter_sse",
]
