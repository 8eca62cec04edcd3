"""Hand-made mutation check: does the test suite notice when the core logic is wrong?

Each mutant is one small, plausible bug in the agent loop, the hub's routing or a security check
(who may speak for an agent, which runs replay trusts, what the sandbox refuses). For each, a copy of
the tree gets that one change and the tests that cover the module run against the copy; a mutant
the tests do not fail on "survives", and is printed. Not part of the normal test run (it takes a
few minutes); run it when you change the loop or the routing:

    python tests/mutation/run_mutants.py            # all mutants
    python tests/mutation/run_mutants.py loop       # only those whose name contains "loop"

Exit status: the number of surviving mutants (0 = every mutant was killed).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LOOP_TESTS = ["tests/agents/test_loop.py", "tests/agents/test_agent.py",
              "tests/agents/test_loop_context.py"]
REGISTRY_TESTS = ["tests/bus/test_registry.py"]
EVENT_PATH_TESTS = ("tests/bus/test_replay_limit_and_heartbeat_order.py",)


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]


MUTANTS = [
    Mutant("loop: max_iterations off by one", "agents/loop/run.py",
           "if run.iterations >= run.config.max_iterations:",
           "if run.iterations > run.config.max_iterations:", tuple(LOOP_TESTS)),
    Mutant("loop: steering not polled between turns", "agents/loop/run.py",
           "        pending = await _poll(run.config.get_steering_messages)\n    return None",
           "        pending = []\n    return None", tuple(LOOP_TESTS)),
    Mutant("loop: aborted reply reported as error", "agents/loop/run.py",
           '    if assistant.stop_reason == "aborted":\n        return _End(assistant.text.strip(), "aborted"',
           '    if assistant.stop_reason == "never":\n        return _End(assistant.text.strip(), "aborted"',
           tuple(LOOP_TESTS)),
    Mutant("loop: sequential mode ignored", "agents/loop/run.py",
           '    if run.config.tool_execution == "sequential":\n        return True',
           '    if run.config.tool_execution == "never":\n        return True', tuple(LOOP_TESTS)),
    Mutant("loop: sequential batch goes on after done", "agents/loop/run.py",
           "        if stop or result.done:\n            return  # later calls are not started",
           "        if stop:\n            return  # later calls are not started", tuple(LOOP_TESTS)),
    Mutant("loop: parallel batch ignores a block-and-stop", "agents/loop/run.py",
           "        if stop:\n            batch.denied = True\n            break",
           "        if stop:\n            batch.denied = True", tuple(LOOP_TESTS)),
    Mutant("loop: tool calls do not keep the loop going", "agents/loop/run.py",
           "        has_tool_calls = bool(info.message.tool_calls)",
           "        has_tool_calls = False", tuple(LOOP_TESTS)),
    Mutant("loop: turn counter not advanced", "agents/loop/run.py",
           "    run.turn += 1\n", "    run.turn += 0\n", tuple(LOOP_TESTS)),
    Mutant("loop: max_iterations ends without its summary", "agents/loop/run.py",
           'return _End(f"{MAX_ITERATIONS_PREFIX}{summary}", "max_iterations")',
           'return _End(f"{MAX_ITERATIONS_PREFIX}", "max_iterations")', tuple(LOOP_TESTS)),
    Mutant("loop: no compaction between turns", "agents/loop/run.py",
           "            await _maybe_compact(run)\n", "            pass\n", tuple(LOOP_TESTS)),
    Mutant("agent: one-at-a-time queue drains everything", "agents/loop/agent.py",
           "        return [self._items.popleft()]",
           "        items = list(self._items)\n        self._items.clear()\n        return items",
           tuple(LOOP_TESTS)),
    Mutant("agent: run usage not summed", "agents/loop/agent.py",
           "            self._usage.merge(event.usage)", "            pass", tuple(LOOP_TESTS)),
    Mutant("loop: compaction only past the threshold", "agents/loop/context.py",
           "    return usage.total >= math.floor(context_window * config.threshold)",
           "    return usage.total > math.floor(context_window * config.threshold)", tuple(LOOP_TESTS)),
    Mutant("hub: a reused routing id's key not checked", "bus/hub.py",
           "        if self._user_id == peer.user_id:\n            return False",
           "        if True:\n            return False", ("tests/multihost/test_curve_loopback.py",)),
    Mutant("registry: a full slot still takes requests", "bus/registry.py",
           "            if load >= slot.capacity:\n                continue",
           "            if load > slot.capacity:\n                continue", tuple(REGISTRY_TESTS)),
    Mutant("registry: ties do not rotate", "bus/registry.py",
           "(ratio == best_ratio and slot.last < best.last)",
           "(ratio == best_ratio and slot.last > best.last)", tuple(REGISTRY_TESTS)),
    Mutant("registry: most-loaded instead of least-loaded", "bus/registry.py",
           "            if ratio < best_ratio or", "            if ratio > best_ratio - 2 or",
           tuple(REGISTRY_TESTS)),
    Mutant("registry: a queued cancel is not answered", "bus/registry.py",
           '            self._unqueue(req)\n            self._answer_cancelled(req, "cancelled by the requester while queued")',
           "            self._unqueue(req)", tuple(REGISTRY_TESTS)),
    Mutant("registry: a repeated cancel is not ignored", "bus/registry.py",
           "        if req is None or req.cancelling:", "        if req is None:",
           tuple(REGISTRY_TESTS)),
    Mutant("registry: re-dispatch limit off by one", "bus/registry.py",
           "        if req.lost > self.limits.max_redispatch:",
           "        if req.lost >= self.limits.max_redispatch:", tuple(REGISTRY_TESTS)),
    Mutant("registry: a service's queue never fills", "bus/registry.py",
           "        if service.queued >= lim.queue_limit:", "        if service.queued > lim.queue_limit * 2:",
           tuple(REGISTRY_TESTS)),
    Mutant("registry: a request's `wait` also ends a served one", "bus/registry.py",
           "        if not unserved:\n            if req.deadline != math.inf:",
           "        if False:\n            if req.deadline != math.inf:", tuple(REGISTRY_TESTS)),
    Mutant("replay: a batch cut at the row limit claims the head", "bus/replay_reader.py",
           "        if scanned < limit:", "        if scanned <= limit:", EVENT_PATH_TESTS),
    Mutant("pipeline: a heartbeat overtakes the events it counts", "bus/pipeline.py",
           "        self.flush()\n        self.sub_beat_at = math.inf",
           "        self.sub_beat_at = math.inf", EVENT_PATH_TESTS),
    Mutant("tools: workspace containment by string prefix", "tools/_context.py",
           "    if resolved != root and not resolved.is_relative_to(root):",
           "    if resolved != root and not str(resolved).startswith(str(root)):",
           ("tests/tools/test_confine_sibling.py",)),
    Mutant("replay: a run trusted when any agent's server published it", "agents/replay.py",
           "                       if run.agent not in servers.get(p, ()))",
           "                       if p not in servers)",
           ("tests/security/test_replay_trust.py",)),
    Mutant("hub: the agent-event role check matched by prefix", "bus/hub.py",
           'any(s.startswith(f"agent.{agent}@") for s in served)',
           'any(s.startswith(f"agent.{agent}") for s in served)',
           ("tests/security/test_roles.py",)),
    Mutant("sandbox: only a top-level .git refused", "tools/sandbox.py",
           '    if ".git" in inner.parts:', '    if inner.parts[:1] == (".git",):',
           ("tests/security/test_sandbox_fences.py", "tests/security/test_sandbox.py")),
    Mutant("tool names: any name accepted", "bus/toolnames.py",
           "    if _NAME.match(name):", "    if name:",
           ("tests/coordinator/test_units.py", "tests/coordinator/test_foreign_tools.py")),
]


def _copy_tree(dest: Path) -> None:
    shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "__pycache__", "*.egg-info", "build", ".pytest_cache"))


def _run_tests(tree: Path, tests: tuple[str, ...]) -> bool:
    """True when the tests pass on `tree` (the mutant survived)."""
    existing = [t for t in tests if (tree / t).exists()]
    if not existing:
        return True
    env = {**os.environ, "PYTHONPATH": str(tree), "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                             *existing], cwd=tree, env=env, capture_output=True, text=True,
                            timeout=900)
    return result.returncode == 0


def _uses_the_copy(tree: Path) -> bool:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run([sys.executable, "-c", "import agent_bus; print(agent_bus.__file__)"],
                         cwd=tree, env=env, capture_output=True, text=True, check=True)
    return out.stdout.strip().startswith(str(tree))


def main(selector: str = "") -> int:
    chosen = [m for m in MUTANTS if selector in m.name]
    survivors: list[str] = []
    with tempfile.TemporaryDirectory(prefix="mutants-") as tmp:
        tree = Path(tmp) / "tree"
        _copy_tree(tree)
        if not _uses_the_copy(tree):
            print("the copy's packages do not shadow the installed ones; cannot run", file=sys.stderr)
            return 1
        for tests in sorted({m.tests for m in chosen}):
            if not _run_tests(tree, tests):  # a mutant is only killed if the baseline passes
                print(f"the unmutated tree fails {' '.join(tests)}; fix that first", file=sys.stderr)
                return 1
        for mutant in chosen:
            target = tree / mutant.path
            original = target.read_text()
            if original.count(mutant.old) != 1:
                print(f"SKIP      {mutant.name}: the code it mutates has changed")
                continue
            target.write_text(original.replace(mutant.old, mutant.new))
            started = time.monotonic()
            try:
                survived = _run_tests(tree, mutant.tests)
            finally:
                target.write_text(original)
            verdict = "SURVIVED" if survived else "killed"
            print(f"{verdict:<9} {mutant.name}  ({time.monotonic() - started:.0f}s)", flush=True)
            if survived:
                survivors.append(mutant.name)
    print(f"{len(chosen) - len(survivors)} killed, {len(survivors)} survived")
    return len(survivors)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
