"""What an `srun` step of `busctl up --engine slurm` runs: the bus process, as its child.

`srun` ends a step at once when it gets SIGTERM itself ("forcing job termination": the task is
killed, with no chance to close its event log or abort its runs), but forwards SIGUSR1 to the
task untouched. So the supervisor stops a step with SIGUSR1, and this relay turns it into the
SIGTERM the bus process stops cleanly on. SIGTERM from Slurm itself (scancel, preemption, the
time limit: slurmstepd signals every task, then SIGKILLs after KillWait) is relayed too.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from types import FrameType

RELAYED = (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def main(argv: list[str]) -> int:
    if not argv:
        sys.stderr.write("usage: python -m agent_bus.agents.launch.slurm_step COMMAND...\n")
        return 2
    # slurmstepd signals every process of the step (proctrack), the bus process too: it must
    # ignore SIGUSR1 (an ignored signal stays ignored across exec), or it would die of it.
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    child = subprocess.Popen(argv)  # stdin, stdout (its ready line) and stderr are srun's

    def relay(signum: int, frame: FrameType | None) -> None:
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)

    for sig in RELAYED:
        signal.signal(sig, relay)
    code = child.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
