"""The run's watchdog: a small process that outlives a killed trainer and ends every process the
trainer started.

A trainer killed with SIGKILL runs no cleanup, and vLLM's engine processes (EngineCore, Worker) do
not watch their parent: they would keep their memory, CPU and GPUs for good (issue 13).
`start(dirs)` launches this file as a process in its own session, so neither a terminal's Ctrl-C
nor a kill of the trainer's process group reaches it. Every POLL_S seconds it records the
trainer's descendants (pid and start time, so a reused pid is never mistaken for one of them);
once the trainer is gone (or a zombie), it sends them SIGTERM, SIGKILL after GRACE_S, deletes the
directories it was given, and exits: within about POLL_S + 2 * GRACE_S seconds of the trainer's
death. A trainer that closes normally calls `stop`, which kills the watchdog before it acts.

Why this design: PR_SET_PDEATHSIG or a parent-pid poll would need code inside vLLM's processes,
which vLLM starts itself (on CPU by forking from a thread, on GPU by spawning); the watchdog needs
none, and it also covers the multiprocessing resource tracker and the reward workers. It polls the
trainer instead of waiting for EOF on a pipe from it, because vLLM forks its engine from the
trainer, so the engine would hold the pipe open.

    proc = watchdog.start([weights_root])   # infra/generator.py, before either engine starts
    watchdog.stop(proc)                      # after a normal shutdown (generator.Engines.close)

Exercised by `pytest tests/test_watchdog.py` and, on a real run killed with SIGKILL,
tests/test_train.py. Plumbing the paper (arXiv 2510.13786) does not describe, so no departures
from it: 1. none.
"""

import contextlib
import os
import shutil
import subprocess
import sys
import time

import psutil

POLL_S = 1.0  # seconds between looks at the trainer and its process tree
GRACE_S = 2.0  # seconds between SIGTERM and SIGKILL, then the most it waits for the killed to go
# (2, not more: a vLLM process at nice 19, the CPU eval engine's, may not run its SIGTERM handler
# for seconds on a loaded machine, and everything must be gone within 10 s of the trainer's death)


def start(dirs: list[str]) -> subprocess.Popen:
    """Start a watchdog over this process and its descendants; `dirs` are deleted once this process
    is dead. Returns the watchdog's Popen, for `stop`."""
    me = psutil.Process()
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), str(me.pid), repr(me.create_time()), *dirs],
        stdin=subprocess.DEVNULL,
        start_new_session=True,  # a terminal's Ctrl-C, or a kill of our process group, misses it
    )


def stop(proc: subprocess.Popen) -> None:
    """End a watchdog whose trainer is closing normally (it leaves everything alone) and reap
    it."""
    proc.kill()
    proc.wait()


def _gone(trainer: psutil.Process) -> bool:
    try:
        return not trainer.is_running() or trainer.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _trainer(pid: int, create_time: float) -> psutil.Process | None:
    """The trainer's process, or None when it is gone (its pid may have been reused since)."""
    try:
        trainer = psutil.Process(pid)
        started = trainer.create_time()
    except psutil.NoSuchProcess:
        return None
    if abs(started - create_time) > 0.01:  # the pid was reused: the trainer is gone
        return None
    return trainer


def watch(pid: int, create_time: float, dirs: list[str]) -> None:
    """The watchdog's loop (this file's __main__): see the module docstring."""
    trainer = _trainer(pid, create_time)
    # the trainer's descendants so far; each psutil.Process holds its start time
    seen: dict[int, psutil.Process] = {}
    while trainer is not None and not _gone(trainer):
        with contextlib.suppress(psutil.Error):
            for p in trainer.children(recursive=True):
                if p.pid != os.getpid() and p.pid not in seen:
                    # another pipeline's watchdog is not ours to end
                    with contextlib.suppress(psutil.Error):
                        if os.path.abspath(__file__) not in p.cmdline():
                            seen[p.pid] = p
        time.sleep(POLL_S)
    left = [p for p in seen.values() if p.is_running()]  # is_running() compares start times too
    for p in left:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(left, timeout=GRACE_S)
    for p in alive:  # e.g. the resource tracker, which ignores SIGTERM
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(alive, timeout=GRACE_S)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]), sys.argv[3:])
