"""watchdog.py: with real processes. A fake trainer starts the watchdog, a child that ignores
SIGTERM (as the multiprocessing resource tracker does) and a child with a grandchild; killed with
SIGKILL, it leaves none of them alive after POLL_S + 2 * GRACE_S seconds (+1 s of slack), and the
directory it named is gone. A trainer that stops its watchdog (a normal close) keeps its processes
and the directory: the watchdog never acts on a live trainer."""

import contextlib
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from infra import watchdog

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = """
import subprocess, sys, time
from infra import watchdog
wd = watchdog.start([sys.argv[1]])
deaf = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"])
tree = subprocess.Popen(["sh", "-c", "sleep 600 & sleep 600"])
time.sleep(2.5)  # the watchdog has looked at the tree at least twice (POLL_S = 1)
if sys.argv[2] == "stop":
    watchdog.stop(wd)
print(deaf.pid, tree.pid, wd.pid, flush=True)
time.sleep(600)
"""


def fake_trainer(tmp_path, mode):
    """Start the fake trainer; returns (its Popen, its descendants as psutil processes, the
    watchdog's pid)."""
    doomed = tmp_path / "weights"
    doomed.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-c", TRAINER, str(doomed), mode],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    deaf, tree, wd = map(int, proc.stdout.readline().split())
    kids = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.pid != wd]
    assert {deaf, tree} <= {p.pid for p in kids} and len(kids) == 4  # + sh's two sleeps
    return proc, kids, wd, doomed


def alive(procs):
    return [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


@pytest.mark.slow
def test_kill_9_of_the_trainer_ends_its_processes_and_deletes_its_dirs(tmp_path):
    proc, kids, wd, doomed = fake_trainer(tmp_path, "watch")
    os.kill(proc.pid, signal.SIGKILL)  # the trainer only, as `kill -9 <pid>` does
    proc.wait()
    proc.stdout.close()  # else its garbage collection fails a later test (an unclosed file)
    t, limit = time.monotonic(), watchdog.POLL_S + 2 * watchdog.GRACE_S + 1
    while alive(kids) and time.monotonic() - t < limit:
        time.sleep(0.1)
    left = alive(kids)
    for p in left:
        p.kill()
    assert not left, f"alive {limit} s after the trainer died: {[p.cmdline() for p in left]}"
    with contextlib.suppress(psutil.NoSuchProcess):  # it deletes the directories, then exits
        assert psutil.wait_procs([psutil.Process(wd)], timeout=5)[1] == []
    assert not doomed.exists()


def test_a_stopped_watchdog_leaves_a_live_trainers_processes_alone(tmp_path):
    proc, kids, wd, doomed = fake_trainer(tmp_path, "stop")
    try:
        assert not psutil.pid_exists(wd) or psutil.Process(wd).status() == psutil.STATUS_ZOMBIE
        time.sleep(watchdog.POLL_S + 0.5)
        assert len(alive(kids)) == 4 and doomed.exists()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)  # the fake trainer's whole session
        proc.wait()
        proc.stdout.close()
