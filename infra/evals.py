"""Asynchronous held-out evaluation on an engine of its own: the eval side of pipeline.Pipeline.

An eval is a snapshot of one weight version (hard links to the published files: no copy), sampled
and scored on the eval engine while training goes on, in a thread and event loop of their own (the
training engine's weights change under its requests); the result comes back tagged with that
version. At most `max_evals_pending` evals wait or run at once (each holds a snapshot), one at a
time on the engine, first in first out. The paper's evals block nothing either, but it does not
say how (arXiv 2510.13786 §7.1: pass rate, the mean reward over n samples per held-out prompt).

`Evals` is a mixin of pipeline.Pipeline, which calls `_init_evals` and `_start_evals` from its
constructor and `_close_eval` from close(), and provides the lock `_cv` and `_closed`, `_check`,
`_wait_until`, `_fail`, `_poke`, `_on_loop`, `_root`, `reward_fn`, `reward_timeout`,
`gen_timeout`. Exercised by `pytest tests/test_pipeline.py`:

    pipe.submit_eval(heldout, 16, version=v + 1, weights=that_dir)  # before publish; at once
    for result in pipe.eval_results(): ...  # the evals done since the last call, in order
"""

import asyncio
import collections
import os
import shutil
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import generate
from infra.weight_dirs import snapshot
from producer import score


@dataclass
class EvalResult:
    """A finished eval (Pipeline.submit_eval): what it measured, and the caller's tag as is."""

    version: int  # the trainer version evaluated: every sampled token came from its weights
    tag: dict  # the caller's (train.py: the step and compute clock of that version)
    metrics: dict[str, float]  # eval_metrics + eval/version
    records: list[dict]  # one per sampled completion: index, sample, text, gold, reward, ...
    queued_s: float  # seconds from submit_eval until its snapshot was loaded
    eval_s: float  # seconds from then until scored


@dataclass
class EvalJob:
    prompts: list
    n: int
    temperature: float | None
    greedy: bool
    version: int
    weights: str  # directory to load; a snapshot in the pipeline's root when `owned`
    owned: bool  # a snapshot: deleted once loaded
    tag: dict
    submitted: float = field(default_factory=time.perf_counter)


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


def check_evaluator(evaluator, eval_loop, max_evals_pending: int) -> None:
    """Raise ValueError unless max_evals_pending >= 1 and the evaluator is None, a model directory
    (an engine of the pipeline's own) or a running Sampler given with its eval_loop."""
    if max_evals_pending < 1 or (
        evaluator is not None and isinstance(evaluator, str) == (eval_loop is not None)
    ):
        raise ValueError(
            "need max_evals_pending >= 1, and as evaluator a model directory or a running "
            "Sampler together with its eval_loop"
        )


class Evals:
    """pipeline.Pipeline's eval side (a mixin: see the module docstring)."""

    def _init_evals(self, max_evals_pending: int) -> None:
        self.max_evals_pending = max_evals_pending
        self._evals: collections.deque[EvalJob] = collections.deque()  # waiting or running
        self._evals_done: collections.deque[EvalResult] = collections.deque()
        self._eval_ready = threading.Event()  # set once the eval engine started (or failed to)
        self._eval_thread = None
        self._eval_worker = None
        self.eval_sampler = None
        self._eval_loaded = None  # (weights directory, version label) the eval engine holds
        self._eval_wake = asyncio.Event()  # bound to the eval loop at first wait
        # eval grading apart: an eval's thousands of completions never hold up a training group's
        self._eval_executor = ThreadPoolExecutor(2, thread_name_prefix="pipeline-eval-reward")

    def _start_evals(self, evaluator, eval_loop, kwargs: dict | None) -> None:
        """Start the eval thread's work on `evaluator` (see Pipeline), if any."""
        if evaluator is None:
            self._eval_ready.set()  # nothing to start: wait_eval_engine returns at once
            return
        if isinstance(evaluator, str):  # after the training engine: environments never mix
            self.eval_loop = asyncio.new_event_loop()
            self._eval_thread = threading.Thread(
                target=self.eval_loop.run_forever, name="pipeline-eval", daemon=True
            )
            self._eval_thread.start()
            work = self._eval_engine(evaluator, kwargs or {})
        else:
            self.eval_loop = eval_loop
            self.eval_sampler = evaluator
            self._eval_ready.set()
            work = self._eval_engine(None, {})
        self._eval_worker = asyncio.run_coroutine_threadsafe(work, self.eval_loop)

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
        directory in the pipeline's root (`weights_dir`) is snapshotted first (hard links, no
        copy), so call this before `publish` hands it to the training engine, which deletes it
        once loaded; any other directory (the start model) is read in place and left alone. The
        eval runs on the eval engine once the evals before it are done; its EvalResult comes back
        from `eval_results` with `tag`, the same object (the caller may fill it in meanwhile).
        Raises RuntimeError when there is no evaluator or `max_evals_pending` evals are pending
        already (`wait_evals(max_evals_pending - 1)` first), Stopped once stop() is True, the
        pipeline's error if it failed; OSError if `weights` cannot be read."""
        with self._cv:
            self._check()
            if self._eval_worker is None:
                raise RuntimeError("this pipeline has no evaluator")
            if len(self._evals) >= self.max_evals_pending:
                raise RuntimeError(
                    f"{len(self._evals)} evals pending already (max_evals_pending); "
                    "wait_evals first"
                )
        owned = os.path.dirname(os.path.abspath(weights)) == self._root
        if owned:  # the training engine may delete `weights` once loaded: the eval keeps its own
            weights = snapshot(weights, self._root, version)
        job = EvalJob(prompts, n, temperature, greedy, version, weights, owned, tag or {})
        with self._cv:
            self._evals.append(job)
        self._poke(self._eval_wake, self.eval_loop)

    def wait_eval_engine(self, timeout: float | None = None) -> bool:
        """Wait until the eval engine has started (the constructor starts an owned one in the
        background); True then (at once for a borrowed one or none), False after `timeout` s.
        train.py waits before its first step, so that a Ctrl-C never meets vLLM's processes while
        they start (their imports would print tracebacks). Waits in pipeline.POLL_S slices. Raises
        the engine's start error, Stopped once stop() is True, RuntimeError once closed."""
        with self._cv:
            if not self._wait_until(self._eval_ready.is_set, timeout):
                return False
            self._check()  # a failed start sets the event too
        return True

    def evals_pending(self) -> list[int]:
        """The versions of the evals submitted and not finished (running first, then waiting)."""
        with self._cv:
            return [job.version for job in self._evals]

    def wait_evals(self, at_most: int = 0, timeout: float | None = None) -> bool:
        """Wait until at most `at_most` evals are pending (`eval_results` then holds the others);
        True then, False after `timeout` s. Waits in pipeline.POLL_S slices. Raises Stopped once
        stop() is True, the pipeline's error (an eval's, the eval engine's start error too),
        RuntimeError if an engine died or the pipeline is closed."""
        with self._cv:
            return self._wait_until(lambda: len(self._evals) <= at_most, timeout)

    def eval_results(self) -> list[EvalResult]:
        """The evals finished since the last call, in the order they were submitted."""
        with self._cv:
            done = list(self._evals_done)
            self._evals_done = collections.deque()
        return done

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

    async def _eval_engine(self, model: str | None, kwargs: dict) -> None:
        """The eval thread's work: start an owned eval engine from `model`, then run the queued
        evals one at a time, first in first out. Its errors reach the trainer's next wait."""
        if model is not None:
            try:
                self.eval_sampler = await generate.Sampler.create(model, **kwargs)
                self._eval_loaded = (model, self.eval_sampler.version)
            except Exception as exc:
                return self._fail(exc, "starting the eval engine")
            finally:
                self._eval_ready.set()  # after _fail: wait_eval_engine finds a start's error
                with self._cv:
                    self._cv.notify_all()  # wakes wait_eval_engine
            with self._cv:
                closed = self._closed
            if closed:  # close() stopped waiting for the start: nothing else will stop it
                return self.eval_sampler.shutdown()
        try:
            while True:
                await self._eval_wake.wait()
                self._eval_wake.clear()
                await self._run_queued_evals()
        except Exception as exc:  # a load, sampling, a reward function
            with self._cv:
                job = self._evals[0] if self._evals else None
            self._fail(exc, f"evaluating version {job.version if job else '?'}")

    async def _run_queued_evals(self) -> None:
        """Run the queued evals, first in first out, until the queue is empty."""
        while True:
            with self._cv:
                job = self._evals[0] if self._evals else None
            if job is None:
                return
            result = await self._run_eval(job)
            with self._cv:
                self._evals.popleft()
                self._evals_done.append(result)
                self._cv.notify_all()

    async def _run_eval(self, job: EvalJob) -> EvalResult:
        """Load the job's weights into the idle eval engine (unless it holds them), sample, check
        that every sampled token came from those weights, score -> EvalResult."""
        sampler = self.eval_sampler
        await self._load_eval_weights(job)
        loaded = sampler.version
        t0 = time.perf_counter()
        requests = [(p, job.n, job.temperature) for p in job.prompts]
        if job.greedy:  # one greedy sample per prompt, after the sampled ones
            requests += [(p, 1, 0.0) for p in job.prompts]
        groups = await self._progressing(
            [
                sampler.generate(p.prompt_ids, n=n, thinking=p.thinking, temperature=temperature)
                for p, n, temperature in requests
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
                score(
                    self.reward_fn, p, [c.text for c in g], self._eval_executor, self.reward_timeout
                )
                for (p, _, _), g in zip(requests, groups, strict=True)
            ]
        )
        records, greedy = eval_records(job.prompts, job.version, groups, scored)
        metrics = {**eval_metrics(records, greedy), "eval/version": job.version}
        queued_s = t0 - job.submitted
        eval_s = time.perf_counter() - t0
        return EvalResult(job.version, job.tag, metrics, records, queued_s, eval_s)

    async def _load_eval_weights(self, job: EvalJob) -> None:
        """Load the job's weights into the eval engine, labelled with the job's version, unless it
        holds them already; a snapshot is deleted once read (or failed)."""
        sampler = self.eval_sampler
        try:
            if self._eval_loaded == (job.weights, sampler.version):
                return
            try:
                async with asyncio.timeout(self.gen_timeout):
                    await sampler.update_weights(job.weights, job.version)
            except TimeoutError as exc:
                raise TimeoutError(
                    f"the eval engine did not load the weights of version {job.version} "
                    f"within gen_timeout={self.gen_timeout} s"
                ) from exc
            self._eval_loaded = (job.weights, sampler.version)
        finally:
            if job.owned:  # read to the end (or failed): the snapshot goes
                shutil.rmtree(job.weights, ignore_errors=True)

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
