"""Rollouts to scored groups to batches: a producer thread and asynchronous RL with bounded off-policyness k.

PipelineRL-k and its baseline PPO-off-policy-k (arXiv 2510.13786 §3.1, A.11; PAPER.md §6). A producer thread runs an
asyncio loop with the `generate.Sampler`: it draws prompts from the `filters.PromptPool`, samples groups of G, scores
them in a thread with their kind's reward (`reward.math_rewards`, `code_reward.code_rewards`) and
queues them; the trainer takes batches of P groups and publishes weights (loaded in flight). Held-out
evaluation runs on an engine of its own, in a thread of its own: an eval is a snapshot of one weight
version, and the training engine's weights change under its requests. Run by `pytest
tests/test_pipeline.py`, `python bench/pipeline.py`, `train.py`:

    with Pipeline(model_dir, prompts, pool, group_size=16, prompts_per_batch=48, max_lag=8,
                  evaluator=model_dir) as pipe:
        batch = pipe.get_batch(v)  # ...train...; then save to pipe.weights_dir(v + 1) and pipe.publish(that_dir, v + 1)
        pipe.submit_eval(heldout, 16, version=v + 1, weights=that_dir)  # before publish; returns at once
        for result in pipe.eval_results(): ...  # the evals done since the last call, in order

A group consumed at trainer version t has lag t - min_version, the oldest policy version of any of its sampled tokens
(queue time counts); it is accepted iff lag <= k. Where this departs from the paper, and why:
1. "Trainers wait if k steps ahead" is enforced by the producer (`may_start`): a group starts only if, counting the
   groups ahead of it, it will be consumed with lag <= k, so k = 0 is synchronous on-policy RL exactly. A group
   overtaken by later ones (it finished late) can still exceed k: it is dropped and counted (`gen/dropped_stale`),
   and its prompt is handed back to the pool to be sampled again.
2. Versions are the trainer's (`publish`'s numbers); forced phrase tokens (mask 0) do not count towards the lag.
3. Publishes coalesce: if several arrive while one loads, only the newest loads (weights are whole snapshots).
4. PPO-off-policy-k: k·P groups per frozen weight version, k batches per version (lags 0..k-1); a batch may be
   consumed before the round's other groups finish (same data); weights published mid-round wait for the round's
   end. An eval measures the version it is given (`submit_eval`), whatever the training engine holds.
5. Producer idle time is time with no group in flight: the sampler's idle time, which PipelineRL reduces.
6. Evaluation is asynchronous (the paper's evals block nothing either, but it does not say how): the eval engine
   loads a snapshot of the version (hard links to the published files: no copy), samples and scores it while
   training goes on, and the result comes back tagged with that version; at most `max_evals_pending` evals wait or
   run at once (each holds a snapshot), one at a time on the engine, first in first out.
"""

import asyncio
import atexit
import collections
import contextlib
import glob
import os
import re
import shutil
import statistics
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import psutil
import torch

import generate
import reward
import watchdog

# weight directories alive at once: one loading, one published and waiting, one being written
VERSIONS_ALIVE = 3
CLOSE_TIMEOUT = (
    30.0  # seconds close() takes at most in all (groups cancelled, engine stopped, thread joined)
)
POLL_S = 0.5  # the trainer thread's waits check for a stop request and a dead engine this often
# evals waiting or running at once: one sampling on the eval engine, one snapshot waiting for it
EVALS_PENDING = 2
GEN_S_PER_TOKEN = (
    0.1  # group_timeout's decode step: ~3x a loaded vLLM GPU engine's, slower than CPU's
)
GEN_TIMEOUT_MIN_S = 600.0


class Stopped(Exception):
    """Raised by get_batch, wait_evals and submit_eval once the pipeline's `stop` callable returns
    True (the trainer was asked to stop: Ctrl-C): they stop waiting for the engines, whose processes
    a terminal's Ctrl-C stops too. An error an engine raised meanwhile is its __cause__."""


def weights_root(parent: str | None = None) -> str:
    """A fresh directory for the weight versions handed to the sampler, in `parent` (default:
    /dev/shm where there is one, so vLLM reloads from memory; see weights_parent). Named
    pipeline_<pid>-<process start time>_*, so the ones a killed run left behind in `parent` are
    known and deleted here first (the run's watchdog normally deleted them already)."""
    if parent is None:
        parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    for path in glob.glob(os.path.join(parent, "pipeline_*-*_*")):
        owner = re.match(r"pipeline_(\d+)-(\d+)_", os.path.basename(path))
        try:
            alive = owner and int(psutil.Process(int(owner[1])).create_time()) == int(owner[2])
        except psutil.NoSuchProcess:
            alive = False
        except psutil.Error:  # another user's process: not ours to judge
            alive = True
        if owner and not alive:
            shutil.rmtree(path, ignore_errors=True)
    me = psutil.Process()
    os.makedirs(parent, exist_ok=True)
    return tempfile.mkdtemp(prefix=f"pipeline_{me.pid}-{int(me.create_time())}_", dir=parent)


def accept(version: int, min_version: int, max_lag: int) -> bool:
    """True iff a group whose oldest sampled token is from policy `min_version` may be trained on at trainer
    version `version`: lag = version - min_version <= max_lag (§3.1, A.11). Time spent queued counts."""
    return version - min_version <= max_lag


def may_start(t_next: int, outstanding: int, P: int, v: int, max_lag: int) -> bool:
    """PipelineRL throttle: may a group start now? t_next: trainer version at its next consumption; outstanding:
    groups started, not yet consumed or dropped; v: the sampler's weight version. The new group will be consumed
    about `outstanding // P` batches after t_next, and its tokens come from versions >= v."""
    return t_next + outstanding // P - v <= max_lag


def weights_parent(
    weights_bytes: int,
    fallback: str | None,
    shm: str = "/dev/shm",
    free_bytes=None,
    versions: int = VERSIONS_ALIVE,
) -> str | None:
    """Where weight versions are written for the disk path: `shm` (RAM-backed) when it exists and
    has room for `versions` versions of `weights_bytes` each (parameters x the sampler dtype's
    bytes; the Pipeline counts VERSIONS_ALIVE + its eval snapshots), else `fallback` (the run
    directory; None: the system temp dir, weights_root's default). Containers often give /dev/shm
    64 MB, an 8B model needs 49 GB. free_bytes(path) -> bytes free there (default:
    shutil.disk_usage), injectable for tests."""
    free_bytes = free_bytes or (lambda path: shutil.disk_usage(path).free)
    if os.path.isdir(shm) and free_bytes(shm) >= versions * weights_bytes:
        return shm
    return fallback


def reason_fractions(groups) -> dict[str, float]:
    """{"reward/<task>/<reason>": share of the task's samples in `groups` with that reason}, over
    the groups whose reward function gave reasons (code: passed, no_code, ...); {} if none did."""
    counts, totals = collections.Counter(), collections.Counter()
    for g in groups:
        task = getattr(g.prompt, "task", "math")
        totals[task] += len(g.reasons or [])
        counts.update((task, why) for why in g.reasons or [])
    return {f"reward/{task}/{why}": n / totals[task] for (task, why), n in sorted(counts.items())}


def eval_metrics(records: list[dict], greedy: list[dict] = ()) -> dict[str, float]:
    """The eval's metrics from its records (Pipeline._run_eval's: reward, tokens, truncated,
    interrupted, version, task), and `greedy`, records of the greedy samples (reward, task; none:
    no greedy metric): eval/pass_rate (mean reward: the paper's metric), eval/mean_len (tokens),
    eval/truncation_rate, eval/interrupt_rate, eval/version, eval/greedy_pass_rate; and when the
    records hold more than one task, eval/<task>/pass_rate, eval/<task>/mean_len and
    eval/<task>/greedy_pass_rate for each (their curves are fitted apart: train.final_fit). Raises
    ValueError on no records."""
    if not records:
        raise ValueError("eval_metrics: no records")
    mean = lambda rs, key: statistics.fmean(float(r[key]) for r in rs)
    out = {
        "eval/pass_rate": mean(records, "reward"),
        "eval/mean_len": mean(records, "tokens"),
        "eval/version": records[0]["version"],
        "eval/truncation_rate": mean(records, "truncated"),
        "eval/interrupt_rate": mean(records, "interrupted"),
    }
    if greedy:
        out["eval/greedy_pass_rate"] = mean(greedy, "reward")
    tasks = list(dict.fromkeys(r["task"] for r in records))
    for task in tasks if len(tasks) > 1 else []:
        mine = [r for r in records if r["task"] == task]
        out[f"eval/{task}/pass_rate"] = mean(mine, "reward")
        out[f"eval/{task}/mean_len"] = mean(mine, "tokens")
        if mine := [r for r in greedy if r["task"] == task]:
            out[f"eval/{task}/greedy_pass_rate"] = mean(mine, "reward")
    return out


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


@dataclass
class Group:
    """G rollouts of one prompt with their rewards; versions are trainer versions (`completion.versions` too)."""

    prompt: object  # data.Prompt: prompt_ids, gold, thinking
    index: int  # the prompt's index in the pool (pool.next()), for PromptPool.record
    completions: list[generate.Completion]
    rewards: list[float]  # (G,)
    min_version: int  # oldest policy version of any sampled token (mask True) in the group
    max_version: int  # newest one
    seq: int  # start order over the pipeline's life
    gen_s: float  # seconds from start to scored
    reasons: list[str] | None = None  # (G,) why each reward, when the reward function says (code)


@dataclass
class Batch:
    groups: list[Group]  # P groups, in the order they finished
    version: int  # trainer version the batch was consumed at
    metrics: dict[str, float]  # see Pipeline.get_batch


@dataclass
class EvalResult:
    """A finished eval (Pipeline.submit_eval): what it measured and the caller's tag, returned as is."""

    version: int  # the trainer version evaluated: every sampled token came from its weights
    tag: dict  # the caller's (train.py: the step and compute clock of that version)
    metrics: dict[str, float]  # eval_metrics + eval/version
    records: list[dict]  # one per sampled completion: index, sample, text, gold, reward, ...
    queued_s: float  # seconds from submit_eval until its snapshot was loaded
    eval_s: float  # seconds from then until scored


@dataclass
class _EvalJob:
    prompts: list
    n: int
    temperature: float | None
    greedy: bool
    version: int
    weights: str  # directory to load; a snapshot in the pipeline's root when `owned`
    owned: bool  # a snapshot: deleted once loaded
    tag: dict
    submitted: float = field(default_factory=time.perf_counter)


class Pipeline:
    """Producer thread + sampler + queue for the trainer's main thread (§3.1); use it as a context manager.

    model: a model directory (the producer thread starts `generate.Sampler.create(model, **sampler_kwargs)` in its
    own loop and shuts it down on close), or a running Sampler with `loop`, the event loop running it in another
    thread (borrowed: left running). prompts[i]: prompt_ids, gold, thinking (data.Prompt), i from pool.next(). mode
    "pipeline": PipelineRL-k, k = max_lag >= 0; "ppo": PPO-off-policy-k, k = max_lag >= 1 batches per weight
    version. max_inflight: groups generated at once (default 2P).
    reward_fn(responses, golds, thinking, timeout) -> a list of floats, as `reward.math_rewards`, or
    (floats, reasons), as `code_reward.code_rewards`; or a dict kind -> such a function, picked by
    each prompt's `kind` (data.Prompt.kind; default "math"). gen_timeout: seconds to sample and score one group before
    the pipeline fails; an eval fails after so long without one of its requests finishing, or a
    load of its weights. version: trainer version of the start weights. weights_bytes: one weight
    version's size on disk (parameters x the sampler dtype's bytes) and spill_dir: where versions go
    when /dev/shm lacks room (`weights_parent`). stop: polled (POLL_S) by every wait of the trainer's
    thread; once it returns True, get_batch and wait_evals raise Stopped and publish only deletes the
    directory it is given. An owned engine also gets a watchdog (watchdog.py) that ends its
    processes (the eval engine's too) if this process is killed.
    evaluator: the eval engine, a model directory (started in a thread and event loop of its own,
    `generate.Sampler.create(evaluator, **eval_sampler_kwargs)`, in the background: the constructor
    does not wait for it; it is shut down on close) or a running Sampler with `eval_loop` (borrowed),
    or None (no evals). max_evals_pending: evals waiting or running at once (`submit_eval`).
    Raises ValueError on bad settings, the sampler's start errors; the eval engine's start errors
    reach the next wait of the trainer's thread.
    """

    def __init__(
        self,
        model,
        prompts,
        pool,
        *,
        group_size: int,
        prompts_per_batch: int,
        max_lag: int = 8,
        mode: str = "pipeline",
        max_inflight: int | None = None,
        sampler_kwargs: dict | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        reward_fn=reward.math_rewards,
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
        if (
            mode not in ("pipeline", "ppo")
            or max_lag < (mode == "ppo")
            or min(group_size, prompts_per_batch) < 1
        ):
            raise ValueError(
                f"need mode 'pipeline' (max_lag >= 0) or 'ppo' (max_lag >= 1), group_size and "
                f"prompts_per_batch >= 1; got {mode!r}, {max_lag}, {group_size}, {prompts_per_batch}"
            )
        if getattr(pool, "n_prompts", len(prompts)) != len(prompts) or isinstance(model, str) == (
            loop is not None
        ):
            raise ValueError(
                "need as many prompts as the pool's n_prompts, and a model directory or a running "
                "Sampler together with its event loop"
            )
        if max_evals_pending < 1 or (
            evaluator is not None and isinstance(evaluator, str) == (eval_loop is not None)
        ):
            raise ValueError(
                "need max_evals_pending >= 1, and as evaluator a model directory or a running "
                "Sampler together with its eval_loop"
            )
        self.G, self.P, self.k, self.mode, self.gen_timeout = (
            group_size,
            prompts_per_batch,
            max_lag,
            mode,
            gen_timeout,
        )
        self._accept_lag = (
            max_lag if mode == "pipeline" else max_lag - 1
        )  # ppo: lags 0..k-1 by construction
        self.max_inflight = max_inflight or 2 * prompts_per_batch
        self.prompts, self.pool, self.reward_fn, self.reward_timeout = (
            prompts,
            pool,
            reward_fn,
            reward_timeout,
        )
        self._cv = threading.Condition()  # guards the state both threads touch
        self._queue: collections.deque[Group] = collections.deque()
        self._error, self._closed, self._pending = (
            None,
            False,
            None,
        )  # _pending: newest published (dir, version)
        self._t_next = self._published = self._released = self._applied = version
        self._outstanding = self._started = self._round_started = self._round_consumed = (
            self.dropped
        ) = 0
        self.max_evals_pending = max_evals_pending
        self._evals: collections.deque[_EvalJob] = collections.deque()  # waiting or running
        self._evals_done: collections.deque[EvalResult] = collections.deque()
        self._eval_ready = threading.Event()  # set once the eval engine started (or failed to)
        self._eval_thread = self._eval_worker = self.eval_sampler = self._eval_loaded = None
        self._eval_wake = asyncio.Event()  # bound to the eval loop at first wait
        self._inflight: dict[int, float] = {}  # seq -> start time
        self._idle_s, self._idle_since = 0.0, time.perf_counter()
        self._wake, self._publish_event = (
            asyncio.Event(),
            asyncio.Event(),
        )  # bound to the loop at first wait
        self._stop_requested = stop or (lambda: False)
        versions = VERSIONS_ALIVE + (max_evals_pending if evaluator is not None else 0)
        self._root = weights_root(weights_parent(weights_bytes, spill_dir, versions=versions))
        self._executor = ThreadPoolExecutor(4, thread_name_prefix="pipeline-reward")
        # eval grading apart: an eval's thousands of completions never hold up a training group's
        self._eval_executor = ThreadPoolExecutor(2, thread_name_prefix="pipeline-eval-reward")
        self._thread = self._task = self._producer = self._loading = self.sampler = None
        self._watchdog = None
        atexit.register(self.close)
        try:
            if isinstance(model, str) or isinstance(evaluator, str):
                self._watchdog = watchdog.start([self._root])  # before the engine's processes exist
            if isinstance(model, str):
                self.loop = asyncio.new_event_loop()
                self._thread = threading.Thread(
                    target=self.loop.run_forever, name="pipeline-producer", daemon=True
                )
                self._thread.start()
                create = generate.Sampler.create(model, **(sampler_kwargs or {}))
                self.sampler = asyncio.run_coroutine_threadsafe(create, self.loop).result()
            else:
                self.loop, self.sampler = loop, model
            self._vmap = {self.sampler.version: version}  # sampler version -> trainer version
            self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self.loop)
            if isinstance(evaluator, str):  # after the training engine: environments never mix
                self.eval_loop = asyncio.new_event_loop()
                self._eval_thread = threading.Thread(
                    target=self.eval_loop.run_forever, name="pipeline-eval", daemon=True
                )
                self._eval_thread.start()
                start = self._eval_engine(evaluator, eval_sampler_kwargs or {})
            elif evaluator is not None:
                self.eval_loop, self.eval_sampler = eval_loop, evaluator
                self._eval_ready.set()
                start = self._eval_engine(None, {})
            if evaluator is not None:
                self._eval_worker = asyncio.run_coroutine_threadsafe(start, self.eval_loop)
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def get_batch(self, version: int, timeout: float | None = None) -> Batch:
        """The next P groups with lag <= k at trainer version `version`; stale ones are dropped, counted, and
        their prompts handed back to the pool (`PromptPool.release`: sampled again, not skipped). Waits
        in POLL_S slices. Raises Stopped once stop() is True, the producer's exception (sampler, reward, data; its
        traceback and a note) once stored, RuntimeError once closed or if the engine died, TimeoutError after
        `timeout` s saying what the producer is doing. metrics:
        train/lag_min|mean|max, gen/queue_depth (left queued), gen/inflight, gen/dropped_stale, gen/tokens,
        gen/interrupt_rate, gen/truncation_rate, gen/reward_mean|std, time/trainer_wait_s, time/producer_idle_s
        (no group in flight, since the last batch), time/group_gen_s (mean seconds to sample and score a group)."""
        t0, dropped = time.perf_counter(), 0
        with self._cv:
            self._t_next = max(self._t_next, version)
            while True:
                self._check()
                for g in [
                    g for g in self._queue if not accept(version, g.min_version, self._accept_lag)
                ]:
                    self._queue.remove(g)
                    self.pool.release(g.index)  # never trained on: the pool serves the prompt again
                    self._outstanding, dropped, self.dropped = (
                        self._outstanding - 1,
                        dropped + 1,
                        self.dropped + 1,
                    )
                    self._poke(self._wake)
                if len(self._queue) >= self.P:
                    break
                left = None if timeout is None else t0 + timeout - time.perf_counter()
                if left is not None and left <= 0:
                    raise TimeoutError(self._describe(version, timeout))
                self._cv.wait(POLL_S if left is None else min(POLL_S, left))
            groups = [self._queue.popleft() for _ in range(self.P)]
            self._outstanding -= self.P
            self._t_next, self._round_consumed = (
                max(self._t_next, version + 1),
                self._round_consumed + 1,
            )
            now = time.perf_counter()
            idle = self._idle_s + (0.0 if self._inflight else now - self._idle_since)
            self._idle_s, self._idle_since = 0.0, now
            queued, inflight = len(self._queue), len(self._inflight)
        self._poke(self._wake)
        lags, comps = (
            [version - g.min_version for g in groups],
            [c for g in groups for c in g.completions],
        )
        rewards, mean = [r for g in groups for r in g.rewards], statistics.fmean
        return Batch(
            groups,
            version,
            {
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
                "time/trainer_wait_s": now - t0,
                "time/producer_idle_s": idle,
                "time/group_gen_s": mean(g.gen_s for g in groups),
                **reason_fractions(groups),
            },
        )

    def weights_dir(self, version: int) -> str:
        """A fresh directory (on /dev/shm if there is one) to save a version into for `publish`; the pipeline
        deletes it once loaded or superseded, so vLLM never reads a directory that is being written."""
        return tempfile.mkdtemp(prefix=f"v{version}_", dir=self._root)

    def publish(self, weights_dir: str, version: int) -> None:
        """Hand the sampler trainer version `version` (a safetensors directory) and return: PipelineRL loads it in
        flight (§3.1); PPO-off-policy-k holds it until the round's k batches are consumed. A directory from
        `weights_dir()` is deleted once loaded or superseded; others are left alone. Raises ValueError unless
        `version` exceeds every earlier one; the producer's exception if it failed; RuntimeError once closed. Once
        stop() is True it only deletes a `weights_dir()` directory: the run is stopping."""
        with self._cv:
            if self._stop_requested():
                self._remove(weights_dir)
                return
            self._check()
            if version <= self._published:
                raise ValueError(
                    f"version {version} must exceed the last published one, {self._published}"
                )
            old, self._pending, self._published = (
                self._pending,
                (os.fspath(weights_dir), version),
                version,
            )
            self._t_next = max(self._t_next, version)
            if release := self.mode == "pipeline" or self._round_consumed >= self.k:
                self._released, self._round_consumed = version, 0
        if old:
            self._remove(old[0])
        if release:
            self._poke(self._publish_event)

    def releases(self) -> bool:
        """Would a publish now reach the sampler at once? Always under PipelineRL; under
        PPO-off-policy-k once the round's k batches are consumed. The NCCL path asks first: every
        trainer rank must join its send."""
        with self._cv:
            return self.mode == "pipeline" or self._round_consumed >= self.k

    def publish_by(self, version: int, send) -> bool:
        """`publish` for the NCCL path: hand the sampler trainer version `version` through `send()`,
        a blocking call that loads it into the running engine (generate.Sampler.sync_client: pause,
        receive the broadcast, bump the sampler's version, resume), with the same bookkeeping: the
        sampler-to-trainer version map is set before the load, and the version is released as
        `publish` would (`releases()`); one not released (PPO-off-policy-k mid-round) is only
        recorded, never sent, as a superseded directory is never loaded. Returns whether it was
        sent. Raises ValueError unless `version` exceeds every earlier one, the producer's exception
        if it failed, RuntimeError if the sampler did not move to its next version, and send's
        errors."""
        with self._cv:
            self._check()
            if version <= self._published:
                raise ValueError(
                    f"version {version} must exceed the last published one, {self._published}"
                )
            self._published, self._t_next = version, max(self._t_next, version)
            if release := self.mode == "pipeline" or self._round_consumed >= self.k:
                self._released, self._round_consumed = version, 0
        if not release:
            return False
        expected = self.sampler.version + 1
        self._vmap[expected] = (
            version  # first: tokens of the new weights may come back before send returns
        )
        send()
        if self.sampler.version != expected:
            raise RuntimeError(
                f"the sampler went to version {self.sampler.version}, expected {expected}"
            )
        with self._cv:
            self._applied = version
            self._round_started = 0 if self.mode == "ppo" else self._round_started
            self._cv.notify_all()
        self._poke(self._wake)
        return True

    def submit_eval(
        self,
        prompts,
        n: int,
        *,
        version: int,
        weights: str,
        temperature: float | None = None,
        greedy: bool = False,
        tag: dict | None = None,
    ) -> None:
        """Queue an eval of trainer version `version` and return at once: n samples of each prompt
        (temperature: the eval engine's default; 0 is greedy) on the weights in `weights`, scored;
        greedy=True adds one greedy sample per prompt (eval/greedy_pass_rate, never in records). A
        directory in the pipeline's root (`weights_dir`) is snapshotted first (hard links, no copy),
        so call this before `publish` hands it to the training engine, which deletes it once loaded;
        any other directory (the start model) is read in place and left alone. The eval runs on the
        eval engine once the evals before it are done; its EvalResult comes back from
        `eval_results` with `tag`, the same object (the caller may fill it in meanwhile). Raises
        RuntimeError when there is no evaluator or `max_evals_pending` evals are pending already
        (`wait_evals(max_evals_pending - 1)` first), Stopped once stop() is True, the pipeline's
        error if it failed; OSError if `weights` cannot be read."""
        with self._cv:
            self._check()
            if self._eval_worker is None:
                raise RuntimeError("this pipeline has no evaluator")
            if len(self._evals) >= self.max_evals_pending:
                raise RuntimeError(
                    f"{len(self._evals)} evals pending already (max_evals_pending); wait_evals first"
                )
        owned = os.path.dirname(os.path.abspath(weights)) == self._root
        if owned:  # the training engine may delete `weights` once loaded: the eval keeps its own
            snapshot = tempfile.mkdtemp(prefix=f"eval_v{version}_", dir=self._root)
            for name in os.listdir(weights):
                src, dst = os.path.join(weights, name), os.path.join(snapshot, name)
                try:
                    os.link(src, dst)
                except OSError:  # a filesystem without hard links
                    shutil.copy2(src, dst)
            weights = snapshot
        job = _EvalJob(prompts, n, temperature, greedy, version, weights, owned, tag or {})
        with self._cv:
            self._evals.append(job)
        self._poke(self._eval_wake, self.eval_loop)

    def wait_eval_engine(self, timeout: float | None = None) -> bool:
        """Wait until the eval engine has started (the constructor starts an owned one in the
        background); True then (at once for a borrowed one or none), False after `timeout` s.
        train.py waits before its first step, so that a Ctrl-C never meets vLLM's processes while
        they start (their imports would print tracebacks). Waits in POLL_S slices. Raises the
        engine's start error, Stopped once stop() is True, RuntimeError once closed."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        while not self._eval_ready.wait(POLL_S):
            with self._cv:
                self._check()
            if deadline is not None and time.perf_counter() > deadline:
                return False
        with self._cv:
            self._check()  # a failed start sets the event too
        return True

    def evals_pending(self) -> list[int]:
        """The versions of the evals submitted and not finished (running first, then waiting)."""
        with self._cv:
            return [job.version for job in self._evals]

    def wait_evals(self, at_most: int = 0, timeout: float | None = None) -> bool:
        """Wait until at most `at_most` evals are pending (`eval_results` then holds the others);
        True then, False after `timeout` s. Waits in POLL_S slices. Raises Stopped once stop() is
        True, the pipeline's error (an eval's, the eval engine's start error too), RuntimeError if
        an engine died or the pipeline is closed."""
        deadline = None if timeout is None else time.perf_counter() + timeout
        with self._cv:
            while True:
                self._check()
                if len(self._evals) <= at_most:
                    return True
                left = None if deadline is None else deadline - time.perf_counter()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(POLL_S if left is None else min(POLL_S, left))

    def eval_results(self) -> list[EvalResult]:
        """The evals finished since the last call, in the order they were submitted."""
        with self._cv:
            done, self._evals_done = list(self._evals_done), collections.deque()
        return done

    def close(self) -> None:
        """Stop the producer, abort in-flight requests (a weight load finishes first) and pending evals, shut
        owned samplers down (the two engines at once), join the threads, end the engines' processes and idle reward
        workers, delete weight directories and snapshots, end the watchdog. Idempotent. Returns within about
        CLOSE_TIMEOUT s in all, whatever state the producer and the engines are in (a dead or hung engine
        included): each wait gets what is left of that budget, and the engines' processes still alive at its end
        are killed. An eval engine still starting then is left to the watchdog, which ends it once this process
        exits (and to the eval thread, which shuts it down once started)."""
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
        waiter.start()  # running reward calls hold workers that reward.close() would leave alive
        waiter.join(left())
        eval_closed = []  # [True] once nothing of the eval engine runs
        eval_closer = threading.Thread(
            target=lambda: eval_closed.append(self._close_eval(left)), daemon=True
        )
        eval_closer.start()  # beside the training engine's shutdown: each may take seconds
        if self._thread is not None:
            if self.sampler is not None:
                self.sampler.shutdown(timeout=max(left(), 1.0))  # kills what is left after it
                # let vLLM's cancelled tasks finish before the loop stops
                self._on_loop(asyncio.sleep(0.2), left())
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(left())
            if not self._thread.is_alive():
                self.loop.close()
        eval_closer.join(left())
        reward.close()
        shutil.rmtree(self._root, ignore_errors=True)
        if self._watchdog is not None and eval_closed == [True]:
            watchdog.stop(self._watchdog)

    def _close_eval(self, left) -> bool:
        """close()'s part for the eval engine: True once nothing of it runs (an owned engine shut
        down, its thread joined), False if it is still starting after what is `left()` of the
        budget."""
        if self._eval_thread is None:
            return True
        if not self._eval_ready.wait(left()):
            return False
        if self.eval_sampler is not None:
            self.eval_sampler.shutdown(timeout=max(left(), 1.0))
            self._on_loop(asyncio.sleep(0.2), left(), self.eval_loop)
        self.eval_loop.call_soon_threadsafe(self.eval_loop.stop)
        self._eval_thread.join(left())
        if not self._eval_thread.is_alive():
            self.eval_loop.close()
        return True

    async def _produce(self) -> None:
        self._task, tasks = asyncio.current_task(), set()
        with self._cv:
            self._idle_since = time.perf_counter()  # engine start is not idle time
        updater = asyncio.create_task(self._update_loop())
        try:
            while True:
                self._wake.clear()
                while (seq := self._claim()) is not None:
                    tasks.add(task := asyncio.create_task(self._group(seq, self.pool.next())))
                    task.add_done_callback(tasks.discard)
                await self._wake.wait()
        except Exception as exc:  # pool.next() or prompts[...]: data errors
            self._fail(exc, "drawing a prompt")
        finally:
            for task in [*tasks, updater]:
                task.cancel()  # vLLM aborts a cancelled request
            await asyncio.gather(*tasks, updater, return_exceptions=True)

    def _claim(
        self,
    ) -> int | None:  # the start order of a group that may start now (counted as started), or None
        with self._cv:
            if (
                self._error
                or self._closed
                or len(self._inflight) >= self.max_inflight
                or not (
                    self._round_started < self.k * self.P
                    if self.mode == "ppo"  # k batches per weight version
                    else may_start(self._t_next, self._outstanding, self.P, self._applied, self.k)
                )
            ):
                return None
            seq, now = self._started, time.perf_counter()
            self._idle_s += 0.0 if self._inflight else now - self._idle_since
            self._inflight[seq], self._started, self._outstanding = (
                now,
                seq + 1,
                self._outstanding + 1,
            )
            self._round_started += 1
            return seq

    async def _group(self, seq: int, index: int) -> None:
        prompt = self.prompts[index]
        t0, deadline = time.perf_counter(), asyncio.timeout(self.gen_timeout)
        try:
            async with deadline:
                comps = await self.sampler.generate(
                    prompt.prompt_ids, n=self.G, thinking=prompt.thinking
                )
                rewards, reasons = await self._score(prompt, [c.text for c in comps])
            for c in (
                comps
            ):  # sampler versions -> trainer versions (a completion holds a few distinct ones)
                u, inv = c.versions.unique(return_inverse=True)
                c.versions = torch.tensor([self._vmap[v] for v in u.tolist()], dtype=torch.int64)[
                    inv
                ]
            sampled = torch.cat([c.versions[c.mask] for c in comps])
            group = Group(
                prompt,
                index,
                comps,
                rewards,
                int(sampled.min()),
                int(sampled.max()),
                seq,
                time.perf_counter() - t0,
                reasons,
            )
        except Exception as exc:
            hang = TimeoutError(
                f"group {seq} (prompt {index}) was not sampled and scored within "
                f"gen_timeout={self.gen_timeout} s"
            )  # clearer than asyncio's bare TimeoutError
            return self._fail(
                hang if deadline.expired() else exc, f"generating or scoring group {seq}"
            )
        finally:
            with self._cv:
                del self._inflight[seq]
                self._idle_since = self._idle_since if self._inflight else time.perf_counter()
            self._wake.set()
        with self._cv:
            self._queue.append(group)
            self._cv.notify_all()

    async def _update_loop(self) -> None:
        while True:
            await self._publish_event.wait()
            self._publish_event.clear()
            with self._cv:
                job, self._pending = self._pending, None
            if job is None:
                continue
            # Map first: tokens of the new weights may come back before the load returns.
            self._vmap[expected := self.sampler.version + 1] = job[1]
            # Shielded: a load cancelled halfway could leave the engine paused, so close() waits for it instead.
            self._loading = asyncio.ensure_future(self.sampler.update_weights(job[0]))
            self._loading.add_done_callback(
                lambda _, path=job[0]: self._remove(path)
            )  # read to the end, deleted
            try:
                if (new := await asyncio.shield(self._loading)) != expected:
                    raise RuntimeError(f"the sampler went to version {new}, expected {expected}")
            except Exception as exc:
                return self._fail(exc, f"loading the weights of version {job[1]} from {job[0]}")
            with self._cv:
                self._applied, self._round_started = (
                    job[1],
                    0 if self.mode == "ppo" else self._round_started,
                )
                self._cv.notify_all()
            self._wake.set()

    async def _eval_engine(self, model: str | None, kwargs: dict) -> None:
        """The eval thread's work: start an owned eval engine from `model`, then run the queued evals
        one at a time, first in first out. Its errors reach the trainer's next wait."""
        started = model is None
        try:
            if model is not None:
                try:
                    self.eval_sampler = await generate.Sampler.create(model, **kwargs)
                    self._eval_loaded = (model, self.eval_sampler.version)
                finally:
                    self._eval_ready.set()
                with self._cv:
                    closed = self._closed
                if closed:  # close() stopped waiting for the start: nothing else will stop it
                    return self.eval_sampler.shutdown()
                started = True
            while True:
                await self._eval_wake.wait()
                self._eval_wake.clear()
                while True:
                    with self._cv:
                        job = self._evals[0] if self._evals else None
                    if job is None:
                        break
                    result = await self._run_eval(job)
                    with self._cv:
                        self._evals.popleft()
                        self._evals_done.append(result)
                        self._cv.notify_all()
        except Exception as exc:  # the engine's start, a load, sampling, a reward function
            with self._cv:
                job = self._evals[0] if self._evals else None
            doing = (
                f"evaluating version {job.version}"
                if started and job
                else "starting the eval engine"
            )
            self._fail(exc, doing)

    async def _run_eval(self, job: _EvalJob) -> EvalResult:
        """Load the job's weights into the idle eval engine (unless it holds them), sample, check that
        every sampled token came from those weights, score -> EvalResult."""
        sampler = self.eval_sampler
        try:
            if self._eval_loaded != (job.weights, sampler.version):
                try:
                    async with asyncio.timeout(self.gen_timeout):
                        await sampler.update_weights(job.weights)
                except TimeoutError as exc:
                    raise TimeoutError(
                        f"the eval engine did not load the weights of version {job.version} "
                        f"within gen_timeout={self.gen_timeout} s"
                    ) from exc
                self._eval_loaded = (job.weights, sampler.version)
        finally:
            if job.owned:  # read to the end (or failed): the snapshot goes
                shutil.rmtree(job.weights, ignore_errors=True)
        loaded, t0 = sampler.version, time.perf_counter()
        prompts = job.prompts
        jobs = [(p, job.n, job.temperature) for p in prompts]
        jobs += [(p, 1, 0.0) for p in prompts if job.greedy]
        groups = await self._progressing(
            [
                sampler.generate(p.prompt_ids, n=k, thinking=p.thinking, temperature=t)
                for p, k, t in jobs
            ],
            f"the eval of version {job.version}",
        )
        seen = {int(v) for g in groups for c in g for v in c.versions[c.mask].unique().tolist()}
        if seen - {loaded}:
            raise RuntimeError(
                f"the eval of version {job.version} sampled tokens from eval-engine weights "
                f"{sorted(seen)}, not only {loaded}: its weights changed during the eval"
            )
        scored = await asyncio.gather(
            *[
                self._score(p, [c.text for c in g], self._eval_executor)
                for (p, _, _), g in zip(jobs, groups, strict=True)
            ]
        )
        records = [
            {
                "index": p.index,
                "task": getattr(p, "task", "math"),
                "sample": j,
                "text": c.text,
                "gold": p.gold,
                "reward": rs[j],
                "reason": why[j] if why else None,
                "tokens": len(c.completion_ids),
                "interrupted": c.interrupted,
                "truncated": c.truncated,
                "version": job.version,
            }
            for p, g, (rs, why) in zip(prompts, groups, scored, strict=False)
            for j, c in enumerate(g)
        ]  # the sampled ones; greedy ones follow in groups[len(prompts):]
        greedy = [
            {"task": getattr(p, "task", "math"), "reward": rs[0]}
            for (p, _, _), (rs, _) in zip(jobs[len(prompts) :], scored[len(prompts) :], strict=True)
        ]
        metrics = {**eval_metrics(records, greedy), "eval/version": job.version}
        queued_s = t0 - job.submitted
        return EvalResult(
            job.version, job.tag, metrics, records, queued_s, time.perf_counter() - t0
        )

    async def _progressing(self, coros: list, what: str) -> list:
        """asyncio.gather(*coros) for an eval's requests, which queue in the eval engine behind
        each other (so no one request has a deadline): TimeoutError, the requests cancelled
        (vLLM aborts them), once none has finished for gen_timeout s, the horizon on which a
        training group calls the engine hung."""
        last = time.perf_counter()

        async def tick(coro):
            nonlocal last
            out = await coro
            last = time.perf_counter()
            return out

        task = asyncio.ensure_future(asyncio.gather(*map(tick, coros)))
        try:
            while not task.done():
                await asyncio.wait([task], timeout=min(self.gen_timeout, 5.0))
                if not task.done() and time.perf_counter() - last > self.gen_timeout:
                    raise TimeoutError(
                        f"{what}: no request finished for gen_timeout={self.gen_timeout} s "
                        "(the eval engine hangs?)"
                    )
            return task.result()
        finally:
            task.cancel()  # a no-op once done
            await asyncio.gather(task, return_exceptions=True)

    async def _score(
        self, prompt, texts: list[str], executor=None
    ) -> tuple[list[float], list[str] | None]:
        """(rewards, reasons or None) of `texts`, completions of `prompt`, from the reward function
        of its kind (data.Prompt.kind), run in the reward thread pool (or `executor`). Raises
        ValueError when no function grades the prompt's kind or the function returns the wrong number
        of values."""
        fn, kind = self.reward_fn, getattr(prompt, "kind", "math")
        if isinstance(fn, dict) and kind not in fn:
            raise ValueError(f"no reward function for kind {kind!r} (have {sorted(fn)})")
        fn = fn[kind] if isinstance(fn, dict) else fn
        golds = [prompt.gold] * len(texts)
        out = await asyncio.get_running_loop().run_in_executor(
            executor or self._executor, fn, texts, golds, prompt.thinking, self.reward_timeout
        )
        pair = isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list | tuple)
        rewards, reasons = out if pair else (out, None)
        if len(rewards) != len(texts) or len(reasons or texts) != len(texts):
            raise ValueError(
                f"reward_fn returned {len(rewards)} rewards for {len(texts)} completions"
            )
        return [float(r) for r in rewards], reasons and [str(why) for why in reasons]

    async def _stop(self) -> None:
        self._task.cancel()
        # A borrowed engine must not be left paused, so its weight load finishes first; an owned one is shut down
        # next, and its load may hang on an engine that died (a terminal's Ctrl-C): not awaited.
        owned = self._thread is not None
        if owned and self._loading:
            self._loading.cancel()
        load = [self._loading] if self._loading and not owned else []
        await asyncio.gather(self._task, *load, return_exceptions=True)

    def _on_loop(self, coro, timeout: float, loop=None) -> None:
        # for close(): a stuck loop must not keep it from shutting the rest down
        future = asyncio.run_coroutine_threadsafe(coro, loop or self.loop)
        with contextlib.suppress(Exception):
            future.result(timeout)
        future.cancel()  # if it timed out; a coroutine never started is closed with it

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

    def _describe(self, version: int, timeout: float) -> str:  # with self._cv held
        oldest = time.perf_counter() - min(self._inflight.values(), default=time.perf_counter())
        doing = (
            f"generating {len(self._inflight)} groups, the oldest for {oldest:.1f} s"
            if self._inflight
            else f"loading the weights of version {self._released}"
            if self._applied < self._released
            else f"throttled (mode {self.mode}, k={self.k}): waiting for newer weights to be published"
        )
        return (
            f"no batch of {self.P} groups for trainer version {version} within {timeout} s: {len(self._queue)} "
            f"queued, sampler at version {self._applied}, last published {self._published}; producer: {doing}"
        )
