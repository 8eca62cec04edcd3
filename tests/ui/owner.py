"""The owner's way into `busctl ui` for tests that read its routes with a plain HTTP client: the
token from the file the ready line names (a browser opens the ready line's `url` instead)."""

from __future__ import annotations

import html
import re
import urllib.parse
import urllib.request
from http.client import HTTPResponse
from http.cookiejar import CookieJar
from pathlib import Path
from typing import Any


def owner_headers(ready: dict[str, Any]) -> dict[str, str]:
    token = Path(ready["token_file"]).read_text().strip()
    return {"Authorization": f"Bearer {token}"}


def owner_get(ready: dict[str, Any], route: str, timeout: float = 5.0,
              headers: dict[str, str] | None = None) -> HTTPResponse:
    """GET `route` (e.g. `events`, `experiment?name=E`) of the view as its owner."""
    request = urllib.request.Request(str(ready["page"]) + route,
                                     headers={**owner_headers(ready), **(headers or {})})
    answer: HTTPResponse = urllib.request.urlopen(request, timeout=timeout)
    return answer


def open_link(link: str, timeout: float = 10.0) -> str:
    """What the owner's browser shows for the link `busctl ui` printed (the `file://` launcher),
    followed without a script as a browser does: its address with the token, whose answer sets
    the cookie and names the page, then the page with that cookie. Returns the page's HTML."""
    opener = urllib.request.build_opener(urllib.request.HTTPCookieProcessor(CookieJar()))
    with urllib.request.urlopen(link, timeout=timeout) as launcher:  # the file itself
        text = launcher.read().decode()
    for _ in range(2):  # the launcher's target, then the page the token's answer names
        target = re.search(r'<a href="([^"]+)"', text)
        assert target is not None, text
        link = urllib.parse.urljoin(link, html.unescape(target[1]))
        with opener.open(link, timeout=timeout) as answer:
            text = answer.read().decode()
    return text
