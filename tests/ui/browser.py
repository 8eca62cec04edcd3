"""Drive the distribution's headless Chromium over the DevTools protocol, with the standard
library only: `--remote-debugging-pipe` speaks JSON messages ended by NUL on fds 3 (to the
browser) and 4 (from it). Needed because `--dump-dom` returns at the load event, before a live
page (an open EventSource never finishes loading) has drawn what it received."""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_TRAMPOLINE = ("import os, sys; r, w = os.dup(int(sys.argv[1])), os.dup(int(sys.argv[2])); "
               "os.dup2(r, 3); os.dup2(w, 4); os.set_inheritable(3, True); "
               "os.set_inheritable(4, True); os.execv(sys.argv[3], sys.argv[3:])")


#: What DevTools answers to an evaluation while the tab navigates.
_BETWEEN_DOCUMENTS = ("Execution context was destroyed", "Cannot find default execution context",
                      "Inspected target navigated or closed")


def find_chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


class Browser:
    def __init__(self, binary: str, profile: Path) -> None:
        profile.mkdir(parents=True, exist_ok=True)
        self.log_path = profile.parent / "chromium.log"  # its own complaints, for a failure
        self._log = self.log_path.open("wb")
        to_browser_r, self._to_browser = os.pipe()
        self._from_browser, from_browser_w = os.pipe()
        args = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                "--remote-debugging-pipe", f"--user-data-dir={profile}",
                "--window-size=1400,900", "about:blank"]
        # The child's fds 3 and 4 must be exactly these pipe ends: a tiny Python trampoline moves
        # them there (preexec_fn's dup2 would be undone by Popen closing the fds it was not told
        # to keep; `sh` redirections take one-digit fds only).
        self.proc = subprocess.Popen([sys.executable, "-c", _TRAMPOLINE, str(to_browser_r),
                                      str(from_browser_w), *args], stdout=subprocess.DEVNULL,
                                     stderr=self._log,
                                     pass_fds=(to_browser_r, from_browser_w),
                                     start_new_session=True)
        os.close(to_browser_r)
        os.close(from_browser_w)
        self._buf = b""
        self._next = 0
        self.session = ""

    def call(self, method: str, params: dict[str, Any] | None = None, timeout: float = 20.0,
             session: bool = True) -> dict[str, Any]:
        self._next += 1
        msg: dict[str, Any] = {"id": self._next, "method": method, "params": params or {}}
        if session and self.session:
            msg["sessionId"] = self.session
        os.write(self._to_browser, json.dumps(msg).encode() + b"\0")
        deadline = time.monotonic() + timeout
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next:
                if "error" in reply:
                    raise RuntimeError(f"{method}: {reply['error']}")
                return reply.get("result", {})

    def _read(self, deadline: float) -> dict[str, Any]:
        import select

        while b"\0" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no answer from chromium")
            ready, _, _ = select.select([self._from_browser], [], [], left)
            if ready:
                chunk = os.read(self._from_browser, 1 << 20)
                if not chunk:
                    raise RuntimeError("chromium exited: " + self.log_path.read_text()[-2000:])
                self._buf += chunk
        raw, self._buf = self._buf.split(b"\0", 1)
        return json.loads(raw)

    def open(self, url: str) -> None:
        target = self.call("Target.createTarget", {"url": url}, session=False)["targetId"]
        self.session = self.call("Target.attachToTarget", {"targetId": target, "flatten": True},
                                 session=False)["sessionId"]

    def evaluate(self, expression: str) -> Any:
        """The expression's value; None while the tab is between two documents (the view's link
        goes through two pages before the view's own: tests poll with `until`)."""
        try:
            result = self.call("Runtime.evaluate", {"expression": expression,
                                                    "returnByValue": True})
        except RuntimeError as exc:
            if any(what in str(exc) for what in _BETWEEN_DOCUMENTS):
                return None
            raise
        return result.get("result", {}).get("value")

    def screenshot(self, path: Path) -> None:
        data = self.call("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))

    def close(self) -> None:
        try:
            self.call("Browser.close", session=False, timeout=5)
            self.proc.wait(10)
        except (RuntimeError, TimeoutError, OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)
        finally:
            self._log.close()
            os.close(self._to_browser)
            os.close(self._from_browser)
