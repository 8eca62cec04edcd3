"""Redaction of secrets from text that leaves a process: errors, events, log lines.

    redactor = Redactor(["sk-proj-..."])     # the values of the configured API keys
    redactor(text)                           # every trace of them and of key-shaped tokens -> ***
    clip(text, redactor, limit=500)          # redact the whole text first, then cut it

Two layers, both applied before anything cuts the text (a cut can leave a piece of a key that
no longer matches the whole key, which is how a 30-character prefix once reached events):

- known secrets: every substring of at least `FRAGMENT` characters of a secret, also in its JSON,
  repr and URL-escaped forms, so a server that echoes the key whole, masked or cut leaves nothing
  longer than `FRAGMENT - 1` characters of it;
- key shapes, whoever's they are: `sk-...` (OpenAI, `sk-proj-`, Anthropic `sk-ant-`), `Bearer
  <token>`, `x-api-key: ...`, AWS, Google, GitHub and Slack tokens.

`log_redaction(redactor)` applies a redactor to every log record of the process while it is active.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from urllib.parse import quote

MARK = "***"
FRAGMENT = 8  # a shorter piece of a random key is no help to an attacker; a longer one might be
SCAN_LIMIT = 64 * 1024  # redaction is linear; text beyond this is cut first (callers cut far shorter)
_SHORT_SECRET = 4  # secrets shorter than this are not redacted at all: they would hit ordinary words

# A recognisable token is kept as its label ("Bearer ", "x-api-key: ") followed by MARK.
_KEY_SHAPES = re.compile(
    r"""
      \bsk-[A-Za-z0-9][A-Za-z0-9_\-]{11,}                    # OpenAI sk-/sk-proj-, Anthropic sk-ant-
    | \bAKIA[0-9A-Z]{16}\b                                   # AWS access key id
    | \bAIza[0-9A-Za-z_\-]{35}                               # Google API key
    | \b(?:gh[pousr]_[A-Za-z0-9]{30,}|github_pat_[A-Za-z0-9_]{30,})  # GitHub tokens
    | \bxox[abprs]-[A-Za-z0-9\-]{10,}                        # Slack tokens
    | (?P<label>\bBearer\s+
        | \b(?:x-api-key|api[-_]?key|x-goog-api-key)["']?\s*[:=]\s*["']?)
      (?P<value>[A-Za-z0-9._~+/\-]{8,}=*)
    """,
    re.IGNORECASE | re.VERBOSE,
)


class Redactor:
    """Replaces known secrets (and any `FRAGMENT`-long piece of them) and key-shaped tokens."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._grams: set[str] = set()
        self._short: list[str] = []
        for secret in {s.strip() for s in secrets}:
            for form in _escaped_forms(secret):
                self._add(form)

    def _add(self, form: str) -> None:
        if len(form) < _SHORT_SECRET:
            return
        if len(form) < FRAGMENT:
            self._short.append(form)
            return
        self._grams.update(form[i : i + FRAGMENT] for i in range(len(form) - FRAGMENT + 1))

    def __call__(self, text: str) -> str:
        if len(text) > SCAN_LIMIT:
            text = text[:SCAN_LIMIT] + "…"
        if self._grams:
            text = _replace_spans(text, self._spans(text))
        for secret in self._short:
            text = text.replace(secret, MARK)
        return _KEY_SHAPES.sub(_mark_token, text)

    def _spans(self, text: str) -> Iterator[tuple[int, int]]:
        """Merged (start, end) ranges covered by windows of `text` that are pieces of a secret."""
        start = end = -1
        for i in range(len(text) - FRAGMENT + 1):
            if text[i : i + FRAGMENT] not in self._grams:
                continue
            if i > end:  # a gap: the previous span is complete
                if end >= 0:
                    yield start, end
                start = i
            end = i + FRAGMENT
        if end >= 0:
            yield start, end


def clip(text: str, redactor: Callable[[str], str], limit: int = 500) -> str:
    """`text` redacted, then cut to `limit` characters (with "…"): never the other way round."""
    clean = redactor(text)
    return clean if len(clean) <= limit else clean[:limit] + "…"


@contextmanager
def log_redaction(redactor: Callable[[str], str]) -> Iterator[None]:
    """Redact every log record created in this process (any logger, any handler) while active.

    A record factory rather than a handler filter: it also covers handlers added later and the
    formatted traceback of `log.exception`."""
    previous = logging.getLogRecordFactory()

    def factory(*args: object, **kwargs: object) -> logging.LogRecord:
        record = previous(*args, **kwargs)
        _redact_record(record, redactor)
        return record

    logging.setLogRecordFactory(factory)
    try:
        yield
    finally:
        logging.setLogRecordFactory(previous)


def _redact_record(record: logging.LogRecord, redactor: Callable[[str], str]) -> None:
    try:
        message = record.getMessage()
    except (TypeError, ValueError):  # a bad format string: logging reports it when it formats
        return
    clean = redactor(message)
    if clean != message:
        record.msg, record.args = clean, None
    if record.exc_info and not record.exc_text:
        record.exc_text = logging.Formatter().formatException(record.exc_info)
    if record.exc_text:
        record.exc_text = redactor(record.exc_text)
    if record.stack_info:
        record.stack_info = redactor(record.stack_info)


def _escaped_forms(secret: str) -> set[str]:
    """How a server or a formatter may write `secret`: raw, JSON-, repr- and URL-escaped."""
    if not secret:
        return set()
    return {secret, json.dumps(secret)[1:-1], repr(secret)[1:-1], quote(secret, safe="")}


def _replace_spans(text: str, spans: Iterable[tuple[int, int]]) -> str:
    parts: list[str] = []
    last = 0
    for start, end in spans:
        parts += [text[last:start], MARK]
        last = end
    if not parts:
        return text
    parts.append(text[last:])
    return "".join(parts)


def _mark_token(match: re.Match[str]) -> str:
    label = match.group("label")
    return f"{label}{MARK}" if label else MARK


__all__ = ["FRAGMENT", "MARK", "Redactor", "clip", "log_redaction"]
