"""bench/scale.py: the orchestration of a qwen3-8b-shaped run at scale, scaled down to seconds.

Pins the trainer's FLOPs count and the split parser on hand-worked values, and runs the bench's
simulated trainer (the real Sampler, Pipeline, EvalEngine, rewards and timeouts on
bench/vllm_sim.py's engines, in compressed time) on a small version of the preset: 3 steps of 4
prompts x 4 rollouts with thinking budgets of 256-320 tokens on 3 training engines of 8 slots, and
the step-0 eval plus one more, each 200 held-out prompts x (4 + 1 greedy) two-phase rollouts on one
eval engine of 4 slots. gen_timeout is 120 simulated seconds, about 5x a training group's time here
(the preset: 5.5 h against about 1 h). What any correct code must do: every step gets a batch,
every lag is within max_lag, both evals complete, nothing times out. With vLLM's default fcfs
queue and a no-progress timer that counts whole groups, the eval's first group waits behind all
1,000 thinking phases (~250 rounds of 4 slots, several gen_timeouts): the eval times out, as issue
25 predicts for the preset.
"""

import dataclasses

import pytest

from bench import scale, vllm_sim

STEPS = 3
MAX_LAG = 2


def test_trainer_flops_counts_four_passes_of_weights_and_causal_attention():
    # one sequence of 3 tokens, 10 parameters: 2 x 10 x 3 weight FLOPs and 3 x 4 / 2 = 6 causal
    # pairs x 4 x 36 layers x 4096 (q_dim) per pass; 4 passes with checkpointing, 3 without
    attn = 4 * 36 * 4096
    assert scale.trainer_flops([3], params=10, checkpointing=True) == 4 * (60 + 6 * attn)
    assert scale.trainer_flops([3], params=10, checkpointing=False) == 3 * (60 + 6 * attn)


def test_parse_splits():
    assert scale.parse_splits("4/3/1, 2/5/1") == [(4, 3, 1), (2, 5, 1)]
    for bad in ("4/3", "4/3/2", "0/7/1"):
        with pytest.raises(ValueError):
            scale.parse_splits(bad)


def test_scaled_down_run_trains_every_step_and_finishes_both_evals_without_timeout():
    args = scale.preset_args(
        think_budget=(256, 320),
        answer_budget=64,
        max_model_len=1024,
        max_prompt_len=400,
        prompts_per_step=4,
        group_size=4,
        max_lag=MAX_LAG,
        eval_size=200,
        eval_n=4,
        gen_timeout=120.0,
    )
    lay = scale.layout(args, (4, 3, 1), vllm_sim.H200)
    lay = dataclasses.replace(
        lay,
        gen=dataclasses.replace(lay.gen, max_num_seqs=8),
        eval=dataclasses.replace(lay.eval, max_num_seqs=4),
    )
    sim = scale.SimTrainer(args, lay, time_scale=40.0, seed=0, safety_s=60.0, out=lambda s: None)
    rep = sim.run(STEPS, eval_every=STEPS)
    assert rep.error is None, f"stopped at {rep.where}: {rep.error}"
    assert not rep.timed_out
    assert [r.step for r in rep.rows] == [1, 2, 3]
    for r in rep.rows:
        lag_min, _, lag_max = r.lags
        assert 0 <= lag_min <= lag_max <= MAX_LAG
        assert 0 < r.gen_busy <= 1.0 + 1e-9
        assert 0 <= r.trainer_idle < 1
    assert [v for v, *_ in rep.evals] == [0, STEPS]
