"""Scorers: each turns (answer, sample) into a score in [0, 1], or None when it cannot apply
(the sample has no target). Built-ins are binary; a `python` scorer may return any number.

    exact       the answer equals the target (surrounding whitespace ignored; `ignore_case`)
    includes    the target occurs in the answer
    regex       `pattern` (else the target, as a pattern) matches somewhere in the answer
    number      the answer's last number is within `tolerance` of the target
    json_field  the answer's JSON object (the first `{...}` in it) has `field` (a dotted path)
                equal to the target
    python      fn = "module:function", called as function(answer, sample) -> float | bool
    model       graded through the gateway (`grade`): the `template` prompt (DEFAULT_TEMPLATE)
                to model alias `model`; its last `GRADE: C` / `P` / `I` gives 1 / 0.5 / 0, no
                grade (or a failed call) None. Inspect's `model_graded_qa` convention.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from agent_bus.agents.coordinator.bus_adapters import BusLlmClient
from agent_bus.agents.experiment.spec import Sample, Scorer, ScorerError, load_function
from agent_bus.bus.messages import LlmRequest, TextPart, user_text

NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def score(scorer: Scorer, answer: str, sample: Sample) -> float | None:
    """One scorer's score of `answer`; None when the sample has no target to compare with."""
    if scorer.kind == "python":
        value = load_function(scorer.fn)(answer, sample)
        return None if value is None else float(value)
    if sample.target is None and not (scorer.kind == "regex" and scorer.pattern):
        return None
    target = sample.target if isinstance(sample.target, str) else json.dumps(sample.target)
    if scorer.kind == "exact":
        return float(_fold(answer.strip(), scorer) == _fold(target.strip(), scorer))
    if scorer.kind == "includes":
        return float(_fold(target, scorer) in _fold(answer, scorer))
    if scorer.kind == "regex":
        flags = re.IGNORECASE if scorer.ignore_case else 0
        return float(re.search(scorer.pattern or target, answer, flags) is not None)
    if scorer.kind == "number":
        return _number(answer, sample.target, scorer.tolerance)
    if scorer.kind == "json_field":
        return _json_field(answer, sample.target, scorer.field)
    raise ScorerError(f"scorer kind `{scorer.kind}` is graded through the gateway (`grade`)")


def score_all(scorers: list[Scorer], answer: str, sample: Sample) -> dict[str, float | None]:
    """Every scorer's score but the `model` ones' (`grade`, which calls the gateway)."""
    return {s.label: score(s, answer, sample) for s in scorers if s.kind != "model"}


DEFAULT_TEMPLATE = """You are an impartial grader. Compare the submitted answer with the reference.
[Question]: {input}
[Reference answer]: {target}
[Submitted answer]: {answer}
Reason briefly, then end with one line: GRADE: C if the submission is correct, GRADE: P if it
is partially correct, GRADE: I if it is incorrect."""
GRADES = {"C": 1.0, "P": 0.5, "I": 0.0}
GRADE = re.compile(r"GRADE\s*:\s*([CPI])\b")


async def grade(llm: BusLlmClient, scorer: Scorer, answer: str, sample: Sample) -> float | None:
    """A `model` scorer's grade of `answer` (None: no grade in the reply, or the call failed)."""
    target = "" if sample.target is None else (
        sample.target if isinstance(sample.target, str) else json.dumps(sample.target))
    prompt = (scorer.template or DEFAULT_TEMPLATE).format(input=sample.input, answer=answer,
                                                          target=target)
    reply = await llm.complete(LlmRequest(messages=[user_text(prompt)], model=scorer.model))
    if reply.stop_reason == "error":
        return None
    text = "".join(part.text for part in reply.content if isinstance(part, TextPart))
    found = GRADE.findall(text)
    return GRADES[found[-1]] if found else None


def _fold(text: str, scorer: Scorer) -> str:
    return text.casefold() if scorer.ignore_case else text


def _number(answer: str, target: Any, tolerance: float) -> float:
    try:
        want = float(str(target).replace(",", ""))
    except ValueError:
        return 0.0
    found = NUMBER.findall(answer)
    if not found:
        return 0.0
    try:
        got = float(found[-1].replace(",", ""))
    except ValueError:
        return 0.0
    return float(math.isfinite(got) and abs(got - want) <= tolerance)


def _json_field(answer: str, target: Any, path: str) -> float:
    start, end = answer.find("{"), answer.rfind("}")
    if start < 0 or end < start:
        return 0.0
    try:
        value: Any = json.loads(answer[start:end + 1])
    except json.JSONDecodeError:
        return 0.0
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return 0.0
        value = value[part]
    return float(value == target or str(value) == str(target))
