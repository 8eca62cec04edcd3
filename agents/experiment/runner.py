"""Run an experiment's missing cells on the running topology, journaling each finished one.

Each sample × variant × repeat (a cell) is one fresh session of the variant's agent, prompted
through `agents.client.remote.AgentBus` (as `run_many` does) with the experiment tag
`E.<variant>.r<repeat>`; the hub routes each prompt to a coordinator serving the agent, by
capacity. At most `run.concurrency` cells run at once, and at most `run.per_model[alias]` of
the variants on that model (a cell waits for its model's slot first, then for one of the total,
so cells waiting for a busy model hold none of the total).

The journal is the event log: the runner publishes (with `confirm`: logged before it goes on)
one `experiment_plan` event when an experiment starts and one `experiment_sample` event per
finished cell, carrying its result and scores (both `ext` events of experiment `E`, agent and
run empty, so no agent's lifecycle is spoken for). Only the runner writes the journal: the hub
takes these events only from an identity with full rights or a role matching `experiment.E`,
and stamps the right it checked in the header (`granted`); every reader (`--resume`, `report`,
the web view: `Journal.add_logged`) ignores and counts an entry without it (a forger's on a hub before
that check). `--resume E` reads them back and runs only the
cells with no `ok` result: a cell is never journaled twice as done, and one the runner did not
journal (it was killed, Ctrl-C) runs again. Errors (a run that ended `error`/`aborted`, a bus
error) are retried `run.retries` times; the last one is journaled with status `error`, and a
resume runs that cell again (the latest entry of a cell wins).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Iterable, Sequence
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any, TextIO
from uuid import uuid4

import anyio
import msgspec

from agent_bus.agents import commands as cmd
from agent_bus.agents.client.remote import AgentBus, Run
from agent_bus.agents.commands import RunResult
from agent_bus.agents.coordinator.bus_adapters import BusLlmClient
from agent_bus.agents.experiment.scoring import grade, score_all
from agent_bus.agents.experiment.spec import (
    DEFAULT_MODEL_KEY,
    Loaded,
    Sample,
    ScorerError,
    SpecError,
    Variant,
    cell_folder,
    experiment_tag,
    load_spec,
    spec_digest,
    variant_model,
)
from agent_bus.agents.replay_wire import REPLAY_SERVICE, ReplayLoad
from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.client import Peer, Subscription
from agent_bus.bus.errors import BusError, HubLost, NoService, RemoteError
from agent_bus.bus.logfile import open_log, rows
from agent_bus.bus.messages import AssistantMessage, RunWorkspace, Usage
from agent_bus.bus.watch import replay_batch
from agent_bus.tools.workspaces import WORKSPACES_META

PLAN_TYPE = "experiment_plan"  # the tags of ev.ExperimentPlan / ev.ExperimentSample
SAMPLE_TYPE = "experiment_sample"
JOURNAL_TOPIC = "ext///experiment_"  # both types, published with no agent and no run
END_WAIT = 5.0  # seconds to wait for a run's agent_end (its turns) after its result
# Seconds a journal entry may take across a hub takeover (a pair of hubs: issue 52): the
# standby leads within its lease TTL + a quarter (5 s by default), then the log is checked.
JOURNAL_FAILOVER_WAIT = 60.0
log = logging.getLogger("agents.experiment.runner")

FAILED = frozenset({"error", "aborted"})  # stop reasons that are errors, not answers
#: The one failure rule the report, its --json, the web page and the results file follow.
FAILURE_RULE = ("a cell that timed out (run.timeout), passed its run.token_limit / cost_limit, or "
                "ended in an error once its retries were spent is scored 0 on every scorer and "
                "counted; the report shows how many of each beside the score")
LIMIT_REASON = "the experiment's run.token_limit / run.cost_limit for a sample was passed"


# The journal's entries are bus events (bus/events.py), so every reader of the log knows them
# (`busctl watch --type experiment_sample`, `busctl export`); their names here are the runner's.
Plan = ev.ExperimentPlan
SampleResult = ev.ExperimentSample


class Journal(msgspec.Struct):
    plan: Plan | None
    results: dict[tuple[str, str, int], SampleResult]  # the latest entry of each cell
    bad: int = 0  # journal events that did not decode (skipped)
    ok_entries: int = 0  # `ok` entries read: more than len(ok results) = a cell done twice
    # entries the hub did not stamp as from an identity that may write the journal (`granted`):
    # a forger's, logged by a hub that predates the check; ignored
    ignored: int = 0

    def add_logged(self, experiment: str, header_bytes: bytes, body: bytes) -> None:
        """Take one logged journal event of `experiment` in (read_journal and the web view
        read the journal this one way); a broken or unstamped entry is counted, never fatal."""
        try:
            header = p.decode_header(header_bytes)
            if header.experiment != experiment:
                return
            if header.type in (PLAN_TYPE, SAMPLE_TYPE) and not header.granted:
                self.ignored += 1  # only the runner writes the journal (see the module's text)
                return
            if header.type == PLAN_TYPE:
                self.plan = self.plan or msgspec.msgpack.decode(body, type=Plan)
            elif header.type == SAMPLE_TYPE:
                entry = msgspec.msgpack.decode(body, type=SampleResult)
                self.results[entry.key] = entry
                self.ok_entries += entry.status == "ok"
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.bad += 1  # another version's or a broken entry: counted, never fatal


IGNORED_WHY = ("not stamped by the hub as written by an identity that may write the journal "
               "(full rights, or a role matching `experiment.<E>`): a forger's, logged by a hub "
               "that did not check")


async def read_journal(peer: Peer, experiment: str) -> Journal:
    """The experiment's plan and latest result per cell, from the hub's log."""
    journal = Journal(None, {})
    cursor, end = 0, None
    while end is None or cursor < end:
        batch = await replay_batch(peer, p.ReplayRequest(since=cursor, topics=[JOURNAL_TOPIC]))
        end = batch.head if end is None else end
        for header_bytes, body in batch.events:
            journal.add_logged(experiment, header_bytes, body)
        if batch.upto >= batch.head or batch.upto <= cursor:
            break
        cursor = batch.upto
    return journal


def journal_from_log(path: Path, experiment: str) -> Journal:
    """The same, read from the log file with no hub (bus.logfile, as `busctl export` reads it):
    only the experiment's journal rows, through the log's experiment index."""
    journal = Journal(None, {})
    with open_log(path) as db:
        for _, _, header_bytes, body in rows(db, [experiment], (PLAN_TYPE, SAMPLE_TYPE)):
            journal.add_logged(experiment, header_bytes, body)
    return journal


class Progress:
    """Counts for the progress line: done / running / failed, ETA, tokens, cost."""

    def __init__(self, planned: int, already: int, out: TextIO | None) -> None:
        self.planned, self.done, self.running, self.failed = planned, already, 0, 0
        self.already = already
        self.tokens, self.cost = 0, 0.0
        self.started = time.monotonic()
        self.out = out
        self._shown = 0.0

    def line(self) -> str:
        ran = self.done - self.already
        elapsed = time.monotonic() - self.started
        left = self.planned - self.done
        eta = f"{elapsed / ran * left:.0f}s" if ran else "?"
        return (f"{self.done}/{self.planned} done, {self.running} running, {self.failed} failed,"
                f" ETA {eta}, {self.tokens} tokens, {money(self.cost)}")

    def show(self, force: bool = False) -> None:
        now = time.monotonic()
        if self.out is None or (not force and now - self._shown < 0.2):
            return
        self._shown = now
        self.out.write("\r\x1b[K" + self.line())
        self.out.flush()

    def finish(self) -> None:
        if self.out is not None:
            self.show(force=True)
            self.out.write("\n")


class RunTally:
    """What a cell's result does not say, read from one subscription to every live agent's
    events (not one per run: 50 runs reading their own would each get all 50 runs' events):
    the turns of each run, and the usage of the runs it asked for (`ask_<agent>`, and theirs
    in turn), so a team's tokens and cost are its whole tree's."""

    def __init__(self) -> None:
        self.turns: dict[str, int] = {}
        self.children: dict[str, list[str]] = {}
        self.usage: dict[str, list[Usage]] = {}
        self.ended: dict[str, anyio.Event] = {}
        # per-sample limits on tokens and cost: usage so far of each tree (by its top run),
        # and the trees watched: top run -> (token limit, cost limit, set when passed)
        self.top: dict[str, str] = {}
        self.used: dict[str, Usage] = {}
        self.limits: dict[str, tuple[int, float, anyio.Event]] = {}

    async def follow(self, events: Subscription) -> None:
        async for envelope in events:
            header, event = envelope.header, envelope.event
            if isinstance(event, ev.TurnStart):
                self.turns[header.run] = self.turns.get(header.run, 0) + 1
            elif isinstance(event, ev.AgentStart) and header.parent:
                self.top[header.run] = self.top.get(header.parent, header.parent)
            elif isinstance(event, ev.MessageEnd) and isinstance(event.message,
                                                                 AssistantMessage):
                top = self.top.get(header.run, header.run)
                self.used[top] = self.used.get(top, Usage()) + event.message.usage
                self._check(top)
            elif isinstance(event, ev.AgentEnd):
                if header.parent:
                    self.children.setdefault(header.parent, []).append(header.run)
                    self.usage[header.run] = list(event.usage.values())
                self._ended(header.run).set()

    def limit(self, run: str, tokens: int, cost: float) -> anyio.Event:
        """An event set once `run`'s tree has used more than `tokens` / `cost` (0: no limit)."""
        passed = anyio.Event()
        if tokens or cost:
            self.limits[run] = (tokens, cost, passed)
            self._check(run)
        return passed

    def _check(self, top: str) -> None:
        watched, used = self.limits.get(top), self.used.get(top)
        if watched is None or used is None:
            return
        tokens, cost, passed = watched
        if (tokens and tokens_of([used]) > tokens) or (cost and used.cost > cost):
            passed.set()

    def _ended(self, run: str) -> anyio.Event:
        return self.ended.setdefault(run, anyio.Event())

    async def finished(self, run: str, timeout: float) -> tuple[int, list[Usage]]:
        """`run`'s turns and its helpers' usage, once its agent_end was seen (at most `timeout`
        seconds after its result: it is published just before); forgotten once read."""
        with anyio.move_on_after(timeout):
            await self._ended(run).wait()
        self.ended.pop(run, None)
        self.used.pop(run, None)
        self.limits.pop(run, None)
        found: list[Usage] = []
        stack = self.children.pop(run, [])
        while stack:
            child = stack.pop()
            found += self.usage.pop(child, [])
            self.turns.pop(child, None)
            self.ended.pop(child, None)
            self.top.pop(child, None)
            stack += self.children.pop(child, [])
        return self.turns.pop(run, 0), found


def cell_workspaces(journal: Journal, tag: str, target: str,
                    spec: str = "") -> dict[str, RunWorkspace]:
    """For a replay with live tools of the cells whose sessions carry experiment id `tag`:
    the workspace each cell's run (by run id) is prompted with. A fresh folder,
    `<target>/<variant>.r<repeat>/<sample>`, with the sample's files as the cell started with
    them (not the cell's own folder: it holds what the cell's tools wrote since, and is a
    result). The log has only the folder's id, so the files are read again from the dataset of
    the spec the experiment ran (`spec`, else the path its plan names), which must be the one it
    ran: same digest. A SpecError naming what to give otherwise."""
    cells = [c for c in journal.results.values() if c.tag == tag and c.workspace and c.run_id]
    if not cells or journal.plan is None:
        return {}
    plan = journal.plan
    path = spec or plan.spec
    try:
        loaded = load_spec(path, limit=plan.samples)
    except SpecError as exc:
        raise SpecError(f"--spec: the sample files of experiment `{plan.experiment}` are read "
                        f"again from its spec's dataset for live tools: {exc}") from None
    if spec_digest(loaded) != plan.digest:
        raise SpecError(f"--spec: {path} (or its dataset) is not what experiment "
                        f"`{plan.experiment}` ran; give the spec it ran with (its sample files "
                        f"are read again from its dataset for live tools)")
    samples = {s.key: s for s in loaded.samples}
    variants = {v.name: v for v in loaded.spec.variants}
    found: dict[str, RunWorkspace] = {}
    for cell in cells:
        recorded = loaded.workspace(plan.experiment, variants[cell.variant],
                                    samples[cell.sample], cell.repeat)
        if recorded is not None:
            folder = cell_folder(target, cell.variant, cell.repeat, cell.sample)
            found[cell.run_id] = RunWorkspace(id=folder, files=recorded.files)
    return found


async def old_tool_workers(peer: Peer) -> list[str]:
    """The live peers serving a `tool.*` service that predate run workspaces (no `workspaces`
    in their services' meta): they would run a call with a workspace in their own."""
    return old_workers(await peer.status())


def old_workers(status: p.Status) -> list[str]:
    return sorted(live.name for live in status.peers
                  if any(s.name.startswith("tool.") for s in live.services)
                  and not any(s.meta.get(WORKSPACES_META) for s in live.services))


def unconfined_tools(status: p.Status) -> dict[str, list[str]]:
    """Each live tool some peer serves without `workspaces` in that service's meta (it would
    run a call with a workspace in its own folder), with those peers' names."""
    out: dict[str, list[str]] = {}
    for live in status.peers:
        for service in live.services:
            if service.name.startswith("tool.") and not service.meta.get(WORKSPACES_META):
                out.setdefault(service.name.removeprefix("tool."), []).append(live.name)
    return {tool: sorted(names) for tool, names in sorted(out.items())}


def reachable(status: p.Status, agent: str, tools: dict[str, list[str]]) -> list[tuple[str, str]]:
    """(agent, tool) for each of `tools` that `agent`, or an agent it asks (`agents`, again and
    again), may call, by the `tools` and `agents` of each agent's service meta. An agent whose
    coordinator names neither (an older one) counts as `tools = ["*"]`."""
    metas = {s.name.removeprefix("agent."): s.meta for s in status.services
             if s.name.startswith("agent.") and "@" not in s.name}
    found, seen, todo = [], set(), [agent]
    while todo:
        name = todo.pop(0)
        if name in seen:
            continue
        seen.add(name)
        meta = metas.get(name, {})
        allowed = meta.get("tools", ["*"])
        found += [(name, tool) for tool in tools if "*" in allowed or tool in allowed]
        todo += [a for a in meta.get("agents", []) if isinstance(a, str)]
    return found


def split_tools(status: p.Status) -> dict[str, list[str]]:
    """The tools served by workers whose `.runs` differ (their `workspaces` meta, see
    tools.workspaces.workspace_key), each with those workers (`name on host`). A run's calls
    prefer the worker that served its first one, but go to another when that one is full or
    gone, splitting its folder (docs/protocol.md, "Run workspaces")."""
    by_tool: dict[str, dict[Any, list[str]]] = {}
    for live in status.peers:
        for service in live.services:
            key = service.meta.get(WORKSPACES_META)
            if service.name.startswith("tool.") and key and not isinstance(key, (dict, list)):
                by_tool.setdefault(service.name.removeprefix("tool."), {}).setdefault(
                    key, []).append(f"{live.name} on {live.host or '?'}")
    return {tool: sorted(w for workers in keys.values() for w in workers)
            for tool, keys in sorted(by_tool.items()) if len(keys) > 1}


class Runner:
    def __init__(self, bus: AgentBus, loaded: Loaded, experiment: str,
                 progress: Progress | None = None) -> None:
        self.bus = bus
        self.loaded = loaded
        self.experiment = experiment
        self.progress = progress
        self.tally = RunTally()
        # `model` scorers' calls: tagged with the experiment, under an agent name of their own
        self.grader = BusLlmClient(bus.peer, agent="experiment-grader", experiment=experiment)
        self.models: dict[str, str] = {}  # variant -> its model alias (with run.per_model)
        self._confirmed_head = 0  # the log's head at the last confirmed journal entry

    async def start(self, resume: bool, fresh: bool = False) -> Journal:
        """Check the journal against `resume` and publish the plan of a new experiment.
        `fresh`: the id was just made up (random): it has no journal, and reading the log to
        make sure (a scan of the whole log: `hub.replay` filters by topic, not experiment)
        is skipped."""
        journal = Journal(None, {}) if fresh and not resume else \
            await read_journal(self.bus.peer, self.experiment)
        if journal.ignored:
            log.warning("experiment %s: %d journal entries ignored, %s", self.experiment,
                        journal.ignored, IGNORED_WHY)
        digest = spec_digest(self.loaded)
        spec = self.loaded.spec
        if journal.plan is None and resume:
            raise SpecError(f"--resume {self.experiment}: no experiment `{self.experiment}` in "
                            f"the hub's log; start it with --name {self.experiment}")
        if journal.plan is not None and not resume:
            raise SpecError(f"--name {self.experiment}: experiment `{self.experiment}` is "
                            f"already in the hub's log; finish it with --resume "
                            f"{self.experiment}, or name a new one")
        if journal.plan is not None and journal.plan.digest != digest:
            raise SpecError(f"--resume {self.experiment}: the spec or dataset (or --limit) "
                            f"differs from the one the experiment started with "
                            f"({journal.plan.spec}); resume with the same")
        await self._check_topology()
        if journal.plan is None:
            journal.plan = Plan(self.experiment, digest, self.loaded.source,
                                len(self.loaded.samples), [v.name for v in spec.variants],
                                spec.run.repeats, self.loaded.planned,
                                [s.label for s in spec.scorers])
            await self._publish(PLAN_TYPE, journal.plan)
        return journal

    async def _check_topology(self) -> None:
        """Before anything is journaled: every variant's agent is served, and the gateway
        takes every variant's model settings (an unknown alias is refused, code `invalid`)."""
        live = await self.bus.agents()
        for i, variant in enumerate(self.loaded.spec.variants):
            if variant.agent not in live:
                raise SpecError(f"{self.loaded.source}: variants[{i}].agent: no live "
                                f"coordinator serves agent `{variant.agent}` (live agents: "
                                f"{', '.join(live) or 'none'})")
        if self.loaded.spec.run.per_model:
            await self._models()
        if self.loaded.spec.run.workspace == "sample":
            await self._check_workers()
        try:
            await self._overlays()
        except RemoteError as exc:
            if exc.code != "invalid":
                raise
            raise SpecError(f"{self.loaded.source}: variants (model / set.model): "
                            f"{exc.message}") from None

    async def _check_workers(self) -> None:
        """Every tool a variant's agents can call runs a call with a workspace in it: one served
        by a worker without `workspaces` in that service's meta (older, or a foreign tool that
        does not confine calls) would run it in its own folder. Tools no variant reaches (a
        stateless foreign tool offered to other agents) do not matter."""
        status = await self.bus.peer.status()
        for tool, workers in split_tools(status).items():
            log.warning("note: tool `%s` is served by workers whose run folders differ "
                        "(%s): each cell's calls stay on the worker of its first call unless "
                        "that worker is full or gone (then a file one call wrote is not seen "
                        "by the next; docs/protocol.md, \"Run workspaces\"): give them "
                        "`--concurrency` for the cells at once, or one workspace on one host",
                        tool, ", ".join(workers))
        unconfined = unconfined_tools(status)
        for i, variant in enumerate(self.loaded.spec.variants):
            for agent, tool in reachable(status, variant.agent, unconfined):
                via = "" if agent == variant.agent else f" (asked by `{variant.agent}`)"
                raise SpecError(
                    f"{self.loaded.source}: variants[{i}] (`{variant.name}`): agent `{agent}`"
                    f"{via} can call tool `{tool}`, which cannot honour a run workspace: its "
                    f"worker(s) {', '.join(unconfined[tool])} name no `workspaces` in its meta "
                    f"(older workers, or a tool that does not run calls in `.runs/<id>/`), so "
                    f"a sample's calls would run in their own folder; upgrade them, leave "
                    f"`{tool}` out of the agent's `tools`, or set run.workspace = \"shared\"")

    async def _models(self) -> None:
        """Each variant's model alias, for run.per_model: the one it pins, else its agent's
        (asked of a coordinator serving it); every per_model key must be one of them."""
        for variant in self.loaded.spec.variants:
            alias = variant_model(variant)
            if not alias:
                body = await self.bus.peer.request(cmd.agent_service(variant.agent),
                                                   cmd.encode(cmd.GetState()), timeout=10)
                alias = msgspec.msgpack.decode(body, type=cmd.AgentState).model
            self.models[variant.name] = alias or DEFAULT_MODEL_KEY
        used = sorted(set(self.models.values()))
        for alias in self.loaded.spec.run.per_model:
            if alias not in used:
                raise SpecError(f"{self.loaded.source}: run.per_model.{alias}: no variant runs on "
                                f"model `{alias}` (the variants' models here: "
                                f"{', '.join(used)}; a variant's model is its `model` or "
                                f"`set.model`, else its agent's, `{DEFAULT_MODEL_KEY}` when its "
                                f"agent names none)")

    async def _overlays(self) -> None:
        """Load each cell's model settings into the gateway (see agents.experiment.spec)."""
        for variant in self.loaded.spec.variants:
            for repeat in range(1, self.loaded.spec.run.repeats + 1):
                overrides = self.loaded.overrides(variant, repeat)
                if not overrides:
                    continue
                load = ReplayLoad(experiment=experiment_tag(self.experiment, variant.name,
                                                            repeat),
                                  source=self.experiment, entries=[], overrides=overrides,
                                  fork=True)
                await self.bus.peer.request(REPLAY_SERVICE, msgspec.msgpack.encode(load),
                                            timeout=10)

    def missing(self, journal: Journal) -> list[tuple[Variant, Sample, int]]:
        """The cells with no `ok` result, repeat by repeat, sample by sample, variant by variant
        (so a partial run has every variant about as far along)."""
        spec = self.loaded.spec
        return [(variant, sample, repeat)
                for repeat in range(1, spec.run.repeats + 1)
                for sample in self.loaded.samples
                for variant in spec.variants
                if (old := journal.results.get((variant.name, sample.key, repeat))) is None
                or old.status != "ok"]

    async def run(self, resume: bool = False, fresh: bool = False) -> Journal:
        journal = await self.start(resume, fresh)
        cells = self.missing(journal)
        if self.progress is not None:
            self._count_kept(journal, cells)
        limiter = anyio.CapacityLimiter(self.loaded.spec.run.concurrency)
        per_model = {alias: anyio.CapacityLimiter(n)
                     for alias, n in self.loaded.spec.run.per_model.items()}

        async def one(variant: Variant, sample: Sample, repeat: int) -> None:
            # its model's slot first: a cell waiting for a busy model holds none of the total
            async with _held(per_model.get(self.models.get(variant.name, ""))), limiter:
                result = await self.cell(variant, sample, repeat)
            # its slot is free for the next cell: the rest only waits
            result = await self._completed(result)
            await self._publish(SAMPLE_TYPE, result)
            journal.results[result.key] = result
            self._count(result)

        topics = [f"agent/{a}/" for a in await self.bus.agents()]
        # entered (in place) before the first prompt: no run's events are missed
        async with self.bus.peer.subscribe(topics) as events, \
                anyio.create_task_group() as tg:
            tg.start_soon(self.tally.follow, events)
            async with anyio.create_task_group() as cells_tg:
                for variant, sample, repeat in cells:
                    cells_tg.start_soon(one, variant, sample, repeat)
            tg.cancel_scope.cancel()
        if self.progress is not None:
            self.progress.finish()
        return journal

    def _count_kept(self, journal: Journal, cells: list[tuple[Variant, Sample, int]]) -> None:
        """A resume's progress line starts from the experiment's cells kept (not run again):
        its done, failed, tokens and cost are the whole experiment's, as the report's are."""
        assert self.progress is not None
        again = {(v.name, s.key, r) for v, s, r in cells}
        kept = [c for key, c in journal.results.items() if key not in again]
        self.progress.done = self.progress.already = self.loaded.planned - len(cells)
        self.progress.failed = sum(c.outcome != "ok" for c in kept)
        self.progress.tokens = sum(c.tokens for c in kept)
        self.progress.cost = sum(c.cost for c in kept)

    def _count(self, result: SampleResult) -> None:
        if self.progress is None:
            return
        self.progress.done += 1
        self.progress.failed += result.outcome != "ok"
        self.progress.tokens += result.tokens
        self.progress.cost += result.cost
        self.progress.show()

    async def cell(self, variant: Variant, sample: Sample, repeat: int) -> SampleResult:
        """Run one cell, retrying errors; its result (status `error` once retries are spent)."""
        tag = experiment_tag(self.experiment, variant.name, repeat)
        workspace = self.loaded.workspace(self.experiment, variant, sample, repeat)
        base = SampleResult(self.experiment, variant.name, sample.key, repeat, "error", tag=tag,
                            workspace=workspace.id if workspace is not None else "")
        result = base
        for attempt in range(1, self.loaded.spec.run.retries + 2):
            if self.progress is not None:
                self.progress.running += 1
            lost = False
            try:
                result = await self._attempt(base, variant, sample, tag, workspace)
            except BusError as exc:
                result = msgspec.structs.replace(base, error=f"{type(exc).__name__}: {exc}")
                lost = isinstance(exc, NoService)
            finally:
                if self.progress is not None:
                    self.progress.running -= 1
            result.attempts = attempt
            if result.status == "ok":
                break
            if lost:  # its only coordinator is gone for now (restarted, its node lost): wait
                await self._served(variant.agent)
        return result

    async def _served(self, agent: str) -> None:
        """Until a coordinator serves `agent` again, at most `resume_wait` seconds: a retry at
        once would fail the same way while the supervisor (or Ray, on another node) brings it
        back, and spend the cell's retries in a moment."""
        with anyio.move_on_after(self.bus.resume_wait):
            while agent not in await self.bus.agents():
                await anyio.sleep(0.25)

    async def _attempt(self, base: SampleResult, variant: Variant, sample: Sample,
                       tag: str, workspace: RunWorkspace | None) -> SampleResult:
        started = time.monotonic()
        timeout = self.loaded.spec.run.timeout
        run: Run | None = None
        outcome: RunResult | None = None
        limited = False
        with anyio.move_on_after(timeout if timeout else float("inf")):
            # the cell's key (one per attempt: a retry is a new run on purpose): a prompt
            # re-sent on the next hub attaches to the run the coordinator already has
            run = await self.bus.prompt(variant.agent, sample.input, experiment=tag,
                                        max_turns=self.loaded.max_turns(variant),
                                        workspace=workspace,
                                        key=f"cell:{tag}:{uuid4().hex}")
            try:
                outcome, limited = await self._result(run)
            finally:  # an error or the limit: its subscription and stream go too
                with anyio.CancelScope(shield=True):
                    await run.close()
        wall = time.monotonic() - started
        if outcome is None:  # the wall-time limit: cancelling the prompt aborts the run
            run_id = run.run_id if run is not None else ""
            return msgspec.structs.replace(base, status="ok", stop_reason="timeout", wall=wall,
                                           scores=self._scores("", sample), run_id=run_id)
        usage = list(outcome.usage.values())
        done = msgspec.structs.replace(
            base, answer=outcome.final_text, stop_reason=outcome.stop_reason,
            tokens=tokens_of(usage), cost=sum(u.cost for u in usage), wall=wall,
            run_id=outcome.run_id, session=outcome.session, error=outcome.error or "")
        if limited and outcome.stop_reason == "aborted":  # our abort at its limit: `limited`, not an error
            done = msgspec.structs.replace(done, stop_reason="limit", error="")
        elif outcome.stop_reason in FAILED:
            return done
        scores = self._scores(outcome.final_text, sample)
        for scorer in self.loaded.spec.scorers:
            if scorer.kind == "model":
                scores[scorer.label] = await grade(self.grader, scorer, outcome.final_text,
                                                   sample)
        first = scores.get(self.loaded.spec.scorers[0].label) if self.loaded.spec.scorers \
            else None
        return msgspec.structs.replace(done, status="ok", scores=scores, score=first)

    async def _result(self, run: Run) -> tuple[RunResult, bool]:
        """The run's result; with run.token_limit / cost_limit, the run is aborted once its
        tree passes one (then true)."""
        limits = self.loaded.spec.run
        if not (limits.token_limit or limits.cost_limit):
            return await run.result(), False
        passed = self.tally.limit(run.run_id, limits.token_limit, limits.cost_limit)

        async def enforce() -> None:
            await passed.wait()
            try:
                await run.abort(LIMIT_REASON)
            except RemoteError as exc:  # it ended by itself meanwhile: its result tells
                log.debug("abort of %s at its limit: %s", run.run_id, exc)

        async with anyio.create_task_group() as tg:
            tg.start_soon(enforce)
            outcome = await run.result()
            tg.cancel_scope.cancel()
        return outcome, passed.is_set()

    async def _completed(self, result: SampleResult) -> SampleResult:
        """`result` with its run's turns and its helpers' usage, once its agent_end is seen."""
        if not result.run_id:
            return result
        turns, helpers = await self.tally.finished(result.run_id, END_WAIT)
        return msgspec.structs.replace(result, turns=turns,
                                       tokens=result.tokens + tokens_of(helpers),
                                       cost=result.cost + sum(u.cost for u in helpers))

    def _scores(self, answer: str, sample: Sample) -> dict[str, float | None]:
        try:
            return score_all(self.loaded.spec.scorers, answer, sample)
        except ScorerError:
            raise
        except Exception as exc:  # noqa: BLE001 - a user's python scorer: its failure is data
            raise ScorerError(f"scoring sample {sample.key!r}: {type(exc).__name__}: "
                              f"{exc}") from exc

    async def _publish(self, type_: str, entry: Plan | SampleResult) -> None:
        """Journal `entry` exactly once: published, then confirmed logged. When the hub is lost
        before it confirms and the peer follows a pair of hubs (issue 52), the entry may or may
        not be in the log: the log on the next hub is read from where the last confirmation
        left it, and the entry sent again only if it is not there."""
        peer = self.bus.peer
        body = msgspec.msgpack.encode(entry)
        deadline = time.monotonic() + JOURNAL_FAILOVER_WAIT
        while True:
            refused = peer.counters.get("events_refused", 0)
            try:
                await peer.publish_raw(type_, body, experiment=self.experiment)
                self._confirmed_head = await peer.confirm()
                return
            except HubLost:
                if peer.counters.get("events_refused", 0) != refused:
                    raise self._refused(type_) from None
                if len(peer.hubs) < 2 or time.monotonic() > deadline:
                    raise
            try:
                await peer.wait_connection(deadline)
                found = await self._journaled(type_, body)
                log.warning("experiment %s: a journal entry (`%s`) was not confirmed before "
                            "the hub was lost: %s", self.experiment, type_,
                            "the log on the next hub has it" if found else "sending it again")
                if found:
                    return
            except HubLost:  # moved again: the loop looks once more, within the deadline
                if time.monotonic() > deadline:
                    raise

    async def _journaled(self, type_: str, body: bytes) -> bool:
        """Whether the log holds this journal entry (its exact body) past the last confirmed
        head: what a hub lost mid-publish may or may not have logged."""
        peer = self.bus.peer
        cursor = self._confirmed_head
        while True:
            batch = await replay_batch(peer, p.ReplayRequest(
                since=cursor, topics=[JOURNAL_TOPIC], experiment=self.experiment))
            for header_bytes, logged in batch.events:
                if bytes(logged) == body and p.decode_header(header_bytes).type == type_:
                    return True
            if batch.upto >= batch.head or batch.upto <= cursor:
                return False
            cursor = batch.upto

    def _refused(self, type_: str) -> JournalRefused:
        return JournalRefused(
            f"the hub refused experiment `{self.experiment}`'s journal (`{type_}`): this "
            f"identity may not write it; run the experiment with the owner's rights, or "
            f"give this key a role matching `experiment.{self.experiment}` in the hub's "
            f"roles.toml (docs/protocol.md section 8, Roles)")


class JournalRefused(SpecError):
    """The hub refused a journal entry: the runner's identity may not write the journal (the
    plan is the first entry: refused, nothing runs; `busctl experiment run` exits 2)."""


def _held(limiter: anyio.CapacityLimiter | None) -> AbstractAsyncContextManager[Any]:
    return limiter if limiter is not None else contextlib.nullcontext()


def tokens_of(usage: Iterable[Usage]) -> int:
    return sum(u.total or u.input + u.output for u in usage)


def result_rows(results: Iterable[SampleResult],
                scorers: Sequence[str] = ()) -> list[dict[str, Any]]:
    """One flat dict per cell (scores as `score_<name>` columns), in a stable order, by the
    failure rule: `status` is the cell's outcome (ok, timed_out, limited, error) and its
    scores are the ones the report counts (0 for a failed cell), so the report's numbers
    follow from the rows (README, "Experiment statistics"). `scorers`: the plan's, in order
    (else the ones the cells have)."""
    cells = sorted(results, key=lambda r: (r.variant, r.sample, r.repeat))
    names = list(scorers) or sorted({name for c in cells for name in c.scores})
    rows = []
    for entry in cells:
        row = msgspec.to_builtins(entry)
        row.pop("type", None)
        row.pop("scores")
        counted = entry.counted(names)
        row["status"] = entry.outcome
        # the first scorer's (the plan's), whichever `scorers` this was given
        row["score"] = entry.score if entry.outcome == "ok" else 0.0 if names else None
        for name, value in counted.items():
            row[f"score_{name}"] = value
        rows.append(row)
    return rows


def write_results(path: Path, results: Iterable[SampleResult],
                  scorers: Sequence[str] = ()) -> int:
    """The results file: JSON Lines, one cell a line (`pandas.read_json(path, lines=True)`,
    `polars.read_ndjson(path)`). Written whole to a temporary file, then renamed."""
    rows = result_rows(results, scorers)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    with part.open("w") as out:
        for row in rows:
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
    part.replace(path)
    return len(rows)


def money(value: float) -> str:
    """A cost in dollars with three significant digits however small ($0.0000400, never
    $0.0000), cents from $1 up."""
    if value == 0:
        return "$0"
    if abs(value) >= 1:
        return f"${value:,.2f}"
    return f"${value:.{max(2, 2 - math.floor(math.log10(abs(value))))}f}"


def progress_for(stream: TextIO, planned: int) -> Progress:
    """A progress line on a terminal; counts only otherwise."""
    return Progress(planned, 0, stream if stream.isatty() else None)


__all__ = ["FAILURE_RULE", "PLAN_TYPE", "SAMPLE_TYPE", "Journal", "Plan", "Progress", "Runner",
           "SampleResult", "cell_workspaces", "journal_from_log", "money", "old_tool_workers",
           "progress_for",
           "read_journal", "result_rows", "split_tools", "write_results"]
