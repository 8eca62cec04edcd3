"""A real Slurm on this machine: `munged`, `slurmctld` and two `slurmd` "nodes" (n1, n2, both on
loopback), from Debian's slurm-wlm, with a slurm.conf in a temporary folder named by `SLURM_CONF`
(the machine's /etc/slurm is not touched) and its own munge socket, free ports, spool and state.
One cluster per session (it costs seconds to start on 2 cores); torn down even when a test fails:
every job cancelled, the daemons stopped, and any process still carrying this cluster's
`SLURM_CONF` (a step, a job's child) killed.

Skipped, with the reason, where it cannot run: slurm-wlm not installed (`.ci/run` installs it),
not root (slurmd starts jobs as their user), or slurmctld not coming up.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support import wait_for

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol")
MUNGE_KEY = Path("/etc/munge/munge.key")


@dataclass
class SlurmCluster:
    folder: Path
    conf: Path

    def env(self, **more: str) -> dict[str, str]:
        """A `busctl` or Slurm client of the tests: this cluster, nothing of another job."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        return {**env, "SLURM_CONF": str(self.conf), **more}

    def tool(self, *argv: str, timeout: float = 30.0) -> str:
        done = subprocess.run(list(argv), env=self.env(), capture_output=True, text=True,
                              timeout=timeout, check=False)
        if done.returncode != 0:
            raise AssertionError(f"{' '.join(argv)}: {done.stderr.strip()}")
        return done.stdout

    def jobs(self) -> list[str]:
        return self.tool("squeue", "-h", "-o", "%i").split()

    def processes(self, needle: str = "") -> list[str]:
        """Live processes that carry this cluster's SLURM_CONF (jobs, steps), with `needle` in
        their command line: what a stopped topology must not leave on any node."""
        return carrying(f"SLURM_CONF={self.conf}".encode(), needle)


def carrying(marker: bytes, needle: str = "") -> list[str]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if state != "Z" and marker in environ.split(b"\0") and needle in cmdline:
            found.append(f"{entry.name} {cmdline.strip()}")
    return found


def _skip_reason() -> str:
    missing = [name for name in DAEMONS if shutil.which(name) is None]
    if missing:
        return (f"slurm-wlm is not installed ({', '.join(missing)} missing): `apt-get install "
                "slurm-wlm` (.ci/run does) to run the Slurm tests")
    if os.geteuid() != 0:
        return "the Slurm tests start slurmd, which needs root"
    if not MUNGE_KEY.exists():
        return f"no munge key at {MUNGE_KEY} (slurm-wlm's munge package makes it)"
    return ""


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def write_conf(folder: Path, ports: list[int]) -> Path:
    host = socket.gethostname().split(".")[0]
    ctld, n1, n2 = ports
    (folder / "state").mkdir()
    for node in ("n1", "n2"):
        (folder / "spool" / node).mkdir(parents=True)
    conf = folder / "slurm.conf"
    conf.write_text(f"""\
ClusterName=bustest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={folder / "munge.socket"}
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
KillWait=5
MinJobAge=5
SchedulerParameters=bf_interval=1
StateSaveLocation={folder / "state"}
SlurmdSpoolDir={folder / "spool"}/%n
SlurmctldPidFile={folder}/slurmctld.pid
SlurmdPidFile={folder}/slurmd-%n.pid
SlurmctldLogFile={folder}/slurmctld.log
SlurmdLogFile={folder}/slurmd-%n.log
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1} CPUs=1 RealMemory=1000
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2} CPUs=1 RealMemory=1000
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
    return conf


def _start(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _stop(daemons: list[subprocess.Popen[bytes]]) -> None:
    for proc in reversed(daemons):
        if proc.poll() is None:
            proc.terminate()
    for proc in reversed(daemons):
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def _kill_leftovers(cluster: SlurmCluster) -> None:
    """Steps and job processes outlive slurmd: kill whatever still carries our SLURM_CONF."""
    for line in cluster.processes():
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.fixture(scope="session")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    folder = tmp_path_factory.mktemp("slurm")
    cluster = SlurmCluster(folder, write_conf(folder, _free_ports(3)))
    env = cluster.env()
    daemons: list[subprocess.Popen[bytes]] = []
    try:
        daemons.append(_start(["munged", "-F", "--force", f"--socket={folder / 'munge.socket'}",
                               f"--pid-file={folder / 'munged.pid'}",
                               f"--log-file={folder / 'munged.log'}",
                               f"--seed-file={folder / 'munged.seed'}"], env, folder / "munged.out"))
        wait_for(lambda: (folder / "munge.socket").exists(), 15, "munged's socket")
        daemons.append(_start(["slurmctld", "-D", "-i", "-f", str(cluster.conf)], env,
                              folder / "slurmctld.out"))
        for node in ("n1", "n2"):
            daemons.append(_start(["slurmd", "-D", "-N", node, "-f", str(cluster.conf)], env,
                                  folder / f"slurmd-{node}.out"))
        try:
            wait_for(lambda: _idle(cluster) == ["n1", "n2"], 45, "n1 and n2 idle in sinfo")
        except TimeoutError:
            log = (folder / "slurmctld.log")
            tail = log.read_text(errors="replace")[-1500:] if log.exists() else ""
            pytest.skip(f"slurmctld/slurmd did not come up here within 45 s:\n{tail}")
        yield cluster
    finally:
        _teardown(cluster, daemons)


def _idle(cluster: SlurmCluster) -> list[str]:
    try:
        lines = cluster.tool("sinfo", "-N", "-h", "-o", "%N %t", timeout=10).split("\n")
    except (AssertionError, subprocess.TimeoutExpired):
        return []
    return sorted(line.split()[0] for line in lines if line.strip().endswith("idle"))


def _teardown(cluster: SlurmCluster, daemons: list[subprocess.Popen[bytes]]) -> None:
    try:
        if cluster.jobs():
            cluster.tool("scancel", "--full", "--quiet", *cluster.jobs())
            wait_for(lambda: not cluster.jobs(), 30, "every job of the test cluster gone")
    except (AssertionError, TimeoutError, subprocess.TimeoutExpired):
        pass  # killed below either way
    finally:
        _kill_leftovers(cluster)
        _stop(daemons)
        _kill_leftovers(cluster)
