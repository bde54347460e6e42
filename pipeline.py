"""Rollouts to scored groups to batches: asynchronous RL with bounded off-policyness k.

PipelineRL-k and its baseline PPO-off-policy-k (arXiv 2510.13786 §3.1 and appendix A.11). A
producer runs in the training engine's thread and asyncio loop (`infra.engine.SamplerThread`)
beside the `generate.Sampler`: it draws prompts from the `filters.PromptPool`, samples groups of
G, scores them in a thread pool with their kind's reward (`math_reward.math_rewards`,
`code_reward.code_rewards`; `score`) and queues them; the trainer takes batches of P groups
(`get_batch`) and publishes weights, which the producer loads in flight. The three rules, as pure
functions taking the mode: may a group start now (`may_start`), may published weights reach the
sampler now (`may_release`), may a queued group be trained on (`accept`). Held-out evaluation is
not here: it runs on an engine of its own (infra/evals.py), since an eval measures one weight
version and this engine's weights change under its requests. Run by `pytest
tests/test_pipeline.py` (the rules on hand-worked tables; fake and real engines),
`python bench/pipeline.py`, and `train.py` (through infra/generator.py):

    with Pipeline(model_dir, prompts, pool, group_size=16, prompts_per_step=48, max_lag=8) as pipe:
        batch = pipe.get_batch(v)  # ...train...; save to that_dir = pipe.weights_dir(v + 1)
        pipe.publish(that_dir, v + 1)

A group consumed at trainer version t has lag t - min_version, the oldest policy version of any of
its sampled tokens (queue time counts); it is accepted iff lag <= k. Where this departs from the
paper, and why:
1. "Trainers wait if k steps ahead" is enforced by the producer (`may_start`): a group starts only
   if, counting the groups ahead of it, it will be consumed with lag <= k, so k = 0 is synchronous
   on-policy RL exactly. A group overtaken by later ones (it finished late) can still exceed k: it
   is dropped and counted (`gen/dropped_stale`), and its prompt is handed back to the pool to be
   sampled again.
2. Versions are the trainer's (`publish`'s numbers): the sampler labels the weights it loads with
   them; forced phrase tokens (mask 0) do not count towards the lag.
3. Publishes coalesce: if several arrive while one loads, only the newest loads (weights are whole
   snapshots).
4. PPO-off-policy-k: k·P groups per frozen weight version, k batches per version (lags 0..k-1); a
   batch may be consumed before the round's other groups finish (same data); weights published
   mid-round wait for the round's end.
5. Producer idle time is time with no group in flight: the sampler's idle time, which PipelineRL
   reduces.
"""

import asyncio
import atexit
import collections
import os
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

import filters
import generate
from infra import engine
from infra.weight_dirs import WeightDirs
from tasks import math_reward

MODES = ("pipeline", "ppo")  # PipelineRL-k, PPO-off-policy-k
# seconds close() takes at most in all (groups cancelled, engine stopped, thread joined)
CLOSE_TIMEOUT = 30.0
POLL_S = 0.5  # the trainer thread's waits check for a stop request and a dead engine this often
# group_timeout's decode step: ~3x a loaded vLLM GPU engine's, slower than CPU's
GEN_S_PER_TOKEN = 0.1
GEN_TIMEOUT_MIN_S = 600.0


# ---- the rules (§3.1, A.11), pure ----


def accept(version: int, min_version: int, max_lag: int, mode: str = "pipeline") -> bool:
    """True iff a group whose oldest sampled token is from policy `min_version` may be trained on
    at trainer version `version`: lag = version - min_version <= max_lag (§3.1, A.11); under
    PPO-off-policy-k lag <= max_lag - 1, as its k batches per weight version have lags 0..k-1 by
    construction. Time spent queued counts."""
    if mode == "ppo":
        return version - min_version <= max_lag - 1
    return version - min_version <= max_lag


def may_start(
    t_next: int,
    outstanding: int,
    prompts_per_step: int,
    sampler_version: int,
    max_lag: int,
    mode: str = "pipeline",
    round_started: int = 0,
) -> bool:
    """May a group start now? PipelineRL-k's throttle: t_next is the trainer version at the next
    consumption, outstanding the groups started and not yet consumed or dropped, sampler_version
    the trainer version of the sampler's weights; the new group will be consumed about
    `outstanding // prompts_per_step` batches after t_next, and its tokens come from versions >=
    sampler_version, so it starts iff that lag is <= max_lag. PPO-off-policy-k: iff fewer than
    k·P groups (`round_started`) have started on the weights loaded last."""
    if mode == "ppo":
        return round_started < max_lag * prompts_per_step
    lag = t_next + outstanding // prompts_per_step - sampler_version
    return lag <= max_lag


def may_release(mode: str, round_consumed: int, max_lag: int) -> bool:
    """May weights published now reach the sampler at once? Always under PipelineRL (loaded in
    flight); under PPO-off-policy-k once the round's k batches (`round_consumed`) are consumed."""
    return mode == "pipeline" or round_consumed >= max_lag


def group_timeout(
    rollout_tokens: int, rollouts_in_flight: int, seqs_at_once: int, s_per_token=GEN_S_PER_TOKEN
) -> float:
    """Seconds a group may take to be sampled and scored before the pipeline calls the engine hung
    (the Pipeline's gen_timeout; train.py's default): a group may wait behind ceil(rollouts in
    flight / sequences the engines decode at once) rounds of full-length rollouts (rollout_tokens:
    thinking budget + phrase + answer budget), each decoded at s_per_token; at least
    GEN_TIMEOUT_MIN_S. Qwen3-8B preset on 3 H100 engines of 66 sequences: 1,536 rollouts in
    flight, 8 rounds of 16,512 tokens, 3.7 h."""
    rounds = -(-rollouts_in_flight // max(seqs_at_once, 1))
    return max(GEN_TIMEOUT_MIN_S, rounds * rollout_tokens * s_per_token)


# ---- groups and batches ----


@dataclass(eq=False)  # one group is one sampling event: == is identity (its tensors never compare)
class Group:
    """G rollouts of one prompt with their rewards; versions are trainer versions (those of
    `completion.versions` too)."""

    prompt: object  # data.Prompt: prompt_ids, gold, thinking
    index: int  # the prompt's index in the pool (pool.next()), for PromptPool.record
    completions: list[generate.Completion]
    rewards: list[float]  # (G,)
    min_version: int  # oldest policy version of any sampled token (mask True) in the group
    gen_s: float  # seconds from start to scored
    reasons: list[str] | None = None  # (G,) why each reward, when the reward function says (code)


@dataclass
class Batch:
    groups: list[Group]  # P groups, in the order they finished
    metrics: dict[str, float]  # batch_metrics


def reason_fractions(groups) -> dict[str, float]:
    """{"reward/<task>/<reason>": share of the task's samples in `groups` with that reason}, over
    the groups whose reward function gave reasons (code: passed, no_code, ...); {} if none did."""
    counts = collections.Counter()
    totals = collections.Counter()
    for g in groups:
        task = getattr(g.prompt, "task", "math")
        totals[task] += len(g.reasons or [])
        counts.update((task, why) for why in g.reasons or [])
    return {f"reward/{task}/{why}": n / totals[task] for (task, why), n in sorted(counts.items())}


def batch_metrics(
    groups: list[Group],
    version: int,
    *,
    queued: int,
    inflight: int,
    dropped: int,
    wait_s: float,
    idle_s: float,
) -> dict[str, float]:
    """The metrics of a batch of `groups` consumed at trainer version `version`: train/lag_min,
    train/lag_mean, train/lag_max; gen/queue_depth (`queued`: groups left queued), gen/inflight,
    gen/dropped_stale (`dropped` for this batch), gen/tokens, gen/interrupt_rate,
    gen/truncation_rate, gen/reward_mean, gen/reward_std; time/trainer_wait_s (`wait_s`),
    time/producer_idle_s (`idle_s`: no group in flight, since the last batch), time/group_gen_s
    (mean seconds to sample and score a group); and reason_fractions."""
    mean = statistics.fmean
    lags = [version - g.min_version for g in groups]
    comps = [c for g in groups for c in g.completions]
    rewards = [r for g in groups for r in g.rewards]
    return {
        "train/lag_min": min(lags),
        "train/lag_mean": mean(lags),
        "train/lag_max": max(lags),
        "gen/queue_depth": queued,
        "gen/inflight": inflight,
        "gen/dropped_stale": dropped,
        "gen/tokens": sum(len(c.completion_ids) for c in comps),
        "gen/interrupt_rate": mean(c.interrupted for c in comps),
        "gen/truncation_rate": mean(c.truncated for c in comps),
        "gen/reward_mean": mean(rewards),
        "gen/reward_std": statistics.pstdev(rewards),
        "time/trainer_wait_s": wait_s,
        "time/producer_idle_s": idle_s,
        "time/group_gen_s": mean(g.gen_s for g in groups),
        **reason_fractions(groups),
    }


async def score(
    reward_fn, prompt, texts: list[str], executor, timeout: float
) -> tuple[list[float], list[str] | None]:
    """(rewards, reasons or None) of `texts`, completions of `prompt`, from `reward_fn` (a function
    as `math_reward.math_rewards`, returning floats, or as `code_reward.code_rewards`, returning
    (floats, reasons); or a dict kind -> such a function, picked by the prompt's kind,
    data.Prompt.kind) run in `executor` with `timeout` s per completion. Raises ValueError when no
    function grades the prompt's kind or the function returns the wrong number of values."""
    kind = getattr(prompt, "kind", "math")
    if isinstance(reward_fn, dict) and kind not in reward_fn:
        raise ValueError(f"no reward function for kind {kind!r} (have {sorted(reward_fn)})")
    fn = reward_fn
    if isinstance(reward_fn, dict):
        fn = reward_fn[kind]
    golds = [prompt.gold] * len(texts)
    loop = asyncio.get_running_loop()
    out = await loop.run_in_executor(executor, fn, texts, golds, prompt.thinking, timeout)
    rewards = out
    reasons = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list | tuple):
        rewards, reasons = out  # code_rewards' (floats, reasons)
    if len(rewards) != len(texts) or len(reasons or texts) != len(texts):
        raise ValueError(f"reward_fn returned {len(rewards)} rewards for {len(texts)} completions")
    if reasons is not None:
        reasons = [str(why) for why in reasons]
    return [float(r) for r in rewards], reasons


# ---- what the trainer's thread shares with a background one ----


class Stopped(Exception):
    """Raised by the trainer thread's waits (Pipeline.get_batch, EvalEngine.wait, ...) once their
    `stop` callable returns True (the trainer was asked to stop: Ctrl-C): they stop waiting for
    the engines, whose processes a terminal's Ctrl-C stops too. An error raised in the background
    meanwhile is its __cause__."""


class SharedState:
    """What the trainer's thread shares with a background thread (the producer's here, the eval
    engine's in infra/evals.py), under one condition `cv`: the first error raised there (`fail`),
    whether it is closed, and the trainer's waits (`wait_until`), which check every POLL_S for a
    stop request (`stop()` True), an error, a close and a dead engine (`dead()`: why the engine can
    no longer serve, or None). `name` names the owner in messages."""

    def __init__(self, name: str, stop: Callable[[], bool] | None, dead: Callable[[], str | None]):
        self.cv = threading.Condition()
        self.error: BaseException | None = None
        self.closed = False
        self.name = name
        self.stopping = stop or (lambda: False)
        self._dead = dead

    def check(self) -> None:
        """With cv held: raise Stopped, the stored error, RuntimeError once closed or if the engine
        died; else return."""
        if self.stopping():
            raise Stopped("stop requested") from self.error
        if self.error is not None:
            raise self.error
        if self.closed:
            raise RuntimeError(f"the {self.name} is closed")
        dead = self._dead()
        if dead:
            raise RuntimeError(f"{dead}; the {self.name} cannot go on")

    def wait_until(self, done: Callable[[], bool], timeout: float | None) -> bool:
        """With cv held: wait in POLL_S slices until done() (True), calling `check` every slice;
        False after `timeout` s."""
        deadline = None
        if timeout is not None:
            deadline = time.perf_counter() + timeout
        while True:
            self.check()
            if done():
                return True
            slice_s = POLL_S
            if deadline is not None:
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                slice_s = min(POLL_S, left)
            self.cv.wait(slice_s)

    def fail(self, exc: BaseException, doing: str) -> None:
        """Store `exc` (the first error only), noted with the thread and what it was `doing`, for
        the trainer's next wait."""
        exc.add_note(f"raised in the {threading.current_thread().name} thread while {doing}")
        with self.cv:
            if self.error is None:
                self.error = exc
            self.cv.notify_all()


# ---- the pipeline ----


class Pipeline:
    """Producer + sampler + queue for the trainer's main thread (§3.1); use it as a context
    manager.

    model: a model directory (the pipeline starts `generate.Sampler.create(model,
    **sampler_kwargs)` in a thread and event loop of its own, `infra.engine.SamplerThread`, and
    shuts it down on close), or a running Sampler with `loop`, the event loop running it in another
    thread (borrowed: left running). prompts[i]: prompt_ids, gold, thinking (data.Prompt), i from
    pool.next(). mode "pipeline": PipelineRL-k, k = max_lag >= 0; "ppo": PPO-off-policy-k, k =
    max_lag >= 1 batches per weight version (train.py's flags: config.py checks k, G and P).
    prompts_per_step: P, the groups of a batch. max_inflight: groups generated at once (default
    2P). reward_fn(responses, golds, thinking, timeout) -> a list of floats, as
    `math_reward.math_rewards`, or (floats, reasons), as `code_reward.code_rewards`; or a dict
    kind -> such a function, picked by each prompt's `kind` (data.Prompt.kind; default "math").
    gen_timeout: seconds to sample and score one group before the pipeline fails. version: trainer
    version of the start weights (the sampler labels them with it). weight_dirs: where published
    versions are written (`weights_dir`), an `infra.weight_dirs.WeightDirs` the caller closes, as
    infra/generator.py shares one with the eval engine; None: one of the pipeline's own, on
    /dev/shm where there is one, deleted on close. stop: polled (POLL_S) by every wait of the
    trainer's thread; once it returns True, get_batch raises Stopped and publish only deletes the
    directory it is given. The caller that owns this process starts the watchdog over the engine's
    processes (infra/generator.py). Raises ValueError for an unknown mode, prompts the pool does not
    serve or a model without its matching loop, and the sampler's start errors.
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
        weight_dirs: WeightDirs | None = None,
        stop: Callable[[], bool] | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if getattr(pool, "n_prompts", len(prompts)) != len(prompts):
            raise ValueError(
                f"need as many prompts as the pool's n_prompts: {len(prompts)} prompts, "
                f"n_prompts={pool.n_prompts}"
            )
        if isinstance(model, str) == (loop is not None):
            raise ValueError(
                "need a model directory, or a running Sampler together with its event loop"
            )
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
        self._state = SharedState("pipeline", stop, self._dead)
        # the state the producer and the trainer's thread share, under self._state.cv
        self._queue: collections.deque[Group] = collections.deque()
        self._pending = None  # the newest published (directory, version), not yet loading
        # trainer versions (one version space: the sampler labels its weights with them)
        self._t_next = version  # the trainer's version at the next consumption
        self._published = version  # the last published
        self._released = version  # the last released to the sampler
        self._applied = version  # the sampler's weights
        self._outstanding = 0  # groups started, not yet consumed or dropped
        self._started = 0  # groups started over the pipeline's life: the next one's start order
        self._round_started = 0  # groups started on the weights loaded last (PPO-off-policy-k)
        self._round_consumed = 0  # batches consumed since the last release (PPO-off-policy-k)
        self.dropped = 0  # stale groups dropped over the pipeline's life
        self._inflight: dict[int, float] = {}  # start order -> start time
        self._all_retired: str | None = None  # why the pool has nothing left to draw
        self._idle_s = 0.0
        self._idle_since = time.perf_counter()
        self._wake = asyncio.Event()  # bound to the loop at first wait
        self._publish_event = asyncio.Event()
        self._task = None  # the producer's asyncio task
        self._producer = None  # its future, in the trainer's thread
        self._loading = None  # the weight load in progress
        self._thread = None  # the engine's SamplerThread
        self._lent = False  # the producer stopped for good, the engine lent out (`lend`)
        self.sampler = None
        self.loop = None
        self._owns_dirs = weight_dirs is None
        self.weight_dirs = weight_dirs or WeightDirs()
        self._executor = ThreadPoolExecutor(4, thread_name_prefix="pipeline-reward")
        atexit.register(self.close)
        try:
            self._start(model, loop, sampler_kwargs, version)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _start(self, model, loop, sampler_kwargs: dict | None, version: int) -> None:
        """Start (a model directory) or borrow (a running Sampler) the engine, label its weights
        with the trainer's start version, and start the producer in its loop."""
        if isinstance(model, str):
            self._thread = engine.SamplerThread("pipeline-producer")
            create = generate.Sampler.create(model, **(sampler_kwargs or {}))
            self._thread.start(create).result()
        else:
            self._thread = engine.SamplerThread("pipeline-producer", model, loop)
        self.sampler = self._thread.sampler
        self.loop = self._thread.loop
        if self.sampler.version != version:  # one version space: tokens carry trainer versions
            self._thread.run(self.sampler.set_version(version))
        self._producer = self._thread.submit(self._produce())

    # ---- the trainer's side ----

    def get_batch(self, version: int, timeout: float | None = None) -> Batch:
        """The next P groups with lag <= k at trainer version `version`; stale ones are dropped,
        counted, and their prompts handed back to the pool (`PromptPool.release`: sampled again,
        not skipped). Waits in POLL_S slices. Raises Stopped once stop() is True, the producer's
        exception (sampler, reward, data; its traceback and a note) once stored, RuntimeError once
        closed or if the engine died, TimeoutError after `timeout` s saying what the producer is
        doing, filters.AllRetired once the pool has no prompt left to draw and the groups already
        drawn cannot fill a batch (not a failure: the run is over). Its metrics: batch_metrics."""
        if self._lent:
            raise RuntimeError("the pipeline lent its engine out (lend): it serves no more batches")
        t0 = time.perf_counter()
        dropped = 0

        def ready() -> bool:
            nonlocal dropped
            dropped += self._drop_stale(version)
            drained = self._all_retired is not None and not self._inflight
            return len(self._queue) >= self.P or drained

        with self._state.cv:
            self._t_next = max(self._t_next, version)
            if not self._state.wait_until(ready, timeout):
                raise TimeoutError(self._describe(version, timeout))
            if len(self._queue) < self.P:  # the pool is empty and nothing is in flight
                raise filters.AllRetired(self._all_retired)
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
        self._thread.wake(self._wake)
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

    def _drop_stale(self, version: int) -> int:  # with self._state.cv held
        """Drop the queued groups too stale to train on at `version`; returns how many."""
        keep, stale = [], []
        for g in self._queue:
            (keep if accept(version, g.min_version, self.k, self.mode) else stale).append(g)
        if stale:  # one pass, the fresh groups in their order (no deque.remove: no == per group)
            self._queue.clear()
            self._queue.extend(keep)
        for g in stale:
            self.pool.release(g.index)  # never trained on: the pool serves the prompt again
            self._outstanding -= 1
            self.dropped += 1
            self._thread.wake(self._wake)
        return len(stale)

    def weights_dir(self, version: int) -> str:
        """A fresh directory (in `weight_dirs`) to save a version into for `publish`; the pipeline
        deletes it once loaded or superseded, so vLLM never reads a directory that is being
        written."""
        return self.weight_dirs.new(version)

    def publish(self, weights_dir: str, version: int) -> None:
        """Hand the sampler trainer version `version` (a safetensors directory) and return:
        PipelineRL loads it in flight (§3.1); PPO-off-policy-k holds it until the round's k
        batches are consumed. A directory from `weights_dir()` is deleted once loaded or
        superseded; others are left alone. Raises ValueError unless `version` exceeds every
        earlier one; the producer's exception if it failed; RuntimeError once closed. Once stop()
        is True it only deletes a `weights_dir()` directory: the run is stopping."""
        with self._state.cv:
            if self._state.stopping():
                self.weight_dirs.remove(weights_dir)
                return
            self._state.check()
            superseded = self._pending
            release = self._record_publish(version)  # raises before the swap below
            self._pending = (os.fspath(weights_dir), version)
        if superseded:
            self.weight_dirs.remove(superseded[0])
        if release:
            self._thread.wake(self._publish_event)

    def releases(self) -> bool:
        """Would a publish now reach the sampler at once? Always under PipelineRL; under
        PPO-off-policy-k once the round's k batches are consumed. The NCCL path asks first: every
        trainer rank must join its send."""
        with self._state.cv:
            return may_release(self.mode, self._round_consumed, self.k)

    def publish_by(
        self,
        version: int,
        send,
        *,
        agree=None,
        abort=None,
        timeout: float | None = None,
    ) -> bool:
        """`publish` for the NCCL path: hand the sampler trainer version `version` through
        `send()`, a blocking call that loads it into the running engine
        (generate.Sampler.sync_client: pause, receive the broadcast, label the weights with
        `version`, resume), with the same bookkeeping: the version is released as `publish` would
        (`releases()`); one not released (PPO-off-policy-k mid-round) is only recorded, never
        sent, as a superseded directory is never loaded. Once stop() is True nothing is recorded
        or sent: the run is stopping, as in `publish`.
        Every trainer rank joins the send's gathers, so the decision is taken once: `agree(decide)`
        runs `decide()` (the bookkeeping above; True to send) and returns what every rank follows
        (infra/generator.py: launch.rank0_call(decide, share=True), which hands rank 0's decision,
        or its error, to the other ranks); default: decide() itself.
        The send runs in a thread under a watchdog that checks every POLL_S whether the engine died
        and whether `timeout` s (None: no limit) passed: then `abort(why)` is called (the sender's:
        it ends a broadcast no receiver will finish, so that send() returns once its gathers are
        done), send() gets up to `timeout` s more (CLOSE_TIMEOUT without one) to return, and
        RuntimeError (a dead engine) or TimeoutError says why in one line. Returns whether it was
        sent. Raises ValueError unless `version` exceeds every earlier one, the producer's
        exception if it failed, RuntimeError if the engine died or the sampler did not move to
        `version`, and send's errors."""

        def decide() -> bool:
            with self._state.cv:
                if self._state.stopping():
                    return False
                self._state.check()
                return self._record_publish(version)

        go = agree(decide) if agree else decide()
        if not go:
            return False
        self.sampler.next_version = version  # the label the engine gives the weights send() loads
        self._watched(send, version, abort, timeout)
        if self.sampler.version != version:
            raise RuntimeError(
                f"the sampler went to version {self.sampler.version}, expected {version}"
            )
        self._weights_loaded(version)
        self._thread.wake(self._wake)
        return True

    def _watched(self, send, version: int, abort, timeout: float | None) -> None:
        """Run send() in a thread until it returns (raising what it raised) or the engine dies or
        `timeout` s pass: then abort(why), a grace for send() to return, and raise."""
        out = {}
        # the device is per thread: the send's gathers and broadcast run on the caller's
        device = torch.cuda.current_device() if torch.cuda.is_available() else None

        def run():
            try:
                if device is not None:
                    torch.cuda.set_device(device)
                send()
            except BaseException as e:  # re-raised in the calling thread
                out["error"] = e

        sender = threading.Thread(target=run, name="weight-send", daemon=True)
        sender.start()
        deadline = None
        if timeout is not None:
            deadline = time.monotonic() + timeout
        while True:
            sender.join(POLL_S)
            if not sender.is_alive():
                if "error" in out:
                    raise out["error"]
                return
            dead = self._dead()
            late = deadline is not None and time.monotonic() > deadline
            if dead or late:
                break
        if dead:
            why = f"{dead} during the weight send of version {version}"
            error = RuntimeError(f"{why}; the pipeline cannot go on")
        else:
            why = f"the weight send of version {version} did not finish within {timeout} s"
            error = TimeoutError(why)
        if abort is not None:
            abort(why)
        grace = CLOSE_TIMEOUT if timeout is None else timeout
        sender.join(grace)
        if sender.is_alive():
            error.add_note(f"the send did not return within {grace} s of its abort")
        raise error from out.get("error")

    def _record_publish(self, version: int) -> bool:  # with self._state.cv held
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
        with self._state.cv:
            self._applied = version
            self._round_started = 0  # a new PPO-off-policy-k round (PipelineRL never reads it)
            self._state.cv.notify_all()

    def lend(self, timeout: float = CLOSE_TIMEOUT) -> tuple:
        """Stop the producer for good (its groups in flight aborted, a weight load in progress
        finished first) and return the idle engine, (sampler, loop), for other work in that loop:
        the run's queued evals once the step loop has ended (infra/generator.py Engines.lend).
        get_batch raises RuntimeError from then on; close still shuts the engine down. Raises
        TimeoutError if the producer has not stopped within `timeout` s, RuntimeError once closed
        or if the engine died."""
        with self._state.cv:
            if self._state.closed:
                raise RuntimeError("the pipeline is closed")
            if dead := self._dead():
                raise RuntimeError(dead)
            self._lent = True
        self._thread.run(self._stop(finish_load=True), timeout)
        return self.sampler, self.loop

    def close(self) -> None:
        """Stop the producer, abort in-flight requests (a weight load finishes first), shut an
        owned sampler down, join its thread, end the engine's processes and idle reward workers,
        delete the pipeline's own weight directories. Idempotent. Returns within about
        CLOSE_TIMEOUT s, whatever state the producer and the engine are in (a dead or hung engine
        included): each wait gets what is left of that budget, and the engine's processes still
        alive at its end are killed."""
        with self._state.cv:
            if self._state.closed:
                return
            self._state.closed = True
            self._state.cv.notify_all()
        atexit.unregister(self.close)
        deadline = time.monotonic() + CLOSE_TIMEOUT
        left = lambda: max(0.0, deadline - time.monotonic())
        if self._producer is not None:
            self._thread.try_run(self._stop(), min(left(), 10.0))
        # running reward calls hold workers that math_reward.close() would leave alive
        waiter = threading.Thread(
            target=self._executor.shutdown, kwargs={"cancel_futures": True}, daemon=True
        )
        waiter.start()
        waiter.join(left())
        if self._thread is not None:
            self._thread.close(left())
        math_reward.close()
        if self._owns_dirs:
            self.weight_dirs.close()

    def _dead(self) -> str | None:
        """Why the engine can no longer serve, or None (fakes in tests have no engine)."""
        if isinstance(self.sampler, generate.Sampler):
            return self.sampler.engine.dead()
        return None

    def _describe(self, version: int, timeout: float) -> str:  # with self._state.cv held
        """What the producer is doing, for get_batch's TimeoutError."""
        if self._inflight:
            oldest = time.perf_counter() - min(self._inflight.values())
            doing = f"generating {len(self._inflight)} groups, the oldest for {oldest:.1f} s"
        elif self._applied < self._released:
            doing = f"loading the weights of version {self._released}"
        else:
            doing = (
                f"throttled (mode {self.mode}, k={self.k}): waiting for newer weights to be "
                "published"
            )
        return (
            f"no batch of {self.P} groups for trainer version {version} within {timeout} s: "
            f"{len(self._queue)} queued, sampler at version {self._applied}, last published "
            f"{self._published}; producer: {doing}"
        )

    # ---- the producer: coroutines in the engine's loop ----

    async def _produce(self) -> None:
        """Start a group whenever `may_start` allows (`_claim`), and the weight loads beside."""
        self._task = asyncio.current_task()
        tasks = set()
        with self._state.cv:
            self._idle_since = time.perf_counter()  # engine start is not idle time
        updater = asyncio.create_task(self._update_loop())
        try:
            while True:
                self._wake.clear()
                while (claim := self._claim()) is not None:
                    task = asyncio.create_task(self._group(*claim))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await self._wake.wait()
        except Exception as exc:  # pool.next() or prompts[...]: data errors
            self._state.fail(exc, "drawing a prompt")
        finally:
            for task in [*tasks, updater]:
                task.cancel()  # vLLM aborts a cancelled request
            await asyncio.gather(*tasks, updater, return_exceptions=True)

    def _claim(self) -> tuple[int, int] | None:
        """(start order, prompt index from pool.next()) of a group that may start now, then counted
        as started; or None. When the pool has nothing left (AllRetired) the draws end for good:
        the groups in flight finish and queue, weights still load, and the trainer's wait wakes."""
        with self._state.cv:
            if self._state.error or self._state.closed or self._all_retired is not None:
                return None
            if len(self._inflight) >= self.max_inflight:
                return None
            allowed = may_start(
                self._t_next,
                self._outstanding,
                self.P,
                self._applied,
                self.k,
                self.mode,
                self._round_started,
            )
            if not allowed:
                return None
            try:
                index = self.pool.next()
            except filters.AllRetired as exc:
                self._all_retired = str(exc)
                self._state.cv.notify_all()
                return None
            seq = self._started
            now = time.perf_counter()
            if not self._inflight:  # the producer was idle until now
                self._idle_s += now - self._idle_since
            self._inflight[seq] = now
            self._started += 1
            self._outstanding += 1
            self._round_started += 1
            return seq, index

    async def _group(self, seq: int, index: int) -> None:
        """Sample, score and queue group `seq` of prompt `index`; its errors fail the pipeline."""
        prompt = self.prompts[index]
        t0 = time.perf_counter()
        deadline = asyncio.timeout(self.gen_timeout)
        group = None
        try:
            async with deadline:
                comps = await self.sampler.generate(
                    prompt.prompt_ids, n=self.G, thinking=prompt.thinking
                )
                texts = [c.text for c in comps]
                rewards, reasons = await score(
                    self.reward_fn, prompt, texts, self._executor, self.reward_timeout
                )
            # the tokens carry trainer versions; forced phrase tokens (mask 0) do not count
            sampled = torch.cat([c.versions[c.mask] for c in comps])
            gen_s = time.perf_counter() - t0
            group = Group(prompt, index, comps, rewards, int(sampled.min()), gen_s, reasons)
        except Exception as exc:
            if not deadline.expired():
                return self._state.fail(exc, f"generating or scoring group {seq}")
            hang = TimeoutError(  # clearer than asyncio's bare TimeoutError
                f"group {seq} (prompt {index}) was not sampled and scored within "
                f"gen_timeout={self.gen_timeout} s"
            )
            return self._state.fail(hang, f"generating or scoring group {seq}")
        finally:
            # out of flight and into the queue at once: a wait never sees it in neither
            with self._state.cv:
                del self._inflight[seq]
                if not self._inflight:  # idle from now on
                    self._idle_since = time.perf_counter()
                if group is not None:
                    self._queue.append(group)
                self._state.cv.notify_all()
            self._wake.set()

    async def _update_loop(self) -> None:
        """Load each released weight version in flight, the newest only if several wait."""
        while True:
            await self._publish_event.wait()
            self._publish_event.clear()
            with self._state.cv:
                job = self._pending
                self._pending = None
            if job is None:
                continue
            path, version = job
            # the sampler labels the tokens from these weights on with the trainer's version
            load = self.sampler.update_weights(path, version)
            # shielded: a load cancelled halfway could leave the engine paused, so close() waits
            self._loading = asyncio.ensure_future(load)
            # read to the end (or failed): deleted
            self._loading.add_done_callback(lambda _, path=path: self.weight_dirs.remove(path))
            try:
                await asyncio.shield(self._loading)
            except Exception as exc:
                return self._state.fail(
                    exc, f"loading the weights of version {version} from {path}"
                )
            self._weights_loaded(version)
            self._wake.set()

    async def _stop(self, finish_load: bool = False) -> None:
        """close()'s and lend()'s part in the engine's loop: cancel the producer and its groups."""
        self._task.cancel()
        # An engine that goes on serving (borrowed, or lent: finish_load) must not be left paused,
        # so its weight load finishes first; an owned one is shut down next, and its load may hang
        # on an engine that died (a terminal's Ctrl-C): not awaited.
        finish_load = finish_load or not self._thread.owned
        if self._loading and not finish_load:
            self._loading.cancel()
        load = []
        if self._loading and finish_load:
            load = [self._loading]
        await asyncio.gather(self._task, *load, return_exceptions=True)
