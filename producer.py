"""The producer thread's side of pipeline.Pipeline: groups sampled, scored, queued; weights loaded.

A mixin of pipeline.Pipeline: Pipeline.__init__ calls `_init_producer`, which sets up the state
both threads share under the lock `_cv`; from Pipeline this side uses `sampler`, `_fail`,
`_remove`, `_on_loop`, `_weights_loaded` and `_executor`. The coroutines here run in the
producer thread's asyncio loop beside the `generate.Sampler`. `_produce` starts a group whenever
`offpolicy.may_start` allows (`_claim`); each group is sampled, scored in the reward thread pool
(`score`) and queued for the trainer's `get_batch`; `_update_loop` loads each released weight
version in flight. Exercised by `pytest tests/test_pipeline.py`. Departures from the paper: see
pipeline.py.
"""

import asyncio
import collections
import threading
import time

import torch

import generate
from offpolicy import Group, may_start


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
    fn = reward_fn[kind] if isinstance(reward_fn, dict) else reward_fn
    golds = [prompt.gold] * len(texts)
    loop = asyncio.get_running_loop()
    out = await loop.run_in_executor(executor, fn, texts, golds, prompt.thinking, timeout)
    rewards = out
    reasons = None
    if isinstance(out, tuple) and len(out) == 2 and isinstance(out[0], list | tuple):
        rewards, reasons = out  # code_rewards' (floats, reasons)
    if len(rewards) != len(texts) or len(reasons or texts) != len(texts):
        raise ValueError(f"reward_fn returned {len(rewards)} rewards for {len(texts)} completions")
    return [float(r) for r in rewards], reasons and [str(why) for why in reasons]


def check_sources(prompts, pool, model, loop) -> None:
    """Raise ValueError unless the pool serves `prompts`, and the engine is a model directory (an
    engine of the pipeline's own) or a running Sampler given with its event loop (see Pipeline)."""
    if getattr(pool, "n_prompts", len(prompts)) != len(prompts) or (
        isinstance(model, str) == (loop is not None)
    ):
        raise ValueError(
            "need as many prompts as the pool's n_prompts, and a model directory or a running "
            "Sampler together with its event loop"
        )


class Producer:
    """pipeline.Pipeline's producer coroutines (a mixin: see the module docstring)."""

    def _init_producer(self, version: int) -> None:
        """The state the producer and the trainer's thread share, under the lock `_cv`."""
        self._cv = threading.Condition()  # guards the state both threads touch
        self._queue: collections.deque[Group] = collections.deque()
        self._error = None
        self._closed = False
        self._pending = None  # the newest published (directory, version), not yet loading
        # trainer versions: at the next consumption, last published, last released, loaded
        self._t_next = self._published = self._released = self._applied = version
        self._outstanding = 0  # groups started, not yet consumed or dropped
        self._started = 0  # groups started over the pipeline's life: the next one's start order
        self._round_started = 0  # groups started on the weights loaded last (PPO-off-policy-k)
        self._round_consumed = 0  # batches consumed since the last release (PPO-off-policy-k)
        self.dropped = 0  # stale groups dropped over the pipeline's life
        self._inflight: dict[int, float] = {}  # start order -> start time
        self._idle_s = 0.0
        self._idle_since = time.perf_counter()
        self._wake = asyncio.Event()  # bound to the loop at first wait
        self._publish_event = asyncio.Event()
        self._thread = self._task = self._producer = self._loading = self.sampler = None

    def _start_producer(self, model, loop, sampler_kwargs: dict | None, version: int) -> None:
        """Start (a model directory) or borrow (a running Sampler) the engine, label its weights
        with the trainer's start version, and start the producer in its loop."""
        if isinstance(model, str):
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self.loop.run_forever, name="pipeline-producer", daemon=True
            )
            self._thread.start()
            create = generate.Sampler.create(model, **(sampler_kwargs or {}))
            self.sampler = asyncio.run_coroutine_threadsafe(create, self.loop).result()
        else:
            self.loop = loop
            self.sampler = model
        if self.sampler.version != version:  # one version space: tokens carry trainer versions
            relabel = self.sampler.set_version(version)
            asyncio.run_coroutine_threadsafe(relabel, self.loop).result()
        self._producer = asyncio.run_coroutine_threadsafe(self._produce(), self.loop)

    async def _produce(self) -> None:
        self._task = asyncio.current_task()
        tasks = set()
        with self._cv:
            self._idle_since = time.perf_counter()  # engine start is not idle time
        updater = asyncio.create_task(self._update_loop())
        try:
            while True:
                self._wake.clear()
                while (seq := self._claim()) is not None:
                    task = asyncio.create_task(self._group(seq, self.pool.next()))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                await self._wake.wait()
        except Exception as exc:  # pool.next() or prompts[...]: data errors
            self._fail(exc, "drawing a prompt")
        finally:
            for task in [*tasks, updater]:
                task.cancel()  # vLLM aborts a cancelled request
            await asyncio.gather(*tasks, updater, return_exceptions=True)

    def _claim(self) -> int | None:
        """The start order of a group that may start now (then counted as started), or None."""
        with self._cv:
            if self._error or self._closed or len(self._inflight) >= self.max_inflight:
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
            seq = self._started
            now = time.perf_counter()
            if not self._inflight:  # the producer was idle until now
                self._idle_s += now - self._idle_since
            self._inflight[seq] = now
            self._started += 1
            self._outstanding += 1
            self._round_started += 1
            return seq

    async def _group(self, seq: int, index: int) -> None:
        """Sample, score and queue group `seq` of prompt `index`; its errors fail the pipeline."""
        prompt = self.prompts[index]
        t0 = time.perf_counter()
        deadline = asyncio.timeout(self.gen_timeout)
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
                return self._fail(exc, f"generating or scoring group {seq}")
            hang = TimeoutError(  # clearer than asyncio's bare TimeoutError
                f"group {seq} (prompt {index}) was not sampled and scored within "
                f"gen_timeout={self.gen_timeout} s"
            )
            return self._fail(hang, f"generating or scoring group {seq}")
        finally:
            with self._cv:
                del self._inflight[seq]
                if not self._inflight:  # idle from now on
                    self._idle_since = time.perf_counter()
            self._wake.set()
        with self._cv:
            self._queue.append(group)
            self._cv.notify_all()

    async def _update_loop(self) -> None:
        """Load each released weight version in flight, the newest only if several wait."""
        while True:
            await self._publish_event.wait()
            self._publish_event.clear()
            with self._cv:
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
            self._loading.add_done_callback(lambda _, path=path: self._remove(path))
            try:
                await asyncio.shield(self._loading)
            except Exception as exc:
                return self._fail(exc, f"loading the weights of version {version} from {path}")
            self._weights_loaded(version)
            self._wake.set()

    async def _stop(self) -> None:
        """close()'s part in the producer loop: cancel the producer and its groups."""
        self._task.cancel()
        # A borrowed engine must not be left paused, so its weight load finishes first; an owned
        # one is shut down next, and its load may hang on an engine that died (a terminal's
        # Ctrl-C): not awaited.
        owned = self._thread is not None
        if owned and self._loading:
            self._loading.cancel()
        load = [self._loading] if self._loading and not owned else []
        await asyncio.gather(self._task, *load, return_exceptions=True)

    def _close_engine(self, left) -> None:
        """close()'s part for the training engine: an owned one shut down (what is left of it
        killed), its thread joined within what is `left()` of the budget."""
        if self._thread is None:
            return
        if self.sampler is not None:
            self.sampler.shutdown(timeout=max(left(), 1.0))  # kills what is left after it
            # let vLLM's cancelled tasks finish before the loop stops
            self._on_loop(asyncio.sleep(0.2), left())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(left())
        if not self._thread.is_alive():
            self.loop.close()

    def _describe(self, version: int, timeout: float) -> str:  # with self._cv held
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
