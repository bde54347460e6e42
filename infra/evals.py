"""Asynchronous held-out evaluation on a vLLM engine of its own: `EvalEngine`.

The paper's metric is the pass rate, the mean reward over n samples per held-out prompt (arXiv
2510.13786 §7.1, appendix A.5); its evals block nothing either, but it does not say how. Here an
eval is a snapshot of one weight version (hard links to the published files, no copy: the training
engine deletes them once loaded), sampled and scored on the eval engine while training goes on, in
a thread and event loop of their own (`infra.engine.SamplerThread`; the training engine's weights
change under its requests); the result comes back tagged with that version. At most
`max_evals_pending` evals wait or run at once (each holds a snapshot), one at a time on the
engine, first in first out (once the step loop ends the idle training engine may serve them too:
`borrow`); an eval keeps at most `EVAL_SLOTS_FACTOR` x the engine's running slots of rollouts in
flight, and fails after gen_timeout s without a finished request (a rollout phase).
infra/generator.py starts it beside the pipeline, infra/records.py (RunLog) submits evals and logs
their results, train.py closes it. Exercised by `pytest
tests/test_pipeline.py` and `python train.py --steps 2 --eval-every 2`:

    eval_engine = EvalEngine(model_dir, weight_dirs=pipe.weight_dirs)  # starts in the background
    eval_engine.submit(heldout, 16, version=v + 1, weights=that_dir)  # before publish; at once
    for result in eval_engine.results(): ...  # the evals done since the last call, in order

Where it departs from the paper, and why:
1. Evals run on an engine of their own, one weight version at a time, asynchronously (issue 10):
   an eval of the training engine would mix versions (in-flight updates) and slow training; the
   result is logged steps after the step it measured, against that step's compute.
2. Beside the paper's pass rate, one greedy sample per prompt (eval/greedy_pass_rate, logged,
   never fitted), and per-task rates in a run of several tasks.
"""

import asyncio
import atexit
import collections
import math
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import generate
import pipeline
from infra import engine
from infra.weight_dirs import WeightDirs
from tasks import math_reward

# evals waiting or running at once: one sampling on the eval engine, one snapshot waiting for it
EVALS_PENDING = 2
# an eval's rollouts in flight at most, in units of the engine's running slots (max_num_seqs x
# dp): each slot has a rollout running and one waiting behind it, so the slots stay full while
# finished ones are replaced; an eval submitted whole finishes its first group only after about
# every thinking phase, past any sane no-progress timeout (issue 25)
EVAL_SLOTS_FACTOR = 2
# the no-progress check runs this many times per gen_timeout (so it raises at most a quarter late)
PROGRESS_CHECKS = 4


@dataclass
class EvalResult:
    """A finished eval (EvalEngine.submit): what it measured, and the caller's tag as is."""

    version: int  # the trainer version evaluated: every sampled token came from its weights
    tag: dict  # the caller's (train.py: the step and compute clock of that version)
    metrics: dict[str, float]  # eval_metrics + eval/version
    records: list[dict]  # one per sampled completion: index, sample, text, gold, reward, ...
    queued_s: float  # seconds from submit until its snapshot was loaded
    eval_s: float  # seconds from then until scored


@dataclass
class EvalJob:
    prompts: list
    n: int
    temperature: float | None
    greedy: bool
    version: int
    weights: str  # directory to load; a snapshot in the weight_dirs root when `owned`
    owned: bool  # a snapshot: deleted once loaded
    tag: dict
    submitted: float = field(default_factory=time.perf_counter)
    taken: bool = False  # an engine runs it (or ran it)
    result: EvalResult | None = None  # once finished; `results` returns it in submission order


def eval_metrics(records: list[dict], greedy: list[dict] = ()) -> dict[str, float]:
    """The eval's metrics from its records (eval_records': reward, tokens, truncated, interrupted,
    version, task), and `greedy`, records of the greedy samples (reward, task; none: no greedy
    metric): eval/pass_rate (mean reward: the paper's metric), eval/mean_len (tokens),
    eval/truncation_rate, eval/interrupt_rate, eval/version, eval/greedy_pass_rate; and when the
    records hold more than one task, eval/<task>/pass_rate, eval/<task>/mean_len and
    eval/<task>/greedy_pass_rate for each (their curves are fitted apart: records.final_fit).
    Raises ValueError on no records."""
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
    if len(tasks) == 1:  # one task: the overall metrics are its own
        return out
    for task in tasks:
        mine = [r for r in records if r["task"] == task]
        out[f"eval/{task}/pass_rate"] = mean(mine, "reward")
        out[f"eval/{task}/mean_len"] = mean(mine, "tokens")
        if mine := [r for r in greedy if r["task"] == task]:
            out[f"eval/{task}/greedy_pass_rate"] = mean(mine, "reward")
    return out


def eval_records(prompts, version: int, groups, scored) -> tuple[list[dict], list[dict]]:
    """(records, greedy) of an eval of trainer version `version`: groups[i] holds the completions
    of prompts[i], then, past len(prompts), one greedy completion per prompt; scored[i] is
    (rewards, reasons or None) of groups[i]. A record per sampled completion (index, task, sample,
    text, gold, reward, reason, tokens, interrupted, truncated, version); greedy: task and reward
    of each greedy one."""
    n = len(prompts)
    records = []
    for p, g, (rewards, reasons) in zip(prompts, groups[:n], scored[:n], strict=True):
        for j, c in enumerate(g):
            records.append(
                {
                    "index": p.index,
                    "task": getattr(p, "task", "math"),
                    "sample": j,
                    "text": c.text,
                    "gold": p.gold,
                    "reward": rewards[j],
                    "reason": reasons[j] if reasons else None,
                    "tokens": len(c.completion_ids),
                    "interrupted": c.interrupted,
                    "truncated": c.truncated,
                    "version": version,
                }
            )
    greedy = [
        {"task": getattr(p, "task", "math"), "reward": rewards[0]}
        for p, (rewards, _) in zip(prompts, scored[n:], strict=False)
    ]
    return records, greedy


class EvalEngine:
    """The held-out evals of a run, on an engine of their own (see the module docstring); use it
    as a context manager, or close() it.

    model: a model directory (the engine starts in the background, `generate.Sampler.create(model,
    **sampler_kwargs)` in a thread and event loop of its own: the constructor does not wait for it,
    `wait_started` does; shut down on close), or a running Sampler with `loop`, the event loop
    running it in another thread (borrowed: left running). reward_fn, reward_timeout: as
    pipeline.Pipeline's. gen_timeout: an eval fails after so long without one of its requests
    finishing, or a load of its weights. weight_dirs: the directories published versions are saved
    in (pipeline.Pipeline.weight_dirs); a version submitted from one of them is snapshotted there
    first; None: every directory is read in place. max_evals_pending: evals waiting or running at
    once (`submit`). stop: polled (pipeline.POLL_S) by every wait; once it returns True they raise
    pipeline.Stopped. Raises ValueError for a model without its matching loop; the engine's start
    errors reach the next wait (and `results`).
    """

    def __init__(
        self,
        model,
        *,
        sampler_kwargs: dict | None = None,
        loop: asyncio.AbstractEventLoop | None = None,
        reward_fn=math_reward.math_rewards,
        reward_timeout: float = 5.0,
        gen_timeout: float = 3600.0,
        weight_dirs: WeightDirs | None = None,
        max_evals_pending: int = EVALS_PENDING,
        stop: Callable[[], bool] | None = None,
    ):
        if isinstance(model, str) == (loop is not None):
            raise ValueError(
                "need as the eval engine a model directory, or a running Sampler together with "
                "its event loop"
            )
        self.reward_fn = reward_fn
        self.reward_timeout = reward_timeout
        self.gen_timeout = gen_timeout
        self.weight_dirs = weight_dirs
        self.max_evals_pending = max_evals_pending
        self._state = pipeline.SharedState("eval engine", stop, self._dead)
        self._jobs: collections.deque[EvalJob] = collections.deque()  # waiting or running
        self._done: collections.deque[EvalResult] = collections.deque()
        self._ready = threading.Event()  # set once the engine started (or failed to)
        self._loaded = {}  # id(sampler) -> (weights directory, version label) it holds
        self._wake = asyncio.Event()  # bound to the engine's loop at first wait
        # engines lent for the queue (borrow): (SamplerThread, its wake event, its worker)
        self._lent: list[tuple[engine.SamplerThread, asyncio.Event, Future]] = []
        self._down = None  # close()'s answer: True once nothing of the engine runs
        # eval grading apart: an eval's thousands of completions never hold up a training group's
        self._executor = ThreadPoolExecutor(2, thread_name_prefix="eval-reward")
        atexit.register(self.close)
        start = None  # the owned engine's start, in the background
        if isinstance(model, str):
            self._thread = engine.SamplerThread("eval-engine")
            start = self._thread.start(generate.Sampler.create(model, **(sampler_kwargs or {})))
        else:
            self._thread = engine.SamplerThread("eval-engine", model, loop)
            self._ready.set()
        self.sampler = self._thread.sampler  # an owned one's once started
        self._worker = self._thread.submit(self._work(model, start))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def submit(
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
        (temperature: the engine's default; 0 is greedy) on the weights in `weights`, scored;
        greedy=True adds one greedy sample per prompt (eval/greedy_pass_rate, never in records). A
        directory of `weight_dirs` is snapshotted first (hard links, no copy), so call this before
        pipeline.Pipeline.publish hands it to the training engine, which deletes it once loaded;
        any other directory (the start model) is read in place and left alone. The eval runs once
        the evals before it are done; its EvalResult comes back from `results` with `tag`, the same
        object (the caller may fill it in meanwhile). Raises RuntimeError when `max_evals_pending`
        evals are pending already (`wait(max_evals_pending - 1)` first), pipeline.Stopped once
        stop() is True, the engine's error if it failed; OSError if `weights` cannot be read."""
        with self._state.cv:
            self._state.check()
            if len(self._jobs) >= self.max_evals_pending:
                raise RuntimeError(
                    f"{len(self._jobs)} evals pending already (max_evals_pending); wait first"
                )
        owned = self.weight_dirs is not None and self.weight_dirs.owns(weights)
        if owned:  # the training engine may delete `weights` once loaded: the eval keeps its own
            weights = self.weight_dirs.snapshot(weights, version)
        job = EvalJob(prompts, n, temperature, greedy, version, weights, owned, tag or {})
        with self._state.cv:
            self._jobs.append(job)
            lent = list(self._lent)
        self._thread.wake(self._wake)
        for thread, wake, _ in lent:
            thread.wake(wake)

    def borrow(self, sampler, loop: asyncio.AbstractEventLoop) -> None:
        """Run the waiting evals on a second engine too: `sampler`, running in `loop` (another
        thread's; left running, never closed here), as the training engine once the step loop has
        ended (infra/generator.py Engines.lend). Whichever engine is idle takes the next waiting
        eval, loads its weights and samples it as the eval engine would; `results` still returns
        the evals in the order they were submitted. An eval that fails there goes back to the
        queue, and the lent engine serves no more (a warning says why): only the eval engine's own
        errors fail the run. Raises ValueError for an engine that serves the queue already,
        RuntimeError once closed."""
        thread = engine.SamplerThread("eval-lent", sampler, loop)
        wake = asyncio.Event()  # bound to `loop` at its first wait
        with self._state.cv:
            if self._state.closed:
                raise RuntimeError("the eval engine is closed")
            if sampler is self.sampler or any(t.sampler is sampler for t, _, _ in self._lent):
                raise ValueError("this engine serves the eval queue already")
            worker = thread.submit(self._serve(sampler, wake, lent=True))
            self._lent.append((thread, wake, worker))
        thread.wake(wake)

    def wait_started(self, timeout: float | None = None) -> bool:
        """Wait until the engine has started (the constructor starts an owned one in the
        background); True then (at once for a borrowed one), False after `timeout` s. train.py
        waits before its first step, so that a Ctrl-C never meets vLLM's processes while they
        start (their imports would print tracebacks). Waits in pipeline.POLL_S slices. Raises the
        engine's start error, pipeline.Stopped once stop() is True, RuntimeError once closed."""
        with self._state.cv:
            if not self._state.wait_until(self._ready.is_set, timeout):
                return False
            self._state.check()  # a failed start sets the event too
        return True

    def pending(self) -> list[int]:
        """The versions of the evals submitted and not yet in `results` (running, waiting, or
        finished behind one still running), in submission order."""
        with self._state.cv:
            return [job.version for job in self._jobs]

    def wait(self, at_most: int = 0, timeout: float | None = None) -> bool:
        """Wait until at most `at_most` evals are pending (`results` then holds the others); True
        then, False after `timeout` s. Waits in pipeline.POLL_S slices. Raises pipeline.Stopped
        once stop() is True, the engine's error (an eval's, the start's), RuntimeError if the
        engine died or is closed."""
        with self._state.cv:
            return self._state.wait_until(lambda: len(self._jobs) <= at_most, timeout)

    def results(self) -> list[EvalResult]:
        """The evals finished since the last call, in the order they were submitted. Raises the
        engine's error (an eval's, the start's) once stored and RuntimeError if the engine died,
        unless the run is stopping or this is closed: infra/records.py calls this after every
        step, so a failed eval stops the run at the end of that step."""
        with self._state.cv:
            if not self._state.stopping() and not self._state.closed:
                self._state.check()
            done = list(self._done)
            self._done.clear()
        return done

    def close(self) -> bool:
        """Abort the running eval (vLLM aborts its requests) and drop the waiting ones, shut an
        owned engine down and join its thread, end idle reward workers. Idempotent. Returns within
        about pipeline.CLOSE_TIMEOUT s: True once nothing of the engine runs, False if it is still
        starting then (it is shut down once started; the run's watchdog ends its processes if this
        process exits first). Snapshots stay in weight_dirs, whose owner deletes them."""
        with self._state.cv:
            if self._state.closed:
                return self._down
            self._state.closed = True
            self._state.cv.notify_all()
        atexit.unregister(self.close)
        deadline = time.monotonic() + pipeline.CLOSE_TIMEOUT
        left = lambda: max(0.0, deadline - time.monotonic())
        self._worker.cancel()  # vLLM aborts the eval's requests
        for _, _, worker in self._lent:
            worker.cancel()  # on a lent engine too, which its owner shuts down
        # running reward calls hold workers that math_reward.close() would leave alive
        waiter = threading.Thread(
            target=self._executor.shutdown, kwargs={"cancel_futures": True}, daemon=True
        )
        waiter.start()
        waiter.join(left())
        self._down = self._thread.close(left())
        math_reward.close()
        return self._down

    def _dead(self) -> str | None:
        """Why the engine can no longer serve, or None (fakes in tests have no engine)."""
        if isinstance(self.sampler, generate.Sampler):
            return self.sampler.engine.dead()
        return None

    async def _work(self, model, start) -> None:
        """The engine thread's work: wait for an owned engine's `start`, then serve the queue."""
        if start is not None:
            try:
                # shielded: close() cancels this, and the start must end by itself (SamplerThread)
                self.sampler = await asyncio.shield(asyncio.wrap_future(start))
                self._loaded[id(self.sampler)] = (model, self.sampler.version)
            except Exception as exc:
                return self._state.fail(exc, "starting the eval engine")
            finally:
                self._ready.set()  # after fail: wait_started finds a start's error
                with self._state.cv:
                    self._state.cv.notify_all()  # wakes wait_started
        await self._serve(self.sampler, self._wake)

    async def _serve(self, sampler, wake: asyncio.Event, lent: bool = False) -> None:
        """One engine's worker (`sampler`, in this loop): whenever woken, run the waiting evals,
        first in first out, until none waits. The eval engine's errors reach the trainer's next
        wait; a `lent` engine's hand its eval back (_give_back)."""
        job = None
        try:
            while True:
                await wake.wait()
                wake.clear()
                while (job := self._take()) is not None:
                    # a lent engine keeps the snapshot until its eval is done: it may go back
                    result = await self._run_eval(job, sampler, keep=lent)
                    if lent and job.owned:
                        self.weight_dirs.remove(job.weights)
                    with self._state.cv:
                        job.result = result
                        # finished in submission order: those behind a running one wait for it
                        while self._jobs and self._jobs[0].result is not None:
                            self._done.append(self._jobs.popleft().result)
                        self._state.cv.notify_all()
        except Exception as exc:  # a load, sampling, a reward function
            if lent:
                return self._give_back(job, sampler, exc)
            version = "?" if job is None else job.version
            self._state.fail(exc, f"evaluating version {version}")

    def _give_back(self, job: EvalJob | None, sampler, exc: Exception) -> None:
        """A lent engine failed `job`: the job goes back to the queue for the eval engine, and the
        engine serves no more; said in one line."""
        with self._state.cv:
            self._lent = [entry for entry in self._lent if entry[0].sampler is not sampler]
            if job is not None:
                job.taken = False
        version = "?" if job is None else job.version
        print(
            f"warning: the lent training engine failed the eval of version {version} "
            f"({type(exc).__name__}: {exc}); the eval engine runs it and the rest",
            flush=True,
        )
        self._thread.wake(self._wake)

    def _take(self) -> EvalJob | None:
        """The first eval no engine has taken, now taken; None when none waits."""
        with self._state.cv:
            job = next((job for job in self._jobs if not job.taken), None)
            if job is not None:
                job.taken = True
            return job

    async def _run_eval(self, job: EvalJob, sampler, keep: bool = False) -> EvalResult:
        """Load the job's weights into `sampler`, an idle engine (unless it holds them; `keep`: a
        snapshot stays once read), sample, check that every sampled token came from those weights,
        score -> EvalResult."""
        await self._load_weights(job, sampler, keep)
        loaded = sampler.version
        t0 = time.perf_counter()
        # eval_s on the loop's clock, as the eval's timeouts (bench/scale.py's is simulated)
        clock = asyncio.get_running_loop().time
        started = clock()
        requests = [(p, job.n, job.temperature) for p in job.prompts]
        if job.greedy:  # one greedy sample per prompt, after the sampled ones
            requests += [(p, 1, 0.0) for p in job.prompts]
        groups = await self._sample(requests, f"the eval of version {job.version}", sampler)
        seen = {int(v) for g in groups for c in g for v in c.versions[c.mask].unique().tolist()}
        if seen - {loaded}:
            raise RuntimeError(
                f"the eval of version {job.version} sampled tokens from eval-engine weights "
                f"{sorted(seen)}, not only {loaded}: its weights changed during the eval"
            )
        scored = await asyncio.gather(
            *[
                pipeline.score(
                    self.reward_fn, p, [c.text for c in g], self._executor, self.reward_timeout
                )
                for (p, _, _), g in zip(requests, groups, strict=True)
            ]
        )
        records, greedy = eval_records(job.prompts, job.version, groups, scored)
        metrics = {**eval_metrics(records, greedy), "eval/version": job.version}
        queued_s = t0 - job.submitted
        eval_s = clock() - started
        return EvalResult(job.version, job.tag, metrics, records, queued_s, eval_s)

    async def _load_weights(self, job: EvalJob, sampler, keep: bool = False) -> None:
        """Load the job's weights into `sampler`'s engine, labelled with the job's version, unless
        it holds them already; a snapshot is deleted once read (or failed), unless `keep`."""
        try:
            if self._loaded.get(id(sampler)) == (job.weights, sampler.version):
                return
            try:
                async with asyncio.timeout(self.gen_timeout):
                    await sampler.update_weights(job.weights, job.version)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"the engine did not load the weights of version {job.version} for its eval "
                    f"within gen_timeout={self.gen_timeout} s"
                ) from exc
            self._loaded[id(sampler)] = (job.weights, sampler.version)
        finally:
            if job.owned and not keep:  # read to the end (or failed): the snapshot goes
                self.weight_dirs.remove(job.weights)

    async def _sample(self, requests: list, what: str, sampler) -> list:
        """The groups of `requests`, (prompt, n, temperature) each, sampled on `sampler` in order
        with at most EVAL_SLOTS_FACTOR x the engine's slots (generate.Sampler.slots) rollouts in
        flight: a group starts once its n rollouts fit, or when none runs (a stand-in sampler
        without an engine, in tests: no bound). TimeoutError, the requests cancelled (vLLM aborts
        them), once neither a request (a rollout phase, generate.Sampler.finished_requests) nor a
        group has finished for gen_timeout s, the horizon on which a training group calls the
        engine hung; seen within gen_timeout / PROGRESS_CHECKS s."""
        limit = math.inf
        if isinstance(sampler, generate.Sampler):
            limit = EVAL_SLOTS_FACTOR * sampler.slots
        groups = [None] * len(requests)
        running = {}  # task -> (its index in requests, its rollouts)
        rollouts = 0  # in flight
        start = 0  # the next group to start
        # stand-ins serve a group as one request and count none: their groups count
        progress = lambda: (start - len(running), getattr(sampler, "finished_requests", 0))
        seen = progress()
        # the loop's clock, which asyncio.wait's timeout reads too (a simulated loop's is simulated)
        clock = asyncio.get_running_loop().time
        last = clock()
        try:
            while start < len(requests) or running:
                while start < len(requests) and (
                    not running or rollouts + requests[start][1] <= limit
                ):
                    p, n, temperature = requests[start]
                    coro = sampler.generate(
                        p.prompt_ids, n=n, thinking=p.thinking, temperature=temperature
                    )
                    running[asyncio.ensure_future(coro)] = (start, n)
                    rollouts += n
                    start += 1
                done, _ = await asyncio.wait(
                    running,
                    timeout=self.gen_timeout / PROGRESS_CHECKS,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                for task in done:
                    i, n = running.pop(task)
                    groups[i] = task.result()  # a group's error ends the eval
                    rollouts -= n
                now = clock()
                if progress() != seen:
                    seen = progress()
                    last = now
                elif now - last > self.gen_timeout:
                    raise TimeoutError(
                        f"{what}: no request finished for gen_timeout={self.gen_timeout} s "
                        "(the eval engine hangs?)"
                    )
            return groups
        finally:
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
