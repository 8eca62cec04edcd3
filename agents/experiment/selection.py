"""One name for a whole experiment in `busctl replay` and `busctl diff`: which cells a name
selects (bus.experiments.covers: E all of them, E.<variant> one variant's, a cell's tag itself),
and each logged run's sample, so two executions are paired sample by sample, not by start order
(cells run concurrently: their start order is the scheduler's)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from agent_bus.agents.experiment.runner import Journal, read_journal
from agent_bus.agents.replay import RecordedRun
from agent_bus.bus.client import Peer
from agent_bus.bus.experiments import cell_tag, covers, parse_cell


async def cells_of(peer: Peer, name: str) -> tuple[Journal, list[str]]:
    """The journal of `name`'s experiment and the tags of the cells `name` covers that ran
    (a journaled run), in the plan's order: variant by variant, repeat by repeat. No cells
    (a plain experiment id, a replay's): an empty list."""
    journal = await read_journal(peer, name.split(".", 1)[0])
    ran = {c.tag for c in journal.results.values() if c.run_id and covers(name, c.tag)}
    order = journal.plan.variants if journal.plan else []

    def place(tag: str) -> tuple[int, str, int]:
        cell = parse_cell(tag)
        assert cell is not None  # a journaled tag is a cell's
        rank = order.index(cell.variant) if cell.variant in order else len(order)
        return (rank, cell.variant, cell.repeat)

    return journal, sorted(ran, key=place)


def retagged(tags: Sequence[str], target: str) -> list[str]:
    """Each cell tag's counterpart under experiment `target`: `target.<variant>.r<N>` (what a
    replay of a whole experiment names its cells)."""
    found = []
    for tag in tags:
        cell = parse_cell(tag)
        if cell is not None:
            found.append(cell_tag(target, cell.variant, cell.repeat))
    return found


@dataclass
class Tree:
    """A top-level run and the runs it asked (in call order), with where it belongs: its cell
    (variant, repeat) and its sample, when a journal says; its prompt always."""

    runs: list[RecordedRun]
    variant: str = ""
    repeat: int = 0
    sample: str = ""
    key: tuple[str, ...] = field(default=())

    @property
    def prompt(self) -> str:
        return self.runs[0].prompt

    @property
    def label(self) -> str:
        where = "/".join(x for x in (self.variant, self.sample or _short(self.prompt)) if x)
        return f"{where}/r{self.repeat}" if self.repeat else where


def _short(text: str) -> str:
    text = " ".join(text.split())
    return f"\"{text[:40]}…\"" if len(text) > 40 else f"\"{text}\""


def trees(runs: Sequence[RecordedRun], tag: str, journal: Journal | None) -> list[Tree]:
    """`runs` (in call order: each top-level run followed by the runs it asked) as trees, each
    labelled with its cell (from `tag`) and its sample (the journal's entry for its run)."""
    samples = {c.run_id: c.sample for c in journal.results.values()} if journal else {}
    cell = parse_cell(tag)
    found: list[Tree] = []
    for run in runs:
        if run.parent and found and any(r.run_id == run.parent for r in found[-1].runs):
            found[-1].runs.append(run)
            continue
        found.append(Tree([run], cell.variant if cell else "", cell.repeat if cell else 0,
                          samples.get(run.run_id, "")))
    if all(tree.sample for tree in found):  # a cell's samples in their ids' order (q2 < q10),
        found.sort(key=lambda tree: _natural(tree.sample))  # not the order they started in
    return found


def _natural(text: str) -> list[str | int]:
    """A sort key that orders the numbers in `text` as numbers (even places text, odd digits)."""
    return [int(part) if i % 2 else part for i, part in enumerate(re.split(r"(\d+)", text))]


def pair(a: list[Tree], b: list[Tree]) -> list[tuple[str, Tree | None, Tree | None]]:
    """The trees of two executions paired by what they ran: the same sample (by its id when
    both sides' journals name every one, else by its prompt, the sample's input), in the same
    cell when either side has several cells (variant and repeat; one on each side, e.g. two
    variants' cells, are paired as they are). Several trees of one key pair in order. Each
    pair has its label; a tree with no counterpart is paired with None (listed after)."""
    by_id = all(t.sample for t in (*a, *b))
    variants = len({t.variant for t in a}) > 1 or len({t.variant for t in b}) > 1
    repeats = len({t.repeat for t in a}) > 1 or len({t.repeat for t in b}) > 1
    for tree in (*a, *b):
        tree.key = ((tree.variant if variants else ""), (str(tree.repeat) if repeats else ""),
                    tree.sample if by_id else tree.prompt)
    left = {id(t): t for t in b}
    pairs: list[tuple[str, Tree | None, Tree | None]] = []
    for tree in a:
        match = next((t for t in left.values() if t.key == tree.key), None)
        if match is not None:
            del left[id(match)]
        pairs.append((tree.label, tree, match))
    pairs += [(t.label, None, t) for t in left.values()]
    return pairs
