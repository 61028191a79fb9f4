"""A local sweep's runs as child processes, and what a stop signal to the sweep does to them.

`slurm.sweep --local` starts each run as a child in its own process group (a session of its own), so a Ctrl-C in
the terminal or a signal to the sweep's group reaches the sweep alone, and the sweep decides: SIGTERM or SIGINT to
the sweep is forwarded to every running run's group (the fit process and its loader workers), no further run is
started, the sweep waits for each run to write its checkpoint and exit (which releases the run's lock), appends a
line to `<sweep directory>/stops.jsonl` and exits with 128 + the signal's number. A second Ctrl-C is forwarded too,
and stops the runs at once (lightning_modules/stops.py). Rerunning the sweep resumes the stopped runs.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Mapping, Optional

SWEEP_STOPS = "stops.jsonl"
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SweepStopped(RuntimeError):
    """A local sweep stopped on a signal; `exit_code` is the status the sweep ends with."""

    def __init__(self, signum: int, message: str):
        super().__init__(message)
        self.exit_code = 128 + signum


class LocalRuns:
    """The runs a local sweep has running, each in its own process group, and the stop signal that came, if any.

    Runs start from the pool's threads and the signal handler runs in the main thread: a re-entrant lock keeps a
    run from starting unseen by a forward (a second signal may interrupt the handler of the first, hence
    re-entrant), and a run started once the sweep is stopping is not started at all.
    """

    def __init__(self):
        self.received: Optional[int] = None
        self._running: Dict[str, subprocess.Popen] = {}
        self._lock = threading.RLock()
        self._previous: Dict[int, Any] = {}

    def start(self, name: str, command: List[str], output, env: Mapping[str, str]) -> Optional[subprocess.Popen]:
        """Start run `name` in a new session (its own process group), its output to `output`; None once stopping."""
        with self._lock:
            if self.received is not None:
                return None
            # Popen returns after the child's exec, so its setsid has run: a forward reaches its group.
            process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT, env=dict(env),
                                       start_new_session=True)
            self._running[name] = process
            return process

    def ended(self, name: str) -> None:
        with self._lock:
            self._running.pop(name, None)

    def forward(self, signum: int, frame: Any) -> None:
        """The sweep's handler of SIGTERM and SIGINT: pass the signal to every running run's process group."""
        with self._lock:
            if self.received is None:
                self.received = signum
            names = sorted(self._running)
            # os.write, not print: the handler may interrupt a print of the main thread (a re-entrant buffer)
            os.write(sys.stderr.fileno(), (f"received {signal.Signals(signum).name}: passed to {len(names)} running "
                                           f"run(s) ({', '.join(names) or 'none'}), starting no more; waiting for "
                                           f"them to save and exit\n").encode())
            for process in self._running.values():
                try:
                    os.killpg(process.pid, signum)
                except ProcessLookupError:  # it ended just now
                    pass

    @contextmanager
    def forwarding(self) -> Iterator["LocalRuns"]:
        """`forward` as the handler of SIGTERM and SIGINT for the body (in the main thread; elsewhere signals
        cannot be handled, and the runs are left to the caller)."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self._previous = {signum: signal.getsignal(signum) for signum in FORWARDED_SIGNALS}
        for signum in FORWARDED_SIGNALS:
            signal.signal(signum, self.forward)
        try:
            yield self
        finally:
            for signum, handler in self._previous.items():
                signal.signal(signum, handler)

    def stopped_by(self, code: int) -> bool:
        """Whether a run's exit status is a stop by a signal the sweep passed on (128 + its number, as fit exits)."""
        return self.received is not None and code in {128 + signum for signum in FORWARDED_SIGNALS}


def record_sweep_stop(directory: Path, signum: int, outcomes: Mapping[str, List[str]]) -> Path:
    """Append the stop to `<directory>/stops.jsonl`: the signal and the runs by outcome (stopped, finished, failed,
    not started)."""
    path = Path(directory) / SWEEP_STOPS
    entry = {"time": time.strftime("%Y-%m-%dT%H:%M:%S"), "reason": f"signal {signal.Signals(signum).name}",
             **{outcome: sorted(names) for outcome, names in outcomes.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a", encoding="utf-8") as file:
        file.write(json.dumps(entry) + "\n")
    return path
