"""Stopping and failing around the NCCL weight push (issue 25, fixes 2 and 3), on CPU with fakes for
vLLM's side (the NCCL path itself needs GPUs).

Pins: a stopping pipeline's publish_by records and sends nothing and returns False, as publish does;
on 2 gloo ranks (tests/dist_stop_push.py, torchrun) an NCCL-style push whose fake sender all-gathers
on every rank sends on both ranks, a stop on rank 0 during the update phase makes both ranks skip
the send and return within 10 s, and an engine dying in the broadcast ends the push on both ranks
within 10 s with rank 0's stop set and one line naming the cause, every rank agreeing to stop (so
the step's checkpoint is written); a send to a dead engine raises within a poll of its death, one
that hangs past the deadline raises TimeoutError once the abort's grace is spent; SyncClient's
calls end once aborted; torchrun's shutdown grace is read as torch 2.13's torchrun reads it, and
the start-up warning names --shutdown-timeout with the value computed here by hand.
"""

import asyncio
import json
import os
import subprocess
import sys
import threading
import time

import pytest
from torch.distributed import run as torchrun
from torch.distributed.launcher.api import LaunchConfig

import filters
import generate
import pipeline
from infra import engine, launch
from tasks.data import Prompt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def loop():
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(10)
    lp.close()


class DyingEngine:
    """infra.engine.Engine's health check: dead() answers once `died` is set."""

    def __init__(self):
        self.died = threading.Event()

    def dead(self):
        if self.died.is_set():
            return "the vLLM engine died"
        return None


class IdleSampler(generate.Sampler):
    """A Sampler over a fake engine (its health check only) whose requests never finish."""

    def __init__(self):  # no vLLM engine: only what the pipeline touches
        self.version = 0
        self.next_version = None
        self.engine = DyingEngine()

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        await asyncio.sleep(3600)


def make_pipeline(sampler, loop, stop=None):
    prompts = [Prompt(i, f"q{i}", str(i), (1, 2, 3), False) for i in range(4)]
    return pipeline.Pipeline(
        sampler,
        prompts,
        filters.PromptPool(4),
        loop=loop,
        group_size=2,
        prompts_per_step=2,
        max_lag=1,
        stop=stop,
    )


def call_in_thread(fn, limit_s: float) -> dict:
    """fn() in a daemon thread, waited for at most limit_s: {"error": ..., "s": seconds} or
    {"value": ..., "s": ...}; {"hung": True} if it did not return."""
    out = {}

    def run():
        t0 = time.monotonic()
        try:
            out["value"] = fn()
        except BaseException as e:
            out["error"] = e
        out["s"] = time.monotonic() - t0

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(limit_s)
    if thread.is_alive():
        return {"hung": True}
    return out


def test_a_stopping_pipeline_sends_nothing(loop):
    sampler = IdleSampler()
    stop = {"requested": False}
    with make_pipeline(sampler, loop, stop=lambda: stop["requested"]) as pipe:
        stop["requested"] = True
        sent = []
        decided = []

        def agree(decide):
            decided.append(decide())
            return decided[-1]

        assert pipe.publish_by(1, lambda: sent.append(1), agree=agree) is False
        assert decided == [False]  # the one decision every rank follows: do not send
        assert sent == []
        assert pipe._published == 0  # nothing recorded: the run is stopping


def test_send_to_a_dead_engine_raises_within_a_poll_of_its_death(loop):
    sampler = IdleSampler()
    aborts = []
    unblock = threading.Event()

    def abort(why):  # as ncclCommAbort ends the broadcast: the send then fails
        aborts.append(why)
        unblock.set()

    def send():  # a broadcast to a receiver that died: blocks until aborted
        unblock.wait()
        raise RuntimeError("NCCL communicator aborted")

    with make_pipeline(sampler, loop) as pipe:
        threading.Timer(1.0, sampler.engine.died.set).start()
        out = call_in_thread(lambda: pipe.publish_by(1, send, abort=abort, timeout=60), 30)
        assert "hung" not in out, "publish_by never returned"
        assert isinstance(out["error"], RuntimeError)
        message = "the vLLM engine died during the weight send of version 1"
        assert str(out["error"]) == f"{message}; the pipeline cannot go on"
        assert aborts == [message]
        # the death is seen at the watchdog's next poll, far inside the 60 s deadline
        assert 1.0 <= out["s"] < 1.0 + 2 * pipeline.POLL_S
        assert sampler.version == 0


def test_a_send_past_its_deadline_raises_after_the_aborts_grace(loop):
    sampler = IdleSampler()  # alive: only the deadline ends this send
    aborts = []
    with make_pipeline(sampler, loop) as pipe:
        never = threading.Event()
        push = lambda: pipe.publish_by(1, never.wait, abort=aborts.append, timeout=1.0)
        out = call_in_thread(push, 30)
        assert "hung" not in out, "publish_by never returned"
        assert isinstance(out["error"], TimeoutError)
        assert str(out["error"]) == "the weight send of version 1 did not finish within 1.0 s"
        assert out["error"].__notes__ == ["the send did not return within 1.0 s of its abort"]
        assert aborts == [str(out["error"])]
        # 1 s to the deadline, then 1 s of grace for the aborted send, each seen at a poll
        assert 2.0 <= out["s"] < 2.0 + 2 * pipeline.POLL_S
        never.set()


def test_sync_client_calls_end_once_aborted(loop):
    async def hang(*a, **kw):
        await asyncio.sleep(3600)

    client = type("Client", (), {"init_weight_transfer_engine": hang})()
    sampler = type("S", (), {"engine": type("E", (), {"client": client})()})()
    sync = engine.SyncClient(sampler, loop)
    threading.Timer(0.5, sync.abort, args=("the vLLM engine died",)).start()
    out = call_in_thread(lambda: sync.init_weight_transfer_engine({}), 10)
    assert "hung" not in out
    assert str(out["error"]) == "the vLLM engine died"
    assert 0.5 <= out["s"] < 0.5 + 2 * engine.ABORT_POLL_S


def run_pushes(tmp_path, modes):
    """tests/dist_stop_push.py in each mode on 2 ranks, side by side: {mode: (exit code,
    {rank: what it wrote})}."""
    procs = {
        mode: subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node"]
            + ["2", os.path.join(ROOT, "tests", "dist_stop_push.py"), mode, str(tmp_path / mode)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for mode in modes
    }
    out = {}
    for mode, proc in procs.items():
        code = proc.wait(300)
        got = {}
        for rank in (0, 1):
            path = tmp_path / f"{mode}.{rank}"
            if path.exists():
                got[rank] = json.loads(path.read_text())
        out[mode] = (code, got)
    return out


@pytest.mark.slow
def test_two_rank_nccl_style_push_stop_and_dead_engine(tmp_path):
    out = run_pushes(tmp_path, ("send", "stop", "dead"))
    # the control: the fake send reaches both ranks, and rank 0's sampler takes version 1
    code, got = out["send"]
    assert code == 0
    assert [got[r]["sends"] for r in (0, 1)] == [1, 1]
    assert got[0]["version"] == 1
    assert [got[r]["stop_agreed"] for r in (0, 1)] == [False, False]
    # a Ctrl-C on rank 0 during the update phase: no rank enters the send, both agree to stop
    code, got = out["stop"]
    assert code == 0, got
    for rank in (0, 1):
        assert "error" not in got[rank], got[rank]
        assert got[rank]["sends"] == 0
        assert got[rank]["stop_agreed"] is True
        assert got[rank]["push_s"] < 10
    assert got[0]["version"] == 0
    # the engine dies in the broadcast: the sender is aborted, both ranks finish their gathers
    # and agree to stop (train.py then checkpoints the step), rank 0 saying why
    code, got = out["dead"]
    assert code == 0, got
    for rank in (0, 1):
        assert "error" not in got[rank], got[rank]
        assert got[rank]["stop_agreed"] is True
        assert got[rank]["push_s"] < 10
    assert got[0]["failed"] == "the vLLM engine died during the weight send of version 1"
    assert got[1]["failed"] is None
    assert got[1]["sends"] == 1  # its gathers all ran: no collective left half done
    assert got[0]["version"] == 0


def test_torchrun_grace_is_read_as_torchrun_reads_it():
    env = {"TORCHELASTIC_RUN_ID": "none"}
    argv = ["/usr/bin/python", "-m", "torch.distributed.run", "--nproc_per_node", "4", "train.py"]
    assert launch.torchrun_grace_s({}, argv) is None  # not under torchrun
    assert launch.torchrun_grace_s(env, argv) == 30.0  # torch's default
    assert launch.torchrun_grace_s({**env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90"}, argv) == 90.0
    both = {**env, "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "90", "PET_SHUTDOWN_TIMEOUT": "120"}
    assert launch.torchrun_grace_s(both, argv) == 120.0
    flag = argv[:3] + ["--shutdown-timeout", "300"] + argv[3:]
    assert launch.torchrun_grace_s(both, flag) == 300.0
    assert launch.torchrun_grace_s(env, ["torchrun", "--shutdown_timeout=240", "train.py"]) == 240
    # train.py's own flags are not torchrun's
    assert launch.torchrun_grace_s(env, [*argv, "--shutdown-timeout", "5"]) == 30.0
    # torch's own parsing agrees: the flag, its PET_ variable, and LaunchConfig's default
    parser = torchrun.get_args_parser()
    assert parser.parse_args(["--shutdown-timeout", "300", "train.py"]).shutdown_timeout == 300
    assert parser.parse_args(["train.py"]).shutdown_timeout is None
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=1)
    assert config.shutdown_timeout == 30


def test_grace_warning_names_the_flag_and_a_long_enough_grace():
    # Qwen3-8B, 8.19e9 parameters x 12 bytes (fp32 weights + two AdamW moments) = 98.3 GB, 98.3 s
    # at 1 GB/s; twice that (196.6 s) rounded up to a minute: 240 s
    line = launch.grace_warning(8_190_000_000, 30.0)
    assert line == (
        "warning: torchrun kills the workers 30 s after a Ctrl-C, and this model's checkpoint "
        "(98 GB, ~98 s at 1 GB/s) after finishing the step needs more: start torchrun with "
        "--shutdown-timeout 240"
    )
    assert launch.grace_warning(8_190_000_000, 240.0) is None
    assert launch.grace_warning(8_190_000_000, None) is None  # not under torchrun
    # the tiny model: 0.43M parameters, 5.2 MB, 0.005 s: torchrun's default 30 s covers it
    assert launch.grace_warning(430_000, 30.0) is None
    # 2.6e9 parameters: 31.2 GB, 31.2 s, twice that (62.4 s) over a 60 s grace: 120 s
    assert launch.grace_warning(2_600_000_000, 60.0).endswith("--shutdown-timeout 120")
