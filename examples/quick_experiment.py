"""The README's 15-line experiment: one run followed event by event, then 20 runs, 4 at a time.

    busctl up --demo                     # another terminal (or any topology with `assistant`)
    python examples/quick_experiment.py  # then: busctl export --experiment e1
"""

import anyio

from agent_bus import connect


async def main() -> None:
    async with connect() as bus:                       # $BUSCTL_HUB or tcp://127.0.0.1:7400
        run = await bus.prompt("assistant", "list the files", experiment="e1")
        async for envelope in run.events():            # every event of this run, in order
            print(envelope.header.seq, type(envelope.event).__name__)
        result = await run.result()
        print(result.final_text, result.usage)
        many = await bus.run_many([("assistant", f"task {i}") for i in range(20)],
                                  concurrency=4, experiment="e1")
        for r in many:
            print(r.run_id[:8], r.final_text, {m: u.total for m, u in r.usage.items()})
        print(len(many), "runs")


anyio.run(main)
