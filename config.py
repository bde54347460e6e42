"""What a run is: the command line resolved into `Args` (every flag, parsed by tyro) over the
`--model` presets (PRESETS) and the paper's `--recipe` bundles (RECIPES), and the rule each flag
must meet, checked once, before any work (validate).

Paper: the defaults are ScaleRL (§4); the qwen3 presets are the training setup of A.3 and §2
(lengths, batch, optimizer, evaluation); RECIPES are the compared recipes of Fig 2 and A.16 and the
leave-one-out variants of Fig 7.

    python train.py --help                   # every flag with its default and docstring
    python train.py --recipe loo-dapo        # ScaleRL with one choice swapped (Figure 7)
    python train.py --model qwen3-8b         # the paper's lengths and batch (A.3)
    python train.py --steps 0                # train.py: --steps 0: must be >= 1 (exit 2)

Precedence: the ScaleRL defaults (Args), then the --model preset, then the --recipe, then (with
--resume) the run's saved args; a flag given on the command line wins over all of them. The run
directory's args.json records the resolved values. Adding an ablation is a field in Args, its
rule in validate, its use in train.py, and (optionally) a RECIPES row.

Where it departs from the paper, and why:
1. Scale: the default `--model tiny` (12 prompts x 16, 156 steps, evals of 200 x 4 every
   6 steps, 5 warmup steps, k = 2) fits 15 minutes on 2 CPU cores; the paper's 48 x 16, 1,000 x 16
   held-out evals every 100 steps, 100 warmup steps and k = 8 (A.3, §3.1) are the qwen3 presets'.
   Its 1,200 training prompts pass ~1.5 times in a run, as the paper's runs pass Polaris-53K several
   times (an epoch ~1k steps, A.5), so No-Positive-Resampling retires the solved ones.
2. The paper gives the learning rate of its 8B model only (5e-7, A.3); the smaller qwen3 presets
   take 1e-6, the tiny model 2e-4.
3. The CISPO cap is 4: the paper tried 4, 5 and 8 without a difference and does not say which
   ScaleRL used (A.17.2).
4. GSPO's clip widths (3e-3 low, 5e-3 high) are read from a figure legend (A.17.3, Fig 20).
5. The interruption range is U[10240, 12288] thinking tokens, reading A.10's "[10k, 12k]" as
   multiples of 1,024, and max_model_len adds 128 tokens for the phrase to the paper's 16,384.
6. Gradients are clipped at --max-grad-norm 1.0; the paper does not state a clipping value (A.3).
7. The fits start at a fraction of the run, not at 1.5k GPU-hours: the paper's cutoff is its first
   epoch, ~1k steps at batch 768 (A.5, A.6), which on the qwen3 presets (5,000 steps at batch 768)
   is FIT_FROM_FRACTION = 1/5 of the run's compute, whatever the GPUs' speed. The tiny preset fits
   from its first eval: its early evals are its curve.
8. An MoE trains without a load-balancing loss by default (--router-aux-loss-coef 0): the paper
   mentions no load-balancing or router loss for its MoE (Llama-4 Scout) runs, only the policy
   loss; transformers' Qwen3-MoE computes one only when asked (output_router_logits, off in its
   config); RL trainers of MoEs commonly leave it off. > 0 adds it (train.microbatch_loss).
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

# light (no torch, vLLM or transformers): `--help` and flag errors answer before they load
from tasks import data

# from-imports: inside Args the name `data` is a field, not the module
from tasks.arith import ARITH_THINK_BUDGET
from tasks.data import PHRASE  # the interruption phrase (paper v1 §4)


@dataclass
class Args:
    """ScaleRL training (arXiv 2510.13786). Defaults: the recipe of §4 at the scale of --model's
    preset."""

    # --- run, seed, logging
    run_dir: str | None = None
    """run directory (default: runs/<model>-<recipe>-<date>); holds metrics.jsonl, samples.jsonl,
    checkpoints"""
    resume: str | None = None
    """continue the run in this directory from its last checkpoint (from step 0 if it has none
    yet); its saved args are the defaults"""
    seed: int = 0
    """prompt order, held-out split, initialization, sampler seed"""
    steps: int = 80
    """optimizer steps in all"""
    eval_every: int = 8
    """held-out evaluation (and a sigmoid fit) every this many steps; also at step 0 and at the
    end"""
    eval_size: int = 96
    """held-out prompts of each task (paper: 1,000), removed from training"""
    train_size: int = 0
    """training prompts of each task, drawn at random by --seed after the held-out split (0: all);
    a pool a run passes several times is where No-Positive-Resampling (§3.2) acts"""
    eval_n: int = 4
    """samples per held-out prompt (paper: 16); the pass rate is their mean"""
    eval_greedy_every: int = 1
    """one greedy sample per held-out prompt (eval/greedy_pass_rate, logged, never fitted) in every
    this many evals, and always at step 0 and step --steps; 0: only those two"""
    fit_from: float | None = 0.0
    """the sigmoid fits (live and fit.json) use the evals at gpu_hours >= this (paper A.5: 1,500,
    its first epoch, skipping the early transient); None: from 1/5 of the run's compute on (the
    qwen3 presets)"""
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
    """preset (tiny, tiny-moe, smollm2-135m, qwen3-0.6b, qwen3-1.7b, qwen3-4b, qwen3-8b,
    qwen3-30b-a3b), Hugging Face id or local dir"""
    path: str | None = None
    """weights to start from (default: the preset's; `tiny` and `tiny-moe` build their own)"""
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
    remote_engines: int = 0
    """generator engines (tp GPUs each) on other nodes, which join rank 0's as vLLM's headless
    data-parallel engines: rank 0 prints the command to run there (README, two nodes); needs NCCL
    weight transfer and --node-address"""
    node_address: str | None = None
    """rank 0's node address the other nodes reach (vLLM's DP handshake, NCCL weight broadcast)"""
    node_port: int = 29550
    """port of vLLM's DP handshake on --node-address (vLLM's default data_parallel_rpc_port)"""
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
    """prompt groups per optimizer step (paper: 48); P, the batch's, is this x --batch-scale"""
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
    """forced interruptions (§2); off: one phase of think_budget[1] + answer_budget tokens
    (loo-lp)"""
    phrase: str = PHRASE
    """appended when the thinking budget runs out (paper §4)"""
    gen_timeout: float | None = None
    """seconds a group may take to be sampled and scored before the run stops as hung (default:
    scaled from the budgets and the sequences in flight, pipeline.group_timeout)"""
    async_mode: Literal["pipeline", "ppo"] = "pipeline"
    """PipelineRL-k with in-flight updates (§3.1) or PPO-off-policy-k (k batches per weight
    version)"""
    max_lag: int = 8
    """k: the most trainer steps a batch's oldest token may lag (paper: 8); 0 = synchronous
    on-policy"""
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
    """flag bundle: scalerl, deepseek-grpo, qwen2.5-dapo, magistral, minimax, loo-plan, loo-lp,
    loo-batch, loo-8op, loo-fp32, loo-savg, loo-dapo, loo-uniform"""
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
    gspo_eps_low: float = 3e-3
    """GSPO lower clip of the sequence ratio (§3.2, A.17.3: the 10^-3 scale, lower 3e-3)"""
    gspo_eps_high: float = 5e-3
    """GSPO upper clip of the sequence ratio (§3.2, A.17.3: upper 5e-3 fit better than 4e-3)"""
    fp32_head: bool = True
    """LM head in fp32 in sampler and trainer (§3.2); off: the model dtype (bf16 on GPU; no-op on
    CPU)"""
    routing_replay: bool = False
    """MoE only: the trainer routes each token to the experts vLLM sampled it with (R3, arXiv
    2510.11370), gating by its own router; off: the trainer routes itself (issue 27)"""
    router_aux_loss_coef: float = 0.0
    """an MoE's load-balancing loss (Switch Transformer's, as transformers computes it) x this,
    added to the policy loss; 0: off, as the paper states none for its MoE (departure 8)"""
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
    alone"""
    micro_batch_size: int = 128
    """at most this many sequences per forward/backward on each rank"""
    batch_scale: float = 1.0
    """P = round(prompts_per_step x this) (the DAPO and MiniMax recipes ran 80 prompts, not 48)"""


# --model NAME: one row each. Any other value is a Hugging Face id or a local directory and gets
# the "hf" row on a machine with CUDA, the "hf-cpu" row (printed at start) on one without.
# Budgets in tokens; think_budget is the interruption range (paper A.10: U[10k, 12k] then a 2k
# answer).
# the paper fits from its first epoch on, ~1k of 5,000 steps at batch 768 (departure 7): the
# share of the run's compute (gpu_hours) that --fit-from None leaves out of the fits
FIT_FROM_FRACTION = 0.2
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
    fit_from=None,  # FIT_FROM_FRACTION of the run (departure 7)
    # a kill loses at most 8 steps, ~1-1.5 h of a node (simulated step times: docs/results.md); a
    # checkpoint (~100 s for 8B) costs ~2% of the run
    save_every=8,
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
    # the Args defaults: a 0.43M-parameter Qwen3 (tasks/tiny.py) on arith, on CPU, sized so that
    # the curve climbs from a low R0 and flattens within 15 minutes on 2 cores (issue 12; the
    # measurements behind each value: docs/history-presets.md)
    "tiny": dict(
        max_lag=2,  # the trainer is the slow side here: a larger k only adds staleness
        lr=2e-4,  # the steadiest of the rates tried on 3 seeds
        prompts_per_step=12,  # cheaper steps than 16 with the same curve shape
        group_size=16,  # groups of 8 leave too few groups a step after the filter
        steps=156,  # a run within 15 minutes on 2 cores
        eval_every=6,  # 27 evals, 14 in the first half of the compute
        eval_size=200,
        eval_n=4,  # the noise a 15-minute run affords
        # the greedy sample in 8 of the 27 evals (steps 0, 24, ..., 144, 156): in every eval it was
        # 200 of its 1,000 rollouts, ~9% of a run's sampled tokens if as long as the sampled ones
        # (75e63a3: evals 1.4M sampled tokens + the greedy, training 2.0M; docs/history-presets.md)
        eval_greedy_every=4,
        # 1,200 of arith's 1,800 prompts: 800 ran dry (8 active from step 147, one run fell 0.951
        # -> 0.806); 1,200 kept 189-391, six seeds met every bar (58bc348, docs/history-presets.md)
        train_size=1200,
        save_every=0,  # a 15-minute run: the last step's and a stop's checkpoints suffice
        # padded micro-batches (SDPA on CPU: no varlen packing), each cut to its own longest row:
        # 4 of them pad a step's rollouts less than the default budget's 2 (issue 28; measured:
        # docs/history-presets.md)
        max_tokens_per_microbatch=8192,
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
    # activation checkpointing where the estimate without it reaches 60 GiB, 75% of an 80 GB GPU
    # (1.7b at the edge; bench/gpu_trainer.py --plan; not yet measured: docs/history-presets.md)
    "qwen3-0.6b": dict(PAPER_GEN, path="Qwen/Qwen3-0.6B", lr=1e-6, activation_checkpointing=False),
    "qwen3-1.7b": dict(PAPER_GEN, path="Qwen/Qwen3-1.7B", lr=1e-6, activation_checkpointing=True),
    "qwen3-4b": dict(PAPER_GEN, path="Qwen/Qwen3-4B", lr=5e-7, activation_checkpointing=True),
    # paper A.3: lr 5e-7 (for 8B)
    "qwen3-8b": dict(PAPER_GEN, path="Qwen/Qwen3-8B", lr=5e-7, activation_checkpointing=True),
    # an MoE of 128 experts, 8 per token: 30.5B parameters, 3.3B per token. lr: the paper's one
    # value, 5e-7 (A.3), which it states for its runs without another for its MoE (Scout). On one
    # node of 8 x 80 GB it fits nowhere: the placement plan says what it needs (infra/placement.py)
    "qwen3-30b-a3b": dict(
        PAPER_GEN, path="Qwen/Qwen3-30B-A3B", lr=5e-7, activation_checkpointing=True
    ),
    "hf": dict(PAPER_GEN, path=None, lr=1e-6, activation_checkpointing=True),
}
# tiny's mixture-of-experts twin (tasks/tiny.py TINY_MOE: 8 experts of width 192, 2 per token, ~1.3M
# parameters, tiny's active MLP width), warm-started the same way, run at tiny's sizes
PRESETS["tiny-moe"] = dict(PRESETS["tiny"])
# An unknown model without CUDA: the smollm2-135m row's sizes (minutes per step on a few cores, not
# the paper-scale days of "hf"), with room for a thinking model's budget; the data stays the user's
# --data, else gsm8k.
PRESETS["hf-cpu"] = dict(
    PRESETS["smollm2-135m"], think_budget=(192, 256), max_model_len=896, kv_cache_gib=1.0
)
# --recipe NAME: the paper's compared recipes (§4; Fig 2, A.16) and leave-one-out variants (Fig 7)
# as flag settings on top of ScaleRL. A flag given on the command line wins over the recipe.
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


class BadInput(Exception):
    """A mistake train.py reports in one line, `train.py: <message>`, with no traceback: exit code 2
    for a bad flag value (the argparse / tyro convention), 1 for an input found unusable while
    loading (data, model)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def exit_with(error: BadInput) -> None:
    """Print the error's one line on stderr (once: rank 0 under torchrun) and exit with its code."""
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: {error}", file=sys.stderr, flush=True)
    raise SystemExit(error.code)


def has_cuda() -> bool:
    """torch.cuda.is_available(), importing torch (seconds) only on a machine with a GPU device node
    (NVIDIA's /dev/nvidiactl, ROCm's /dev/kfd): without one the driver cannot reach a GPU, so flag
    errors stay fast."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def model_kind(model: str) -> str:
    """What a --model (or --path) value names: "preset" (a PRESETS row), "dir" (a local path:
    data.is_local_path), "hub" (org/name) or "unknown"."""
    # "hf" and "hf-cpu" are the rows an unknown model gets, not names to pass
    if model in PRESETS and not model.startswith("hf"):
        return "preset"
    if data.is_local_path(model):
        return "dir"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return "hub"
    return "unknown"


# the flags that pick a run's prompts and its held-out split: fixed once it has started
RUN_PROMPTS = ("data", "seed", "train_size", "eval_size")


def parse_args(argv=None) -> Args:
    """Defaults = ScaleRL, then the --model preset, then the --recipe, then (with --resume) the
    run's saved args; explicit flags win over all of them. An unknown model (hub id or directory)
    gets the "hf" row with CUDA and the "hf-cpu" row without. Raises BadInput (code 2) for an
    unknown preset or a --resume directory that holds no run; tyro exits 2 on a malformed flag and 0
    after --help, and BadInput (code 2) for a --resume that changes RUN_PROMPTS."""
    argv = sys.argv[1:] if argv is None else argv
    # a first pass reads the three flags that pick the defaults the full parse starts from
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="tiny")
    pre.add_argument("--recipe", default="scalerl")
    pre.add_argument("--resume", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.resume:
        default = saved_args(known.resume)
    else:
        default = preset_args(known.model, known.recipe)
    args = tyro.cli(Args, args=argv, default=default)
    # a resumed run keeps its prompts: its pool's checkpoint and held-out split are of them
    for name in RUN_PROMPTS if known.resume else ():
        given, saved = getattr(args, name), getattr(default, name)
        if given != saved:
            flag = "--" + name.replace("_", "-")
            raise BadInput(
                f"{flag} {given}: the run in --resume {known.resume} was started with {saved}; a "
                "resumed run keeps its prompts (drop the flag)"
            )
    return args


def saved_args(run_dir: str) -> Args:
    """The Args a run saved in `run_dir`/args.json, with `resume` set to `run_dir`. Raises BadInput
    (code 2) when `run_dir` is missing or holds no args.json."""
    path = os.path.join(run_dir, "args.json")
    if not os.path.exists(path):
        if os.path.isdir(run_dir):
            raise BadInput(f"--resume {run_dir}: not a run directory (no args.json in it)")
        raise BadInput(f"--resume {run_dir}: no such directory")
    with open(path) as f:
        saved = json.load(f)
    # JSON has no tuples: give tuple fields (think_budget) their type back, as tyro expects
    for k, v in saved.items():
        if isinstance(getattr(Args, k, None), tuple):
            saved[k] = tuple(v)
    return Args(**{**saved, "resume": run_dir})


def preset_args(model: str, recipe: str) -> Args:
    """Args with the --model preset's row, then the --recipe's flags, over the ScaleRL defaults. An
    unknown model (hub id or directory) gets the "hf" row with CUDA, the "hf-cpu" row without; an
    unknown recipe adds no flags (validate names it). Raises BadInput (code 2) for a model that is
    no preset, hub id or path."""
    kind = model_kind(model)
    if kind == "unknown":
        names = ", ".join(k for k in PRESETS if not k.startswith("hf"))
        raise BadInput(
            f"--model {model}: not a preset ({names}), a hub id (org/name) or a directory"
        )
    if kind == "preset":
        preset = dict(PRESETS[model])
    else:
        row = "hf" if has_cuda() else "hf-cpu"
        preset = dict(PRESETS[row], path=model)
    return Args(**{**preset, **RECIPES.get(recipe, {}), "model": model, "recipe": recipe})


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


def groups_per_step(args: Args) -> int:
    """P, the prompt groups in one batch: --prompts-per-step scaled by --batch-scale (the DAPO and
    MiniMax recipes ran 80 prompts where ScaleRL runs 48)."""
    return round(args.prompts_per_step * args.batch_scale)


def check_nodes(
    remote_engines: int, node_address: str | None, weight_transfer: str, resume: str | None = None
) -> None:
    """BadInput for engines on other nodes without a routable --node-address, with weights via disk
    (a node-local disk the other nodes do not read), or on --resume (the restored weights are
    exported to rank 0's disk for the engines to start from: not yet sent to the other nodes)."""
    if remote_engines < 0:
        raise BadInput(f"--remote-engines {remote_engines}: must be >= 0")
    if not remote_engines:
        return
    if (
        not node_address
        or node_address in ("localhost", "0.0.0.0")
        or node_address.startswith("127.")
    ):
        raise BadInput(
            f"--remote-engines {remote_engines}: needs --node-address, rank 0's node address the "
            f"other nodes reach (got {node_address!r})"
        )
    if weight_transfer == "disk":
        raise BadInput(
            f"--weight-transfer disk: with --remote-engines {remote_engines} weights go by NCCL, "
            "never through a node-local disk"
        )
    if resume:
        raise BadInput(
            f"--resume with --remote-engines {remote_engines}: not supported yet (the other nodes "
            "would start from the model path, not the checkpoint's weights)"
        )


def validate(args: Args, world: int) -> None:
    """Every flag's rule, checked here and only here, before any expensive work, in the order of
    Args' fields (a rule on several fields comes after the last of them). Raises BadInput (code 2)
    naming the first bad flag and its value: `--steps 0: must be >= 1`. The two rules that need the
    data (--eval-size against each task's prompts, --task-weights against the data's tasks) are
    loading.load_prompts', once it has loaded. No rule depends on `world`, the trainer ranks:
    train.plan_microbatches splits any batch over any number of ranks (G need not divide)."""
    # --- run, seed, logging
    checkpointed = bool(args.run_dir) and os.path.exists(os.path.join(args.run_dir, "state.json"))
    if checkpointed and not args.resume:  # with --resume a checkpoint there is expected
        raise BadInput(
            f"--run-dir {args.run_dir}: holds a run with a checkpoint; continue it with --resume "
            f"{args.run_dir}, or pick another --run-dir"
        )
    if args.steps < 1:
        raise BadInput(f"--steps {args.steps}: must be >= 1")
    if args.eval_every < 1:
        raise BadInput(f"--eval-every {args.eval_every}: must be >= 1")
    if args.eval_size < 1:
        raise BadInput(f"--eval-size {args.eval_size}: must be >= 1")
    if args.train_size < 0:
        raise BadInput(f"--train-size {args.train_size}: must be >= 0 (0: every training prompt)")
    if args.eval_n < 1:
        raise BadInput(f"--eval-n {args.eval_n}: must be >= 1")
    if args.eval_greedy_every < 0:
        raise BadInput(f"--eval-greedy-every {args.eval_greedy_every}: must be >= 0")
    fit_from = args.fit_from
    if fit_from is not None and not 0 <= fit_from < math.inf:
        raise BadInput(f"--fit-from {fit_from}: must be a number >= 0 (gpu_hours) or None")
    if args.save_every < 0:
        raise BadInput(f"--save-every {args.save_every}: must be >= 0 (0: only at the end)")
    if args.log_samples < 0:
        raise BadInput(f"--log-samples {args.log_samples}: must be >= 0")
    if args.dist_timeout <= 0:
        raise BadInput(f"--dist-timeout {args.dist_timeout}: must be > 0 (seconds)")
    # --- model and devices
    if args.path is not None and model_kind(args.path) == "dir":
        flag = "--model" if args.path == args.model else "--path"
        path = os.path.expanduser(args.path)
        if not os.path.isdir(path):
            raise BadInput(f"{flag} {args.path}: no such directory")
        if not os.path.exists(os.path.join(path, "config.json")):
            raise BadInput(f"{flag} {args.path}: not a model directory (no config.json in it)")
    if args.eval_gpus is not None and args.eval_gpus < 0:
        raise BadInput(f"--eval-gpus {args.eval_gpus}: must be >= 0")
    tp = args.tensor_parallel_size
    n_gpus = len(args.generator_gpus or [])
    if tp < 1 or n_gpus % tp != 0:
        raise BadInput(
            f"--tensor-parallel-size {tp}: must be >= 1 and divide the {n_gpus} --generator-gpus"
        )
    check_nodes(args.remote_engines, args.node_address, args.weight_transfer, args.resume)
    mem = args.gpu_memory_utilization
    if mem is not None and not 0 < mem <= 1:
        raise BadInput(f"--gpu-memory-utilization {mem}: must be in (0, 1]")
    if args.kv_cache_gib is not None and args.kv_cache_gib <= 0:
        raise BadInput(f"--kv-cache-gib {args.kv_cache_gib}: must be > 0")
    if args.gen_dtype not in ("auto", "float32", "bfloat16", "float16"):
        raise BadInput(f"--gen-dtype {args.gen_dtype}: must be auto, float32, bfloat16 or float16")
    # --- data
    parse_task_weights(args.task_weights)
    if args.max_prompt_len < 1:
        raise BadInput(f"--max-prompt-len {args.max_prompt_len}: must be >= 1")
    # --- generation
    if args.prompts_per_step < 1:
        raise BadInput(f"--prompts-per-step {args.prompts_per_step}: must be >= 1")
    if args.group_size < 2:
        raise BadInput(f"--group-size {args.group_size}: must be >= 2 (group advantages)")
    if args.temperature <= 0:
        raise BadInput(f"--temperature {args.temperature}: must be > 0")
    lo, hi = args.think_budget
    if not 0 < lo <= hi:
        raise BadInput(f"--think-budget {lo} {hi}: needs 0 < lo <= hi")
    if args.answer_budget < 1:
        raise BadInput(f"--answer-budget {args.answer_budget}: must be >= 1")
    # the longest rollout: prompt, thinking, the phrase (at most one token per character), answer
    need = args.max_prompt_len + hi + len(args.phrase) + args.answer_budget
    if need > args.max_model_len:
        raise BadInput(
            f"--max-model-len {args.max_model_len}: < max_prompt_len + think_budget[1] + phrase + "
            f"answer_budget = {need}"
        )
    if args.gen_timeout is not None and args.gen_timeout <= 0:
        raise BadInput(f"--gen-timeout {args.gen_timeout}: must be > 0 (seconds)")
    # PPO-off-policy-k trains k batches per weight version, so it needs k >= 1
    min_lag = 1 if args.async_mode == "ppo" else 0
    if args.max_lag < min_lag:
        raise BadInput(
            f"--max-lag {args.max_lag}: must be >= {min_lag} with --async-mode {args.async_mode}"
        )
    # --- filters
    if not 0 < args.npr_threshold <= 1:
        raise BadInput(f"--npr-threshold {args.npr_threshold}: must be in (0, 1]")
    # --- loss
    if args.recipe not in RECIPES:
        raise BadInput(f"--recipe {args.recipe}: unknown; choose from {', '.join(RECIPES)}")
    # policy_loss weighs a GSPO sequence by its summed token weights: 1/S under sample aggregation
    # (GSPO's one weight per sequence), its length under prompt or token (loss.py departure 5)
    if args.loss == "gspo" and args.agg != "sample":
        raise BadInput(f"--agg {args.agg}: --loss gspo weighs each sequence once; use --agg sample")
    # a cap below 1 also truncates on-policy tokens (rho ~ 1): every gradient shrinks by the cap
    if args.cispo_cap < 1:
        raise BadInput(f"--cispo-cap {args.cispo_cap}: must be >= 1 (paper: 4, 5 or 8)")
    if args.eps_low < 0:
        raise BadInput(f"--eps-low {args.eps_low}: must be >= 0")
    if args.eps_high < 0:
        raise BadInput(f"--eps-high {args.eps_high}: must be >= 0")
    if args.gspo_eps_low < 0:
        raise BadInput(f"--gspo-eps-low {args.gspo_eps_low}: must be >= 0")
    if args.gspo_eps_high < 0:
        raise BadInput(f"--gspo-eps-high {args.gspo_eps_high}: must be >= 0")
    if not 0 <= args.router_aux_loss_coef < math.inf:  # an MoE at all: loading.load_model
        raise BadInput(
            f"--router-aux-loss-coef {args.router_aux_loss_coef}: must be finite and >= 0"
        )
    # --- optimizer
    if args.lr <= 0:
        raise BadInput(f"--lr {args.lr}: must be > 0")
    if args.warmup_steps < 0:
        raise BadInput(f"--warmup-steps {args.warmup_steps}: must be >= 0")
    if args.weight_decay < 0:
        raise BadInput(f"--weight-decay {args.weight_decay}: must be >= 0")
    if args.adam_eps <= 0:
        raise BadInput(f"--adam-eps {args.adam_eps}: must be > 0")
    if args.max_grad_norm <= 0:
        raise BadInput(f"--max-grad-norm {args.max_grad_norm}: must be > 0")
    if args.max_tokens_per_microbatch < 1:
        raise BadInput(
            f"--max-tokens-per-microbatch {args.max_tokens_per_microbatch}: must be >= 1"
        )
    if args.micro_batch_size < 1:
        raise BadInput(f"--micro-batch-size {args.micro_batch_size}: must be >= 1")
    if groups_per_step(args) < 1:
        raise BadInput(f"--batch-scale {args.batch_scale}: must leave >= 1 prompt per step")


def cli(argv=None) -> Args:
    """train.py's command line: parse_args + validate (world size from torchrun's WORLD_SIZE),
    before torch loads. On a bad flag prints one line on stderr and exits 2."""
    try:
        args = parse_args(argv)
        validate(args, int(os.environ.get("WORLD_SIZE", "1")))
    except BadInput as e:
        exit_with(e)
    return args
