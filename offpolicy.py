"""Bounded off-policyness k as pure functions, and the groups and batches they judge.

PipelineRL-k and its baseline PPO-off-policy-k (arXiv 2510.13786 §3.1, A.11; PAPER.md §6): a group
consumed at trainer version t has lag t - min_version, the oldest policy version of any of its
sampled tokens (queue time counts). The pipeline (pipeline.py) asks three questions, each a function
here taking the mode: may a group start now (`may_start`), may published weights reach the sampler
now (`may_release`), may a queued group be trained on (`accept`). Exercised by `pytest
tests/test_pipeline.py` (hand-worked tables). Where this departs from the paper, and why:
1. "Trainers wait if k steps ahead" is enforced by the producer (`may_start`): a group starts only
   if, counting the groups ahead of it, it will be consumed with lag <= k, so k = 0 is synchronous
   on-policy RL exactly.
2. PPO-off-policy-k: k·P groups per frozen weight version, k batches per version (lags 0..k-1);
   weights published mid-round wait for the round's end.
3. Versions are the trainer's; forced phrase tokens (mask 0) do not count towards the lag.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the annotation only: generate.py imports vLLM
    import generate

MODES = ("pipeline", "ppo")  # PipelineRL-k, PPO-off-policy-k


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


def check_settings(mode: str, max_lag: int, group_size: int, prompts_per_step: int) -> None:
    """Raise ValueError on an unknown mode or a k, G or P it cannot run with (see Pipeline)."""
    if mode not in MODES or max_lag < (mode == "ppo") or min(group_size, prompts_per_step) < 1:
        raise ValueError(
            f"need mode 'pipeline' (max_lag >= 0) or 'ppo' (max_lag >= 1), group_size and "
            f"prompts_per_step >= 1; got {mode!r}, {max_lag}, {group_size}, {prompts_per_step}"
        )


@dataclass
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
