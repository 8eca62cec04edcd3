"""Coordinator crashes and restarts, gateway loss, clean shutdown — through real processes."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from agent_bus.agents.client.remote import connect
from tests.coordinator.conftest import Stack, start_stack, text
from tests.support import until

pytestmark = pytest.mark.anyio


def user_texts(body: dict[str, Any]) -> list[str]:
    out = []
    for m in body["messages"]:
        content = m.get("content")
        if m["role"] in ("user", "assistant") and content:
            out.append(content if isinstance(content, str) else content[0]["text"])
    return out


async def test_sigkill_mid_run_then_restart_resumes_the_run_and_keeps_history(
        stack: Stack) -> None:
    stack.coordinator("p", name="coord-p", state="p-state")
    try:
        stack.script([text("Noted: banana."), {"reply": {"text": "never sent"}, "delay": 30}])
        async with connect(stack.endpoint, name="test-restart", resume_wait=30) as bus:
            first = await bus.run("p", "remember the word banana", new_session=True)
            assert first.final_text == "Noted: banana."
            run = await bus.prompt("p", "second question", session=first.session)
            await until(lambda: len(stack.srv.requests) == 2, 10, "the second model request")
            stack.procs["coord-p"].signal(signal.SIGKILL)  # mid-run, no chance to clean up
            stack.stop("coord-p")
            # the same name and state: the journaled run resumes and its follower gets the end
            stack.script([text("Resumed: the word is banana.")])
            stack.coordinator("p", name="coord-p", state="p-state")
            with anyio.fail_after(30):
                resumed = await run.result()
        assert resumed.run_id == run.run_id
        assert resumed.final_text == "Resumed: the word is banana."
        assert user_texts(stack.srv.requests[0].body) == [
            "remember the word banana", "Noted: banana.", "second question"]

        stack.script([text("The word was banana.")])
        async with connect(stack.endpoint, name="test-restart-2") as bus:
            state = await bus.state("p")
            assert state.message_count == 4  # the two exchanges
            assert state.session == first.session
            again = await bus.run("p", "what was the word?", session=first.session)
        assert again.final_text == "The word was banana."
        assert user_texts(stack.srv.requests[0].body) == [
            "remember the word banana", "Noted: banana.", "second question",
            "Resumed: the word is banana.", "what was the word?"]
    finally:
        stack.stop("coord-p")


async def test_sigterm_aborts_the_running_run_and_exits_cleanly(stack: Stack) -> None:
    proc = stack.coordinator("p", name="coord-term", state="term-state")
    try:
        stack.script([{"reply": {"text": "too late"}, "delay": 30}])
        async with connect(stack.endpoint, name="test-term") as bus:
            run = await bus.prompt("p", "take your time", new_session=True)
            await until(lambda: len(stack.srv.requests) == 1, 10, "the model request")
            proc.signal(signal.SIGTERM)
            with anyio.fail_after(5):
                result = await run.result()
        assert result.stop_reason == "aborted"
        assert proc.popen.wait(5) == 0
        # the gateway saw the model request cancelled (it closed the HTTP stream)
        assert stack.srv.wait_disconnect(5) is not None
    finally:
        stack.stop("coord-term")


async def test_no_gateway_then_lost_gateway_error_runs_agent_stays_usable(tmp_path: Path) -> None:
    stack = start_stack(tmp_path, gateway=False, worker=False, coordinator=("p",))
    try:
        stack.script([text("hello from the model"), {"reply": {"text": "never"}, "delay": 30}])
        async with connect(stack.endpoint, name="test-nogw") as bus:
            failed = await bus.run("p", "anyone there?")
            assert failed.stop_reason == "error"
            assert failed.error is not None and failed.error.startswith(
                "No LLM gateway is serving `llm` on the hub at")
            state = await bus.state("p")
            assert state.error == failed.error and not state.is_running

            # off the event loop: blocking it would silence our peer past the hub's liveness
            await anyio.to_thread.run_sync(stack.gateway)
            ok = await bus.run("p", "and now?")
            assert (ok.stop_reason, ok.final_text, ok.error) == ("stop", "hello from the model", None)
            assert (await bus.state("p")).error is None

            run = await bus.prompt("p", "slow one")
            await until(lambda: len(stack.srv.requests) == 2, 10, "the slow model request")
            stack.procs["gateway"].signal(signal.SIGKILL)
            with anyio.fail_after(10):
                lost = await run.result()
            assert lost.stop_reason == "error"
            assert lost.error is not None and lost.error.startswith(
                "The LLM gateway was lost while answering the request")
    finally:
        stack.close()
