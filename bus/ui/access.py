"""Who the web view answers: its owner only (issue 44, "the web view answers only its user").

A port on 127.0.0.1 is open to every local user, and the page streams every event (prompts,
replies, tool results): so every route, on loopback as anywhere else, needs the page's token.
The token is random per `busctl ui` process (or read from `--token-file`) and kept in a 0600
file in the user's 0700 runtime folder (`bus.paths.runtime_home`, which the workers' sandbox
hides), beside a small launcher page `ui-PORT.html` that sends the browser to `/?token=…`. The
link `busctl ui` prints is that launcher's `file://` address: it holds no secret (another user
cannot read the file), so it may sit in a log and on a console, and the token never appears in
an argument (which `ps` shows to everyone), an environment, an event or a status. The server
swaps `?token=` for an HttpOnly, SameSite=Strict cookie named after its port (two views on two
ports keep their own) and sends the browser on to the same address without it; scripts send
`Authorization: Bearer TOKEN`. Anything else gets 401 and no data. Tokens are compared in
constant time.

Why not a peer-uid check (the uid of the client's socket in /proc/net/tcp): a tool that runs
`run_shell` with the network has the owner's uid, so it would be let in and read every run; it
cannot read the token file. A token also works on systems without /proc, and off loopback.
"""

from __future__ import annotations

import hmac
import html
import json
import os
import re
import secrets
import stat
from dataclasses import dataclass
from enum import Enum
from http.cookies import CookieError, SimpleCookie
from pathlib import Path
from urllib.parse import quote, unquote

from agent_bus.bus.errors import ConfigError
from agent_bus.bus.paths import runtime_home, state_home, write_private

MIN_TOKEN = 16  # shorter is guessable
#: What a token may hold: base64 and URL-safe characters, which a cookie carries as they are.
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/=-]+")
TOKEN_FILE_FLAG = "--token-file"


class Verdict(Enum):
    ALLOWED = "allowed"
    SWAP = "swap"          # a right `?token=`: set the cookie, send the browser on without it
    REFUSED = "refused"


@dataclass(frozen=True)
class Access:
    """The page's token and the cookie that carries it (named after the port: cookies are per
    host, not per port, so two views on one host must not overwrite each other's)."""

    token: str
    port: int

    @property
    def cookie(self) -> str:
        return f"busctl_ui_{self.port}"

    def verdict(self, query: dict[str, str], cookie_header: str, authorization: str) -> Verdict:
        if self._right(unquote(query.get("token", ""))):
            return Verdict.SWAP
        held = _cookie(cookie_header, self.cookie)
        bearer = authorization.removeprefix("Bearer ").strip() \
            if authorization.startswith("Bearer ") else ""
        return Verdict.ALLOWED if self._right(held) or self._right(bearer) else Verdict.REFUSED

    def _right(self, given: str) -> bool:
        # bytes: compare_digest refuses a str with non-ASCII characters (a hostile header)
        return bool(given) and hmac.compare_digest(given.encode("utf-8", "surrogateescape"),
                                                   self.token.encode())

    def set_cookie(self) -> str:
        return f"{self.cookie}={self.token}; Path=/; HttpOnly; SameSite=Strict"


def _cookie(header: str, name: str) -> str:
    cookies: SimpleCookie = SimpleCookie()
    try:
        cookies.load(header)
    except CookieError:  # a malformed header: no cookie, not a crash
        return ""
    return cookies[name].value if name in cookies else ""


def new_token() -> str:
    return secrets.token_urlsafe(32)


def read_token_file(path: Path) -> str:
    """The token in `path`, a file of this user's that no one else may read."""
    try:
        st = path.stat()
        text = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{TOKEN_FILE_FLAG} {path}: cannot read it ({exc})") from None
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise ConfigError(f"{TOKEN_FILE_FLAG} {path}: other users may read it (mode "
                          f"{stat.S_IMODE(st.st_mode):o}, uid {st.st_uid}): `chmod 600 {path}` "
                          "as its owner")
    if len(text) < MIN_TOKEN or not TOKEN_CHARS.fullmatch(text):
        raise ConfigError(f"{TOKEN_FILE_FLAG} {path}: the token must be one line of at least "
                          f"{MIN_TOKEN} letters, digits or - _ . ~ + / = (e.g. `openssl rand "
                          "-hex 32`), or leave the flag out to have one generated")
    return text


def tools_can_read(path: Path) -> bool:
    """Whether a sandboxed tool could read `path`: the sandbox hides only the runtime folder and
    the state folders (tools/sandbox.py), and a tool with the network could then use the token."""
    where = path.resolve()
    return not any(where.is_relative_to(folder) for folder in (runtime_home(), state_home()))


@dataclass(frozen=True)
class Handout:
    """The owner's way in, in the private runtime folder: the token and the launcher page."""

    token_file: Path
    launcher: Path

    @property
    def link(self) -> str:
        return self.launcher.as_uri()


def hand_out(access: Access, page: str) -> Handout:
    """Write `ui-PORT.token` and `ui-PORT.html` (0600) for the view at `page` (its base URL)."""
    folder = runtime_home()
    out = Handout(folder / f"ui-{access.port}.token", folder / f"ui-{access.port}.html")
    write_private(out.token_file, access.token + "\n")
    write_private(out.launcher, launcher_page(f"{page}?token={quote(access.token, safe='')}"))
    return out


def withdraw(handout: Handout, access: Access) -> None:
    """Remove both files at exit, unless another view on this port has written its own since."""
    try:
        if handout.token_file.read_text().strip() != access.token:
            return
    except OSError:
        return
    for path in (handout.launcher, handout.token_file):
        path.unlink(missing_ok=True)


def launcher_page(target: str) -> str:
    """The page behind the printed link: on to `target` (with any `#…` the link was opened
    with, e.g. `#experiment=E`), by script, else by a refresh, else by a click."""
    quoted = html.escape(target, quote=True)
    return ("<!doctype html>\n<meta charset=\"utf-8\"><title>busctl ui</title>\n"
            "<meta name=\"referrer\" content=\"no-referrer\">\n"
            f"<script>location.replace({_js_string(target)} + location.hash)</script>\n"
            f"<noscript><meta http-equiv=\"refresh\" content=\"0;url={quoted}\"></noscript>\n"
            f"<p><a href=\"{quoted}\">Open the bus's web view</a></p>\n")


def swap_page(request: str) -> bytes:
    """The answer to a right `?token=` in `request` (the request's path and query): sent with
    the cookie, it moves on to the same address without the token, from the view's own origin.
    Not a 303: after a redirect the browser still counts the request as made by the launcher
    (a `file://` page, another site) and withholds a SameSite=Strict cookie; a navigation this
    page starts is same-site."""
    path = without_token(request)
    quoted = html.escape(path, quote=True)
    return ("<!doctype html>\n<meta charset=\"utf-8\"><title>busctl ui</title>\n"
            f"<script>location.replace({_js_string(path)} + location.hash)</script>\n"
            f"<noscript><meta http-equiv=\"refresh\" content=\"0;url={quoted}\"></noscript>\n"
            f"<p><a href=\"{quoted}\">Continue</a></p>\n").encode()


def without_token(request: str) -> str:
    """`/x?token=T&a=1` -> `/x?a=1`; a path that is not one of this server's (`//host` or
    `/\\host`, which a browser reads as another site) -> `/`."""
    path, _, query = request.partition("?")
    if not path.startswith("/") or path[1:2] in ("/", "\\"):  # a browser reads `\` as `/`
        path = "/"
    kept = "&".join(item for item in query.split("&") if item and item.partition("=")[0] != "token")
    return f"{path}?{kept}" if kept else path


def _js_string(text: str) -> str:
    """`text` as a JavaScript string literal that cannot close the script element."""
    return json.dumps(text).replace("<", "\\u003c").replace(">", "\\u003e")


REFUSED_TEXT = (b"401: this page answers only its owner. Open the link `busctl ui` printed (the "
                b"file:// address of ui-PORT.html in your runtime folder), or add ?token=TOKEN "
                b"once (the token is in ui-PORT.token beside it, or your --token-file); scripts "
                b"send Authorization: Bearer TOKEN.")
