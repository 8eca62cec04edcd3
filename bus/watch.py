"""`busctl watch`: replay and follow the event stream, filtered, as human lines or JSON lines."""

from __future__ import annotations

import contextlib
import sys
import time
import typing
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import msgspec

from agent_bus.bus import events as ev
from agent_bus.bus import protocol as p
from agent_bus.bus.backoff import Backoff, retry
from agent_bus.bus.client import REPLAY_RETRY_FOR, Envelope, Peer, connect
from agent_bus.bus.errors import Overloaded, ProtocolError
from agent_bus.bus.experiments import covers, holds_entries_of, plan_tags
from agent_bus.bus.logfile import Row, covered, experiments, open_log, rows
from agent_bus.bus.messages import Usage
from agent_bus.bus.render import HumanPrinter, json_line, to_json_obj
from agent_bus.bus.security import CurveClient

# Every event type a filter can name: the tags of the `Event` union (bus.events).
EVENT_TYPES: tuple[str, ...] = tuple(sorted(
    member.__struct_config__.tag for member in typing.get_args(ev.Event)))


def unknown_types(types: set[str]) -> list[str]:
    """The names in `types` that are no event type (a typo would otherwise filter out all)."""
    return sorted(types - set(EVENT_TYPES))


@dataclass
class WatchFilter:
    types: set[str] = field(default_factory=set)
    agents: set[str] = field(default_factory=set)
    runs: set[str] = field(default_factory=set)
    experiments: set[str] = field(default_factory=set)

    def topics(self) -> list[str]:
        """Hub-side prefixes: only agent filters map onto the topic (`agent/<name>/`, and
        `ext/<name>/` for what the agent publishes, e.g. topic messages)."""
        if self.agents and not self.runs:
            return [f"{family}/{a}/" for a in sorted(self.agents) for family in ("agent", "ext")]
        return []

    def accepts_header(self, header: p.Header) -> bool:
        """What the header alone decides (a logged event's body is decoded only when wanted)."""
        if self.types and header.type not in self.types:
            return False
        return self.accepts_where(header)

    def accepts_where(self, header: p.Header) -> bool:
        if self.agents and header.agent not in self.agents:
            return False
        # A run is named by its id or a prefix of it: the 8 characters `watch` prints.
        if self.runs and not (header.run and any(header.run.startswith(r) for r in self.runs)):
            return False
        # an experiment's name covers its cells' tags too (bus.experiments): a cell started
        # after the watch did is shown as well (`accepts` checks a journal entry's cell)
        return not self.experiments or any(holds_entries_of(name, header.experiment)
                                           for name in self.experiments)

    def describe(self) -> str:
        """The filter as its flags, for the line that says it matched nothing."""
        flags = [("--type", self.types), ("--agent", self.agents), ("--run", self.runs),
                 ("--experiment", self.experiments)]
        return " ".join(f"{flag} {v}" for flag, values in flags for v in sorted(values))

    def accepts(self, header: p.Header, event: ev.Event) -> bool:
        if self.types and ev.event_type(event) not in self.types and not isinstance(event, ev.Gap):
            return False
        return self.accepts_where(header) and (
            not self.experiments or selected(self.experiments, header, event))


def selected(names: Collection[str], header: p.Header, event: ev.Event) -> bool:
    """Whether an event is one of experiments `names` (bus.experiments.covers): of an id one of
    them covers; or a journal entry of a cell one covers (its `tag`: a variant's or a cell's
    name selects its cells' entries from the experiment's journal)."""
    if any(covers(name, header.experiment) for name in names):
        return True
    return isinstance(event, ev.ExperimentSample) and any(covers(name, event.tag)
                                                          for name in names)


def to_stderr(text: str) -> None:
    """How a command-line reader names what it skipped (`EventTally`'s `warn`)."""
    sys.stderr.write(text + "\n")
    sys.stderr.flush()


#: Asks again of a `hub.replay` the hub's reader was too full for: every 0.05 s.
REPLAY_AGAIN = Backoff(first=0.05, factor=1.0, cap=0.05, jitter=0.0)


async def replay_batch(peer: Peer, request: p.ReplayRequest) -> p.ReplayBatch:
    """One `hub.replay`; asked again while the hub's reader is full (`overloaded`, up to
    REPLAY_RETRY_FOR seconds): replay is idempotent."""
    body = p.encode(request)

    async def ask() -> p.ReplayBatch:
        return p.decode(await peer.request(p.HUB_REPLAY, body), p.ReplayBatch)

    return await retry(ask, retry_on=(Overloaded,), policy=REPLAY_AGAIN,
                       deadline=time.monotonic() + REPLAY_RETRY_FOR)


async def replay(peer: Peer, since: int, topics: list[str], tally: ev.EventTally | None = None,
                 wanted: Callable[[p.Header], bool] | None = None,
                 experiment: str = "") -> AsyncGenerator[Envelope, None]:
    """Logged events after `since` up to the head at the time of the first call, then stop;
    with `experiment`, only its events (the hub reads no other: `ReplayRequest.experiment`).

    Finished only when a batch reaches its head (`upto >= head`): a short batch is not the end.
    A range that retention pruned from the log is yielded as one `Gap` naming the retention.
    Only events whose header is `wanted` are decoded; one that does not decode is skipped and
    counted in `tally` (which names its seq), and the replay goes on."""
    tally = tally if tally is not None else ev.EventTally("replay")
    cursor, end = since, None
    while end is None or cursor < end:
        batch = await replay_batch(peer, p.ReplayRequest(since=cursor, topics=topics,
                                                          experiment=experiment))
        end = batch.head if end is None else end
        if batch.gap is not None and batch.gap.first <= end:
            gap = ev.Gap(first=batch.gap.first, last=min(batch.gap.last, end),
                         reason=batch.gap.reason)
            yield Envelope(p.Header(kind=p.EVENT, type="gap"), gap)
        for header_bytes, body in batch.events:
            header = _logged_header(header_bytes, tally)
            if header is None:
                continue
            if header.seq > end:
                return
            if wanted is not None and not wanted(header):
                continue
            event = tally.decode(header.seq, header.type, body)
            if event is not None:
                yield Envelope(header, event)
        if batch.upto >= batch.head:
            return
        if batch.upto <= cursor:  # a hub that does not move on would loop us forever
            raise ProtocolError(f"`hub.replay` from {cursor} answered upto={batch.upto} "
                                f"< head={batch.head} without progress")
        cursor = batch.upto


#: The topic of an experiment's plan (agents/experiment/runner.py publishes it).
PLAN_TOPIC = "ext///experiment_plan"


async def experiment_tags(peer: Peer, name: str) -> list[str]:
    """The experiment ids `name` covers (bus.experiments.covers), from the hub's log: with a
    plan journaled for its experiment, that one's id and every planned cell's (a cell not run
    yet too: it has no events); else `name` alone. Read through the hub's experiment index:
    no other experiment's event is read."""
    base = name.split(".", 1)[0]
    plans: list[ev.ExperimentPlan] = []

    def plan_of_base(header: p.Header) -> bool:  # only the runner's (granted) plan counts
        return header.experiment == base and header.type in ev.JOURNAL_TYPES \
            and bool(header.granted)

    async for envelope in replay(peer, 0, [PLAN_TOPIC], None, plan_of_base, base):
        if isinstance(envelope.event, ev.ExperimentPlan):
            plans.append(envelope.event)
    if not plans:
        return [name]
    plan = plans[0]
    return plan_tags(name, base, plan.variants, plan.repeats) or [name]


async def replay_tags(peer: Peer, since: int, tags: list[str], tally: ev.EventTally,
                      wanted: Callable[[p.Header], bool] | None = None,
                      upto: int | None = None) -> AsyncIterator[Envelope]:
    """The logged events (after `since`, up to `upto` when given) of the experiment ids `tags`,
    in seq order: each id's read through the hub's experiment index (one batch at a time),
    merged as they come. One `upto` for all: each id's replay ends at the head of its own
    time, and a subscription from `upto` must miss none of them."""
    def of_tag(tag: str) -> Callable[[p.Header], bool]:
        def wanted_of_tag(header: p.Header) -> bool:  # an older hub sends every experiment's
            return header.experiment == tag and (upto is None or header.seq <= upto) \
                and (wanted is None or wanted(header))
        return wanted_of_tag

    streams = [replay(peer, since, [], tally, of_tag(tag), tag) for tag in tags]
    heads = [await anext(stream, None) for stream in streams]
    while any(head is not None for head in heads):
        first = min((i for i, head in enumerate(heads) if head is not None),
                    key=lambda i: _seq_of(heads[i]))
        yield typing.cast(Envelope, heads[first])
        heads[first] = await anext(streams[first], None)


def _seq_of(envelope: Envelope | None) -> int:
    return envelope.header.seq if envelope is not None else 0


async def logged_experiments(peer: Peer) -> set[str]:
    """Every experiment id in the hub's log: a scan of the whole log (no body is decoded, but
    the hub reads and sends them all), for what no plan names."""
    seen: set[str] = set()

    def seen_only(header: p.Header) -> bool:
        seen.add(header.experiment)
        return False

    async for _ in replay(peer, 0, [], None, seen_only):
        pass
    return seen - {""}


async def _has_events(peer: Peer, tag: str) -> bool:
    """Whether the log holds an event of experiment id `tag` (its first batch, by the index)."""
    events = replay(peer, 0, [], None, lambda header: header.experiment == tag, tag)
    async with contextlib.aclosing(events):  # closed at the first: no more is asked
        async for _ in events:
            return True
    return False


async def experiment_ids(peer: Peer, name: str) -> tuple[list[str], set[str] | None]:
    """The experiment ids `name` covers, as `experiment_tags` finds them; for a name with no
    plan and no events of its own (a whole experiment's replay, whose cells are
    `T.<variant>.r<N>`; or a typo), those of every id in the log (`logged_experiments`, also
    returned, to name them) that it covers."""
    tags = await experiment_tags(peer, name)
    if tags != [name] or await _has_events(peer, name):
        return tags, None
    seen = await logged_experiments(peer)
    return [tag for tag in sorted(seen) if holds_entries_of(name, tag)] or [name], seen


async def filtered_tags(peer: Peer, filt: WatchFilter) -> list[str]:
    """The experiment ids of `filt`'s `--experiment` names ([] when it names none)."""
    tags: list[str] = []
    for name in sorted(filt.experiments):
        tags += [tag for tag in (await experiment_ids(peer, name))[0] if tag not in tags]
    return tags


def _logged_header(data: bytes, tally: ev.EventTally, seq: int = 0,
                   type_: str = "") -> p.Header | None:
    """A logged event's header (the hub wrote it, but a log is read by other versions too);
    `seq`/`type_` name it when known (the log file's columns), 0/"" when not."""
    try:
        return p.decode_header(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        tally.skip(seq, type_, f"its header: {exc}")
        return None


async def watch_events(hub: str, curve: CurveClient | None, filt: WatchFilter, since: int | None,
                       last: int | None, follow: bool, as_json: bool, color: bool) -> None:
    out = sys.stdout
    printer = HumanPrinter(out, color)

    shown = 0
    runs: dict[str, set[str]] = {prefix: set() for prefix in filt.runs}

    def show(envelope: Envelope) -> None:
        nonlocal shown
        if not filt.accepts(envelope.header, envelope.event):
            return
        shown += 1
        for prefix, matched in runs.items():
            if envelope.header.run.startswith(prefix):
                matched.add(envelope.header.run)
        if as_json:
            out.write(json_line(envelope.header, envelope.event) + "\n")
            out.flush()
        else:
            printer.print(envelope.header, envelope.event)

    tally = ev.EventTally("busctl watch", to_stderr)
    async with connect(hub, name="busctl-watch", role="watcher", curve=curve) as peer:
        if last is not None:
            since = max(0, (await peer.status()).seq - last)
        tags = await filtered_tags(peer, filt)
        if not follow:
            if tags:  # the hub picks the experiments' events (no other is read or sent)
                async for envelope in replay_tags(peer, since or 0, tags, tally,
                                                  filt.accepts_header):
                    show(envelope)
            else:
                async for envelope in replay(peer, since or 0, filt.topics(), tally,
                                             filt.accepts_header):
                    show(envelope)
            if tally.bad:
                to_stderr(tally.summary())
            live = await _live_agents(peer) if filt.agents and not shown else []
            _say_what_matched(filt, shown, runs, live)
            return
        if since is not None and tags:
            # The experiments' logged events are picked by the hub; the subscription then
            # starts where this left off. Every event of them up to the replay's end was
            # shown, so no hole and no duplicate past the last one shown.
            upto = (await peer.status()).seq
            async for envelope in replay_tags(peer, since, tags, tally, filt.accepts_header,
                                              upto):
                show(envelope)
            since = upto
        # Everything, filtered here: a topic-filtered stream has holes in its seqs by design,
        # so a lost message could not be told from a filtered one; on the full stream every
        # jump in seq is a loss, and the subscription fills it from the log.
        async with peer.subscribe([], since=since, fill_gaps=True) as sub:
            sub.tally = tally
            async for envelope in sub:
                show(envelope)


async def _live_agents(peer: Peer) -> list[str]:
    """The agents a live coordinator serves (their `agent.NAME` services)."""
    services = (await peer.status()).services
    return sorted({s.name[6:].partition("@")[0] for s in services if s.name.startswith("agent.")})


def _say_what_matched(filt: WatchFilter, shown: int, runs: dict[str, set[str]],
                      live_agents: list[str]) -> None:
    """A filter that matched nothing, or a --run prefix that matched several runs, is said on
    stderr: an empty output alone looks like a log with nothing in it (or a wrong id). The
    hint is about the filters given: a run prefix for --run, the live agents for --agent."""
    if not shown and filt.describe():
        hints = []
        if filt.runs:
            hints.append("a run is named by its id or a prefix of it, as `busctl watch` prints it")
        if filt.agents:
            hints.append(f"live agents: {', '.join(live_agents) or 'none'}; an agent is named "
                         f"as in the topology's [[agents]]")
        hint = f" ({'; '.join(hints)})" if hints else ""
        to_stderr(f"busctl watch: no event matched {filt.describe()}{hint}")
    for prefix, matched in sorted(runs.items()):
        if len(matched) > 1:
            to_stderr(f"busctl watch: --run {prefix} matched {len(matched)} runs "
                      f"({', '.join(sorted(matched))}); give more of the id to pick one")


class Totals(msgspec.Struct):
    """Token and cost totals of an export: every billed model call (`events.billed`: replies,
    compaction summaries, retried attempts)."""

    events: int = 0
    #: events of the experiment that were skipped because they do not decode, and their seqs
    #: (the first NAMED_BAD_EVENTS; each is also named on stderr)
    undecodable: int = 0
    undecodable_seqs: list[int] = msgspec.field(default_factory=list)
    runs: list[str] = msgspec.field(default_factory=list)
    #: the experiment ids exported (an experiment's own and its cells'), in order met
    experiments: list[str] = msgspec.field(default_factory=list)
    by_agent: dict[str, Usage] = msgspec.field(default_factory=dict)
    by_model: dict[str, Usage] = msgspec.field(default_factory=dict)
    total: Usage = msgspec.field(default_factory=Usage)

    def add(self, header: p.Header, event: ev.Event) -> None:
        self.events += 1
        if header.run and header.run not in self.runs:  # runs are few; events are many
            self.runs.append(header.run)
        if header.experiment not in self.experiments:
            self.experiments.append(header.experiment)
        billed = ev.billed(event)
        if billed is None:
            return
        model, usage = billed[0] or "?", billed[1]
        self.by_agent[header.agent] = self.by_agent.get(header.agent, Usage()) + usage
        self.by_model[model] = self.by_model.get(model, Usage()) + usage
        self.total = self.total + usage

    def skipped(self, tally: ev.EventTally) -> None:
        self.undecodable, self.undecodable_seqs = tally.bad, list(tally.bad_seqs)


class Export(msgspec.Struct):
    """What an export wrote (`totals`) and, when it found nothing, which experiments exist."""

    totals: Totals
    experiments: list[str]


def _write(out: BinaryIO, fmt: str, envelope: Envelope, encoder: msgspec.msgpack.Encoder) -> None:
    if fmt == "msgpack":
        out.write(encoder.encode(to_json_obj(envelope.header, envelope.event)))
    else:
        out.write(json_line(envelope.header, envelope.event).encode() + b"\n")


async def export_events(hub: str, curve: CurveClient | None, name: str, out: BinaryIO,
                        fmt: str) -> Export:
    """Write every logged event of the experiment ids `name` covers (`experiment_ids`: an
    experiment's own and all its cells') to `out` (JSON lines or msgpack, in seq order), from
    the hub."""
    totals = Totals()
    tally = ev.EventTally("busctl export", to_stderr)
    encoder = msgspec.msgpack.Encoder()
    gaps: set[tuple[int, int]] = set()  # each id's replay names a pruned range: once here

    async def write(tags: list[str]) -> None:
        async for envelope in replay_tags(peer, 0, tags, tally):
            event = envelope.event
            if isinstance(event, ev.Gap) and (event.first, event.last) not in gaps:
                gaps.add((event.first, event.last))
            elif not selected((name,), envelope.header, event):
                continue
            totals.add(envelope.header, event)
            _write(out, fmt, envelope, encoder)

    async with connect(hub, name="busctl-export", role="cli", curve=curve) as peer:
        tags, seen = await experiment_ids(peer, name)
        await write(tags)
        if not totals.events and seen is None:  # which experiments there are, to name them
            seen = await logged_experiments(peer)  # (a typo's rescue)
    out.flush()
    totals.skipped(tally)
    return Export(totals, [] if totals.events else sorted(seen or ()))


def log_envelopes(log: Iterator[Row], tally: ev.EventTally) -> Iterator[Envelope]:
    """The events of rows read from the log file (bus.logfile.rows), decoded through `tally`."""
    for seq, type_, header_bytes, body in log:
        header = _logged_header(header_bytes, tally, seq, type_)
        # None: a type this version does not know (not ours to export), or a body that does
        # not decode (named on stderr and counted in the totals)
        event = tally.decode(seq, type_, body) if header is not None else None
        if header is not None and event is not None:
            yield Envelope(header, event)


def export_from_log(path: Path, name: str, out: BinaryIO, fmt: str) -> Export:
    """Like `export_events`, read from the log file itself (no hub needed; bus.logfile): every
    experiment id in it that `name` covers."""
    totals = Totals()
    tally = ev.EventTally("busctl export", to_stderr)
    encoder = msgspec.msgpack.Encoder()
    with open_log(path) as db:
        for envelope in log_envelopes(rows(db, covered(db, name)), tally):
            if not selected((name,), envelope.header, envelope.event):
                continue
            totals.add(envelope.header, envelope.event)
            _write(out, fmt, envelope, encoder)
        totals.skipped(tally)
        known = [] if totals.events else experiments(db)
    out.flush()
    return Export(totals, known)
