"""Experiment ids as the log carries them. A `busctl experiment run` of experiment E journals
under E (`experiment_plan`, `experiment_sample`) and runs each cell's session under the tag
`E.<variant>.r<repeat>`; experiment and variant names are letters, digits, `_` and `-`, so a tag
parses back. One name then selects several ids (`covers`): E its own and every cell's, `E.<variant>`
that variant's cells, any other id just itself (a plain `busctl run --experiment X`, a replay)."""

from __future__ import annotations

import re
from typing import NamedTuple

#: An experiment's or a variant's name (agents/experiment/spec.py checks names against it).
NAME = r"[A-Za-z0-9_-]+"
CELL_TAG = re.compile(rf"({NAME})\.({NAME})\.r([0-9]+)")


class Cell(NamedTuple):
    experiment: str
    variant: str
    repeat: int


def cell_tag(experiment: str, variant: str, repeat: int) -> str:
    """The experiment id a cell's sessions carry: `E.<variant>.r<repeat>`."""
    return f"{experiment}.{variant}.r{repeat}"


def parse_cell(tag: str) -> Cell | None:
    """The cell a tag names, None for an id that is no cell's."""
    found = CELL_TAG.fullmatch(tag)
    return Cell(found[1], found[2], int(found[3])) if found else None


def covers(name: str, tag: str) -> bool:
    """Whether the experiment id `tag` is one the name `name` selects (see the module's text)."""
    if tag == name:
        return True
    cell = parse_cell(tag)
    return cell is not None and name in (cell.experiment, f"{cell.experiment}.{cell.variant}")


def holds_entries_of(name: str, tag: str) -> bool:
    """Whether events of id `tag` may be `name`'s: its own (`covers`), or its experiment's
    journal, whose cell entries a variant's or a cell's name selects (`selects`)."""
    return covers(name, tag) or (bool(tag) and name.startswith(f"{tag}."))


def plan_tags(name: str, experiment: str, variants: list[str], repeats: int) -> list[str]:
    """The ids whose events `name` selects among a plan's (`holds_entries_of`): the
    experiment's own and its cells', variant by variant, repeat by repeat."""
    tags = [experiment] if holds_entries_of(name, experiment) else []
    tags += [tag for variant in variants for repeat in range(1, repeats + 1)
             if covers(name, tag := cell_tag(experiment, variant, repeat))]
    return tags
