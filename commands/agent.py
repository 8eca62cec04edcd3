"""Drive an agent: run, chat, and the verbs on a live run (steer, follow-up, abort)."""

from __future__ import annotations

import sys
from collections.abc import Callable

import click

from agent_bus.bus.security import CurveClient
from agent_bus.commands.base import COUNT, hub_options, run_async, use_color

# --- busctl run / chat / steer / follow-up / abort ----------------------------------------

LAST_SESSION = "\0last"  # `-c` without a value: the agent's last session


@click.command("run")
@hub_options
@click.option("--agent", default="assistant", show_default=True, help="Agent to prompt.")
@click.option("--json", "as_json", is_flag=True, help="Print the run's events as JSON lines.")
@click.option("-q", "--quiet", is_flag=True, help="Print only the answer (no trace on stderr).")
@click.option("-c", "--continue", "cont", is_flag=False, flag_value=LAST_SESSION, default=None,
              metavar="[SESSION]",
              help="Continue the agent's last session, or SESSION (the id a run printed) "
                   "[default: a fresh session].")
@click.option("--new-session", is_flag=True, hidden=True,
              help="A fresh session (the default now; kept for old scripts).")
@click.option("--experiment", default="", help="Tag the run's events with this experiment id.")
@click.option("--max-turns", type=COUNT, default=None,
              help="End the run after this many turns (stop reason max_iterations) "
                   "[default: the agent's max_iterations].")
@click.argument("prompt", required=False)
def run_cmd(hub: str, curve: CurveClient | None, agent: str, as_json: bool, quiet: bool,
            cont: str | None, new_session: bool, experiment: str, max_turns: int | None,
            prompt: str | None) -> None:
    """Send PROMPT (or `-` for stdin) to an agent; print its answer on stdout.

    Each run starts a fresh session (conversation) and prints its id on stderr; `-c` continues
    the agent's last session, `-c SESSION` a named one.

    The trace (tool calls, thinking, retries) goes to stderr, so `busctl run "…" > answer.txt`
    captures exactly the answer; `--json` prints every event of the run on stdout instead.

    \b
    Exit status: 0 on a normal stop, 1 on error, 2 on bad usage (an agent no coordinator
    serves, a bad flag), 3 when stopped at its turn limit (--max-turns or the agent's
    max_iterations; a line on stderr says so), 130 when aborted (Ctrl-C aborts the run; a
    second Ctrl-C exits at once).
    Example:
      busctl run --agent assistant "summarise README.md"
      busctl run -q "list the files" > files.txt
      busctl run -c "and the tests?"              # continues the last session
      busctl run -c coordinator-1.3f0c9a "again"  # continues that session
    """
    from agent_bus.agents.client.drive import drive_run

    if prompt is None and cont not in (None, LAST_SESSION):
        prompt, cont = cont, LAST_SESSION  # `-c "text"`: click took the prompt for SESSION
    if prompt is None:
        raise click.BadParameter("missing the prompt (or `-` to read it from stdin)",
                                 param_hint="PROMPT")
    text = sys.stdin.read() if prompt == "-" else prompt
    if not text.strip():
        raise click.BadParameter("the prompt is empty", param_hint="PROMPT")
    session = cont if cont not in (None, LAST_SESSION) else ""
    code = run_async(drive_run, hub, curve, agent, text, as_json, False, experiment,
                     use_color(), max_turns or 0, quiet, session or "",
                     cont == LAST_SESSION)
    sys.exit(code)


@click.command()
@hub_options
@click.option("--agent", default="assistant", show_default=True, help="Agent to talk to.")
@click.option("--session", default="", help="Continue this session [default: a fresh one].")
def chat(hub: str, curve: CurveClient | None, agent: str, session: str) -> None:
    """An interactive session: each line is a prompt; while a run streams, a line steers it.

    \b
    Every prompt continues the chat's one session. `/abort` aborts the current run,
    `/follow TEXT` queues a follow-up, `/reset` starts a new session (not during a run),
    `/help` lists these, Ctrl-D quits. Ctrl-C aborts the run in progress and returns to the
    prompt; at the prompt (or again while the abort is under way) it quits with exit 130.
    Examples:
      busctl chat
      busctl chat --agent reviewer --session coordinator-1.3f0c9a   # go on with a run's session
    """
    from agent_bus.agents.client.drive import chat as run_chat

    sys.exit(run_async(run_chat, hub, curve, agent, use_color(), session))


def _agent_verb(verb: str) -> Callable[..., None]:
    @hub_options
    @click.option("--run", "run_id", default="", help="The run to address (id from `busctl "
                  "status` or a run's events) [default: the agent's one live run].")
    @click.option("--session", default="", help="The session whose live run to address.")
    @click.argument("agent")
    @click.argument("text", required=verb in ("steer", "follow_up"))
    def command(hub: str, curve: CurveClient | None, run_id: str, session: str, agent: str,
                text: str | None = None) -> None:
        from agent_bus.agents.client.remote import connect as connect_agents

        async def go() -> str:
            async with connect_agents(hub, name=f"busctl-{verb}", curve=curve) as bus:
                method = getattr(bus, verb)
                detail: str = await method(agent, text or "", run=run_id, session=session)
                return detail

        detail = run_async(go)
        if verb == "abort" and detail == "idle":  # as steer: nothing to act on is a failure
            raise click.ClickException(f"{_whose(agent, run_id, session)} has no run in progress, "
                                       f"so there is nothing to abort (`busctl status` lists the "
                                       f"live runs)")
        click.echo(f"{verb.replace('_', '-')} sent to {agent}: {detail}")

    return command


def _whose(agent: str, run_id: str, session: str) -> str:
    return (f"session `{session}` of agent `{agent}`" if session else
            f"agent `{agent}` (--run {run_id})" if run_id else f"agent `{agent}`")


_ADDRESS = ("\n\nWith several live runs of AGENT, name one with --run or --session (the error "
            "lists them). A session without a run in progress is refused: continue it with "
            "`busctl run -c SESSION TEXT`.")


def _examples(*lines: str) -> str:
    return "\n\n\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


steer = click.command("steer", help="Queue a steering message for AGENT's live run (TEXT)." + _ADDRESS
             + _examples('busctl steer assistant "only look at the tests"',
                         'busctl steer assistant --run RUN_ID "skip the docs"   # one of several live runs'))(
    _agent_verb("steer"))
follow_up = click.command("follow-up", help="Queue TEXT for AGENT's live run to handle when it would "
             "otherwise stop." + _ADDRESS
             + _examples('busctl follow-up assistant "then write the summary to NOTES.md"'))(
    _agent_verb("follow_up"))
abort = click.command("abort", help="Abort AGENT's live run (model call and tool calls); TEXT, the "
             "reason, is in its agent_end error." + _ADDRESS
             + _examples("busctl abort assistant", 'busctl abort assistant "wrong folder"',
                         "busctl abort assistant --session coordinator-1.3f0c9a"))(
    _agent_verb("abort"))
