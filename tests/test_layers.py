"""The layers of docs/architecture.md ("The tree is the map", "Layers"), enforced: each rule names
the modules it governs and what they may not import, so a change that reaches across a layer
fails here with the import named, not in a review. The walker is tests/test_import_graph.py's."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.test_import_graph import imported_names, product_modules, project_imports

BUS, AGENTS, TOOLS = "agent_bus.bus", "agent_bus.agents", "agent_bus.tools"
EDGE = ("agent_bus.cli", "agent_bus.commands")
WIRE = (f"{BUS}.protocol", f"{BUS}.messages", f"{BUS}.events")  # the wire vocabulary
#: what a process's part may take of the gateway: the `llm` reply types, without httpx
GATEWAY_WIRE = ("agent_bus.agents.gateway.wire",)
REPLAY_WIRE = ("agent_bus.agents.replay_wire",)


@dataclass(frozen=True)
class Rule:
    why: str
    governs: tuple[str, ...]            # module names, each with its submodules
    forbidden: tuple[str, ...] = ()     # project modules (with submodules) it may not import
    allowed: tuple[str, ...] | None = None  # when set: the only project modules it may import
    foreign: tuple[str, ...] = ()       # third-party or standard modules it may not import


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


RULES = [
    Rule("bus/ is the bus itself: it knows nothing of agents or tools",
         (BUS,), forbidden=(AGENTS, TOOLS, *EDGE)),
    Rule("tools/ serves tools on the bus; agents use tools, not the reverse",
         (TOOLS,), forbidden=(AGENTS, *EDGE)),
    Rule("the wire vocabulary is the bottom: frames, messages, events, nothing else",
         WIRE, allowed=WIRE, foreign=("zmq", "httpx", "anyio")),
    Rule("the loop is pure: no sockets, no HTTP, no process around it",
         (f"{AGENTS}.loop",), allowed=(f"{AGENTS}.loop", *WIRE, f"{BUS}.errors"),
         foreign=("zmq", "httpx", "socket")),
    Rule("the clients' wire modules load no HTTP stack and no process",
         GATEWAY_WIRE + REPLAY_WIRE, allowed=(*WIRE, *GATEWAY_WIRE), foreign=("httpx", "zmq")),
    Rule("the gateway process takes nothing of the other processes, the replay client or the edge",
         (f"{AGENTS}.gateway",),
         forbidden=(f"{AGENTS}.coordinator", f"{AGENTS}.launch", f"{AGENTS}.client",
                    f"{AGENTS}.experiment", f"{AGENTS}.replay", TOOLS, *EDGE)),
    Rule("the coordinator takes of the gateway only its clients' types and MessageBuilder",
         (f"{AGENTS}.coordinator",),
         forbidden=(f"{AGENTS}.gateway.engine", f"{AGENTS}.gateway.process",
                    f"{AGENTS}.gateway.http1", f"{AGENTS}.gateway.fakellm",
                    f"{AGENTS}.gateway.providers.openai", f"{AGENTS}.gateway.providers.anthropic",
                    f"{AGENTS}.client", f"{AGENTS}.experiment", f"{AGENTS}.replay",
                    f"{AGENTS}.launch.up", f"{AGENTS}.launch.supervisor", *EDGE)),
    Rule("bringing a topology up knows no process's insides, the clients or experiments",
         (f"{AGENTS}.launch",),
         forbidden=(f"{AGENTS}.coordinator", f"{AGENTS}.gateway.engine",
                    f"{AGENTS}.gateway.process", f"{AGENTS}.client", f"{AGENTS}.experiment",
                    f"{AGENTS}.replay", *EDGE)),
    Rule("only busctl's entry and its commands import busctl's commands",
         (BUS, TOOLS, AGENTS), forbidden=EDGE),
]


def _violations(rule: Rule, modules: dict[str, Path]) -> list[str]:
    known = set(modules)
    found = []
    for name, path in sorted(modules.items()):
        if not _under(name, rule.governs):
            continue
        for target in sorted(project_imports(name, path, known)):
            barred = _under(target, rule.forbidden) or (
                rule.allowed is not None and not _under(target, rule.allowed))
            if barred:
                found.append(f"{name} imports {target}")
        for module, _ in imported_names(name, path):
            if _under(module, rule.foreign):
                found.append(f"{name} imports {module}")
    return found


@pytest.mark.parametrize("rule", RULES, ids=[r.why for r in RULES])
def test_the_layers_hold(rule: Rule) -> None:
    found = _violations(rule, product_modules())
    assert not found, f"{rule.why}:\n  " + "\n  ".join(found)


def test_each_rule_governs_modules_that_exist() -> None:
    """A rule over a renamed folder would pass for nothing."""
    modules = product_modules()
    for rule in RULES:
        assert all(any(_under(m, (g,)) for m in modules) for g in rule.governs), rule.why


def test_a_rule_catches_what_it_names(tmp_path: Path) -> None:
    """The checker itself: the bus importing agents, and the loop importing zmq, are caught."""
    bus_module, loop_module = tmp_path / "hub.py", tmp_path / "run.py"
    bus_module.write_text("def f():\n    from agent_bus.agents.client import remote\n")
    loop_module.write_text("import zmq\nfrom agent_bus.agents.client.remote import connect\n")
    modules = {f"{BUS}.hub": bus_module, f"{AGENTS}.loop.run": loop_module,
               f"{AGENTS}.client": tmp_path / "__init__.py",
               f"{AGENTS}.client.remote": Path(__file__)}
    assert _violations(RULES[0], modules) == [f"{BUS}.hub imports {AGENTS}.client.remote"]
    assert _violations(RULES[3], modules) == [f"{AGENTS}.loop.run imports {AGENTS}.client.remote",
                                              f"{AGENTS}.loop.run imports zmq"]
