"""Rollouts to scored groups to batches: asynchronous RL with bounded off-policyness k.

PipelineRL-k and its baseline PPO-off-policy-k (arXiv 2510.13786 §3.1, A.11; PAPER.md §6). A
producer thread runs an asyncio loop with the `generate.Sampler` (producer.py): it draws prompts
from the `filters.PromptPool`, samples groups of G, scores them in a thread with their kind's
reward (`math_reward.math_rewards`, `code_reward.code_rewards`) and queues them; the trainer takes
batches of P groups and publishes weights (loaded in flight). The rules (may a group start, may
weights be released, may a group be trained on) are pure functions in offpolicy.py. Held-out
evaluation runs on an engine of its own, in a thread of its own (evals.py): an eval is a snapshot
of one weight version, and the training engine's weights change under its requests. Run by
`pytest tests/test_pipeline.py`, `python bench/pipeline.py`, `train.py`:

    with Pipeline(model_dir, prompts, pool, group_size=16, prompts_per_step=48, max_lag=8,
                  evaluator=model_dir) as pipe:
        batch = pipe.get_batch(v)  # ...train...; save to that_dir = pipe.weights_dir(v + 1)
        pipe.submit_eval(heldout, 16, version=v + 1, weights=that_dir)  # before publish
        pipe.publish(that_dir, v + 1)
        for result in pipe.eval_results(): ...  # the evals done since the last call, in order

A group consumed at trainer version t has lag t - min_version, the oldest policy version of any of
its sampled tokens (queue time counts); it is accepted iff lag <= k. Where this departs from the
paper, and why:
1. "Trainers wait if k steps ahead" is enforced by the producer (`offpolicy.may_start`): a group
   starts only if, counting the groups ahead of it, it will be consumed with lag <= k, so k = 0 is
   synchronous on-policy RL exactly. A group overtaken by later ones (it finished late) can still
   exceed k: it is dropped and counted (`gen/dropped_stale`), and its prompt is handed back to the
   pool to be sampled again.
2. Versions are the trainer's (`publish`'s numbers): the sampler labels the weights it loads with
   them; forced phrase tokens (mask 0) do not count towards the lag.
3. Publishes coalesce: if several arrive while one loads, only the newest loads (weights are whole
   snapshots).
4. PPO-off-policy-k: k·P groups per frozen weight version, k batches per version (lags 0..k-1); a
   batch may be consumed before the round's other groups finish (same data); weights published
   mid-round wait for the round's end. An eval measures the version it is given (`submit_eval`),
   whatever the training engine holds.
5. Producer idle time is time with no group in flight: the sampler's idle time, which PipelineRL
   reduces.
6. Evaluation is asynchronous (evals.py).
"""

import asyncio
import atexit
import contextlib
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import generate
from infra import watchdog
from infra.evals import Evals, check_evaluator
from infra.weight_dirs import VERSIONS_ALIVE, weights_parent, weights_root
from offpolicy import Batch, accept, batch_metrics, check_settings, may_release
from producer import Producer, check_sources
from tasks import math_reward

# seconds close() takes at most in all (groups cancelled, engine stopped, thread joined)
CLOSE_TIMEOUT = 30.0
POLL_S = 0.5  # the trainer thread's waits check for a stop request and a dead engine this often
# evals waiting or running at once: one sampling on the eval engine, one snapshot waiting for it
EVALS_PENDING = 2
# group_timeout's decode step: ~3x a loaded vLLM GPU engine's, slower than CPU's
GEN_S_PER_TOKEN = 0.1
GEN_TIMEOUT_MIN_S = 600.0


class Stopped(Exception):
    """Raised by get_batch, wait_evals and submit_eval once the pipeline's `stop` callable returns
    True (the trainer was asked to stop: Ctrl-C): they stop waiting for the engines, whose processes
    a terminal's Ctrl-C stops too. An error an engine raised meanwhile is its __cause__."""


def group_timeout(
    rollout_tokens: int, rollouts_in_flight: int, seqs_at_once: int, s_per_token=GEN_S_PER_TOKEN
) -> float:
    """Seconds a group may take to be sampled and scored before the pipeline calls the engine hung
    (the Pipeline's gen_timeout; train.py's default): a group may wait behind ceil(rollouts in
    flight / sequences the engines decode at once) rounds of full-length rollouts (rollout_tokens:
    thinking budget + phrase + answer budget), each decoded at s_per_token; at least
    GEN_TIMEOUT_MIN_S. Qwen3-8B preset on 3 engines of 22 sequences: 1,536 rollouts in flight, 24
    rounds of 14,400 tokens, 9.6 h (the fixed 1 h before issue 10 would have failed it)."""
    rounds = -(-rollouts_in_flight // max(seqs_at_once, 1))
    return max(GEN_TIMEOUT_MIN_S, rounds * rollout_tokens * s_per_token)


class Pipeline(Producer, Evals):
    """Producer thread + sampler + queue for the trainer's main thread (§3.1); use it as a context
    manager. The producer's coroutines are in producer.py, the eval side in evals.py.

    model: a model directory (the producer thread starts `generate.Sampler.create(model,
    **sampler_kwargs)` in its own loop and shuts it down on close), or a running Sampler with
    `loop`, the event loop running it in another thread (borrowed: left running). prompts[i]:
    prompt_ids, gold, thinking (data.Prompt), i from pool.next(). mode "pipeline": PipelineRL-k,
    k = max_lag >= 0; "ppo": PPO-off-policy-k, k = max_lag >= 1 batches per weight version.
    prompts_per_step: P, the groups of a batch. max_inflight: groups generated at once (default
    2P). reward_fn(responses, golds, thinking, timeout) -> a list of floats, as
    `math_reward.math_rewards`, or (floats, reasons), as `code_reward.code_rewards`; or a dict
    kind -> such a function, picked by each prompt's `kind` (data.Prompt.kind; default "math").
    gen_timeout: seconds to sample and score one group before the pipeline fails; an eval fails
    after so long without one of its requests finishing, or a load of its weights. version:
    trainer version of the start weights (the sampler labels them with it). weights_bytes: one
    weight version's size on disk (parameters x the sampler dtype's bytes) and spill_dir: where
    versions go when /dev/shm lacks room (`weights_parent`). stop: polled (POLL_S) by every wait
    of the trainer's thread; once it returns True, get_batch and wait_evals raise Stopped and
    publish only deletes the directory it is given. An owned engine also gets a watchdog
    (watchdog.py) that ends its processes (the eval engine's too) if this process is killed.
    evaluator: the eval engine, a model directory (started in a thread and event loop of its own,
    `generate.Sampler.create(evaluator, **eval_sampler_kwargs)`, in the background: the
    constructor does not wait for it; it is shut down on close) or a running Sampler with
    `eval_loop` (borrowed), or None (no evals). max_evals_pending: evals waiting or running at
    once (`submit_eval`). Raises ValueError on bad settings, the sampler's start errors; the eval
    engine's start errors reach the next wait of the trainer's thread.
    """

    def __init__(
        self,
        model,
        prompts,
        pool,
        *,
        group_size: int,
        prompts_per_step: int,
        max_lag: int = 8,
        mode: str = "pipeline",
        max_inflight: int | None = None,
        sampler_kwargs: dict | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        reward_fn=math_reward.math_rewards,
        reward_timeout: float = 5.0,
        gen_timeout: float = 3600.0,
        version: int = 0,
        weights_bytes: int = 0,
        spill_dir: str | None = None,
        stop: Callable[[], bool] | None = None,
        evaluator=None,
        eval_sampler_kwargs: dict | None = None,
        eval_loop: asyncio.AbstractEventLoop | None = None,
        max_evals_pending: int = EVALS_PENDING,
    ):
        check_settings(mode, max_lag, group_size, prompts_per_step)
        check_sources(prompts, pool, model, loop)
        check_evaluator(evaluator, eval_loop, max_evals_pending)
        self.G = group_size
        self.P = prompts_per_step
        self.k = max_lag
        self.mode = mode
        self.gen_timeout = gen_timeout
        self.max_inflight = max_inflight or 2 * prompts_per_step
        self.prompts = prompts
        self.pool = pool
        self.reward_fn = reward_fn
        self.reward_timeout = reward_timeout
        self._stop_requested = stop or (lambda: False)
        self._init_producer(version)
        self._init_evals(max_evals_pending)
        versions = VERSIONS_ALIVE + (max_evals_pending if evaluator is not None else 0)
        self._root = weights_root(weights_parent(weights_bytes, spill_dir, versions=versions))
        self._executor = ThreadPoolExecutor(4, thread_name_prefix="pipeline-reward")
        self._watchdog = None
        atexit.register(self.close)
        try:
            if isinstance(model, str) or isinstance(evaluator, str):
                self._watchdog = watchdog.start([self._root])  # before the engine's processes exist
            self._start_producer(model, loop, sampler_kwargs, version)
            self._start_evals(evaluator, eval_loop, eval_sampler_kwargs)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get_batch(self, version: int, timeout: float | None = None) -> Batch:
        """The next P groups with lag <= k at trainer version `version`; stale ones are dropped,
        counted, and their prompts handed back to the pool (`PromptPool.release`: sampled again,
        not skipped). Waits in POLL_S slices. Raises Stopped once stop() is True, the producer's
        exception (sampler, reward, data; its traceback and a note) once stored, RuntimeError once
        closed or if the engine died, TimeoutError after `timeout` s saying what the producer is
        doing. Its metrics: offpolicy.batch_metrics."""
        t0 = time.perf_counter()
        dropped = 0

        def ready() -> bool:
            nonlocal dropped
            dropped += self._drop_stale(version)
            return len(self._queue) >= self.P

        with self._cv:
            self._t_next = max(self._t_next, version)
            if not self._wait_until(ready, timeout):
                raise TimeoutError(self._describe(version, timeout))
            groups = [self._queue.popleft() for _ in range(self.P)]
            self._outstanding -= self.P
            self._t_next = max(self._t_next, version + 1)
            self._round_consumed += 1
            now = time.perf_counter()
            idle = self._idle_s
            if not self._inflight:  # idle right now too: up to now
                idle += now - self._idle_since
            self._idle_s = 0.0
            self._idle_since = now
            queued = len(self._queue)
            inflight = len(self._inflight)
        self._poke(self._wake)
        metrics = batch_metrics(
            groups,
            version,
            queued=queued,
            inflight=inflight,
            dropped=dropped,
            wait_s=now - t0,
            idle_s=idle,
        )
        return Batch(groups, metrics)

    def _drop_stale(self, version: int) -> int:  # with self._cv held
        """Drop the queued groups too stale to train on at `version`; returns how many."""
        stale = [g for g in self._queue if not accept(version, g.min_version, self.k, self.mode)]
        for g in stale:
            self._queue.remove(g)
            self.pool.release(g.index)  # never trained on: the pool serves the prompt again
            self._outstanding -= 1
            self.dropped += 1
            self._poke(self._wake)
        return len(stale)

    def weights_dir(self, version: int) -> str:
        """A fresh directory (on /dev/shm if there is one) to save a version into for `publish`;
        the pipeline deletes it once loaded or superseded, so vLLM never reads a directory that is
        being written."""
        return tempfile.mkdtemp(prefix=f"v{version}_", dir=self._root)

    def publish(self, weights_dir: str, version: int) -> None:
        """Hand the sampler trainer version `version` (a safetensors directory) and return:
        PipelineRL loads it in flight (§3.1); PPO-off-policy-k holds it until the round's k
        batches are consumed. A directory from `weights_dir()` is deleted once loaded or
        superseded; others are left alone. Raises ValueError unless `version` exceeds every
        earlier one; the producer's exception if it failed; RuntimeError once closed. Once stop()
        is True it only deletes a `weights_dir()` directory: the run is stopping."""
        with self._cv:
            if self._stop_requested():
                self._remove(weights_dir)
                return
            self._check()
            superseded = self._pending
            release = self._record_publish(version)  # raises before the swap below
            self._pending = (os.fspath(weights_dir), version)
        if superseded:
            self._remove(superseded[0])
        if release:
            self._poke(self._publish_event)

    def releases(self) -> bool:
        """Would a publish now reach the sampler at once? Always under PipelineRL; under
        PPO-off-policy-k once the round's k batches are consumed. The NCCL path asks first: every
        trainer rank must join its send."""
        with self._cv:
            return may_release(self.mode, self._round_consumed, self.k)

    def publish_by(self, version: int, send) -> bool:
        """`publish` for the NCCL path: hand the sampler trainer version `version` through
        `send()`, a blocking call that loads it into the running engine
        (generate.Sampler.sync_client: pause, receive the broadcast, label the weights with
        `version`, resume), with the same bookkeeping: the version is released as `publish` would
        (`releases()`); one not released (PPO-off-policy-k mid-round) is only recorded, never
        sent, as a superseded directory is never loaded. Returns whether it was sent. Raises
        ValueError unless `version` exceeds every earlier one, the producer's exception if it
        failed, RuntimeError if the sampler did not move to `version`, and send's errors."""
        with self._cv:
            self._check()
            release = self._record_publish(version)
        if not release:
            return False
        self.sampler.next_version = version  # the label the engine gives the weights send() loads
        send()
        if self.sampler.version != version:
            raise RuntimeError(
                f"the sampler went to version {self.sampler.version}, expected {version}"
            )
        self._weights_loaded(version)
        self._poke(self._wake)
        return True

    def _record_publish(self, version: int) -> bool:  # with self._cv held
        """Record a publish of `version`; True if it is released to the sampler now."""
        if version <= self._published:
            raise ValueError(
                f"version {version} must exceed the last published one, {self._published}"
            )
        self._published = version
        self._t_next = max(self._t_next, version)
        release = may_release(self.mode, self._round_consumed, self.k)
        if release:
            self._released = version
            self._round_consumed = 0
        return release

    def _weights_loaded(self, version: int) -> None:
        with self._cv:
            self._applied = version
            self._round_started = 0  # a new PPO-off-policy-k round (PipelineRL never reads it)
            self._cv.notify_all()

    def close(self) -> None:
        """Stop the producer, abort in-flight requests (a weight load finishes first) and pending
        evals, shut owned samplers down (the two engines at once), join the threads, end the
        engines' processes and idle reward workers, delete weight directories and snapshots, end
        the watchdog. Idempotent. Returns within about CLOSE_TIMEOUT s in all, whatever state the
        producer and the engines are in (a dead or hung engine included): each wait gets what is
        left of that budget, and the engines' processes still alive at its end are killed. An eval
        engine still starting then is left to the watchdog, which ends it once this process exits
        (and to the eval thread, which shuts it down once started)."""
        with self._cv:
            if self._closed:
                return
            self._closed = True
            self._cv.notify_all()
        atexit.unregister(self.close)
        deadline = time.monotonic() + CLOSE_TIMEOUT
        left = lambda: max(0.0, deadline - time.monotonic())
        if self._eval_worker is not None:
            self._eval_worker.cancel()  # vLLM aborts the eval's requests
        if self._producer is not None:
            self._on_loop(self._stop(), min(left(), 10.0))

        def shutdown_executors():
            for ex in (self._executor, self._eval_executor):
                ex.shutdown(cancel_futures=True)

        waiter = threading.Thread(target=shutdown_executors, daemon=True)
        # running reward calls hold workers that math_reward.close() would leave alive
        waiter.start()
        waiter.join(left())
        eval_closed = []  # [True] once nothing of the eval engine runs
        eval_closer = threading.Thread(
            target=lambda: eval_closed.append(self._close_eval(left)), daemon=True
        )
        eval_closer.start()  # beside the training engine's shutdown: each may take seconds
        self._close_engine(left)
        eval_closer.join(left())
        math_reward.close()
        shutil.rmtree(self._root, ignore_errors=True)
        if self._watchdog is not None and eval_closed == [True]:
            watchdog.stop(self._watchdog)

    def _on_loop(self, coro, timeout: float, loop=None) -> None:
        # for close(): a stuck loop must not keep it from shutting the rest down
        future = asyncio.run_coroutine_threadsafe(coro, loop or self.loop)
        with contextlib.suppress(Exception):
            future.result(timeout)
        future.cancel()  # if it timed out; a coroutine never started is closed with it

    def _wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """With self._cv held: wait in POLL_S slices until done() (True), checking every slice for
        a stop request, an error and a dead engine (`_check`); False after `timeout` s."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while True:
            self._check()
            if done():
                return True
            left = None if deadline is None else deadline - time.perf_counter()
            if left is not None and left <= 0:
                return False
            self._cv.wait(POLL_S if left is None else min(POLL_S, left))

    def _check(self) -> None:  # with self._cv held; the trainer's waits call it every POLL_S
        if self._stop_requested():
            raise Stopped("stop requested") from self._error
        if self._error is not None:
            raise self._error
        if self._closed:
            raise RuntimeError("the pipeline is closed")
        for name, sampler in (("", self.sampler), ("eval ", self.eval_sampler)):
            dead = sampler.dead() if isinstance(sampler, generate.Sampler) else None
            if dead:
                raise RuntimeError(f"{name and 'eval engine: '}{dead}; the pipeline cannot go on")

    def _fail(self, exc: BaseException, doing: str) -> None:
        exc.add_note(
            f"raised in the pipeline's {threading.current_thread().name} thread while {doing}"
        )
        with self._cv:
            self._error = self._error or exc
            self._cv.notify_all()

    def _poke(self, event: asyncio.Event, loop=None) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to wake
            (loop or self.loop).call_soon_threadsafe(event.set)

    def _remove(self, path: str) -> None:
        if os.path.dirname(os.path.abspath(path)) == self._root:
            shutil.rmtree(path, ignore_errors=True)
