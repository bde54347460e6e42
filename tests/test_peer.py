"""bench/peer.py's arithmetic, without TRL: the mapping of our job to GRPOConfig's settings, the
wall time to a pass rate, and our side's row read from a hand-written metrics.jsonl."""

import json

from bench import peer


def test_trl_settings_map_the_default_job():
    args = peer.job_args(None, None, None, 0)
    s = peer.trl_settings(args, "out")
    # 12 prompts x 16 rollouts in one optimizer step, 156 steps
    assert (s["per_device_train_batch_size"], s["num_generations"]) == (192, 16)
    assert (s["generation_batch_size"], s["gradient_accumulation_steps"]) == (192, 1)
    assert s["max_steps"] == 156
    # no interruptions in TRL: the thinking budget's max (110) + the answer budget (16)
    assert s["max_completion_length"] == 126
    # TRL's CISPO clamps the ratio at epsilon_high itself: our cap, 4
    assert (s["loss_type"], s["epsilon_high"], s["beta"]) == ("cispo", 4.0, 0.0)
    assert (s["learning_rate"], s["weight_decay"], s["adam_epsilon"]) == (2e-4, 0.01, 1e-15)
    assert (s["max_grad_norm"], s["temperature"], s["num_iterations"]) == (1.0, 1.0, 1)
    assert s["use_vllm"] is False


def test_first_reach_takes_the_first_eval_at_or_over_the_threshold():
    points = [(0.0, 5.0, 0.3), (10.0, 14.0, 0.69), (20.0, 26.0, 0.7), (30.0, 33.0, 0.9)]
    assert peer.first_reach(points, 0.7) == (20.0, 26.0)
    assert peer.first_reach(points, 0.95) is None


def test_ours_row_reads_clock_steps_and_evals(tmp_path):
    lines = [
        # two steps of 4 s and 6 s (gpu_hours = the loop's seconds / 3600 on one CPU device)
        {"step": 1, "gpu_hours": 4 / 3600, "time/step_s": 4.0, "gen/tokens": 100,
         "train/tokens": 80, "time/update_s": 2.0},
        # the step-0 eval
        {"step": 0, "gpu_hours": 0.0, "eval/pass_rate": 0.25, "eval/logged_at_step": 1,
         "time/eval_s": 3.0, "time/eval_queued_s": 0.5},
        {"step": 2, "gpu_hours": 10 / 3600, "time/step_s": 6.0, "gen/tokens": 200,
         "train/tokens": 120, "time/update_s": 4.0},
        {"step": 2, "gpu_hours": 10 / 3600, "eval/pass_rate": 0.75, "eval/logged_at_step": 2,
         "time/eval_s": 5.0, "time/eval_queued_s": 1.0},
    ]  # fmt: skip
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    row = peer.ours_row(str(tmp_path), 99.0)
    assert row["steps"] == 2
    assert row["step_s"] == 5.0  # median of 4 and 6
    assert (row["gen_tokens"], row["loop_s"]) == (300, 10.0)
    assert row["trainer_tok_s"] == 35.0  # median of 80 / 2 = 40 and 120 / 4 = 30
    assert row["eval_s"] == [3.0, 5.0]
    # step 0's weights at 0 s, known 0.5 + 3 s later; step 2's at the loop's end (10 s), known
    # 1 + 5 s after it (an eval drained after the last step)
    assert [(round(w, 6), round(k, 6), r) for w, k, r in row["points"]] == [
        (0.0, 3.5, 0.25),
        (10.0, 16.0, 0.75),
    ]
    assert row["final"] == 0.75
    table = {line[:32].strip(): line[32:].strip() for line in peer.table([row]).splitlines()}
    assert table["s to pass 0.5 (weights / known)"] == "10 / 16"
    assert table["s to pass 0.8 (weights / known)"] == "not reached"
    assert table["sampled tok/s of step time"] == "30"  # 300 tokens / 10 s
