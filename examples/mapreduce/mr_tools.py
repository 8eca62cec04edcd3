"""Map and reduce tools for the map-reduce example, served by the workers of both hosts.

    busctl worker --tools examples/mapreduce/mr_tools.py --workspace examples/mapreduce/host-b ...

`count_words(path)` is the map step: it counts the words of one file of this worker's workspace
and says which host did it (the workspace folder's name, e.g. `host-a`). `reduce_counts(partials)`
is the reduce step: it sums the map results. Both return JSON text, so a model can read them and
pass them on unchanged.
"""

from __future__ import annotations

import json
import re
import time
from collections import Counter
from typing import Annotated, Any

import msgspec

from agent_bus.tools import ToolContext, ToolError, tool

WORD = re.compile(r"[a-z][a-z']*")
MAP_WORK_SECONDS = 0.2  # simulated per-file work, so the calls visibly overlap across hosts


@tool(idempotent=True)
def count_words(path: Annotated[str, msgspec.Meta(description="A file, relative to the workspace")],
                ctx: ToolContext) -> str:
    """Map step: count the words of one text file; returns JSON {file, host, words, top}."""
    target = (ctx.workspace / path).resolve()
    if not target.is_relative_to(ctx.workspace) or not target.is_file():
        raise ToolError(f"no file {path!r} in the workspace of {ctx.workspace.name}")
    counts = Counter(WORD.findall(target.read_text(errors="replace").lower()))
    time.sleep(MAP_WORK_SECONDS)  # runs in a worker thread: the worker serves other calls meanwhile
    return json.dumps({"file": path, "host": ctx.workspace.name, "words": sum(counts.values()),
                       "counts": dict(sorted(counts.items()))})


@tool(idempotent=True)
def reduce_counts(partials: Annotated[str, msgspec.Meta(
        description="The count_words results: a JSON array of them, or the results one per line")]
                  ) -> str:
    """Reduce step: sum count_words results; returns JSON {reduced, files, words, by_host, top}."""
    items = _partials(partials)
    if not items:
        raise ToolError("no count_words results found in `partials`")
    total: Counter[str] = Counter()
    by_host: Counter[str] = Counter()
    for item in items:
        total.update(item.get("counts", {}))
        by_host[item.get("host", "?")] += 1
    top = [f"{word} {n}" for word, n in sorted(total.items(), key=lambda kv: (-kv[1], kv[0]))[:5]]
    return json.dumps({"reduced": True, "files": len(items), "words": sum(total.values()),
                       "by_host": dict(sorted(by_host.items())), "top": top})


def _partials(text: str) -> list[dict[str, Any]]:
    """Map results from a JSON array (of objects or of JSON strings) or from loose JSON objects."""
    try:
        data = json.loads(text)
    except ValueError:
        data = None
    if isinstance(data, dict):
        data = [data]
    if isinstance(data, list):
        out = []
        for item in data:
            if isinstance(item, str):
                try:
                    item = json.loads(item)
                except ValueError:
                    continue
            if isinstance(item, dict) and "counts" in item:
                out.append(item)
        return out
    decoder, out, i = json.JSONDecoder(), [], 0
    while (start := text.find("{", i)) != -1:
        try:
            item, i = decoder.raw_decode(text, start)
        except ValueError:
            i = start + 1
            continue
        if isinstance(item, dict) and "counts" in item:
            out.append(item)
    return out
