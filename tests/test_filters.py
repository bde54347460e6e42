"""Pins filters.py: which groups zero-variance filtering keeps (float residue counts as zero), the
DAPO length penalty at the paper's L_max = 14k / L_cache = 2k, get_batch's filters on real groups
(rollouts with a non-finite behaviour log-prob dropped, named and counted; has_variance; the penalty
on correct rollouts only), and PromptPool: exact-integer retirement at the threshold (9/10 retires
at 0.9 although Fraction(0.9) > 9/10; 15/16 retires; 0/16 stays), the latest group deciding, epoch
reshuffles that skip retired prompts, the error when all are retired, the uniform policy, JSON state
round-trips that continue the same sequence, prompts drawn but not recorded (in flight at a
checkpoint, or released as stale) served again first, and thread safety of next()/record().
TaskPools (issue 16): each task drawn by its weight from the documented seeded stream, prompts
within a task in that task's own epoch order, the single-task path identical to a PromptPool,
retirement per task (a retired task stops being drawn; the error when none is left), weights checked
against the data's tasks, state round-trips through JSON that continue the task sequence and serve
each task's unfinished prompts first, and concurrent draws equal to sequential ones. Expected values
are worked out by hand or with numpy in each test."""

import json
import threading
from collections import Counter

import numpy as np
import pytest
import torch

import generate
import pipeline
from filters import (
    AllRetired,
    PromptPool,
    TaskPools,
    dapo_length_penalty,
    drop_nonfinite_logp,
    has_variance,
    length_penalty,
    prompt_pool,
    task_weights,
    zero_variance_mask,
)
from tasks import data


def completion(logp, mask=None):
    """A rollout of prompt [1, 2] with these behaviour log-probs (mask: all True unless given)."""
    logp = torch.tensor(logp)
    mask = torch.ones(len(logp), dtype=torch.bool) if mask is None else torch.tensor(mask)
    return generate.Completion(
        [1, 2], [3] * len(logp), logp, mask, torch.zeros(len(logp)), "stop", False, False, ""
    )


def group(index, comps, rewards):
    prompt = data.Prompt(index, f"q{index}", "1", (1, 2), True)
    return pipeline.Group(prompt, index, comps, rewards, 0, 0.0)


# ---------------------------------------------------------------- zero_variance_mask
def test_zero_variance_mask_by_hand():
    # groups 7 (all right), 3 (mixed), 9 (all wrong), 4 (single sample); ids interleaved and
    # non-contiguous
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    group_ids = torch.tensor([7, 3, 7, 9, 3, 7, 9, 4])
    expected = [False, True, False, False, True, False, False, False]
    assert zero_variance_mask(rewards, group_ids).tolist() == expected
    assert zero_variance_mask(rewards, group_ids).dtype == torch.bool


def test_zero_variance_mask_float_residue_and_threshold():
    # eight rewards of 0.35 in float32: the group is constant, whatever residue a float32 mean
    # would leave
    assert not zero_variance_mask(
        torch.full((8,), 0.35, dtype=torch.float32), torch.zeros(8, dtype=torch.long)
    ).any()
    # rewards {0, d}: population std = d / 2, so d = 1e-6 -> 5e-7 (zero), d = 3e-6 -> 1.5e-6
    # (non-zero)
    ids = torch.tensor([0, 0, 1, 1])
    assert zero_variance_mask(
        torch.tensor([0.0, 1e-6, 0.0, 3e-6], dtype=torch.float64), ids
    ).tolist() == [False, False, True, True]
    # length-penalised correct answers differ by at least 1/L_cache: a real difference
    assert zero_variance_mask(
        torch.tensor([1.0, 1.0 - 1 / 2048]), torch.tensor([5, 5])
    ).tolist() == [True, True]


def test_zero_variance_mask_shapes():
    assert zero_variance_mask(torch.zeros(0), torch.zeros(0, dtype=torch.long)).tolist() == []
    with pytest.raises(ValueError, match="group_ids"):
        zero_variance_mask(torch.zeros(3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError):
        zero_variance_mask(torch.zeros(2, 2), torch.zeros(2, 2, dtype=torch.long))


# ---------------------------------------------------------------- length_penalty
def test_length_penalty_paper_values():
    # A.10: L_max 14k, L_cache 2k -> 0 up to 12k, linear to -1 at 14k, -1 beyond
    lengths = torch.tensor([0, 12000, 12001, 13000, 13500, 14000, 20000])
    # (14000 - L) / 2000 - 1, clipped to [-1, 0]
    expected = [0.0, 0.0, -1 / 2000, -0.5, -0.75, -1.0, -1.0]
    out = length_penalty(lengths, max_len=14000, cache_len=2000)
    assert out.dtype == torch.float32 and out.shape == (7,)
    np.testing.assert_allclose(out.numpy(), expected, rtol=0, atol=1e-7)


# ---------------------------------------------------------------- the batch filters of get_batch
def test_rollouts_with_a_non_finite_behaviour_log_prob_are_dropped_before_the_batch(capsys):
    # issue 14: a NaN / inf sampler log-prob on a policy token is a sampler fault; the rollout
    # leaves the batch before advantages and weights are computed, named and counted
    comp = completion
    nan, inf = float("nan"), float("inf")
    groups = [
        group(
            5,
            [comp([-1.0, -2.0]), comp([-1.0, nan]), comp([-0.5, -0.5]), comp([-inf, -1.0])],
            [1.0, 0.0, 0.0, 1.0],
        ),
        # NaN on a forced phrase token (mask False): no policy token, kept
        group(7, [comp([-1.0, -2.0]), comp([-1.0, nan], [True, False])], [1.0, 0.0]),
        group(9, [comp([nan]), comp([inf])], [1.0, 0.0]),  # nothing left: the group goes
    ]
    kept, dropped = drop_nonfinite_logp(groups)
    assert dropped == 4
    assert [g.prompt.index for g in kept] == [5, 7]
    assert kept[0].rewards == [1.0, 0.0]
    assert [id(c) for c in kept[0].completions] == [id(groups[0].completions[i]) for i in (0, 2)]
    assert kept[1] is groups[1] and len(groups[0].completions) == 4  # the input is left as it was
    out = capsys.readouterr().out.splitlines()
    msg = "warning: dropped rollout {} of prompt {}: behaviour log-prob {} at completion token {}"
    msg += " (a sampler fault)"
    assert out == [
        msg.format(*x)
        for x in [(1, 5, "nan", 1), (3, 5, "-inf", 0), (0, 9, "nan", 0), (1, 9, "inf", 0)]
    ]
    assert all(torch.isfinite(c.logp[c.mask]).all() for g in kept for c in g.completions)
    assert [len(g.completions) for g in kept] == [2, 2]  # advantages see groups of 2 and 2


def test_has_variance_keeps_only_groups_whose_rewards_differ():
    one = [completion([-1.0])]
    assert has_variance(group(0, one * 3, [1.0, 0.0, 1.0]))
    assert not has_variance(group(1, one * 3, [1.0, 1.0, 1.0]))  # all right
    assert not has_variance(group(2, one * 2, [0.0, 0.0]))  # all wrong
    assert has_variance(group(3, one * 2, [1.0, 1.0 - 1 / 2048]))  # a length-penalised one


def test_dapo_length_penalty_shapes_only_correct_rollouts():
    # max_len 10, cache_len 4: 0 up to 6 tokens, then (10 - L) / 4 - 1 (A.10 Eq. 9), -1 from 10 on
    comps = [completion([-1.0] * n) for n in (6, 8, 12, 9)]
    groups = [group(0, comps, [1.0, 1.0, 1.0, 0.0])]
    out = dapo_length_penalty(groups, max_len=10, cache_len=4)
    assert out[0].rewards == [1.0, 0.5, 0.0, 0.0]  # the wrong one (reward 0) keeps its 0
    assert out[0].completions is comps and groups[0].rewards == [1.0, 1.0, 1.0, 0.0]  # input kept


# ---------------------------------------------------------------- PromptPool
def draw(pool, k):
    return [pool.next() for _ in range(k)]


def test_epochs_are_permutations_seeded_by_seed_and_epoch():
    pool = PromptPool(6, seed=3)
    first, second = draw(pool, 6), draw(pool, 6)
    assert sorted(first) == sorted(second) == list(range(6))
    assert pool.state_dict()["epoch"] == 1
    pool.next()
    assert pool.state_dict()["epoch"] == 2
    # the order contract: numpy's generator seeded by [seed, epoch] (so a restored pool
    # regenerates it)
    assert first == np.random.default_rng([3, 0]).permutation(6).tolist()
    assert second == np.random.default_rng([3, 1]).permutation(6).tolist()
    assert draw(PromptPool(6, seed=3), 12) == first + second
    assert draw(PromptPool(50, seed=0), 50) != draw(PromptPool(50, seed=1), 50)


@pytest.mark.parametrize(
    "threshold,n_correct,n_total,retired",
    [
        # exactly the threshold; Fraction(0.9) = 0.90000000000000002 would wrongly keep it
        (0.9, 9, 10, True),
        (0.9, 15, 16, True),  # 0.9375
        (0.9, 14, 16, False),  # 0.875
        (0.9, 0, 16, False),
        (0.9, 16, 16, True),
        (0.1, 1, 10, True),  # Fraction(0.1) = 0.10000000000000000555 would keep it too
        (0.7, 7, 10, True),
        (1.0, 15, 16, False),
        (1.0, 16, 16, True),
        ("9/10", 9, 10, True),
    ],
)
def test_retirement_is_exact(threshold, n_correct, n_total, retired):
    pool = PromptPool(4, threshold=threshold)
    pool.record(2, n_correct, n_total)
    assert pool.num_active == (3 if retired else 4)
    assert (2 not in draw(pool, 40)) == retired


def test_retired_prompt_trains_its_step_then_leaves_for_good():
    pool = PromptPool(5, seed=1)
    idx = pool.next()  # this group is sampled and trains this step...
    pool.record(idx, 15, 16)  # ...then is retired: 15/16 >= 0.9
    rest = draw(pool, 4 * 3)  # the rest of epoch 0 plus 2 whole epochs of the 4 survivors
    assert idx not in rest
    assert Counter(rest) == {i: 3 for i in range(5) if i != idx}
    assert pool.state_dict()["epoch"] == 2


def test_all_retired_raises():
    pool = PromptPool(3)
    for i in range(3):
        pool.record(i, 10, 10)
    assert pool.num_active == 0
    with pytest.raises(AllRetired, match=r"all 3 training prompts are retired .* >= 0\.9\)"):
        pool.next()


def test_uniform_never_retires():
    pool = PromptPool(3, policy="uniform")
    for i in range(3):
        pool.record(i, 16, 16)
    pool.record(0, 4, 16)
    assert pool.num_active == 3
    assert sorted(draw(pool, 3)) == [0, 1, 2]
    assert pool.state_dict()["retired"] == []


def test_the_latest_group_decides():
    pool = PromptPool(10)
    pool.record(1, 10, 10)
    pool.record(2, 3, 10)
    pool.record(2, 9, 10)  # the latest group decides: retired
    pool.record(5, 0, 10)
    pool.record(1, 0, 10)  # retired for good: a later hard group does not bring it back
    assert pool.num_active == 8
    assert pool.state_dict()["retired"] == [1, 2] and pool.state_dict()["epoch"] == 0


def test_state_round_trip_continues_the_same_sequence():
    a = PromptPool(7, seed=11)
    drawn = draw(a, 9)  # into epoch 1
    a.record(3, 9, 10)
    a.record(4, 2, 10)
    a.record(np.int64(5), torch.tensor(3), torch.tensor(10))  # counts straight from tensors
    state = json.loads(json.dumps(a.state_dict()))  # must survive JSON
    # the 9 draws minus one draw each of 3, 4, 5 (recorded), in draw order; 3 is retired (9 of 10)
    unfinished = list(drawn)
    for idx in (3, 4, 5):
        unfinished.remove(idx)
    assert state["unfinished"] == unfinished and len(unfinished) == 6
    b = PromptPool(7, seed=11)
    b.load_state_dict(state)
    assert (b.state_dict()["epoch"], b.num_active) == (1, 6)
    again = [i for i in unfinished if i != 3]  # served first, retired ones skipped
    assert draw(b, 30) == again + draw(a, 30 - len(again))
    assert b.state_dict()["epoch"] == a.state_dict()["epoch"] and b.num_active == a.num_active
    saved = ("epoch", "pos", "retired")
    assert {k: b.state_dict()[k] for k in saved} == {k: a.state_dict()[k] for k in saved}
    with pytest.raises(ValueError, match="n_prompts"):
        PromptPool(8, seed=11).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptPool(7, seed=12).load_state_dict(state)


def test_resume_serves_the_prompts_in_flight_at_the_checkpoint_first():
    # issue 14: the producer drew 6, the trainer recorded 2, then the checkpoint saved the state.
    # The epoch's order is numpy's permutation seeded by [0, 0]: [4, 6, 2, 7, 3, 5, 9, 0, 8, 1]
    # (printed once by hand).
    a = PromptPool(10, policy="uniform", seed=0)
    assert draw(a, 6) == [4, 6, 2, 7, 3, 5]
    a.record(4, 1, 2)
    a.record(6, 0, 2)
    state = json.loads(json.dumps(a.state_dict()))
    assert state["unfinished"] == [2, 7, 3, 5]
    b = PromptPool(10, policy="uniform", seed=0)
    b.load_state_dict(state)
    # before the fix: [9, 0, 8, 1], and 2, 7, 3, 5 were never trained in this epoch
    assert draw(b, 8) == [2, 7, 3, 5, 9, 0, 8, 1]
    assert b.state_dict()["epoch"] == 0 and b.state_dict()["unfinished"] == [2, 7, 3, 5, 9, 0, 8, 1]
    # a state from before unfinished prompts were saved still loads (none to serve again), and so
    # does one with the per-prompt counts that states kept until issue 15 (ignored)
    old = {k: v for k, v in state.items() if k != "unfinished"}
    old.update(correct=[0, 0, 0, 0, 1, 0, 0, 0, 0, 0], total=[0, 0, 0, 0, 2, 0, 2, 0, 0, 0])
    c = PromptPool(10, policy="uniform", seed=0)
    c.load_state_dict(old)
    assert draw(c, 4) == [9, 0, 8, 1]


def test_released_prompts_come_back_first_and_unfinished_never_grows_without_bound():
    pool = PromptPool(5, threshold=0.5, seed=2)  # order: numpy's permutation seeded by [2, 0]
    order = np.random.default_rng([2, 0]).permutation(5).tolist()
    p0, p1, p2 = draw(pool, 3)
    assert [p0, p1, p2] == order[:3]
    # the pipeline dropped p1's group as stale: served again before the order goes on
    pool.release(p1)
    pool.record(p2, 1, 2)  # retired (1/2 >= 0.5)
    assert pool.state_dict()["unfinished"] == [p1, p0]  # handed back first, then drawn
    assert pool.next() == p1 and pool.next() == order[3]
    with pytest.raises(ValueError, match="not drawn and unrecorded"):
        pool.release(p2)  # recorded: nothing to hand back
    # a released prompt that retires meanwhile (its other draw was recorded at 2/2) is skipped
    q = PromptPool(2, threshold=0.5, seed=0)
    first = draw(q, 4)  # two epochs: each prompt drawn twice, nothing recorded yet
    assert sorted(q.state_dict()["unfinished"]) == [0, 0, 1, 1]
    q.release(first[0])
    q.record(first[0], 2, 2)
    assert q.next() == 1 - first[0]
    # a long run that records or releases every group it draws keeps unfinished = the groups in
    # flight
    r, inflight, pending = PromptPool(7, policy="uniform", seed=1), [], None
    for step in range(300):
        idx = r.next()
        assert pending is None or idx == pending  # a released prompt is the next one served
        inflight.append(idx)
        pending = None
        # 4 groups in flight; the oldest finishes: trained, or dropped as stale
        if len(inflight) > 4:
            done = inflight.pop(0)
            if step % 5 == 0:
                r.release(done)
                pending = done
            else:
                r.record(done, 1, 2)
    assert Counter(r.state_dict()["unfinished"]) == Counter(
        inflight + [pending] * (pending is not None)
    )


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        PromptPool(3, policy="dapo")
    with pytest.raises(ValueError):
        PromptPool(0)
    pool = PromptPool(3)
    for args in [(3, 1, 2), (-1, 1, 2), (0, 3, 2), (0, -1, 2), (0, 0, 0)]:
        with pytest.raises(ValueError, match="bad record"):
            pool.record(*args)
    with pytest.raises(TypeError):
        pool.record(0, 0.9 * 10, 10)  # a float count would defeat the exact comparison


def test_concurrent_next_and_record():
    # 4 threads draw exactly 100 epochs of 100 prompts, each recording every prompt it draws: every
    # prompt must come out exactly 100 times (a lost or duplicated position breaks this; without
    # the lock it fails ~9 runs in 10) and every record must finish its draw.
    pool = PromptPool(100, policy="uniform", seed=5)
    drawn, errors, lock = [], [], threading.Lock()

    def producer():
        local = []
        try:
            for _ in range(2500):
                local.append(pool.next())
                pool.record(local[-1], 1, 2)
        except Exception as e:  # surface in the test, not just on stderr
            errors.append(e)
            return
        with lock:
            drawn.extend(local)

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert Counter(drawn) == {i: 100 for i in range(100)}
    assert pool.state_dict()["unfinished"] == []


# ---------------------------------------------------------------- TaskPools (issue 16)
TASKS = ["a", "b", "a", "a", "b", "a", "c", "a", "b", "a"]  # a: 0 2 3 5 7 9, b: 1 4 8, c: 6


def expected_draws(tasks, weights, seed, n):
    """The documented rule, written out with numpy: draw k's task is the first whose cumulative
    weight exceeds u_k * total (u_k the k-th double of default_rng(seed)), and within a task the
    prompts come in epochs of default_rng([seed, epoch]).permutation of its own positions."""
    names = list(dict.fromkeys(tasks))
    members = {t: [i for i, x in enumerate(tasks) if x == t] for t in names}
    orders = {t: [] for t in names}
    out, u = [], np.random.default_rng(seed).random(n)
    for k in range(n):
        cum = np.cumsum([weights[t] for t in names])
        t = names[int(np.argmax(cum > u[k] * cum[-1]))]
        if not orders[t]:
            epoch = sum(x == t for x in [tasks[i] for i in out]) // len(members[t])
            perm = np.random.default_rng([seed, epoch]).permutation(len(members[t]))
            orders[t] = [members[t][j] for j in perm]
        out.append(orders[t].pop(0))
    return out


def test_task_pools_draw_each_task_by_weight_and_its_prompts_in_epochs():
    weights = {"a": 3.0, "b": 1.0, "c": 0.5}
    pools = TaskPools(TASKS, weights, seed=7)
    got = draw(pools, 60)
    assert got == expected_draws(TASKS, weights, 7, 60)
    shares = Counter(TASKS[i] for i in draw(TaskPools(TASKS, weights, policy="uniform"), 9000))
    for t, w in weights.items():  # w / 4.5 of 9,000 draws, within 4 binomial standard deviations
        p = w / 4.5
        assert abs(shares[t] - 9000 * p) < 4 * (9000 * p * (1 - p)) ** 0.5
    # default weights: each task's number of prompts (as if the sources were concatenated)
    assert task_weights(TASKS) == {"a": 6.0, "b": 3.0, "c": 1.0}


def test_one_task_is_a_plain_prompt_pool_with_the_same_draws():
    one = prompt_pool(["math"] * 9, None, threshold=0.5, seed=4)
    assert type(one) is PromptPool and draw(one, 30) == draw(PromptPool(9, seed=4), 30)
    assert type(prompt_pool(["math"] * 9, {"math": 2.0})) is PromptPool
    assert type(prompt_pool(TASKS, None)) is TaskPools


def test_retired_task_stops_being_drawn_and_none_left_raises():
    pools = TaskPools(TASKS, {"a": 1, "b": 1, "c": 1}, seed=0)
    for i in (1, 4, 8):  # every b prompt solved: 4 of 4 >= 0.9
        pools.record(i, 4, 4)
    assert pools.num_active == 7
    assert {TASKS[i] for i in draw(pools, 50)} == {"a", "c"}
    for i in (0, 2, 3, 5, 7, 9, 6):
        pools.record(i, 4, 4)
    with pytest.raises(AllRetired, match=r"every task with a weight > 0 \(a, b, c\)"):
        pools.next()
    # a task of weight 0 is never drawn, and does not keep the pools alive
    zero = TaskPools(TASKS, {"a": 1, "b": 0, "c": 0}, seed=0)
    assert {TASKS[i] for i in draw(zero, 30)} == {"a"}
    for i in (0, 2, 3, 5, 7, 9):
        zero.record(i, 1, 1)
    with pytest.raises(AllRetired, match=r"every task with a weight > 0 \(a\) is retired"):
        zero.next()


def test_task_weights_checked_against_the_data():
    for weights, match in [
        ({"a": 1, "b": 1}, "no weight for task c"),
        ({"a": 1, "b": 1, "c": 1, "d": 1}, "no task d in the data"),
    ]:
        with pytest.raises(ValueError, match=match):
            TaskPools(TASKS, weights)
    pools = TaskPools(TASKS)
    with pytest.raises(ValueError, match="bad record"):
        pools.record(10, 1, 2)
    with pytest.raises(ValueError, match="bad record"):
        pools.record(3, 3, 2)  # PromptPool's check, in a's pool


def test_task_pools_state_round_trip_continues_and_serves_unfinished_first():
    weights = {"a": 2, "b": 1, "c": 1}
    a = TaskPools(TASKS, weights, seed=3)
    drawn = draw(a, 13)
    a.record(drawn[0], 1, 4)
    a.release(drawn[1])  # stale: served again first when its task is drawn
    a.record(drawn[2], 4, 4)  # retired
    state = json.loads(json.dumps(a.state_dict()))
    b = TaskPools(TASKS, weights, seed=3)
    b.load_state_dict(state)
    assert b.num_active == a.num_active == 9
    got = draw(b, 40)
    # the task sequence continues: the same stream of u as the original's next 40 draws
    assert [TASKS[i] for i in got] == [TASKS[i] for i in draw(a, 40)]
    # each task's unfinished prompts (released first, then drawn and not recorded, each record or
    # release finishing one draw; the retired one skipped) are that task's first draws after it
    left = list(drawn)
    for i in drawn[:3]:
        if i in left:
            left.remove(i)
    for t in "abc":
        mine = [i for i in [drawn[1], *left] if TASKS[i] == t and i != drawn[2]]
        assert [i for i in got if TASKS[i] == t][: len(mine)] == mine
    with pytest.raises(ValueError, match="seed"):
        TaskPools(TASKS, weights, seed=4).load_state_dict(state)
    with pytest.raises(ValueError, match="tasks"):
        TaskPools(TASKS[:-1] + ["d"], None, seed=3).load_state_dict(state)


def test_task_pools_concurrent_draws_equal_sequential_ones():
    tasks = ["x"] * 60 + ["y"] * 40
    pools = TaskPools(tasks, {"x": 1, "y": 1}, policy="uniform", seed=5)
    drawn, lock = [], threading.Lock()

    def producer():
        local = []
        for _ in range(1000):
            local.append(pools.next())
            pools.record(local[-1], 1, 2)
        with lock:
            drawn.extend(local)

    threads = [threading.Thread(target=producer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    # each draw is atomic (task, then prompt), so 4,000 concurrent draws are the first 4,000 in
    # order
    assert Counter(drawn) == Counter(draw(TaskPools(tasks, {"x": 1, "y": 1}, seed=5), 4000))
    # every record finished its draw in its task's pool
    assert [s["unfinished"] for s in pools.state_dict()["tasks"].values()] == [[], []]
