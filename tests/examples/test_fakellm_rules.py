"""The fake model's rule keys the examples rely on: one server driving several agents."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from agent_bus.agents.gateway.fakellm import FakeLLMServer

SCRIPT = {
    "rules": [
        {"system": ["you are the judge"], "tool_result": True, "results_contain": ["REBUTTAL"],
         "reply": {"text": "verdict after {tool_results_full}"}},
        {"system": ["you are the judge"], "tool_result": True,
         "reply": {"text": "round two", "tool_calls": [
             {"name": "ask_pro", "arguments": {"prompt": "rebut: {tool_results_json}",
                                               "nested": ["{last_user}"]}}]}},
        {"system": ["you are the judge"], "offers": ["ask_pro", "ask_con"],
         "reply": {"text": "round one", "tool_calls": [
             {"name": "ask_pro", "arguments": {"prompt": "open on {last_user}"}},
             {"name": "ask_con", "arguments": {"prompt": "open on {last_user}"}}]}},
        {"model": ["slow-model"], "delay": 0.3, "reply": {"text": "slow {last_user}"}},
        {"system": ["argue FOR"], "reply": {"text": "PRO: {last_user}"}},
    ],
    "echo": True,
}

TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("ask_pro", "ask_con")]


def openai(srv: FakeLLMServer, system: str, messages: list[dict[str, Any]],
           model: str = "m", tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "system", "content": system}, *messages],
            "tools": tools or [], "stream": False}
    response = httpx.post(f"{srv.base_url}/chat/completions", json=body, timeout=5)
    return response.json()["choices"][0]["message"]


def test_rules_match_on_system_prompt_offered_tools_results_and_model() -> None:
    with FakeLLMServer(SCRIPT) as srv:
        user = [{"role": "user", "content": "the motion"}]
        first = openai(srv, "You are the JUDGE.", user, tools=TOOLS)
        assert first["content"] == "round one"
        calls = first["tool_calls"]
        assert [c["function"]["name"] for c in calls] == ["ask_pro", "ask_con"]
        assert json.loads(calls[0]["function"]["arguments"]) == {"prompt": "open on the motion"}
        # Without the tools offered, the rule needing them does not match: echo.
        assert openai(srv, "You are the JUDGE.", user)["content"] == "echo: the motion"

        results = [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "a", "type": "function", "function": {"name": "ask_pro", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "a", "content": "PRO OPENING: yes"}]
        second = openai(srv, "You are the JUDGE.", user + results, tools=TOOLS)
        args = json.loads(second["tool_calls"][0]["function"]["arguments"])
        assert args == {"prompt": 'rebut: ["PRO OPENING: yes"]', "nested": ["the motion"]}
        results[1]["content"] = "PRO REBUTTAL: still yes"
        third = openai(srv, "You are the JUDGE.", user + results, tools=TOOLS)
        assert third["content"] == "verdict after PRO REBUTTAL: still yes"

        assert openai(srv, "You argue FOR it.", user)["content"] == "PRO: the motion"
        start = time.monotonic()
        assert openai(srv, "anyone", user, model="slow-model")["content"] == "slow the motion"
        assert time.monotonic() - start >= 0.3


def test_anthropic_system_prompt_is_matched_too() -> None:
    with FakeLLMServer(SCRIPT) as srv:
        body = {"model": "m", "max_tokens": 100, "stream": False,
                "system": [{"type": "text", "text": "You argue FOR the motion."}],
                "messages": [{"role": "user", "content": "hello"}]}
        reply = httpx.post(f"{srv.base_url}/messages", json=body, timeout=5).json()
        assert reply["content"][0]["text"] == "PRO: hello"
