"""fetch_url: GET a web page or text resource over HTTP(S), size- and time-limited, text only."""

from __future__ import annotations

from typing import Annotated

import anyio
import httpx
import msgspec

from tools._exceptions import ToolError
from tools._tool import tool

MAX_FETCH_BYTES = 1024 * 1024
FETCH_TIME_LIMIT = 20.0
USER_AGENT = "agent-bus-fetch/0.1"
_TEXT_TYPES = ("application/json", "application/xml", "application/javascript",
               "application/xhtml+xml", "application/x-yaml", "application/yaml", "application/toml")


@tool(idempotent=True, timeout=FETCH_TIME_LIMIT + 5)
async def fetch_url(
    url: Annotated[
        str,
        msgspec.Meta(
            pattern=r"^https?://", description="Absolute http:// or https:// URL to fetch with GET."
        ),
    ],
) -> str:
    """Fetch a URL with HTTP GET and return the response body as text.
    Only text responses (text/*, JSON, XML, JavaScript, YAML) are returned; bodies over 1 MiB are
    cut, redirects are followed, and the whole fetch must finish within 20 seconds. HTML is
    returned as-is, not rendered.
    """
    try:
        with anyio.fail_after(FETCH_TIME_LIMIT):
            return await _fetch(url)
    except TimeoutError as exc:
        raise ToolError(f"Fetching `{url}` timed out after {FETCH_TIME_LIMIT:g}s") from exc
    except httpx.HTTPError as exc:  # the one place httpx errors enter: map them to a message
        raise ToolError(f"Cannot fetch `{url}`: {type(exc).__name__}: {exc}") from exc


async def _fetch(url: str) -> str:
    headers = {"User-Agent": USER_AGENT, "Accept": "text/*, application/json;q=0.9, */*;q=0.1"}
    async with httpx.AsyncClient(follow_redirects=True, max_redirects=5, timeout=10.0) as client:
        async with client.stream("GET", url, headers=headers) as response:
            _check_response(url, response)
            body, truncated = await _read_capped(response, MAX_FETCH_BYTES)
            text = _decode(body, response.encoding)
    if truncated:
        text += f"\n[truncated: the body is larger than {MAX_FETCH_BYTES} bytes]"
    return text


def _decode(body: bytes, encoding: str | None) -> str:
    try:
        return body.decode(encoding or "utf-8", errors="replace")
    except LookupError:  # an unknown charset in Content-Type
        return body.decode("utf-8", errors="replace")


def _check_response(url: str, response: httpx.Response) -> None:
    if response.status_code >= 400:
        raise ToolError(f"`{url}` returned HTTP {response.status_code} {response.reason_phrase}")
    content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
    if content_type and not _is_text(content_type):
        raise ToolError(
            f"`{url}` returned `{content_type}`, not text; fetch_url only returns text responses"
        )


def _is_text(content_type: str) -> bool:
    return (
        content_type.startswith("text/")
        or content_type in _TEXT_TYPES
        or content_type.endswith(("+json", "+xml"))
    )


async def _read_capped(response: httpx.Response, limit: int) -> tuple[bytes, bool]:
    body = bytearray()
    async for chunk in response.aiter_bytes():
        body += chunk
        if len(body) > limit:
            return bytes(body[:limit]), True
    return bytes(body), False
