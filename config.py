"""What a run is: `Args` (every flag, tyro), the `--model` presets and the `--recipe` bundles of the paper.

    python train.py --help                   # every flag with its default and docstring
    python train.py --recipe loo-dapo        # ScaleRL with one choice swapped (Figure 7)
    python train.py --model qwen3-8b         # the paper's lengths and batch (PAPER.md 9)

Precedence: the ScaleRL defaults (Args), then the --model preset, then the --recipe, then (with --resume) the
run's saved args; a flag given on the command line wins over all of them. The run directory's args.json records
the resolved values. Adding an ablation is a field here, its use in train.py, and (optionally) a RECIPES row.
"""

import argparse
import json
import os
import sys
from dataclasses import dataclass
from typing import Literal

import tyro

import data
import generate

ARITH_THINK_BUDGET = data.ARITH_THINK_BUDGET  # Args has a field named `data`
# --model NAME: one row each. Any other value is a Hugging Face id or a local directory and gets the "hf" row.
# Budgets in tokens; think_budget is the interruption range (paper A.10: U[10k, 12k] then a 2k answer).
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
    micro_batch_size=1,
    activation_checkpointing=True,
    data="polaris",
    temperature=1.0,
)
PRESETS = {
    # the Args defaults (a 0.43M-parameter Qwen3 built by tiny.py, the arith task, CPU), but k = 2: here the trainer,
    # not the sampler, is the slow side, so k = 8 would only make every batch 8 steps stale (measured: the sampled
    # pass rate then drifted instead of rising); k needs to be just large enough to hide generation
    "tiny": dict(max_lag=2),
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
    "qwen3-0.6b": dict(PAPER_GEN, path="Qwen/Qwen3-0.6B", lr=1e-6, gpu_memory_utilization=0.5),
    "qwen3-1.7b": dict(PAPER_GEN, path="Qwen/Qwen3-1.7B", lr=1e-6, gpu_memory_utilization=0.5),
    "qwen3-4b": dict(PAPER_GEN, path="Qwen/Qwen3-4B", lr=5e-7, gpu_memory_utilization=0.6),
    "qwen3-8b": dict(
        PAPER_GEN, path="Qwen/Qwen3-8B", lr=5e-7, gpu_memory_utilization=0.6
    ),  # paper A.3: 5e-7
    "hf": dict(PAPER_GEN, path=None, lr=1e-6, gpu_memory_utilization=0.6),
}
# --recipe NAME: the paper's compared recipes (§4, A.16; PAPER.md 10.2) and leave-one-out variants (Fig 7) as flag
# settings on top of ScaleRL. A flag given on the command line wins over the recipe.
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


@dataclass
class Args:
    """ScaleRL training (arXiv 2510.13786). Defaults: the recipe of §4 at the scale of --model's preset."""

    # --- run, seed, logging
    run_dir: str | None = None
    """run directory (default: runs/<model>-<recipe>-<date>); holds metrics.jsonl, samples.jsonl, checkpoints"""
    resume: str | None = None
    """continue the run in this directory from its last checkpoint (its args are the defaults)"""
    seed: int = 0
    """prompt order, held-out split, initialization, sampler seed"""
    steps: int = 80
    """optimizer steps in all"""
    eval_every: int = 8
    """held-out evaluation (and a sigmoid fit) every this many steps; also at step 0 and at the end"""
    eval_size: int = 96
    """held-out prompts (paper: 1,000), removed from training"""
    eval_n: int = 4
    """samples per held-out prompt (paper: 16); the pass rate is their mean"""
    save_every: int = 50
    """checkpoint every this many steps (and on Ctrl-C); 0: only at the end"""
    log_samples: int = 4
    """completions per step written to samples.jsonl"""
    wandb_project: str | None = None
    """also log to Weights & Biases (needs `pip install wandb`)"""
    # --- model and devices
    model: str = "tiny"
    """preset (tiny, smollm2-135m, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b), Hugging Face id or local dir"""
    path: str | None = None
    """weights to start from (default: the preset's; `tiny` builds its own)"""
    generator_gpus: list[int] | None = None
    """GPUs for vLLM, tp x dp of them (default: rank 0's GPU, shared with its trainer)"""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism; generator_gpus = tp * dp GPUs"""
    gpu_memory_utilization: float | None = None
    """vLLM's share of each generator GPU"""
    kv_cache_gib: float | None = None
    """vLLM KV cache size on CPU"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in backward (the GPU presets: 16k-token sequences)"""
    gen_dtype: str = "auto"
    """vLLM weights dtype ("auto": bf16 on GPU)"""
    max_model_len: int = 512
    """vLLM context: prompt + thinking + phrase + answer must fit"""
    # --- data
    data: str = "arith"
    """dataset: preset (arith, gsm8k, polaris, math500; code: humaneval, deepcoder), a mixture a+b
    (e.g. polaris+deepcoder), local .jsonl/.json/.parquet, or a hub id"""
    unsafe_no_sandbox: bool = False
    """grade code WITHOUT the bubblewrap sandbox (no user namespaces here): it sees your files"""
    question_key: str | None = None
    """column holding the question (default: question / problem / prompt)"""
    answer_key: str | None = None
    """column holding the gold answer (default: answer / solution / final_answer)"""
    max_prompt_len: int = 128
    """prompts longer than this after templating are skipped (counted)"""
    # --- generation
    prompts_per_step: int = 16
    """P: prompt groups per optimizer step (paper: 48)"""
    group_size: int = 8
    """G: completions per prompt (paper: 16)"""
    temperature: float = 1.0
    """sampling temperature of training and evaluation; the trainer divides logits by it too"""
    think_budget: tuple[int, int] = ARITH_THINK_BUDGET
    """forced interruption after L ~ U[lo, hi] thinking tokens (paper A.10: 10k-12k)"""
    answer_budget: int = 16
    """tokens for the answer after thinking (paper: 2k)"""
    interruptions: bool = True
    """forced interruptions (§2); off: one phase of think_budget[1] + answer_budget tokens (loo-lp)"""
    phrase: str = generate.PHRASE
    """appended when the thinking budget runs out (paper §4)"""
    async_mode: Literal["pipeline", "ppo"] = "pipeline"
    """PipelineRL-k with in-flight updates (§3.1) or PPO-off-policy-k (k batches per weight version)"""
    max_lag: int = 8
    """k: the most trainer steps a batch's oldest token may lag (paper: 8); 0 = synchronous on-policy"""
    # --- filters
    zero_var_filter: bool = True
    """drop groups whose rewards are all equal from the loss (§3.2 "effective batch")"""
    prompt_sampling: Literal["no_positive", "uniform"] = "no_positive"
    """No-Positive-Resampling (retire prompts with pass rate >= npr_threshold) or uniform epochs"""
    npr_threshold: float = 0.9
    """pass rate at which No-Positive-Resampling retires a prompt (paper: 0.9)"""
    length_penalty: bool = False
    """DAPO overlong penalty on correct rollouts (A.10 Eq. 9; loo-lp)"""
    # --- loss
    recipe: str = "scalerl"
    """flag bundle: scalerl, deepseek-grpo, qwen2.5-dapo, magistral, minimax, loo-plan, loo-lp, loo-batch,
    loo-8op, loo-fp32, loo-savg, loo-dapo, loo-uniform"""
    loss: Literal["cispo", "gspo", "dapo", "grpo"] = "cispo"
    """policy loss (§3.2)"""
    agg: Literal["prompt", "sample", "token"] = "prompt"
    """loss aggregation (§3.2, A.9)"""
    adv_norm: Literal["batch", "prompt", "none"] = "batch"
    """advantage normalization (§3.2, A.9)"""
    cispo_cap: float = 4.0
    """CISPO truncation of the IS ratio (paper: one of 4, 5, 8)"""
    eps_low: float = 0.2
    """DAPO / GRPO lower clip"""
    eps_high: float = 0.28
    """DAPO / GRPO upper clip"""
    fp32_head: bool = True
    """LM head in fp32 in sampler and trainer (§3.2); off: the model dtype (bf16 on GPU; no-op on CPU)"""
    # --- optimizer
    lr: float = 1e-4
    """AdamW learning rate, constant after warmup (paper: 5e-7 for 8B)"""
    warmup_steps: int = 5
    """linear LR warmup (paper: 100)"""
    weight_decay: float = 0.01
    """AdamW weight decay (paper A.3: 0.01)"""
    adam_eps: float = 1e-15
    """paper A.3: 1e-15, against epsilon underflow"""
    max_grad_norm: float = 1.0
    """gradient clipping (the paper does not say)"""
    micro_batch_size: int = 128
    """sequences per forward/backward on each rank"""
    batch_scale: float = 1.0
    """multiplies prompts_per_step (the DAPO and MiniMax recipes ran 80 prompts instead of 48)"""


def parse_args(argv=None) -> Args:
    """Defaults = ScaleRL, then the --model preset, then the --recipe, then (with --resume) the run's saved args;
    explicit flags win over all of them. Raises SystemExit with a message on an unknown preset or recipe."""
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="tiny")
    pre.add_argument("--recipe", default="scalerl")
    pre.add_argument("--resume", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.resume:
        if not os.path.exists(os.path.join(known.resume, "state.json")):
            raise SystemExit(
                f"train.py: --resume {known.resume}: no checkpoint there (state.json) to resume from"
            )
        with open(os.path.join(known.resume, "args.json")) as f:
            default = Args(**{**json.load(f), "resume": known.resume})
    else:
        if known.recipe not in RECIPES:
            raise SystemExit(f"unknown --recipe {known.recipe!r}; choose from {', '.join(RECIPES)}")
        is_path = os.path.sep in known.model or known.model.startswith(".")
        if known.model not in PRESETS and not is_path and "/" not in known.model:
            raise SystemExit(
                f"unknown --model {known.model!r}: not a preset ({', '.join(PRESETS)}), a hub id "
                f"(org/name) or a directory"
            )
        preset = dict(PRESETS.get(known.model, PRESETS["hf"]))
        if known.model not in PRESETS:
            preset["path"] = known.model
        default = Args(
            **{**preset, **RECIPES[known.recipe], "model": known.model, "recipe": known.recipe}
        )
    return tyro.cli(Args, args=argv, default=default)


def validate(args: Args, world: int) -> None:
    """Clear errors before any expensive work (SystemExit naming the flag)."""
    lo, hi = args.think_budget
    need = (
        args.max_prompt_len + hi + len(args.phrase) + args.answer_budget
    )  # phrase: at most one token per char
    checks = [
        (
            args.steps >= 1 and args.eval_every >= 1 and args.eval_size >= 1 and args.eval_n >= 1,
            "--steps, --eval-every, --eval-size, --eval-n must be >= 1",
        ),
        (0 < lo <= hi and args.answer_budget >= 1, f"--think-budget {lo} {hi} needs 0 < lo <= hi"),
        (
            need <= args.max_model_len,
            f"--max-model-len {args.max_model_len} < max_prompt_len + think_budget[1] + "
            f"phrase + answer_budget = {need}",
        ),
        (args.group_size >= 2, "--group-size must be >= 2 (group-centred advantages)"),
        (
            args.group_size % world == 0,
            f"--group-size {args.group_size} must divide across {world} ranks",
        ),
        (
            len(args.generator_gpus or []) % args.tensor_parallel_size == 0,
            f"--generator-gpus {args.generator_gpus}: a multiple of --tensor-parallel-size {args.tensor_parallel_size}",
        ),
        (
            args.max_lag >= 0 and args.temperature > 0 and args.lr > 0,
            "--max-lag >= 0, --temperature, --lr > 0",
        ),
        (
            args.path is None
            or "/" in args.path
            and not args.path.startswith((".", "/"))
            or os.path.isdir(args.path),
            f"model directory {args.path!r} does not exist",
        ),
    ]
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"train.py: {msg}")
