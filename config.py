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
import math
import os
import re
import sys
from dataclasses import dataclass
from typing import Literal

import tyro

import data  # light (stdlib only): `--help` and flag errors answer before torch and vLLM load
from data import PHRASE  # the interruption phrase (paper v1 §4); Args has a field named `data`

ARITH_THINK_BUDGET = data.ARITH_THINK_BUDGET  # Args has a field named `data`
# --model NAME: one row each. Any other value is a Hugging Face id or a local directory and gets the "hf" row on
# a machine with CUDA, the "hf-cpu" row (printed at start) on one without.
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
    # the Args defaults (a 0.43M-parameter Qwen3 built by tiny.py, the arith task, CPU), sized so that the
    # curve climbs from a low R0 and bends within 15 minutes on 2 cores (issue 12; runs in the README):
    # - k = 2: here the trainer, not the sampler, is the slow side, so k = 8 would only make every batch
    #   8 steps stale (measured: the sampled pass rate then drifted instead of rising).
    # - lr 3e-4: the rise is rollout-limited (8 x 8 for 200 steps gained what 16 x 8 for 100 did), so lr
    #   sets C_mid: at 1e-4 / 2e-4 the gain was +0.17 / +0.39 with no plateau in 100 steps, at 3e-4 the
    #   curve bends by step 30-40, at 4e-4 the policy (greedy too) swings +-0.05 between evals and 1e-3
    #   collapses to reward 0.
    # - 100 steps of 16 x 8, an eval of 200 held-out prompts x 8 every 10 steps: 11 points, 5 in the
    #   first half, sampling noise ~0.012 (96 x 4 gave 0.025, as large as the fits' target error).
    "tiny": dict(max_lag=2, lr=3e-4, steps=100, eval_every=10, eval_size=200, eval_n=8),
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
    # paper A.3: lr 5e-7
    "qwen3-8b": dict(PAPER_GEN, path="Qwen/Qwen3-8B", lr=5e-7, activation_checkpointing=True),
    "hf": dict(PAPER_GEN, path=None, lr=1e-6, activation_checkpointing=True),
}
# An unknown model without CUDA: the smollm2-135m row's sizes (minutes per step on a few cores, not the paper-scale
# days of "hf"), with room for a thinking model's budget; the data stays the user's --data, else gsm8k.
PRESETS["hf-cpu"] = dict(
    PRESETS["smollm2-135m"], think_budget=(192, 256), max_model_len=896, kv_cache_gib=1.0
)
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
    """continue the run in this directory from its last checkpoint (from step 0 if it has none yet); its saved
    args are the defaults"""
    seed: int = 0
    """prompt order, held-out split, initialization, sampler seed"""
    steps: int = 80
    """optimizer steps in all"""
    eval_every: int = 8
    """held-out evaluation (and a sigmoid fit) every this many steps; also at step 0 and at the end"""
    eval_size: int = 96
    """held-out prompts of each task (paper: 1,000), removed from training"""
    eval_n: int = 4
    """samples per held-out prompt (paper: 16); the pass rate is their mean"""
    save_every: int = 50
    """checkpoint every this many steps (and on Ctrl-C); 0: only at the end"""
    log_samples: int = 4
    """completions per step written to samples.jsonl"""
    wandb_project: str | None = None
    """also log to Weights & Biases (needs `pip install wandb`)"""
    dist_timeout: float = 1800.0
    """seconds a rank may wait in one collective before torch.distributed calls it hung; rank 0's
    long waits (vLLM starting, rollouts, evals) keep the other ranks polling every second"""
    # --- model and devices
    model: str = "tiny"
    """preset (tiny, smollm2-135m, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b), Hugging Face id or local dir"""
    path: str | None = None
    """weights to start from (default: the preset's; `tiny` builds its own)"""
    generator_gpus: list[int] | None = None
    """GPUs for vLLM, tp x dp of them, as indices into the visible ones (CUDA_VISIBLE_DEVICES
    order); default: every visible GPU of rank 0's node that no trainer rank uses"""
    eval_gpus: int | None = None
    """generator GPUs (the last ones) for the eval engine, which evaluates while training goes on;
    0: it shares the generator's GPU(s); default: tensor_parallel_size GPUs when the generator has
    at least twice that, else 0"""
    share_gpu: bool = False
    """let vLLM share trainer GPUs (default: rank 0's), small models only; weights go via disk"""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism; the generator GPUs form dp engines of tp GPUs each"""
    gpu_memory_utilization: float | None = None
    """vLLM's share of each generator GPU (default: 0.9 on its own GPUs, 0.5 on a shared one)"""
    weight_transfer: Literal["auto", "disk", "nccl"] = "auto"
    """how weights reach vLLM: auto = NCCL when vLLM has GPUs of its own (CUDA), else disk"""
    kv_cache_gib: float | None = None
    """vLLM KV cache size on CPU"""
    activation_checkpointing: bool = False
    """recompute each decoder layer's activations in backward (the GPU presets from 1.7b up)"""
    gen_dtype: str = "auto"
    """vLLM weights dtype ("auto": bf16 on GPU)"""
    max_model_len: int = 512
    """vLLM context: prompt + thinking + phrase + answer must fit"""
    # --- data
    data: str = "arith"
    """dataset: preset (arith, arith-hard, gsm8k, polaris, math500; code: humaneval, deepcoder),
    a mixture a+b of tasks a and b (e.g. polaris+deepcoder), local .jsonl/.json/.parquet, or a hub
    id"""
    task_weights: list[str] | None = None
    """a mixture's sampling: TASK=WEIGHT for each task (e.g. polaris=1 deepcoder=1); a group's
    prompt is of task t with probability w_t / sum(w); default: each task's number of prompts"""
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
    thinking: Literal["auto", "on", "off"] = "auto"
    """<think>...</think> before the answer; auto: iff the chat template renders a think block"""
    think_budget: tuple[int, int] = ARITH_THINK_BUDGET
    """forced interruption after L ~ U[lo, hi] thinking tokens (paper A.10: 10k-12k)"""
    answer_budget: int = 16
    """tokens for the answer after thinking (paper: 2k)"""
    interruptions: bool = True
    """forced interruptions (§2); off: one phase of think_budget[1] + answer_budget tokens (loo-lp)"""
    phrase: str = PHRASE
    """appended when the thinking budget runs out (paper §4)"""
    gen_timeout: float | None = None
    """seconds a group may take to be sampled and scored before the run stops as hung (default:
    scaled from the budgets and the sequences in flight, pipeline.group_timeout)"""
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
    max_tokens_per_microbatch: int = 32768
    """tokens per forward/backward on each rank, as computed: padded rows x their longest (SDPA,
    eager), or the sum of the lengths of a packed row (flash attention); a longer sequence runs
    alone. 0: micro-batches of --micro-batch-size sequences padded to the batch's longest (the
    layout before issue 11)"""
    micro_batch_size: int = 128
    """at most this many sequences per forward/backward on each rank"""
    batch_scale: float = 1.0
    """multiplies prompts_per_step (the DAPO and MiniMax recipes ran 80 prompts instead of 48)"""


class BadInput(Exception):
    """A mistake train.py reports in one line, `train.py: <message>`, with no traceback: exit code 2 for a bad flag
    value (the argparse / tyro convention), 1 for an input found unusable while loading (data, model)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def exit_with(error: BadInput) -> None:
    """Print the error's one line on stderr (once: rank 0 under torchrun) and exit with its code."""
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: {error}", file=sys.stderr, flush=True)
    raise SystemExit(error.code)


def has_cuda() -> bool:
    """torch.cuda.is_available(), importing torch (seconds) only on a machine with a GPU device node (NVIDIA's
    /dev/nvidiactl, ROCm's /dev/kfd): without one the driver cannot reach a GPU, so flag errors stay fast."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def model_kind(model: str) -> str:
    """What a --model (or --path) value names: "preset" (a PRESETS row), "dir" (an existing directory, or a name
    that reads as a path), "hub" (org/name) or "unknown"."""
    if model in PRESETS and not model.startswith("hf"):
        return "preset"
    if os.path.isdir(os.path.expanduser(model)) or model.startswith((".", "/", "~")):
        return "dir"
    return "hub" if re.fullmatch(r"[\w.-]+/[\w.-]+", model) else "unknown"


def parse_args(argv=None) -> Args:
    """Defaults = ScaleRL, then the --model preset, then the --recipe, then (with --resume) the run's saved args;
    explicit flags win over all of them. An unknown model (hub id or directory) gets the "hf" row with CUDA and the
    "hf-cpu" row without. Raises BadInput (code 2) for an unknown preset or recipe or a --resume directory that
    holds no run; tyro exits 2 on a malformed flag and 0 after --help."""
    argv = sys.argv[1:] if argv is None else argv
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="tiny")
    pre.add_argument("--recipe", default="scalerl")
    pre.add_argument("--resume", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.resume:
        saved = os.path.join(known.resume, "args.json")
        if not os.path.exists(saved):
            raise BadInput(
                f"--resume {known.resume}: not a run directory (no args.json in it)"
                if os.path.isdir(known.resume)
                else f"--resume {known.resume}: no such directory"
            )
        with open(saved) as f:
            saved = json.load(f)
        # JSON has no tuples: give tuple fields (think_budget) their type back, as tyro expects
        saved = {
            k: tuple(v) if isinstance(getattr(Args, k, None), tuple) else v
            for k, v in saved.items()
        }
        default = Args(**{**saved, "resume": known.resume})
    else:
        if known.recipe not in RECIPES:
            raise BadInput(f"--recipe {known.recipe}: unknown; choose from {', '.join(RECIPES)}")
        kind = model_kind(known.model)
        if kind == "unknown":
            names = ", ".join(k for k in PRESETS if not k.startswith("hf"))
            raise BadInput(
                f"--model {known.model}: not a preset ({names}), a hub id (org/name) or a directory"
            )
        if kind == "preset":
            preset = dict(PRESETS[known.model])
        else:
            preset = dict(PRESETS["hf" if has_cuda() else "hf-cpu"], path=known.model)
        default = Args(
            **{**preset, **RECIPES[known.recipe], "model": known.model, "recipe": known.recipe}
        )
    return tyro.cli(Args, args=argv, default=default)


def parse_task_weights(items: list[str] | None) -> dict[str, float] | None:
    """--task-weights' TASK=WEIGHT items as {task: weight} (None stays None). Raises BadInput
    (code 2) naming an item that is not TASK=WEIGHT with a finite number >= 0, a task given twice,
    or no weight > 0 (none given, or all 0). Whether the tasks are the data's is checked once the
    data has loaded (filters.task_weights)."""
    if items is None:
        return None
    weights = {}
    for item in items:
        task, _, w = item.rpartition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = math.nan
        if not task or not math.isfinite(weight) or weight < 0:
            raise BadInput(f"--task-weights {item}: must be TASK=WEIGHT, a number >= 0")
        if task in weights:
            raise BadInput(f"--task-weights {item}: task {task} given twice")
        weights[task] = weight
    if not any(weights.values()):
        raise BadInput(f"--task-weights {' '.join(items)}: needs a weight > 0")
    return weights


def validate(args: Args, world: int) -> None:
    """One check per flag, before any expensive work. Raises BadInput (code 2) naming the first bad flag and its
    value: `--steps 0: must be >= 1`."""
    lo, hi = args.think_budget
    need = (
        args.max_prompt_len + hi + len(args.phrase) + args.answer_budget
    )  # phrase: <= 1 token per char
    P = round(
        args.prompts_per_step * args.batch_scale
    )  # prompt groups per batch, as train.py derives it
    gpus = args.generator_gpus or []
    run_dir = args.run_dir if not args.resume else None
    checks = [
        ("--steps", args.steps, args.steps >= 1, "must be >= 1"),
        ("--eval-every", args.eval_every, args.eval_every >= 1, "must be >= 1"),
        ("--eval-size", args.eval_size, args.eval_size >= 1, "must be >= 1"),
        ("--eval-n", args.eval_n, args.eval_n >= 1, "must be >= 1"),
        (
            "--eval-gpus",
            args.eval_gpus,
            args.eval_gpus is None or args.eval_gpus >= 0,
            "must be >= 0",
        ),
        ("--dist-timeout", args.dist_timeout, args.dist_timeout > 0, "must be > 0 (seconds)"),
        (
            "--gen-timeout",
            args.gen_timeout,
            args.gen_timeout is None or args.gen_timeout > 0,
            "must be > 0 (seconds)",
        ),
        (
            "--save-every",
            args.save_every,
            args.save_every >= 0,
            "must be >= 0 (0: only at the end)",
        ),
        ("--log-samples", args.log_samples, args.log_samples >= 0, "must be >= 0"),
        ("--prompts-per-step", args.prompts_per_step, args.prompts_per_step >= 1, "must be >= 1"),
        ("--batch-scale", args.batch_scale, P >= 1, "must leave >= 1 prompt per step"),
        ("--group-size", args.group_size, args.group_size >= 2, "must be >= 2 (group advantages)"),
        (
            "--group-size",
            args.group_size,
            args.group_size % world == 0,
            f"must divide across {world} ranks",
        ),
        ("--micro-batch-size", args.micro_batch_size, args.micro_batch_size >= 1, "must be >= 1"),
        (
            "--max-tokens-per-microbatch",
            args.max_tokens_per_microbatch,
            args.max_tokens_per_microbatch >= 0,
            "must be >= 0 (0: micro-batches of --micro-batch-size padded sequences)",
        ),
        ("--think-budget", f"{lo} {hi}", 0 < lo <= hi, "needs 0 < lo <= hi"),
        ("--answer-budget", args.answer_budget, args.answer_budget >= 1, "must be >= 1"),
        ("--max-prompt-len", args.max_prompt_len, args.max_prompt_len >= 1, "must be >= 1"),
        (
            "--max-model-len",
            args.max_model_len,
            need <= args.max_model_len,
            f"< max_prompt_len + think_budget[1] + phrase + answer_budget = {need}",
        ),
        ("--temperature", args.temperature, args.temperature > 0, "must be > 0"),
        (
            "--max-lag",
            args.max_lag,
            args.max_lag >= (args.async_mode == "ppo"),
            f"must be >= {int(args.async_mode == 'ppo')} with --async-mode {args.async_mode}",
        ),
        ("--npr-threshold", args.npr_threshold, 0 < args.npr_threshold <= 1, "must be in (0, 1]"),
        ("--cispo-cap", args.cispo_cap, args.cispo_cap > 0, "must be > 0"),
        ("--eps-low", args.eps_low, args.eps_low >= 0, "must be >= 0"),
        ("--eps-high", args.eps_high, args.eps_high >= 0, "must be >= 0"),
        ("--lr", args.lr, args.lr > 0, "must be > 0"),
        ("--warmup-steps", args.warmup_steps, args.warmup_steps >= 0, "must be >= 0"),
        ("--weight-decay", args.weight_decay, args.weight_decay >= 0, "must be >= 0"),
        ("--adam-eps", args.adam_eps, args.adam_eps > 0, "must be > 0"),
        ("--max-grad-norm", args.max_grad_norm, args.max_grad_norm > 0, "must be > 0"),
        (
            "--gen-dtype",
            args.gen_dtype,
            args.gen_dtype in ("auto", "float32", "bfloat16", "float16"),
            "must be auto, float32, bfloat16 or float16",
        ),
        (
            "--tensor-parallel-size",
            args.tensor_parallel_size,
            args.tensor_parallel_size >= 1 and len(gpus) % args.tensor_parallel_size == 0,
            f"must be >= 1 and divide the {len(gpus)} --generator-gpus",
        ),
        (
            "--gpu-memory-utilization",
            args.gpu_memory_utilization,
            args.gpu_memory_utilization is None or 0 < args.gpu_memory_utilization <= 1,
            "must be in (0, 1]",
        ),
        (
            "--kv-cache-gib",
            args.kv_cache_gib,
            args.kv_cache_gib is None or args.kv_cache_gib > 0,
            "must be > 0",
        ),
        (
            "--recipe",
            args.recipe,
            args.recipe in RECIPES,
            f"unknown; choose from {', '.join(RECIPES)}",
        ),
        (
            "--run-dir",
            run_dir,
            not (run_dir and os.path.exists(os.path.join(run_dir, "state.json"))),
            f"holds a run with a checkpoint; continue it with --resume {run_dir}, or pick another "
            "--run-dir",
        ),
    ]
    if args.path is not None and model_kind(args.path) == "dir":
        flag = "--model" if args.path == args.model else "--path"
        exists = os.path.isdir(os.path.expanduser(args.path))
        checks.append((flag, args.path, exists, "no such directory"))
        checks.append(
            (
                flag,
                args.path,
                not exists
                or os.path.exists(os.path.join(os.path.expanduser(args.path), "config.json")),
                "not a model directory (no config.json in it)",
            )
        )
    for flag, value, ok, why in checks:
        if not ok:
            raise BadInput(f"{flag} {value}: {why}")
    parse_task_weights(args.task_weights)


def cli(argv=None) -> Args:
    """train.py's command line: parse_args + validate (world size from torchrun's WORLD_SIZE), before torch loads.
    On a bad flag prints one line on stderr and exits 2."""
    try:
        args = parse_args(argv)
        validate(args, int(os.environ.get("WORLD_SIZE", "1")))
    except BadInput as e:
        exit_with(e)
    return args
