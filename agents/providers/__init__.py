"""LLM provider adapters: build a provider's HTTP request, parse its SSE stream."""

from agents.providers.anthropic import AnthropicProvider
from agents.providers.base import (
    MessageBuilder,
    Provider,
    ProviderRequest,
    SseEvent,
    StreamError,
    flatten_schema,
    iter_sse,
)
from agents.providers.openai import OpenAIProvider

PROVIDERS: dict[str, type[Provider]] = {"anthropic": AnthropicProvider, "openai": OpenAIProvider}

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
