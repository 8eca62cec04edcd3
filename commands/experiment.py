"""Recorded runs and experiments: export, replay, diff, and the `busctl experiment` group."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import click
import msgspec

from agent_bus.bus.client import connect
from agent_bus.bus.errors import HubUnreachable
from agent_bus.bus.security import CurveClient
from agent_bus.commands.base import UsageExit, first_leaf, hub_options, run_async

# --- busctl export ------------------------------------------------------------------------


STATE_DIR_HELP = ("Read the event log in this state directory (a topology's, or a hub's "
                  "--state-dir) instead of asking a hub; read-only, no hub needed.")
#: What `--experiment` / EXPERIMENT names: one id, or a whole experiment (bus.experiments)
NAME_HELP = ("an experiment id; an experiment's name E covers all its cells (E.<variant>.r<N>), "
             "E.<variant> one variant's")

T = TypeVar("T")


def _hub_or_log(from_hub: Callable[[], T], from_log: Callable[[Path], T],
                state_dir: str | None) -> T:
    """From the hub; from the log file on disk with --state-dir, or when no hub answers and this
    directory's topology left one (a stopped topology's log). A --hub given on the command line
    names that hub: it is not replaced by the disk; the default or BUSCTL_HUB may be."""
    import sqlite3

    from click.core import ParameterSource

    from agent_bus.bus.logfile import log_file
    from agent_bus.bus.paths import default_state_dir

    explicit = click.get_current_context().get_parameter_source("hub") == ParameterSource.COMMANDLINE
    local = log_file(Path(state_dir or default_state_dir()))
    if state_dir and local is None:
        raise click.BadParameter(f"no event log (events.db or hub/events.db) in {state_dir}; "
                                 f"give the state directory of a topology or a hub",
                                 param_hint="--state-dir")
    if not state_dir:
        try:
            return from_hub()
        except (HubUnreachable, BaseExceptionGroup) as exc:
            leaf = first_leaf(exc) if isinstance(exc, BaseExceptionGroup) else exc
            if local is None or explicit or not isinstance(leaf, HubUnreachable):
                raise
            # said as what happens, not as a failure: with no hub running, the log on disk
            # is the right source (the hub's own words follow, for when one was expected)
            click.echo(f"reading the event log on disk: {local} (no hub answers: {leaf})",
                       err=True)
    assert local is not None
    try:
        return from_log(local)
    except sqlite3.Error as exc:
        raise click.ClickException(f"cannot read the event log {local}: {exc}") from None


@click.command()
@hub_options
@click.option("--experiment", required=True, metavar="E", help=f"What to export: {NAME_HELP}.")
@click.option("--format", "fmt", type=click.Choice(["jsonl", "msgpack"]), default="jsonl",
              show_default=True, help="JSON lines, or a stream of MessagePack maps.")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default="-",
              help="File to write [default: stdout].")
@click.option("--state-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help=STATE_DIR_HELP)
def export(hub: str, curve: CurveClient | None, experiment: str, fmt: str, output: str,
           state_dir: str | None) -> None:
    """Write every event of an experiment from the hub's log, in seq order; print token/cost
    totals (and the experiment ids exported) to stderr. A `busctl experiment` run's name covers
    its journal and all its cells' sessions.

    With no hub running (and no --hub given) it reads the log that `busctl up` left in this
    directory's state directory; --state-dir reads another one.

    \b
    Examples:
      busctl export --experiment debate-3 -o debate-3.jsonl
      busctl export --experiment arith-1            # the journal and every cell of arith-1
      busctl export --experiment arith-1.team.r2    # one cell
      busctl export --experiment debate-3 --state-dir ~/.local/state/agent-bus/proj-1a2b3c4d5e6f
    """
    from agent_bus.bus.watch import export_events, export_from_log

    try:
        out_file = click.open_file(output, "wb")
    except OSError as exc:
        raise click.ClickException(f"cannot write {output}: {exc.strerror}") from None
    with out_file as opened:
        out: Any = opened  # binary: opened "wb"
        result = _hub_or_log(lambda: run_async(export_events, hub, curve, experiment, out, fmt),
                             lambda local: export_from_log(local, experiment, out, fmt),
                             state_dir)
    if not result.totals.events:
        if output != "-":
            Path(output).unlink(missing_ok=True)
        known = ", ".join(result.experiments) or "none"
        raise UsageExit(f"--experiment {experiment}: no experiment `{experiment}` in the event "
                        f"log (experiments: {known}); give one of them (an experiment's name "
                        f"covers all its cells)")
    click.echo(msgspec.json.encode(result.totals).decode(), err=True)


# --- busctl replay / diff (agents.replay) --------------------------------------------------


@click.command()
@hub_options
@click.option("--experiment", required=True, metavar="E",
              help=f"The recorded experiment to replay: {NAME_HELP} (each cell replayed as "
                   f"its own).")
@click.option("--as", "target", default="", metavar="E2",
              help="The replayed experiment's id [default: EXPERIMENT.replay-<hex>; for a "
                   "whole experiment E, E-replay-<hex>, its cells E2.<variant>.r<N>].")
@click.option("--live-from", type=click.IntRange(min=0, max=2**31 - 1), default=None, metavar="TURN",
              help="Fork: replay each run's first TURN turns, then call the live model (0: "
                   "every call live).")
@click.option("--live-from-seq", type=click.IntRange(min=1, max=2**63 - 1), default=None,
              metavar="SEQ",
              help="Fork at a point of the log: model calls logged before event SEQ are "
                   "replayed, the one at or after it and its run's later ones go live.")
@click.option("--model", default="", metavar="ALIAS",
              help="Fork: the model alias (of the gateway) for the live turns.")
@click.option("--system-prompt-file", type=click.Path(exists=True, dir_okay=False),
              default=None, metavar="F",
              help="Fork: the system prompt (file F) of the prompted agents' live turns.")
@click.option("--set", "settings", multiple=True, metavar="AGENT.KEY=VALUE",
              help="Fork: an [[agents]] key for AGENT's live turns: model, system_prompt, "
                   "temperature, top_p, max_tokens, seed, stop; or max_turns (alias "
                   "max_iterations) for its prompted runs. Repeatable.")
@click.option("--live-tools", is_flag=True,
              help="Run the tools again [default: their results come from the log]; the "
                   "runs of a `busctl experiment` cell (EXPERIMENT = E.<variant>.r<repeat>) "
                   "in a fresh copy of their workspace.")
@click.option("--spec", "spec_path", default="", metavar="SPEC",
              help="With --live-tools, for a `busctl experiment` cell: the spec E ran, whose "
                   "dataset has the samples' files [default: the path its plan names].")
def replay(hub: str, curve: CurveClient | None, experiment: str, target: str,
           live_from: int | None, live_from_seq: int | None, model: str,
           system_prompt_file: str | None, settings: tuple[str, ...], live_tools: bool,
           spec_path: str) -> None:
    """Re-execute every run of EXPERIMENT with the gateway serving each model reply from the
    log (no model is called) and each tool result too (unless --live-tools; `ask_<agent>`
    calls always run: the callee's run is replayed); report "identical" or the first
    divergence (exit 1).

    \b
    A fork (--live-from TURN or --live-from-seq SEQ) replays up to that point, then calls the
    live model; --model, --system-prompt-file and --set change the live part.
    A `busctl experiment` run's name E replays each of its cells that ran, E.<variant>.r<N>
    as E2.<variant>.r<N> (one line each; exit 1 if any diverged); E.<variant> one variant's.
    Compare the two afterwards with `busctl diff EXPERIMENT E2`.
    Examples:
      busctl replay --experiment debate-3 --as debate-3-again
      busctl replay --experiment debate-3 --as debate-3-b --live-from 2 --model b
      busctl replay --experiment debate-3 --live-from-seq 1234 --set lead.temperature=0.2
      busctl replay --experiment arith-1 --as arith-1-again   # every cell of an experiment
    """
    from agent_bus.agents.client.remote import connect as connect_agents
    from agent_bus.agents.replay import Fork, ForkError, parse_setting, replay_experiment
    from agent_bus.bus.errors import ConfigError
    from agent_bus.bus.events import EventTally
    from agent_bus.bus.watch import to_stderr

    try:
        fork = Fork(live_from=live_from, live_from_seq=live_from_seq or 0, model=model,
                    system_prompt=_system_prompt(system_prompt_file),
                    settings=dict(parse_setting(s) for s in settings))
    except ForkError as exc:
        raise click.UsageError(str(exc)) from None
    tally = EventTally("busctl replay", to_stderr)  # logged events that do not decode
    notes: list[str] = []  # token usage differences, reported apart from the comparison
    outcomes: list[tuple[str, str, object]] = []  # (source, target, divergence or None)

    async def go() -> object:
        async with connect_agents(hub, name="busctl-replay", curve=curve) as bus:
            try:
                for source, into in await _replays(bus.peer, experiment, target):
                    workspaces = await _cell_workspaces(bus.peer, source, into, spec_path) \
                        if live_tools else {}
                    outcomes.append((source, into, await replay_experiment(
                        bus, source, into, fork=fork, live_tools=live_tools, tally=tally,
                        workspaces=workspaces, notes=notes)))
            except (ValueError, ConfigError) as exc:  # ForkError too: before anything is replayed
                return exc  # raised here it would reach us inside an exception group
        return None

    failed = run_async(go)
    if tally.bad:
        click.echo(tally.summary(), err=True)
    if isinstance(failed, (ValueError, ConfigError)):
        raise click.UsageError(str(failed))
    _say_replayed(experiment, outcomes, notes)


async def _replays(peer: Any, experiment: str, target: str) -> list[tuple[str, str]]:
    """What `busctl replay --experiment` replays as what: an experiment's name (or
    E.<variant>) each cell that ran, `E.<variant>.r<N>` as `T.<variant>.r<N>` (T: --as, by
    default `E-replay-<hex>`: its cells parse back, so `busctl diff E T` pairs them); any
    other id itself, as --as (by default `<id>.replay-<hex>`)."""
    import re
    import uuid

    from agent_bus.agents.experiment.selection import cells_of, retagged
    from agent_bus.bus.experiments import NAME, parse_cell

    hexid = uuid.uuid4().hex[:6]
    _, cells = await cells_of(peer, experiment)
    if not cells or cells == [experiment]:
        return [(experiment, target or f"{experiment}.replay-{hexid}")]
    if target and not re.fullmatch(NAME, target):
        raise ValueError(f"--as {target}: a whole experiment's replay names its cells "
                         f"{target}.<variant>.r<N>, so --as takes letters, digits, _ or - only")
    base = parse_cell(cells[0])
    assert base is not None
    into = target or f"{base.experiment}-replay-{hexid}"
    return list(zip(cells, retagged(cells, into), strict=True))


def _say_replayed(experiment: str, outcomes: list[tuple[str, str, object]],
                  notes: list[str]) -> None:
    """One line per cell replayed (one only for a single id); exit 1 naming the divergences."""
    usage = "".join(f"\n  {note}" for note in notes)
    if usage:  # not part of the comparison: a live call's cache split is the server's state
        usage = f"\ntoken usage differs (compared apart; `busctl diff` shows it):{usage}"
    if len(outcomes) == 1:
        [(source, into, divergence)] = outcomes
        if divergence is not None:
            raise click.ClickException(f"{source} replayed as {into}: {divergence}")
        click.echo(f"{source} replayed as {into}: identical{usage}")
        return
    for source, into, divergence in outcomes:
        click.echo(f"{source} replayed as {into}: {divergence or 'identical'}")
    diverged = sum(divergence is not None for _, _, divergence in outcomes)
    target = outcomes[0][1].rsplit(".", 2)[0]
    if diverged:
        raise click.ClickException(f"{experiment} replayed as {target}: {diverged} of "
                                   f"{len(outcomes)} cells diverged (above); `busctl diff "
                                   f"{experiment} {target}` pairs them sample by sample")
    click.echo(f"{experiment} replayed as {target}: {len(outcomes)} cells, identical{usage}")


async def _cell_workspaces(peer: Any, experiment: str, target: str,
                           spec: str) -> dict[str, Any]:
    """`busctl replay --live-tools` of a `busctl experiment` cell's tag (`E.<variant>.r<N>`):
    its runs' fresh workspaces (agents.experiment.runner.cell_workspaces); none for another."""
    from agent_bus.agents.experiment.runner import cell_workspaces, read_journal

    name, dot, _ = experiment.partition(".")
    if not dot:
        return {}
    return cell_workspaces(await read_journal(peer, name), experiment, target, spec)


SYSTEM_PROMPT_LIMIT = 1 << 20  # a prompt file larger than this is a mistake (or /dev/zero)


def _system_prompt(path: str | None) -> str | None:
    """`busctl replay --system-prompt-file`: the file's text (None: not given), at most
    `SYSTEM_PROMPT_LIMIT` bytes: never read past that, whatever the file is."""
    if path is None:
        return None
    try:
        with open(path, "rb") as f:
            data = f.read(SYSTEM_PROMPT_LIMIT + 1)
        if len(data) > SYSTEM_PROMPT_LIMIT:
            raise click.UsageError(f"--system-prompt-file {path}: larger than 1 MiB; a system "
                                   f"prompt must be at most {SYSTEM_PROMPT_LIMIT} bytes")
        text = data.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise click.UsageError(f"--system-prompt-file {path}: cannot read it as UTF-8 text "
                               f"({exc})") from None
    if not text.strip():
        raise click.UsageError(f"--system-prompt-file {path} is empty; give a file with the "
                               f"system prompt's text")
    return text


@click.command("diff")
@hub_options
@click.argument("first")
@click.argument("second")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (for notebooks).")
def diff_experiments(hub: str, curve: CurveClient | None, first: str, second: str,
                     as_json: bool) -> None:
    """Compare experiments FIRST and SECOND run by run and in total: final texts (a unified
    diff), tool calls, turns, tokens, cost, stop reasons; wall time shown; and where the events
    first differ (the comparison `busctl replay` makes).

    \b
    Runs are paired by what they ran, not by when they started: in a `busctl experiment`
    run, by sample (its id from the journal, else its prompt), cell by cell when a side has
    several; the runs a run asked for follow it, in the order of its calls. A name covers
    what it does in `busctl export`: E every cell, E.<variant> one variant's, a tag itself;
    a replay of a whole experiment (`busctl replay --experiment E --as T`) is paired with E
    cell by cell. Other experiments' runs pair in start order.
    Examples:
      busctl diff debate-3 debate-3-again
      busctl diff arith-1 arith-1-replay-1a2b3c      # every cell, sample by sample
      busctl diff arith-1.solo arith-1.team          # two variants, sample by sample
      busctl diff debate-3 debate-3-b --json | jq .total
    """
    from agent_bus.agents.replay import diff, diff_text
    from agent_bus.bus.client import connect as connect_peer
    from agent_bus.bus.events import EventTally
    from agent_bus.bus.watch import to_stderr

    tally = EventTally("busctl diff", to_stderr)  # logged events that do not decode

    async def go() -> dict[str, Any]:
        async with connect_peer(hub, name="busctl-diff", role="cli", curve=curve) as peer:
            a, b = await _diff_sides(peer, first, second, tally)
        for name, (runs, _) in ((first, a), (second, b)):
            if not runs:
                raise click.UsageError(f"experiment `{name}` has no runs in the hub's log (check "
                                       f"the name with `busctl export --experiment {name}`)")
        return diff(a[0], b[0], _paired(a[1], b[1]) if a[1] or b[1] else None)

    result = run_async(go)
    if tally.bad:
        click.echo(tally.summary(), err=True)
    click.echo(msgspec.json.encode(result).decode() if as_json
               else diff_text(result, first, second))


async def _diff_sides(peer: Any, first: str, second: str,
                      tally: Any) -> list[tuple[list[Any], list[Any]]]:
    """Each side's runs and, when either is a `busctl experiment` run's (or a replay of one),
    its trees labelled by cell and sample (`selection.trees`); else no trees (start order)."""
    from agent_bus.agents.experiment.selection import cells_of, retagged, trees
    from agent_bus.agents.replay import load_experiment

    found = [await cells_of(peer, first), await cells_of(peer, second)]
    sides = []
    for i, name in enumerate((first, second)):
        journal, tags = found[i]
        other = found[1 - i][1]
        if not tags and other and not await load_experiment(peer, name, tally):
            tags = retagged(other, name)  # a replay of the other's cells: T.<variant>.r<N>
        runs: list[Any] = []
        labelled: list[Any] = []
        for tag in tags or [name]:
            logged = await load_experiment(peer, tag, tally)
            runs += logged
            labelled += trees(logged, tag, journal)
        sides.append((runs, labelled if found[0][1] or found[1][1] else []))
    return sides


def _paired(a: list[Any], b: list[Any]) -> list[Any]:
    from agent_bus.agents.experiment.selection import pair

    return [(label, x.runs if x else [], y.runs if y else []) for label, x, y in pair(a, b)]


# --- busctl experiment (agents.experiment) -------------------------------------------------


@click.group("experiment")
def experiment_group() -> None:
    """Experiments as a workflow: a dataset × variants × repeats, each cell one session on the
    running topology, scored, journaled in the event log, resumable, reported.

    \b
    Examples:
      busctl experiment check examples/experiment/spec.toml
      busctl experiment run examples/experiment/spec.toml --name qa-1
      busctl experiment run examples/experiment/spec.toml --resume qa-1
      busctl experiment report qa-1 --json
      busctl experiment compare qa-1 qa-2
      busctl experiment compare qa-1 --variants solo team
    """


def _experiment_spec(spec: str, limit: int = 0) -> Any:
    from agent_bus.agents.experiment.spec import SpecError, load_spec

    try:
        return load_spec(spec, limit=limit)
    except SpecError as exc:
        click.echo(f"Error: {exc}", err=True)
        raise click.exceptions.Exit(2) from None


@experiment_group.command("check")
@click.argument("spec", type=click.Path(dir_okay=False))
def experiment_check(spec: str) -> None:
    """Validate SPEC and its dataset; print what a run would do as JSON (exit 2 naming the
    bad key or dataset line).

    \b
    Examples:
      busctl experiment check examples/experiment/spec.toml
    """
    import json

    from agent_bus.agents.experiment.spec import summary

    click.echo(json.dumps(summary(_experiment_spec(spec))))


@experiment_group.command("run")
@hub_options
@click.argument("spec", type=click.Path(dir_okay=False))
@click.option("--name", default="", metavar="E", help="The experiment's id (checked unused "
              "in the log) [default: the spec's name plus -<12 random hex>].")
@click.option("--resume", default="", metavar="E",
              help="Run what experiment E (started from SPEC) has not finished yet.")
@click.option("--limit", type=click.IntRange(0), default=0,
              help="Only the first N samples (0: all); a resume needs the same.")
@click.option("--results", default="", metavar="FILE",
              help="The results file (JSON Lines) [default: results/E.jsonl in the current "
                   "directory].")
def experiment_run(hub: str, curve: CurveClient | None, spec: str, name: str, resume: str,
                   limit: int, results: str) -> None:
    """Run every sample × variant × repeat of SPEC as a session on the running topology
    (Ctrl-C stops; `--resume E` runs the rest); then write the results file and the report.

    \b
    Examples:
      busctl experiment run examples/experiment/spec.toml --name arith-1
      busctl experiment run examples/experiment/spec.toml --resume arith-1
    """
    import re
    import uuid

    from agent_bus.agents.client.remote import connect as connect_agents
    from agent_bus.agents.experiment.report import report, report_text
    from agent_bus.agents.experiment.runner import Runner, progress_for, write_results
    from agent_bus.agents.experiment.spec import NAME, SpecError

    if name and resume:
        raise click.UsageError("--name starts an experiment, --resume finishes one: give one")
    loaded = _experiment_spec(spec, limit)
    experiment = resume or name or f"{loaded.spec.name}-{uuid.uuid4().hex[:12]}"
    if not re.fullmatch(NAME, experiment):
        raise click.UsageError(f"--name/--resume {experiment!r}: letters, digits, _ or -")
    progress = progress_for(sys.stderr, loaded.planned)
    # SIGTERM (a Slurm job cancelled, preempted or out of time; `kill`) stops as Ctrl-C does:
    # the runs in flight are aborted, the journal keeps every finished cell, --resume the rest
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    async def go() -> Any:
        async with connect_agents(hub, name="busctl-experiment", curve=curve,
                                  resume_wait=loaded.spec.run.resume_wait) as bus:
            try:
                return await Runner(bus, loaded, experiment, progress).run(
                    resume=bool(resume), fresh=not (resume or name))
            except SpecError as exc:
                return exc

    try:
        journal = run_async(go)
    except KeyboardInterrupt:  # the runs in progress were aborted (their prompts cancelled)
        click.echo(f"\nstopped; `busctl experiment run {spec} --resume {experiment}` runs "
                   f"the rest", err=True)
        raise click.exceptions.Exit(130) from None
    if isinstance(journal, SpecError):
        raise click.UsageError(str(journal))
    path = Path(results or Path("results") / f"{experiment}.jsonl")
    scorers = [s.label for s in loaded.spec.scorers]
    try:
        rows = write_results(path, journal.results.values(), scorers)
    except OSError as exc:
        raise click.ClickException(f"--results {path}: cannot write it ({exc.strerror}); the "
                                   f"journal has every cell: `busctl experiment report "
                                   f"{experiment}`") from None
    click.echo(report_text(report(journal, experiment)))
    click.echo(f"{rows} results in {path}", err=True)


def _journals(hub: str, curve: CurveClient | None, names: tuple[str, ...],
              state_dir: str | None = None) -> list[Any]:
    """Each experiment's journal, from the hub's log or the log on disk (`_hub_or_log`)."""
    from agent_bus.agents.experiment.runner import IGNORED_WHY, journal_from_log, read_journal

    async def go() -> list[Any]:
        async with connect(hub, name="busctl-experiment", role="client", curve=curve) as peer:
            return [await read_journal(peer, name) for name in names]

    journals = _hub_or_log(lambda: run_async(go),
                           lambda local: [journal_from_log(local, name) for name in names],
                           state_dir)
    for name, journal in zip(names, journals, strict=True):
        if journal.plan is None and not journal.results:
            ignored = (f"; {journal.ignored} entries of it ignored, {IGNORED_WHY}"
                       if journal.ignored else "")
            base = name.split(".", 1)[0]
            cell = (f"; `{name}` looks like a cell's or a variant's tag: give the experiment's "
                    f"name, `{base}`") if base != name else ""
            raise click.UsageError(f"no experiment `{name}` in the event log (`busctl experiment "
                                   f"run SPEC --name {name}` starts one){ignored}{cell}")
    return journals


@experiment_group.command("report")
@hub_options
@click.argument("experiment")
@click.option("--json", "as_json", is_flag=True, help="One JSON object (variants: [{name, "
              "samples, repeats, score, ci95, scores, timed_out, per_sample, ...}]).")
@click.option("--plot", "plot_dir", default="", metavar="DIR",
              help="Also write score.png, cost.png and time.png into DIR (needs matplotlib: "
                   "the `plot` extra).")
@click.option("--state-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help=STATE_DIR_HELP)
def experiment_report(hub: str, curve: CurveClient | None, experiment: str,
                      as_json: bool, plot_dir: str, state_dir: str | None) -> None:
    """Per variant and scorer: the mean over samples of each sample's mean over its repeats,
    with a 95% t interval over those per-sample means (samples are the unit; n = samples ×
    repeats); cells timed out, limited or in error (scored 0 and counted), tokens, cost,
    p50/p95 wall time, stop reasons; from the journal in the hub's log (with no hub
    running, and no --hub given, from the log `busctl up` left in this directory's state
    directory; --state-dir reads another one).

    \b
    Examples:
      busctl experiment report arith-1
      busctl experiment report arith-1 --json --plot plots/
    """
    import json

    from agent_bus.agents.experiment.report import report, report_text

    if plot_dir:
        _plot_ready()  # before anything is printed: a missing extra is not a half-done report
    journal = _journals(hub, curve, (experiment,), state_dir)[0]
    data = report(journal, experiment)
    click.echo(json.dumps(data) if as_json else report_text(data))
    if plot_dir:
        from agent_bus.agents.experiment.plot import plot

        try:
            written = plot(data, Path(plot_dir))
        except OSError as exc:
            raise click.UsageError(f"--plot {plot_dir}: cannot write there ({exc})") from None
        click.echo(f"wrote {', '.join(map(str, written))}", err=True)


def _plot_ready() -> None:
    from agent_bus.agents.experiment.plot import pyplot
    from agent_bus.agents.experiment.spec import SpecError

    try:
        pyplot()
    except SpecError as exc:
        raise click.UsageError(f"--plot: {exc}") from None


@experiment_group.command("replay")
@hub_options
@click.argument("experiment")
@click.option("--sample", required=True, metavar="ID", help="The sample's id (dataset `id`).")
@click.option("--variant", default="", help="Its variant [default: the experiment's first].")
@click.option("--repeat", type=click.IntRange(1), default=1, show_default=True)
@click.option("--as", "target", default="", metavar="E2",
              help="The replay's experiment id [default: the cell's tag plus .replay-<hex>].")
@click.option("--live-tools", is_flag=True,
              help="Run the tools again, in a fresh copy of the cell's workspace [default: "
                   "their results come from the log].")
@click.option("--spec", "spec_path", default="", metavar="SPEC",
              help="With --live-tools: the spec the experiment ran, whose dataset has the "
                   "sample's files [default: the path its plan names].")
def experiment_replay(hub: str, curve: CurveClient | None, experiment: str, sample: str,
                      variant: str, repeat: int, target: str, live_tools: bool,
                      spec_path: str) -> None:
    """Replay one cell of EXPERIMENT (its session, and the runs it asked) from the log, as
    `busctl replay` does a whole experiment: "identical" or the first divergence (exit 1).
    With --live-tools its tools run again in a fresh folder with the sample's files (read
    again from the dataset), as the cell's own folder was when the cell started.

    \b
    Examples:
      busctl experiment replay arith-1 --sample q07 --variant team --repeat 2
      busctl experiment replay arith-1 --sample q07 --live-tools
    """
    import uuid

    from agent_bus.agents.client.remote import connect as connect_agents
    from agent_bus.agents.experiment.runner import cell_workspaces
    from agent_bus.agents.experiment.spec import SpecError
    from agent_bus.agents.replay import replay_experiment

    journal = _journals(hub, curve, (experiment,))[0]
    variant = variant or (journal.plan.variants[0] if journal.plan else "")
    cell = journal.results.get((variant, sample, repeat))
    if cell is None or not cell.run_id:
        raise click.UsageError(f"--sample {sample} --variant {variant} --repeat {repeat}: no "
                               f"finished cell of experiment `{experiment}` (`busctl experiment "
                               f"report {experiment}` lists its variants)")
    target = target or f"{cell.tag}.replay-{uuid.uuid4().hex[:6]}"
    try:
        workspaces = cell_workspaces(msgspec.structs.replace(
            journal, results={cell.key: cell}), cell.tag, target, spec_path) if live_tools else {}
    except SpecError as exc:
        raise click.UsageError(str(exc)) from None

    async def go() -> object:
        async with connect_agents(hub, name="busctl-replay", curve=curve) as bus:
            try:
                return await replay_experiment(bus, cell.tag, target, only={cell.run_id},
                                               live_tools=live_tools, workspaces=workspaces)
            except ValueError as exc:
                return exc

    divergence = run_async(go)
    if isinstance(divergence, ValueError):
        raise click.UsageError(str(divergence))
    if divergence is not None:
        raise click.ClickException(f"{experiment} {variant}/{sample}/r{repeat} (run "
                                   f"{cell.run_id}) replayed as {target}: {divergence}")
    click.echo(f"{experiment} {variant}/{sample}/r{repeat} (run {cell.run_id}) replayed as "
               f"{target}: identical")


@experiment_group.command("compare")
@hub_options
@click.argument("first")
@click.argument("second", required=False, default="")
@click.option("--variants", nargs=2, default=None, metavar="A B",
              help="Compare variant A with variant B: both of FIRST, or A of FIRST with B of "
                   "SECOND.")
@click.option("--scorer", default="", metavar="NAME",
              help="The scorer compared [default: the first scorer].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object.")
@click.option("--state-dir", type=click.Path(exists=True, file_okay=False), default=None,
              help=STATE_DIR_HELP)
def experiment_compare(hub: str, curve: CurveClient | None, first: str, second: str,
                       variants: tuple[str, str] | None, scorer: str, as_json: bool,
                       state_dir: str | None) -> None:
    """Compare two experiments variant by variant (FIRST SECOND), or two variants (FIRST
    --variants A B), paired by sample: each side's per-sample mean (repeats averaged), the
    effect (mean difference, second minus first) with its 95% paired t interval, and a paired
    test: McNemar's exact test when each sample has one 0/1 outcome a side, else the paired t
    test.

    \b
    Examples:
      busctl experiment compare arith-1 arith-2 --json
      busctl experiment compare arith-1 --variants solo team
      busctl experiment compare arith-1 arith-2 --variants team team --scorer judge
    """
    import json

    from agent_bus.agents.experiment.report import compare, compare_text, compare_variants

    if not second and not variants:
        raise click.UsageError("give two experiments (FIRST SECOND), or one and the two "
                               "variants to compare (FIRST --variants A B)")
    names = (first, second or first)
    journals = _journals(hub, curve, tuple(dict.fromkeys(names)), state_dir)
    a, b = journals[0], journals[-1]
    _check_compared(a, b, names, variants, scorer)
    data = compare_variants(a, variants[0], b, variants[1], names, scorer) if variants \
        else compare(a, b, names, scorer)
    click.echo(json.dumps(data) if as_json else compare_text(data))


def _check_compared(a: Any, b: Any, names: tuple[str, str], variants: tuple[str, str] | None,
                    scorer: str) -> None:
    """--variants and --scorer name what the experiments have."""
    from agent_bus.agents.experiment.report import journal_scorers, variant_names

    for journal, name, variant in zip((a, b), names, variants or (), strict=False):
        known = variant_names(journal)
        if variant not in known:
            raise click.BadParameter(f"experiment `{name}` has no variant `{variant}` (its "
                                     f"variants: {', '.join(known)})", param_hint="--variants")
    known = journal_scorers(a)
    if scorer and scorer not in known:
        raise click.BadParameter(f"experiment `{names[0]}` has no scorer `{scorer}` (its "
                                 f"scorers: {', '.join(known) or 'none'})", param_hint="--scorer")
