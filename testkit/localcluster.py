"""A real single-node SLURM cluster on the local host, for tests: munged, slurmctld and slurmd in a folder.

Needs Debian's `slurm-wlm` and `munge` packages and root (the daemons run as root with their own key,
sockets, ports, state and logs under the folder, so nothing system-wide is touched). Every daemon started is
stopped again by its PID.

    with LocalSlurm(tmp_path) as cluster:
        subprocess.run(["sbatch", ...], env=cluster.env)
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List

DAEMONS = ("munged", "slurmctld", "slurmd")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def slurm_conf(root: Path, host: str, cpus: int, memory_mb: int, ports: tuple) -> str:
    return "\n".join([
        "ClusterName=local", f"SlurmctldHost={host}", "AuthType=auth/munge", "CredType=cred/munge",
        f"AuthInfo=socket={root / 'munge.sock'}", "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
        "SchedulerType=sched/builtin", "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
        f"SlurmctldPidFile={root / 'slurmctld.pid'}", f"SlurmdPidFile={root / 'slurmd.pid'}",
        f"SlurmdSpoolDir={root / 'spool'}", f"StateSaveLocation={root / 'state'}",
        f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}", f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
        f"SlurmctldPort={ports[0]}", f"SlurmdPort={ports[1]}", "SlurmUser=root", "ReturnToService=2",
        "MpiDefault=none", "JobRequeue=1", "AccountingStorageType=accounting_storage/none",
        "JobAcctGatherType=jobacct_gather/none", "KillWait=10",
        f"NodeName={host} CPUs={cpus} RealMemory={memory_mb} State=UNKNOWN",
        f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP", ""])


class LocalSlurm:
    """Start the three daemons under `root`; `env` is the environment for sbatch / squeue / scontrol."""

    def __init__(self, root: Path, cpus: int | None = None):
        self.root = Path(root)
        self.cpus = cpus or os.cpu_count() or 1
        self.env: Dict[str, str] = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def __enter__(self) -> "LocalSlurm":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        for folder in ("state", "spool", "log"):
            (self.root / folder).mkdir(parents=True, exist_ok=True)
        key = self.root / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        memory_mb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2 ** 20 // 2
        host = socket.gethostname().split(".")[0]
        (self.root / "slurm.conf").write_text(slurm_conf(self.root, host, self.cpus, memory_mb,
                                                         (free_port(), free_port())))
        self._run(["munged", f"--key-file={key}", f"--socket={self.root / 'munge.sock'}",
                   f"--pid-file={self.root / 'munged.pid'}", f"--log-file={self.root / 'log' / 'munged.log'}",
                   f"--seed-file={self.root / 'munge.seed'}", "--force"])
        self._run(["slurmctld", "-f", str(self.root / "slurm.conf")])
        self._run(["slurmd", "-f", str(self.root / "slurm.conf")])
        self.wait_for_idle_node()

    def _run(self, command: List[str]) -> None:
        result = subprocess.run(command, env=self.env, capture_output=True, text=True, timeout=60)
        if result.returncode != 0:
            self.stop()
            raise RuntimeError(f"{command[0]} failed to start: {result.stderr.strip()} (logs in {self.root / 'log'})")

    def wait_for_idle_node(self, timeout: float = 60) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            state = self.command("sinfo", "-h", "-o", "%T").stdout.strip()
            if state.startswith("idle"):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the local SLURM node did not become idle (logs in {self.root / 'log'})")

    def command(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=60)

    def stop(self) -> None:
        """Cancel what is left, then stop each daemon this object started, by its PID file."""
        if (self.root / "slurmctld.pid").is_file():
            self.command("scancel", "--full", "--user", os.environ.get("USER", "root"))
        for name in reversed(DAEMONS):
            pid_file = self.root / f"{name}.pid"
            if not pid_file.is_file():
                continue
            pid = int(pid_file.read_text().split()[0])
            _terminate(pid)
            pid_file.unlink(missing_ok=True)


def _terminate(pid: int, timeout: float = 15) -> None:
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
