"""ScaleRL end to end: the RL loop of arXiv 2510.13786 (§4), composed from the pure modules.

    python train.py                                     # tiny embedded model on CPU, ~15 min, no download
    torchrun --nproc_per_node 2 train.py --steps 20     # the same with FSDP2 over 2 CPU ranks (gloo)
    torchrun --nproc_per_node 8 train.py --model qwen3-8b --generator-gpus 8 9 10 11
    python train.py --recipe loo-dapo                   # one of the paper's compared recipes / ablations
    python train.py --resume runs/NAME                  # continue a stopped run where it stopped
    python fit.py runs/NAME/metrics.jsonl --fit-until X # the sigmoid fit of a finished run

One step (DESIGN.md): the pipeline's producer thread samples groups with vLLM (forced interruptions, in-flight
weight updates) and grades them; the trainer takes a batch of P groups with lag <= k, drops zero-variance groups,
records pass rates for No-Positive-Resampling, computes batch-normalized advantages and prompt-level aggregation
weights on the whole batch, runs fp32-head log-probs -> CISPO -> backward per micro-batch on every rank, steps
AdamW, and hands the new weights to the sampler. Every `eval_every` steps: held-out pass rate, the compute clock,
a sigmoid fit of the curve so far, a checkpoint every `save_every`.

Where it departs from the paper, and why:
1. Scale: the `tiny` preset is a ~1M-parameter Qwen3 on a synthetic task (data.py `arith`) with 10^4x smaller
   budgets, so the whole recipe runs on a laptop; the GPU presets keep the paper's lengths and batch.
2. Compute is counted in device-hours (`gpu_hours`): wall time x devices (trainer + generator GPUs; on CPU the
   machine counts as one device). The paper counts GB200-hours.
3. Truncated rollouts stay in the batch with the reward the grader gives them (usually 0); the paper says only
   that they shrink the "effective batch" (PAPER.md 7.4).
4. Gradients are clipped at `max_grad_norm` (default 1.0); the paper does not say whether it clips.
5. The LR warmup is `warmup_steps` (100 in the paper, shorter for the tiny preset's few hundred steps).
"""

import argparse
import dataclasses
import json
import logging
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import tyro
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import filters
import fit
import generate
import loss
import pipeline
import tiny

ARITH_THINK_BUDGET = data.ARITH_THINK_BUDGET  # Args has a field named `data`
# --model NAME: one row each. Any other value is a Hugging Face id or a local directory and gets the "hf" row.
# Budgets in tokens; think_budget is the interruption range (paper A.10: U[10k, 12k] then a 2k answer).
PAPER_GEN = dict(think_budget=(10240, 12288), answer_budget=2048, max_prompt_len=2048, max_model_len=16384 + 128,
                 prompts_per_step=48, group_size=16, eval_size=1000, eval_n=16, eval_every=100, save_every=100,
                 warmup_steps=100, steps=5000, micro_batch_size=4, data="polaris", temperature=1.0)
PRESETS = {
    "tiny": {},  # the Args defaults: a ~1M-parameter Qwen3 built by tiny.py, the arith task, CPU
    "smollm2-135m": dict(path=None, data="gsm8k", think_budget=(1, 1), answer_budget=256, max_prompt_len=256,
                         max_model_len=640, prompts_per_step=4, group_size=4, lr=1e-6, temperature=1.0, steps=100,
                         eval_every=10, eval_size=8, eval_n=2, save_every=50, warmup_steps=10, micro_batch_size=4,
                         kv_cache_gib=0.5, gen_dtype="float32"),
    "qwen3-0.6b": dict(PAPER_GEN, path="Qwen/Qwen3-0.6B", lr=1e-6, gpu_memory_utilization=0.5),
    "qwen3-1.7b": dict(PAPER_GEN, path="Qwen/Qwen3-1.7B", lr=1e-6, gpu_memory_utilization=0.5),
    "qwen3-4b": dict(PAPER_GEN, path="Qwen/Qwen3-4B", lr=5e-7, gpu_memory_utilization=0.6),
    "qwen3-8b": dict(PAPER_GEN, path="Qwen/Qwen3-8B", lr=5e-7, gpu_memory_utilization=0.6),  # paper A.3: 5e-7
    "hf": dict(PAPER_GEN, path=None, lr=1e-6, gpu_memory_utilization=0.6),
}
# --recipe NAME: the paper's compared recipes (§4, A.16; PAPER.md 10.2) and leave-one-out variants (Fig 7) as flag
# settings on top of ScaleRL. A flag given on the command line wins over the recipe.
RECIPES = {
    "scalerl": {},
    "deepseek-grpo": dict(loss="grpo", eps_low=0.2, eps_high=0.2, agg="sample", adv_norm="prompt", async_mode="ppo",
                          zero_var_filter=False, prompt_sampling="uniform", fp32_head=False),
    "qwen2.5-dapo": dict(loss="dapo", eps_low=0.2, eps_high=0.26, agg="prompt", adv_norm="prompt", async_mode="ppo",
                         prompt_sampling="uniform", fp32_head=False, batch_scale=80 / 48),
    "magistral": dict(loss="dapo", eps_low=0.2, eps_high=0.26, agg="prompt", adv_norm="prompt",
                      prompt_sampling="uniform", fp32_head=False),
    "minimax": dict(agg="prompt", adv_norm="prompt", async_mode="ppo", prompt_sampling="uniform",
                    batch_scale=80 / 48),
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
    steps: int = 100
    """optimizer steps in all"""
    eval_every: int = 10
    """held-out evaluation (and a sigmoid fit) every this many steps; also at step 0 and at the end"""
    eval_size: int = 200
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
    """GPUs for vLLM (default: those torchrun does not use, else rank 0's GPU, shared)"""
    tensor_parallel_size: int = 1
    """vLLM tensor parallelism; generator_gpus = tp * dp GPUs"""
    gpu_memory_utilization: float | None = None
    """vLLM's share of each generator GPU"""
    kv_cache_gib: float | None = None
    """vLLM KV cache size on CPU"""
    gen_dtype: str = "auto"
    """vLLM weights dtype ("auto": bf16 on GPU)"""
    max_model_len: int = 512
    """vLLM context: prompt + thinking + phrase + answer must fit"""
    # --- data
    data: str = "arith"
    """dataset: preset (arith, gsm8k, polaris, math500), local .jsonl/.json/.parquet, or a hub id"""
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
    warmup_steps: int = 10
    """linear LR warmup (paper: 100)"""
    weight_decay: float = 0.01
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
        with open(os.path.join(known.resume, "args.json")) as f:
            default = Args(**{**json.load(f), "resume": known.resume})
    else:
        if known.recipe not in RECIPES:
            raise SystemExit(f"unknown --recipe {known.recipe!r}; choose from {', '.join(RECIPES)}")
        is_path = os.path.sep in known.model or known.model.startswith(".")
        if known.model not in PRESETS and not is_path and "/" not in known.model:
            raise SystemExit(f"unknown --model {known.model!r}: not a preset ({', '.join(PRESETS)}), a hub id "
                             f"(org/name) or a directory")
        preset = dict(PRESETS.get(known.model, PRESETS["hf"]))
        if known.model not in PRESETS:
            preset["path"] = known.model
        default = Args(**{**preset, **RECIPES[known.recipe], "model": known.model, "recipe": known.recipe})
    return tyro.cli(Args, args=argv, default=default)


def validate(args: Args, world: int) -> None:
    """Clear errors before any expensive work (SystemExit naming the flag)."""
    lo, hi = args.think_budget
    need = args.max_prompt_len + hi + len(args.phrase) + args.answer_budget  # phrase: at most one token per char
    checks = [
        (args.steps >= 1 and args.eval_every >= 1 and args.eval_size >= 1 and args.eval_n >= 1,
         "--steps, --eval-every, --eval-size, --eval-n must be >= 1"),
        (0 < lo <= hi and args.answer_budget >= 1, f"--think-budget {lo} {hi} needs 0 < lo <= hi"),
        (need <= args.max_model_len, f"--max-model-len {args.max_model_len} < max_prompt_len + think_budget[1] + "
                                     f"phrase + answer_budget = {need}"),
        (args.group_size >= 2, "--group-size must be >= 2 (group-centred advantages)"),
        (args.group_size % world == 0, f"--group-size {args.group_size} must divide across {world} ranks"),
        (args.max_lag >= 0 and args.temperature > 0 and args.lr > 0, "--max-lag >= 0, --temperature, --lr > 0"),
        (args.path is None or "/" in args.path and not args.path.startswith((".", "/")) or os.path.isdir(args.path),
         f"model directory {args.path!r} does not exist"),
    ]
    for ok, msg in checks:
        if not ok:
            raise SystemExit(f"train.py: {msg}")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed():
    """torchrun sets RANK / WORLD_SIZE; a plain `python train.py` becomes a 1-rank group, so one code path (FSDP2)
    serves both. NCCL on GPU, gloo on CPU. Returns (rank, world, device)."""
    if "RANK" not in os.environ:
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                          MASTER_PORT=str(free_port()))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return dist.get_rank(), dist.get_world_size(), device


class Policy(torch.nn.Module):
    """The causal LM as the loss sees it: forward returns the completion tokens' log-probs (S, T) float32, the head
    in fp32 (§3.2) or, with fp32_head=False, in the model's compute dtype (bf16 under FSDP2 mixed precision on GPU).
    The head runs inside this module's forward, so FSDP2 gathers and reduces its weight like any other."""

    def __init__(self, lm, fp32_head: bool):
        super().__init__()
        self.lm, self.fp32_head = lm, fp32_head

    def forward(self, input_ids, attention_mask, mask, temperature: float):
        hidden = self.lm.get_decoder()(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state  # (S,T,H)
        weight = self.lm.get_output_embeddings().weight  # (V, H)
        head_dtype = torch.float32 if self.fp32_head else hidden.dtype
        return loss.completion_logprobs(hidden, weight, input_ids, mask, temperature, head_dtype=head_dtype)


def shard(policy: Policy, device) -> None:
    """FSDP2 as in torchtitan: `fully_shard` each decoder layer, then the root; bf16 compute with fp32 gradient
    reduction on GPU, fp32 throughout on CPU."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if device.type == "cuda" else None
    kw = dict(mp_policy=mp) if mp else {}
    for layer in policy.lm.get_decoder().layers:
        fully_shard(layer, **kw)
    fully_shard(policy, **kw)


def collate(groups, pad_id: int, args: Args) -> dict:
    """Pad a batch of groups into the trainer's tensors (rank 0; broadcast to the others). input_ids, mask (policy
    tokens of the completion), old_logp (the sampler's behaviour log-probs) are (S, T); rewards, group_ids (S,).
    With --length-penalty, correct rollouts get DAPO's overlong penalty added (A.10 Eq. 9)."""
    comps = [(i, c, r) for i, g in enumerate(groups) for c, r in zip(g.completions, g.rewards, strict=True)]
    S = len(comps)
    T = max((len(c.prompt_ids) + len(c.completion_ids) for _, c, _ in comps), default=1)
    input_ids = torch.full((S, T), pad_id, dtype=torch.long)
    attention_mask = torch.zeros(S, T, dtype=torch.long)
    mask = torch.zeros(S, T, dtype=torch.bool)
    old_logp = torch.zeros(S, T, dtype=torch.float32)
    for s, (_, c, _) in enumerate(comps):
        p, n = len(c.prompt_ids), len(c.completion_ids)
        input_ids[s, : p + n] = torch.tensor(c.prompt_ids + c.completion_ids)
        attention_mask[s, : p + n] = 1
        mask[s, p : p + n] = c.mask
        old_logp[s, p : p + n] = c.logp
    rewards = torch.tensor([r for *_, r in comps], dtype=torch.float64)
    if args.length_penalty:  # "added only to correct traces" (A.10)
        lengths = torch.tensor([len(c.completion_ids) for _, c, _ in comps])
        pen = filters.length_penalty(lengths, args.think_budget[1] + args.answer_budget, args.answer_budget)
        rewards = torch.where(rewards > 0, rewards + pen.double(), rewards)
    group_ids = torch.tensor([i for i, *_ in comps], dtype=torch.long)
    return dict(input_ids=input_ids, attention_mask=attention_mask, mask=mask, old_logp=old_logp, rewards=rewards,
                group_ids=group_ids)


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small CPU tensor over ranks (through the GPU under NCCL); returns it on the CPU."""
    y = x.to("cuda") if dist.get_backend() == "nccl" else x.clone()
    dist.all_reduce(y, op=op)
    return y.cpu()


def train_step(policy, optimizer, batch: dict, args: Args, device) -> dict:
    """One optimizer step on a collated batch, the same on 1 or N ranks: advantages and aggregation weights are
    computed on the whole batch (§4), each rank runs its share of the samples in micro-batches, and the shares sum
    to the full-batch loss. Returns the step's metrics, reduced over ranks. Raises FloatingPointError on every rank,
    before the weights change, if a log-prob, the loss or the gradient norm is not finite."""
    rank, world = dist.get_rank(), dist.get_world_size()
    adv = loss.group_advantages(batch["rewards"], batch["group_ids"], norm=args.adv_norm)  # (S,)
    weights = loss.aggregation_weights(batch["mask"], batch["group_ids"], agg=args.agg)  # (S, T), sums to 1
    rows = torch.arange(len(adv))[rank::world]  # validate(): group_size % world == 0, so every rank gets S / world
    sums = torch.zeros(4, dtype=torch.float64)  # loss, valid tokens, clipped tokens, rho summed over tokens
    ext = torch.full((3,), -math.inf, dtype=torch.float64)  # -rho_min, rho_max, -(first non-finite sample) or -inf
    for chunk in rows.split(args.micro_batch_size):
        mask = batch["mask"][chunk].to(device)  # (s, T)
        logp = policy(batch["input_ids"][chunk].to(device), batch["attention_mask"][chunk].to(device), mask,
                      args.temperature)  # (s, T) float32
        l, m = loss.policy_loss(logp, batch["old_logp"][chunk].to(device), adv[chunk].to(device),
                                weights[chunk].to(device), args.loss, eps_low=args.eps_low, eps_high=args.eps_high,
                                cispo_cap=args.cispo_cap)
        finite = torch.isfinite(torch.where(mask, logp.detach(), 0.0)).all(1).cpu()  # (s,)
        if not finite.all() or not torch.isfinite(l):
            ext[2] = max(ext[2].item(), -float(chunk[~finite][0] if not finite.all() else chunk[0]))
        (l * world).backward()  # FSDP2 averages gradients over ranks; each rank's loss is a share of a sum
        n = float(m["n_tokens"])
        sums += torch.tensor([l.item(), n, float(m["clip_frac"]) * n, float(m["rho_mean"]) * n], dtype=torch.float64)
        ext[:2] = torch.maximum(ext[:2], torch.tensor([-float(m["rho_min"]), float(m["rho_max"])], dtype=torch.float64))
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)  # over all ranks' shards
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    sums, ext = all_reduce(sums), all_reduce(ext, dist.ReduceOp.MAX)
    if ext[2] > -math.inf or not math.isfinite(sums[0]) or not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        s = int(-ext[2]) if ext[2] > -math.inf else None
        where = f"log-prob in batch sample {s}" if s is not None else "loss or gradient"
        raise FloatingPointError(f"non-finite {where} (loss {sums[0]:.4g}, grad norm {grad_norm:.4g})")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n = max(sums[1].item(), 1.0)
    return {"train/loss": sums[0].item(), "train/grad_norm": grad_norm, "train/tokens": int(sums[1]),
            "train/clip_frac": sums[2].item() / n, "train/rho_mean": sums[3].item() / n,
            "train/rho_min": -ext[0].item(), "train/rho_max": ext[1].item(),
            "train/adv_abs_mean": adv.abs().mean().item()}


def export_weights(policy: Policy, out_dir: str | None, dtype: torch.dtype) -> None:
    """Gather the full, unsharded weights (a collective: every rank calls it) and, on rank 0, save them to
    `out_dir/model.safetensors` under the Hugging Face names vLLM reloads; a tied head is saved once, as the
    input embedding. FSDP2 DTensors and plain tensors alike (StateDictOptions(full_state_dict=True))."""
    sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if out_dir is None:
        return
    sd = {k.removeprefix("lm."): v.to(dtype).contiguous() for k, v in sd.items()}
    if policy.lm.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(out_dir, "model.safetensors"))


def save_checkpoint(run_dir: str, step: int, policy, optimizer, state: dict) -> None:
    """Model and optimizer, sharded, with torch.distributed.checkpoint (every rank writes its shards), then the run
    state (state.json, atomically: a checkpoint without it does not exist), then older checkpoints are deleted."""
    path = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(run_dir, "state.json.tmp"), "w") as f:
            json.dump({**state, "step": step, "checkpoint": path}, f)
        os.replace(os.path.join(run_dir, "state.json.tmp"), os.path.join(run_dir, "state.json"))
        for old in os.listdir(os.path.dirname(path)):
            if old != os.path.basename(path):
                shutil.rmtree(os.path.join(os.path.dirname(path), old), ignore_errors=True)
    dist.barrier()


def load_checkpoint(run_dir: str, policy, optimizer) -> dict:
    """Restore model and optimizer in place from the run's last checkpoint; returns its run state."""
    with open(os.path.join(run_dir, "state.json")) as f:
        state = json.load(f)
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=state["checkpoint"])
    set_state_dict(policy, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return state


def truncate_log(path: str, step: int) -> None:
    """Keep the lines of steps <= `step` (a resumed run rewrites what came after its checkpoint)."""
    if os.path.exists(path):
        with open(path) as f:
            keep = [line for line in f if line.strip() and json.loads(line).get("step", -1) <= step]
        with open(path, "w") as f:
            f.writelines(keep)


def curve_fit(history: list[dict], steps: int) -> dict:
    """Fit Eq. 1 to the held-out curve so far (pass rate vs gpu_hours; R0 = the step-0 eval) and predict the pass
    rate at the last step, extrapolating compute linearly in steps. {} until there are 4 points past step 0."""
    pts = [(h["gpu_hours"], h["eval/pass_rate"]) for h in history if h["step"] > 0]
    if len(pts) < 4:
        return {}
    C, R = map(np.array, zip(*pts, strict=True))
    try:
        f = fit.fit_sigmoid(C, R, history[0]["eval/pass_rate"])
    except (ValueError, RuntimeError) as e:
        return {"fit/converged": 0.0, "fit/error": str(e)}
    c_end = history[-1]["gpu_hours"] * steps / max(history[-1]["step"], 1)
    return {"fit/A": f.A, "fit/B": f.B, "fit/C_mid": f.C_mid, "fit/converged": float(f.converged),
            "fit/pred_final": float(f.predict(c_end))}


def final_fit(run_dir: str, history: list[dict]) -> dict:
    """The paper's protocol (§5) on this run: fit on the first half of its compute, predict the second half (mean
    absolute error on the held-out evals); plot it like Figure 1 (fit.png) and save the numbers (fit.json)."""
    C = np.array([h["gpu_hours"] for h in history[1:]])
    R = np.array([h["eval/pass_rate"] for h in history[1:]])
    R0, half = history[0]["eval/pass_rate"], C[-1] / 2 if len(C) else 0.0
    out = {"R0": R0, "final_pass_rate": float(R[-1]) if len(R) else R0, "fit_until": half}
    try:
        f, mae, n_tail = fit.extrapolate(C, R, R0, fit_until=half)
        fit.plot([(os.path.basename(run_dir), C, R, f)], os.path.join(run_dir, "fit.png"), xlabel="gpu_hours",
                 ylabel="eval/pass_rate", fit_until=half)
        out.update(A=f.A, B=f.B, C_mid=f.C_mid, converged=f.converged, message=f.message, tail_mae=mae,
                   n_tail=n_tail, predicted_final=float(f.predict(C[-1:])[0]))
    except (ValueError, RuntimeError) as e:
        out["error"] = str(e)
    with open(os.path.join(run_dir, "fit.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def run_metadata(args: Args, world: int) -> dict:
    """What made this run (modded-nanogpt style): code version, libraries, hardware, command line."""
    import transformers
    import vllm

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    cuda = torch.cuda.is_available()
    return {"commit": commit, "argv": sys.argv, "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "vllm": vllm.__version__, "world_size": world,
            "host": platform.node(), "cpu": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if cuda else []}


def main(args: Args) -> None:
    rank, world, device = setup_distributed()
    validate(args, world)
    master = rank == 0
    cuda = device.type == "cuda"
    # ---- run directory: resolved args and what produced them; a resumed run keeps its directory
    run_dir = args.resume or args.run_dir or os.path.join(
        "runs", f"{os.path.basename(args.model)}-{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}")
    if master:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump({**dataclasses.asdict(args), "resume": None}, f, indent=1)
        with open(os.path.join(run_dir, "meta.json"), "w") as f:
            json.dump(run_metadata(args, world), f, indent=1)
    # ---- model, tokenizer, prompts (the tiny model is built once and cached; rank 0 builds, others wait)
    path = args.path
    if path is None and master:
        path = tiny.build(seed=args.seed) if args.model == "tiny" else tiny.smollm2()
    path = [path]
    dist.broadcast_object_list(path)
    path = path[0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    thinking = len(tokenizer.encode("</think>", add_special_tokens=False)) == 1  # a thinking chat format (Qwen3)
    prompts = data.load_prompts(args.data, tokenizer, thinking=thinking, max_prompt_len=args.max_prompt_len,
                                question_key=args.question_key, answer_key=args.answer_key, seed=args.seed)
    for turn in (master, not master):  # rank 0 draws (or, resuming, restores) the held-out split; the others read it
        if turn:
            train_prompts, eval_prompts = data.split_heldout(prompts, args.eval_size, seed=args.seed, run_dir=run_dir)
        dist.barrier()
    pool = filters.PromptPool(len(train_prompts), threshold=args.npr_threshold, policy=args.prompt_sampling,
                              seed=args.seed)
    torch.manual_seed(args.seed)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 master weights
    n_params = sum(p.numel() for p in lm.parameters())
    policy = Policy(lm, args.fp32_head)
    policy.to(device)
    shard(policy, device)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay)
    # ---- resume: weights, optimizer, prompt pool, clock, eval history; metrics.jsonl cut back to the checkpoint
    state = {"step": 0, "clock": {"gpu_hours": 0.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0},
             "history": [], "pool": None}
    if args.resume:
        state = load_checkpoint(run_dir, policy, optimizer)
        pool.load_state_dict(state["pool"])
        if master:
            truncate_log(os.path.join(run_dir, "metrics.jsonl"), state["step"])
            truncate_log(os.path.join(run_dir, "samples.jsonl"), state["step"])
    step, clock, history = state["step"], state["clock"], state["history"]
    gen_dtype = torch.bfloat16 if cuda and args.gen_dtype == "auto" else (
        torch.float32 if args.gen_dtype in ("auto", "float32") else getattr(torch, args.gen_dtype))
    # ---- the generator: rank 0 owns the pipeline (producer thread + vLLM); it starts from the current weights
    devices = 1 if not cuda else world + (len(args.generator_gpus) if args.generator_gpus else 0)
    start_dir = None
    if args.resume:
        start_dir = tempfile.mkdtemp(prefix="resume_", dir=run_dir) if master else None
        if master:
            for f in os.listdir(path):
                if not f.endswith(".safetensors") and os.path.isfile(os.path.join(path, f)):
                    shutil.copy(os.path.join(path, f), start_dir)
        export_weights(policy, start_dir, gen_dtype)
    pipe = None
    if master:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # the engine's processes: warnings and errors only
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
        sampler_kwargs = dict(think_budget=tuple(args.think_budget), answer_budget=args.answer_budget,
                              phrase=args.phrase, temperature=args.temperature, seed=args.seed + step,
                              dtype=args.gen_dtype, max_model_len=args.max_model_len, gpus=args.generator_gpus,
                              tensor_parallel_size=args.tensor_parallel_size,
                              gpu_memory_utilization=args.gpu_memory_utilization, kv_cache_gib=args.kv_cache_gib,
                              max_num_seqs=max(256, 2 * args.prompts_per_step * args.group_size),
                              interruptions=args.interruptions, fp32_head=args.fp32_head)
        pipe = pipeline.Pipeline(start_dir or path, train_prompts, pool, group_size=args.group_size,
                                 prompts_per_batch=round(args.prompts_per_step * args.batch_scale),
                                 max_lag=args.max_lag, mode=args.async_mode, sampler_kwargs=sampler_kwargs,
                                 version=step)
    if args.wandb_project and master:
        import wandb

        wandb.init(project=args.wandb_project, name=os.path.basename(run_dir), config=dataclasses.asdict(args),
                   resume="allow")
    stop = {"requested": False}

    def on_sigint(signum, frame):  # first Ctrl-C: finish the step, checkpoint, exit; second: stop at once
        stop["requested"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, on_sigint)
    metrics_f = open(os.path.join(run_dir, "metrics.jsonl"), "a") if master else None
    samples_f = open(os.path.join(run_dir, "samples.jsonl"), "a") if master else None

    def evaluate() -> dict:
        t0 = time.perf_counter()
        m = {}
        if master:
            m, records = pipe.evaluate(eval_prompts, args.eval_n)
            greedy, _ = pipe.evaluate(eval_prompts, 1, temperature=0.0)
            m["eval/greedy_pass_rate"] = greedy["eval/pass_rate"]  # logged beside the metric, never fitted
            for r in records[: args.log_samples]:
                samples_f.write(json.dumps({"step": step, "split": "eval", **r}) + "\n")
        m["time/eval_s"] = time.perf_counter() - t0
        return m

    def log(m: dict) -> None:
        if not master:
            return
        line = {"step": step, "gpu_hours": clock["gpu_hours"], "tokens": clock["gen_tokens"] + clock["train_tokens"],
                "flops": clock["flops"], "clock/gen_tokens": clock["gen_tokens"],
                "clock/train_tokens": clock["train_tokens"], **m}
        metrics_f.write(json.dumps(line) + "\n")
        metrics_f.flush()
        samples_f.flush()
        if args.wandb_project:
            wandb.log(line, step=step)
        ev = f" | eval {m['eval/pass_rate']:.3f}" if "eval/pass_rate" in m else ""
        fitted = f" | fit A {m['fit/A']:.3f} -> {m['fit/pred_final']:.3f}" if "fit/A" in m else ""
        print(f"step {step:5d}/{args.steps} | reward {m.get('gen/reward_mean', float('nan')):.3f}{ev}{fitted} | "
              f"lag {m.get('train/lag_max', 0):.0f} | zero-var {m.get('filter/zero_var_frac', 0):.2f} | active "
              f"{pool.num_active} | clip {m.get('train/clip_frac', 0):.3f} | {m.get('time/step_s', 0):.1f} s",
              flush=True)

    try:
        if step == 0:  # R0: the pass rate before RL, the curve's anchor (PAPER.md 8.1)
            m = evaluate()
            history.append({"step": 0, "gpu_hours": 0.0, "eval/pass_rate": m.get("eval/pass_rate", 0.0)})
            log(m)
        while step < args.steps:
            t0 = time.perf_counter()
            # ---- 1. rollouts: P groups with lag <= k, from the producer thread (rank 0), to every rank
            payload = [None]
            if master:
                batch = pipe.get_batch(step)
                m = dict(batch.metrics)
                kept = [g for g in batch.groups if not args.zero_var_filter or
                        filters.zero_variance_mask(torch.tensor(g.rewards), torch.zeros(len(g.rewards))).any()]
                for g in batch.groups:  # No-Positive-Resampling history: every scored group counts (§3.2)
                    pool.record(g.index, sum(r >= 1.0 for r in g.rewards), len(g.rewards))
                m["filter/zero_var_frac"] = 1 - len(kept) / len(batch.groups)
                m["filter/active_prompts"] = pool.num_active
                payload = [collate(kept, tokenizer.pad_token_id, args)]
                for g in batch.groups[: args.log_samples]:
                    samples_f.write(json.dumps({"step": step + 1, "split": "train", "prompt": g.prompt.index,
                                                "text": g.completions[0].text, "gold": g.prompt.gold,
                                                "reward": g.rewards[0]}) + "\n")
            dist.broadcast_object_list(payload)
            collated = payload[0]
            # ---- 2. update: advantages, aggregation weights, fp32-head log-probs, CISPO, AdamW (every rank)
            m_train = {"train/tokens": 0}
            lr = args.lr * min(1.0, (step + 1) / max(args.warmup_steps, 1))  # linear warmup, then constant (A.3)
            for group in optimizer.param_groups:
                group["lr"] = lr
            if len(collated["rewards"]):  # every group zero-variance: nothing to learn this step
                m_train = train_step(policy, optimizer, collated, args, device)
            step += 1
            # ---- 3. in-flight weight update: full weights to the sampler, version = step
            out_dir = pipe.weights_dir(step) if master else None
            export_weights(policy, out_dir, gen_dtype)
            if master:
                pipe.publish(out_dir, step)
                m.update(m_train)
                m["train/lr"] = lr
            # ---- 4. compute clock, held-out eval, sigmoid fit, log, checkpoint
            dt = time.perf_counter() - t0
            if master:
                clock["gpu_hours"] += dt * devices / 3600
                clock["gen_tokens"] += m["gen/tokens"]
                clock["train_tokens"] += m_train["train/tokens"]
                clock["flops"] += 2 * n_params * m["gen/tokens"] + 6 * n_params * m_train["train/tokens"]
                m["time/step_s"] = dt
            if step % args.eval_every == 0 or step == args.steps:
                e = evaluate()
                if master:
                    clock["gpu_hours"] += e["time/eval_s"] * devices / 3600  # eval compute counts (PAPER.md 6.1)
                    history.append({"step": step, "gpu_hours": clock["gpu_hours"], **e})
                    m.update(e, **curve_fit(history, args.steps))
            log(m if master else {})
            stop_now = all_reduce(torch.tensor([float(stop["requested"])]), dist.ReduceOp.MAX).item() > 0
            if (args.save_every and step % args.save_every == 0) or step == args.steps or stop_now:
                run_state = {"version": step, "clock": clock, "history": history,
                             "pool": pool.state_dict() if master else None}
                save_checkpoint(run_dir, step, policy, optimizer, run_state)
            if stop_now:
                print(f"[rank {rank}] stopped at step {step}; resume with --resume {run_dir}", flush=True)
                break
        # ---- the run's curve, fit on its first half (§5), and a Hugging Face export vLLM and transformers load
        if master and step == args.steps:
            print(json.dumps(final_fit(run_dir, history)), flush=True)
        sd = get_model_state_dict(policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if master:
            export = os.path.join(run_dir, "final")
            lm.save_pretrained(export, state_dict={k.removeprefix("lm."): v for k, v in sd.items()})
            tokenizer.save_pretrained(export)
    finally:
        if pipe is not None:
            pipe.close()
        for f in (metrics_f, samples_f):
            if f is not None:
                f.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
