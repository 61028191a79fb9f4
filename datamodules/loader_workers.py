"""Loader workers that outlive the signals which stop a training run.

A scheduler or `timeout` sends its stop signal to every process of the job (`scancel` signals the whole job step,
`timeout` and a terminal's Ctrl-C the whole process group), so the DataLoader's worker processes receive it beside
the training process. Left to torch, a worker dies of it: torch's worker handler ends the worker on a SIGTERM from
any process but its parent, a SIGINT ends the worker loop, and SIGUSR1's default action ends the process. The
training process then raises "DataLoader worker exited unexpectedly" wherever it was, even in the middle of a
step, and the run ends with an error instead of the orderly stop that lightning_modules/stops.py makes at the next
step boundary. So a worker ignores these signals from anyone but its parent, and the training process shuts its
workers down itself when it stops; a SIGTERM from the parent (the loader ending a worker that does not shut down)
still ends the worker at once, as torch intends.
"""
from __future__ import annotations

import os
import signal
import threading
from typing import Optional

from lightning.fabric.utilities.seed import pl_worker_init_function

# The signals lightning_modules/stops.py turns into a stop of the training process.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


def init_loader_worker(worker_id: int, rank: Optional[int] = None) -> None:
    """A DataLoader `worker_init_fn`: the stop signals of the process group leave the worker alone (see the module
    docstring); then the per-worker seeding that Lightning gives a loader without an init function of its own
    (`seed_everything(workers=True)`, which fit calls)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    end_on_sigterm_from(os.getppid())
    if int(os.environ.get("PL_SEED_WORKERS", 0)):
        pl_worker_init_function(worker_id, rank)


def end_on_sigterm_from(parent: int) -> None:
    """SIGTERM ends this process only when `parent` sent it; from anyone else it is dropped.

    A handler cannot see who sent a signal, so SIGTERM is blocked (in this thread and in every thread it starts
    later: a forked worker has no other) and a thread takes each one with its sender's pid from `sigwaitinfo`.
    Ignoring SIGTERM outright would leave a stuck worker that the loader or the interpreter's exit tries to
    terminate running forever.
    """
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

    def wait() -> None:
        while signal.sigwaitinfo({signal.SIGTERM}).si_pid != parent:
            pass
        os._exit(0)  # what torch's own handler does on its parent's SIGTERM

    threading.Thread(target=wait, name="sigterm-from-parent", daemon=True).start()
