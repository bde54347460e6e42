"""The `--model` presets and the `--recipe` bundles: named rows of flag values that
config.parse_args lays over the ScaleRL defaults (config.Args).

    python train.py --model qwen3-8b         # the paper's lengths and batch (PAPER.md 9)
    python train.py --recipe loo-dapo        # ScaleRL with one choice swapped (Figure 7)

Paper: A.3 and A.10 (the 8B run's sizes and budgets: PAPER_GEN), §4 and A.16 (the compared
recipes), Figure 7 (the leave-one-out variants). Exercised by `python -m pytest tests/test_train.py
-k recipes`.

Where this departs from the paper, and why:
1. The default `tiny` row and `smollm2-135m` are CPU-sized (minutes, not days), measured to give a
   curve that climbs and bends within 15 minutes on 2 cores (issue 12; runs in the README).
2. An unknown model without CUDA gets the "hf-cpu" row: smollm2-135m's sizes with room for a
   thinking model's budget, not the paper-scale "hf" row.
"""

# --model NAME: one row each. Any other value is a Hugging Face id or a local directory and gets
# the "hf" row on a machine with CUDA, the "hf-cpu" row (printed at start) on one without.
# Budgets in tokens; think_budget is the interruption range (paper A.10: U[10k, 12k] then a 2k
# answer).
PAPER_GEN = dict(
    think_budget=(10240, 12288),
    answer_budget=2048,
    max_prompt_len=2048,
    max_model_len=16384 + 128,
    prompts_per_step=48,
    group_size=16,
    eval_size=1000,
    eval_n=16,
    eval_every=100,
    save_every=100,
    warmup_steps=100,
    steps=5000,
    # one micro-batch holds the longest sequence (max_model_len); short rollouts share one
    max_tokens_per_microbatch=16384 + 128,
    # one vLLM engine per generator GPU (dp = their number): up to 8B the bf16 weights fit one GPU
    # with room for KV cache, and data parallelism adds decoding throughput without tensor
    # parallelism's all-reduces
    tensor_parallel_size=1,
    data="polaris",
    temperature=1.0,
)
PRESETS = {
    # the Args defaults (a 0.43M-parameter Qwen3 built by tiny.py, the arith task, CPU), sized so
    # that the curve climbs from a low R0 and flattens within 15 minutes on 2 cores (issue 12; the
    # runs are in the README). Measured with tiny.py's warm start of bd904ed:
    # - 12 prompts x 16 a step, 185 steps: a step costs ~3.2 s instead of ~3.9 with 16 prompts, so
    #   185 steps take about as long as 140 did (774-854 s a run, against 788-842 s), and the fits'
    #   C_mid fell from 12-13% of the compute to 10-11%.
    #   With 16 prompts and 140 steps (1c38a8f) seed 2 was still climbing at half the compute and
    #   its half-run fit put A at the bound 1 (mean error on the later evals 0.035); with 12 and
    #   185, its half-run A was 0.946 against the whole run's 0.937, the error 0.017 (at 33b4473),
    #   though a second run of it (a72f38d) missed: one eval fell to 0.723 at the end of its half.
    # - 156 steps, not 185: on a slower day (steps and evals ~15-20% slower) runs of 175 took
    #   914-953 s, past the 15 minutes; a fresh clone's run of 185 had taken 917 s. The 8 runs of
    #   175-185 cut at step 156 met every bar but one (a bootstrap that did not converge on the
    #   run with a dip; at full length 6 of 8), and 156 = 26 evals of 6, the last at the last step.
    #   (Tried, no saving: 1 trainer thread, 565 s of training against 545; the eval engine at
    #   nice 0, which only moves the evals from the end into training.)
    # - lr 2e-4 with groups of 16: on seed 1 (16 prompts, 140 steps) the sampled pass rate rose
    #   from 0.21 to 0.73 by step 40 and held at 0.69-0.81 to step 140. At lr 3e-4 (100 steps) it
    #   rose faster, but over the second half consecutive evals moved by 0.029-0.041 on average
    #   (3 seeds; 0.015-0.035 at lr 2e-4), and seed 1 fell from 0.771 at step 60 to 0.580 at step
    #   100: RL wore away the sums (README "Result"). lr 2.5e-4 on seed 2 (16 prompts, 140 steps)
    #   put one eval at 0.715 and missed the half-run bar by more (error 0.050, against 0.035).
    # - groups of 16: with groups of 8 (lr 2e-4 or 3e-4) the zero-variance filter leaves a few
    #   groups per step once most are all right, and those noisy steps swung the pass rate by
    #   0.03-0.07 between evals late in the run and undid the gains (0.76 at step 80 -> 0.66).
    # - k = 2: here the trainer, not the sampler, is the slow side, so k = 8 would only make every
    #   batch 8 steps stale (measured: the sampled pass rate then drifted instead of rising).
    # - an eval of 200 held-out prompts x 4 every 6 steps: 27 points, 14 of them (R0 included) in
    #   the first half of the compute, sampling noise ~0.014. x 8 (noise ~0.010) costs ~13 s an
    #   eval instead of ~8.5 (medians, alone on the CPU); on a CPU the evals queue behind training
    #   and drain at the end (~3 minutes here), and the run would not fit in 15 minutes. With 11
    #   points and the policy's own swings (~0.02), no fit could tell A from one 0.05 higher.
    # - save_every 0 (a checkpoint at the end and on Ctrl-C only): on a CPU the evals queue behind
    #   training, and a checkpoint waits for them, which puts minutes of eval on the compute clock
    #   in the middle of the fitted curve.
    "tiny": dict(
        max_lag=2,
        lr=2e-4,
        prompts_per_step=12,
        group_size=16,
        steps=156,
        eval_every=6,
        eval_size=200,
        eval_n=4,
        save_every=0,
    ),
    "smollm2-135m": dict(
        path=None,
        data="gsm8k",
        think_budget=(1, 1),
        answer_budget=256,
        max_prompt_len=256,
        max_model_len=640,
        prompts_per_step=4,
        group_size=4,
        lr=1e-6,
        temperature=1.0,
        steps=100,
        eval_every=10,
        eval_size=8,
        eval_n=2,
        save_every=50,
        warmup_steps=10,
        micro_batch_size=4,
        kv_cache_gib=0.5,
        gen_dtype="float32",
    ),
    # Activation checkpointing only where memory needs it. Estimated trainer memory at one
    # 16,512-token micro-batch on 1 of 8 ranks without / with it (bench/gpu_trainer.py --plan: fp32
    # states sharded, bf16 activations, head transients): 0.6b 38.7 / 5.6 GiB, 1.7b 59.9 / 10.6, 4b
    # 116 / 18, 8b 155 / 34. Rule: off where it fits in 75% of an 80 GB trainer GPU (60 GiB; the
    # default placement gives vLLM GPUs of its own): 0.6b off, 1.7b (at the edge), 4b and 8b on.
    # With --share-gpu vLLM takes half of rank 0's GPU: pass --activation-checkpointing for 0.6b
    # too. Not yet checked against a measured peak on a GPU.
    "qwen3-0.6b": dict(PAPER_GEN, path="Qwen/Qwen3-0.6B", lr=1e-6, activation_checkpointing=False),
    "qwen3-1.7b": dict(PAPER_GEN, path="Qwen/Qwen3-1.7B", lr=1e-6, activation_checkpointing=True),
    "qwen3-4b": dict(PAPER_GEN, path="Qwen/Qwen3-4B", lr=5e-7, activation_checkpointing=True),
    # paper A.3: lr 5e-7 (for 8B)
    "qwen3-8b": dict(PAPER_GEN, path="Qwen/Qwen3-8B", lr=5e-7, activation_checkpointing=True),
    "hf": dict(PAPER_GEN, path=None, lr=1e-6, activation_checkpointing=True),
}
# An unknown model without CUDA: the smollm2-135m row's sizes (minutes per step on a few cores, not
# the paper-scale days of "hf"), with room for a thinking model's budget; the data stays the user's
# --data, else gsm8k.
PRESETS["hf-cpu"] = dict(
    PRESETS["smollm2-135m"], think_budget=(192, 256), max_model_len=896, kv_cache_gib=1.0
)
# --recipe NAME: the paper's compared recipes (§4, A.16; PAPER.md 10.2) and leave-one-out variants
# (Fig 7) as flag settings on top of ScaleRL. A flag given on the command line wins over the recipe.
RECIPES = {
    "scalerl": {},
    "deepseek-grpo": dict(
        loss="grpo",
        eps_low=0.2,
        eps_high=0.2,
        agg="sample",
        adv_norm="prompt",
        async_mode="ppo",
        zero_var_filter=False,
        prompt_sampling="uniform",
        fp32_head=False,
    ),
    "qwen2.5-dapo": dict(
        loss="dapo",
        eps_low=0.2,
        eps_high=0.26,
        agg="prompt",
        adv_norm="prompt",
        async_mode="ppo",
        prompt_sampling="uniform",
        fp32_head=False,
        batch_scale=80 / 48,
    ),
    "magistral": dict(
        loss="dapo",
        eps_low=0.2,
        eps_high=0.26,
        agg="prompt",
        adv_norm="prompt",
        prompt_sampling="uniform",
        fp32_head=False,
    ),
    "minimax": dict(
        agg="prompt",
        adv_norm="prompt",
        async_mode="ppo",
        prompt_sampling="uniform",
        batch_scale=80 / 48,
    ),
    "loo-plan": dict(adv_norm="prompt"),
    "loo-lp": dict(interruptions=False, length_penalty=True),
    "loo-batch": dict(zero_var_filter=False),
    "loo-8op": dict(async_mode="ppo"),
    "loo-fp32": dict(fp32_head=False),
    "loo-savg": dict(agg="sample"),
    "loo-dapo": dict(loss="dapo"),
    "loo-uniform": dict(prompt_sampling="uniform"),
}
