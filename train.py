"""ScaleRL end to end: the RL loop of arXiv 2510.13786 (§4), composed from the pure modules.

    python train.py                                     # tiny embedded model on CPU, ~13 min, no download
    torchrun --nproc_per_node 2 train.py --steps 20     # the same with FSDP2 over 2 CPU ranks (gloo)
    torchrun --nproc_per_node 8 train.py --model qwen3-8b   # the paper's scale; vLLM shares rank 0's GPU
    python train.py --recipe loo-dapo                   # one of the paper's compared recipes / ablations
    python train.py --resume runs/NAME                  # continue a stopped run where it stopped
    python fit.py runs/NAME/metrics.jsonl --fit-until X # the sigmoid fit of a finished run

One step (DESIGN.md): the pipeline's producer thread samples groups with vLLM (forced interruptions, in-flight
weight updates) and grades them; the trainer takes a batch of P groups with lag <= k, drops zero-variance groups,
records pass rates for No-Positive-Resampling, computes batch-normalized advantages and prompt-level aggregation
weights on the whole batch, runs fp32-head log-probs -> CISPO -> backward per micro-batch on every rank, steps
AdamW, and hands the new weights to the sampler. Every `eval_every` steps: held-out pass rate, the compute clock,
a sigmoid fit of the curve so far, a checkpoint every `save_every`. Flags, presets and recipes: config.py;
checkpoints, weight export and the run directory: checkpoint.py.

Where it departs from the paper, and why:
1. Scale: the `tiny` preset is a 0.43M-parameter Qwen3 on a synthetic task (data.py `arith`) with 10^4x smaller
   budgets, so the whole recipe runs on a laptop; the GPU presets keep the paper's lengths and batch.
2. Compute is counted in device-hours (`gpu_hours`): wall time x devices (trainer + generator GPUs; on CPU the
   machine counts as one device). The paper counts GB200-hours.
3. Truncated rollouts stay in the batch with the reward the grader gives them (usually 0); the paper says only
   that they shrink the "effective batch" (PAPER.md 7.4).
4. Gradients are clipped at `max_grad_norm` (default 1.0); the paper does not say whether it clips.
5. The LR warmup is `warmup_steps` (100 in the paper, shorter for the tiny preset's few hundred steps).
"""

import dataclasses
import datetime
import functools
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer

import checkpoint
import code_reward
import data
import filters
import fit
import loss
import pipeline
import reward
import sandbox
import tiny
from config import Args, parse_args, validate


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def setup_distributed():
    """torchrun sets RANK / WORLD_SIZE; a plain `python train.py` becomes a 1-rank group, so one code path (FSDP2)
    serves both. NCCL on GPU, gloo on CPU. Returns (rank, world, device)."""
    if "RANK" not in os.environ:
        os.environ.update(
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    # 2 h: the other ranks wait in a collective while rank 0 evaluates (1,000 x 16 samples of 12k tokens on GPUs)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        device_id=device if cuda else None,
        timeout=datetime.timedelta(hours=2),
    )
    return dist.get_rank(), dist.get_world_size(), device


class Policy(torch.nn.Module):
    """The causal LM as the loss sees it: forward returns the completion tokens' log-probs (S, T) float32, the head
    in fp32 (§3.2) or, with fp32_head=False, in the model's compute dtype (bf16 under FSDP2 mixed precision on GPU).
    The head runs inside this module's forward, so FSDP2 gathers and reduces its weight like any other."""

    def __init__(self, lm, fp32_head: bool):
        super().__init__()
        self.lm, self.fp32_head = lm, fp32_head

    def forward(self, input_ids, attention_mask, mask, temperature: float):
        decoder = self.lm.get_decoder()  # hidden: (S, T, H)
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state
        weight = self.lm.get_output_embeddings().weight  # (V, H)
        head_dtype = torch.float32 if self.fp32_head else hidden.dtype
        return loss.completion_logprobs(
            hidden, weight, input_ids, mask, temperature, head_dtype=head_dtype
        )


def shard(policy: Policy, device) -> None:
    """FSDP2 as in torchtitan: `fully_shard` each decoder layer, then the root; bf16 compute with fp32 gradient
    reduction on GPU, fp32 throughout on CPU."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else None
    )
    kw = dict(mp_policy=mp) if mp else {}
    for layer in policy.lm.get_decoder().layers:
        fully_shard(layer, **kw)
    fully_shard(policy, **kw)


def collate(groups, pad_id: int, args: Args) -> dict:
    """Pad a batch of groups into the trainer's tensors (rank 0; broadcast to the others). input_ids, mask (policy
    tokens of the completion), old_logp (the sampler's behaviour log-probs) are (S, T); rewards, group_ids (S,).
    With --length-penalty, correct rollouts get DAPO's overlong penalty added (A.10 Eq. 9)."""
    comps = [
        (i, c, r)
        for i, g in enumerate(groups)
        for c, r in zip(g.completions, g.rewards, strict=True)
    ]
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
        pen = filters.length_penalty(
            lengths, args.think_budget[1] + args.answer_budget, args.answer_budget
        )
        rewards = torch.where(rewards > 0, rewards + pen.double(), rewards)
    group_ids = torch.tensor([i for i, *_ in comps], dtype=torch.long)
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        old_logp=old_logp,
        rewards=rewards,
        group_ids=group_ids,
    )


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
    weights = loss.aggregation_weights(
        batch["mask"], batch["group_ids"], agg=args.agg
    )  # (S, T), sums to 1
    rows = torch.arange(len(adv))[
        rank::world
    ]  # validate(): group_size % world == 0, so every rank gets S / world
    sums = torch.zeros(
        4, dtype=torch.float64
    )  # loss, valid tokens, clipped tokens, rho summed over tokens
    ext = torch.full(
        (3,), -math.inf, dtype=torch.float64
    )  # -rho_min, rho_max, -(first non-finite sample) or -inf
    for chunk in rows.split(args.micro_batch_size):
        mask = batch["mask"][chunk].to(device)  # (s, T)
        logp = policy(
            batch["input_ids"][chunk].to(device),
            batch["attention_mask"][chunk].to(device),
            mask,
            args.temperature,
        )  # (s, T) float32
        l, m = loss.policy_loss(
            logp,
            batch["old_logp"][chunk].to(device),
            adv[chunk].to(device),
            weights[chunk].to(device),
            args.loss,
            eps_low=args.eps_low,
            eps_high=args.eps_high,
            cispo_cap=args.cispo_cap,
        )
        finite = torch.isfinite(torch.where(mask, logp.detach(), 0.0)).all(1).cpu()  # (s,)
        if not finite.all() or not torch.isfinite(l):
            ext[2] = max(ext[2].item(), -float(chunk[~finite][0] if not finite.all() else chunk[0]))
        (
            l * world
        ).backward()  # FSDP2 averages gradients over ranks; each rank's loss is a share of a sum
        n = float(m["n_tokens"])
        sums += torch.tensor(
            [l.item(), n, float(m["clip_frac"]) * n, float(m["rho_mean"]) * n], dtype=torch.float64
        )
        ext[:2] = torch.maximum(
            ext[:2], torch.tensor([-float(m["rho_min"]), float(m["rho_max"])], dtype=torch.float64)
        )
    grad_norm = torch.nn.utils.clip_grad_norm_(
        policy.parameters(), args.max_grad_norm
    )  # over all ranks' shards
    grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
    sums, ext = all_reduce(sums), all_reduce(ext, dist.ReduceOp.MAX)
    if ext[2] > -math.inf or not math.isfinite(sums[0]) or not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        s = int(-ext[2]) if ext[2] > -math.inf else None
        where = f"log-prob or loss in batch sample {s}" if s is not None else "loss or gradient"
        raise FloatingPointError(
            f"non-finite {where} (loss {sums[0]:.4g}, grad norm {grad_norm:.4g})"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n = max(sums[1].item(), 1.0)
    return {
        "train/loss": sums[0].item(),
        "train/grad_norm": grad_norm,
        "train/tokens": int(sums[1]),
        "train/clip_frac": sums[2].item() / n,
        "train/rho_mean": sums[3].item() / n,
        "train/rho_min": -ext[0].item(),
        "train/rho_max": ext[1].item(),
        "train/adv_abs_mean": adv.abs().mean().item(),
    }


def reward_fns(prompts, unsafe_no_sandbox: bool) -> dict:
    """The reward function of each task among `prompts`, for the pipeline: math-verify for math, the
    problem's unit tests run in a bubblewrap sandbox for code. Exits with sandbox.check's one-line
    error when code is present and no sandbox can be made here; --unsafe-no-sandbox runs code
    without one, with a warning at every start."""
    fns = {"math": reward.math_rewards}
    if any(p.task == "code" for p in prompts):
        try:
            sandbox.check(sandboxed=not unsafe_no_sandbox)
        except RuntimeError as e:
            raise SystemExit(f"train.py: {e}") from None
        fns["code"] = functools.partial(code_reward.code_rewards, sandboxed=not unsafe_no_sandbox)
    return fns


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
    return {
        "fit/A": f.A,
        "fit/B": f.B,
        "fit/C_mid": f.C_mid,
        "fit/converged": float(f.converged),
        "fit/pred_final": float(f.predict(c_end)),
    }


def final_fit(run_dir: str, history: list[dict]) -> dict:
    """The paper's protocol (§5) on this run: fit on the first half of its compute, predict the second half (mean
    absolute error on the held-out evals); plot it like Figure 1 (fit.png) and save the numbers (fit.json)."""
    C = np.array([h["gpu_hours"] for h in history[1:]])
    R = np.array([h["eval/pass_rate"] for h in history[1:]])
    R0, half = history[0]["eval/pass_rate"], C[-1] / 2 if len(C) else 0.0
    out = {"R0": R0, "final_pass_rate": float(R[-1]) if len(R) else R0, "fit_until": half}
    try:
        f, mae, n_tail = fit.extrapolate(C, R, R0, fit_until=half)
        fit.plot(
            [(os.path.basename(run_dir), C, R, f)],
            os.path.join(run_dir, "fit.png"),
            xlabel="gpu_hours",
            ylabel="eval/pass_rate",
            fit_until=half,
        )
        out.update(
            A=f.A,
            B=f.B,
            C_mid=f.C_mid,
            converged=f.converged,
            message=f.message,
            tail_mae=mae,
            n_tail=n_tail,
            predicted_final=float(f.predict(C[-1:])[0]),
        )
    except (ValueError, RuntimeError) as e:
        out["error"] = str(e)
    with open(os.path.join(run_dir, "fit.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def main(args: Args) -> None:
    rank, world, device = setup_distributed()
    validate(args, world)
    master = rank == 0
    cuda = device.type == "cuda"
    # ---- run directory: resolved args and what produced them; a resumed run keeps its directory
    run_dir = [
        args.resume
        or args.run_dir
        or os.path.join(
            "runs", f"{os.path.basename(args.model)}-{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    ]
    dist.broadcast_object_list(run_dir)  # rank 0's name: the clock may tick between ranks
    run_dir = run_dir[0]
    if not args.resume and os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        raise SystemExit(
            f"train.py: {run_dir} already holds a run; --resume {run_dir} continues it"
        )
    if master:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump({**dataclasses.asdict(args), "resume": None}, f, indent=1)
        meta = checkpoint.run_metadata(world)
        with open(os.path.join(run_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    # ---- model, tokenizer, prompts (the tiny model is built once and cached; rank 0 builds, others wait)
    path = args.path
    if path is None and master:
        path = tiny.build(seed=args.seed) if args.model == "tiny" else tiny.smollm2()
    path = [path]
    dist.broadcast_object_list(path)
    path = path[0]
    tokenizer = AutoTokenizer.from_pretrained(path)
    thinking = (
        len(tokenizer.encode("</think>", add_special_tokens=False)) == 1
    )  # a thinking chat format (Qwen3)
    pad_id = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id or 0
    )  # masked
    prompts = data.load_prompts(
        args.data,
        tokenizer,
        thinking=thinking,
        max_prompt_len=args.max_prompt_len,
        question_key=args.question_key,
        answer_key=args.answer_key,
        seed=args.seed,
    )
    reward_fn = reward_fns(prompts, args.unsafe_no_sandbox)  # before any slow setup: it may exit
    for turn in (
        master,
        not master,
    ):  # rank 0 draws (or, resuming, restores) the held-out split; the others read it
        if turn:
            train_prompts, eval_prompts = data.split_heldout(
                prompts, args.eval_size, seed=args.seed, run_dir=run_dir
            )
        dist.barrier()
    pool = filters.PromptPool(
        len(train_prompts),
        threshold=args.npr_threshold,
        policy=args.prompt_sampling,
        seed=args.seed,
    )
    torch.manual_seed(args.seed)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)  # fp32 master weights
    n_params = sum(p.numel() for p in lm.parameters())
    if args.activation_checkpointing:  # before fully_shard, as torchtitan applies it
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = Policy(
        lm, args.fp32_head
    ).train()  # train mode: HF checkpoints layers only while training; no dropout
    policy.to(device)
    shard(policy, device)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay
    )
    # ---- resume: weights, optimizer, prompt pool, clock, eval history; metrics.jsonl cut back to the checkpoint
    state = {
        "step": 0,
        "clock": {"gpu_hours": 0.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0},
        "history": [],
        "pool": None,
    }
    if args.resume:
        state = checkpoint.load_checkpoint(run_dir, policy, optimizer)
        pool.load_state_dict(state["pool"])
        if master:
            checkpoint.truncate_log(os.path.join(run_dir, "metrics.jsonl"), state["step"])
            checkpoint.truncate_log(os.path.join(run_dir, "samples.jsonl"), state["step"])
    step, clock, history = state["step"], state["clock"], state["history"]
    # sampler weights: bf16 on GPU, fp32 on CPU (vLLM's own "auto" would pick bf16 there, and the trainer is fp32)
    gen_dtype = (
        torch.bfloat16
        if cuda and args.gen_dtype == "auto"
        else (
            torch.float32
            if args.gen_dtype in ("auto", "float32")
            else getattr(torch, args.gen_dtype)
        )
    )
    # ---- the generator: rank 0 owns the pipeline (producer thread + vLLM); it starts from the current weights
    devices = 1 if not cuda else world + (len(args.generator_gpus) if args.generator_gpus else 0)
    start_dir = None
    if args.resume:
        start_dir = tempfile.mkdtemp(prefix="resume_", dir=run_dir) if master else None
        if master:  # config, tokenizer and generation config beside the exported weights (a hub id has no dir)
            lm.config.save_pretrained(start_dir)
            lm.generation_config.save_pretrained(start_dir)
            tokenizer.save_pretrained(start_dir)
        checkpoint.export_weights(policy, start_dir, gen_dtype)
    pipe, P = None, round(args.prompts_per_step * args.batch_scale)  # P: prompt groups per batch
    if master:
        os.environ.setdefault(
            "VLLM_LOGGING_LEVEL", "WARNING"
        )  # the engine's processes: warnings and errors only
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
        sampler_kwargs = dict(
            think_budget=tuple(args.think_budget),
            answer_budget=args.answer_budget,
            phrase=args.phrase,
            temperature=args.temperature,
            seed=args.seed + step,
            dtype=str(gen_dtype).removeprefix("torch."),
            max_model_len=args.max_model_len,
            gpus=args.generator_gpus,
            tensor_parallel_size=args.tensor_parallel_size,
            data_parallel_size=max(1, len(args.generator_gpus or []) // args.tensor_parallel_size),
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=max(256, 2 * args.prompts_per_step * args.group_size),
            interruptions=args.interruptions,
            fp32_head=args.fp32_head,
        )
        pipe = pipeline.Pipeline(
            start_dir or path,
            train_prompts,
            pool,
            group_size=args.group_size,
            prompts_per_batch=P,
            max_lag=args.max_lag,
            mode=args.async_mode,
            reward_fn=reward_fn,
            sampler_kwargs=sampler_kwargs,
            version=step,
        )
        # what this run is, in one line (args.json and meta.json hold the rest)
        print(
            f"run {run_dir} | commit {meta['commit'][:7]} | torch {meta['torch']}, vllm {meta['vllm']} | {world} "
            f"rank(s) on {device.type} | {path}: {n_params / 1e6:.2f}M params | {args.data}: {len(train_prompts)} "
            f"train, {len(eval_prompts)} held-out prompts | {P} prompts x {args.group_size} = "
            f"{P * args.group_size} rollouts per step | recipe {args.recipe}",
            flush=True,
        )
    if args.wandb_project and master:
        import wandb

        wandb.init(
            project=args.wandb_project,
            name=os.path.basename(run_dir),
            config=dataclasses.asdict(args),
            resume="allow",
        )
    stop = {"requested": False}

    def on_sigint(
        signum, frame
    ):  # first Ctrl-C: finish the step, checkpoint, exit; second: stop at once
        stop["requested"] = True
        signal.signal(signal.SIGINT, signal.default_int_handler)

    signal.signal(signal.SIGINT, on_sigint)
    signal.signal(signal.SIGTERM, on_sigint)  # torchrun passes Ctrl-C on to its workers as SIGTERM
    metrics_f = open(os.path.join(run_dir, "metrics.jsonl"), "a") if master else None
    samples_f = open(os.path.join(run_dir, "samples.jsonl"), "a") if master else None

    def evaluate() -> dict:
        t0 = time.perf_counter()
        m = {}
        if master:
            # the paper's metric: eval_n samples at the training temperature; greedy is logged beside it, never fitted
            m, records = pipe.evaluate(eval_prompts, args.eval_n, greedy=True, progress=True)
            for r in records[: args.log_samples]:
                samples_f.write(json.dumps({"step": step, "split": "eval", **r}) + "\n")
        m["time/eval_s"] = time.perf_counter() - t0
        return m

    def log(m: dict) -> None:
        if not master:
            return
        line = {
            "step": step,
            "gpu_hours": clock["gpu_hours"],
            "tokens": clock["gen_tokens"] + clock["train_tokens"],
            "flops": clock["flops"],
            "clock/gen_tokens": clock["gen_tokens"],
            "clock/train_tokens": clock["train_tokens"],
            **m,
        }
        metrics_f.write(json.dumps(line) + "\n")
        metrics_f.flush()
        samples_f.flush()
        if args.wandb_project:
            wandb.log(line, step=step)
        ev = f" | eval {m['eval/pass_rate']:.3f}" if "eval/pass_rate" in m else ""
        fitted = f" | fit A {m['fit/A']:.3f} -> {m['fit/pred_final']:.3f}" if "fit/A" in m else ""
        print(
            f"step {step:5d}/{args.steps} | reward {m.get('train/reward', float('nan')):.3f}{ev}{fitted} | "
            f"lag {m.get('train/lag_max', 0):.0f} | zero-var {m.get('filter/zero_var_frac', 0):.2f} | active "
            f"{pool.num_active} | clip {m.get('train/clip_frac', 0):.3f} | {m.get('time/step_s', 0):.1f} s",
            flush=True,
        )

    try:
        if step == 0:  # R0: the pass rate before RL, the curve's anchor (PAPER.md 8.1)
            m = evaluate()
            history.append(
                {"step": 0, "gpu_hours": 0.0, "eval/pass_rate": m.get("eval/pass_rate", 0.0)}
            )
            log(m)
        while step < args.steps:
            t0 = time.perf_counter()
            # ---- 1. rollouts: P groups with lag <= k, from the producer thread (rank 0), to every rank
            payload = [None]
            if master:
                batch = pipe.get_batch(step)
                m = dict(batch.metrics)
                kept = [
                    g
                    for g in batch.groups
                    if not args.zero_var_filter
                    or filters.zero_variance_mask(
                        torch.tensor(g.rewards), torch.zeros(len(g.rewards))
                    ).any()
                ]
                for g in (
                    batch.groups
                ):  # No-Positive-Resampling history: every scored group counts (§3.2)
                    pool.record(g.index, sum(r >= 1.0 for r in g.rewards), len(g.rewards))
                m["train/reward"] = float(np.mean([r for g in batch.groups for r in g.rewards]))
                m["filter/zero_var_frac"] = 1 - len(kept) / len(batch.groups)
                m["filter/active_prompts"] = pool.num_active
                payload = [collate(kept, pad_id, args)]
                for g in batch.groups[: args.log_samples]:
                    samples_f.write(
                        json.dumps(
                            {
                                "step": step + 1,
                                "split": "train",
                                "prompt": g.prompt.index,
                                "text": g.completions[0].text,
                                "gold": g.prompt.gold,
                                "reward": g.rewards[0],
                                "reason": g.reasons[0] if g.reasons else None,
                            }
                        )
                        + "\n"
                    )
            dist.broadcast_object_list(payload)
            collated = payload[0]
            # ---- 2. update: advantages, aggregation weights, fp32-head log-probs, CISPO, AdamW (every rank)
            m_train = {"train/tokens": 0}
            lr = args.lr * min(
                1.0, (step + 1) / max(args.warmup_steps, 1)
            )  # linear warmup, then constant (A.3)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t1 = time.perf_counter()
            if len(collated["rewards"]):  # every group zero-variance: nothing to learn this step
                m_train = train_step(policy, optimizer, collated, args, device)
            step += 1
            # ---- 3. in-flight weight update: full weights to the sampler, version = step
            t2 = time.perf_counter()
            out_dir = pipe.weights_dir(step) if master else None
            checkpoint.export_weights(policy, out_dir, gen_dtype)
            if master:
                pipe.publish(out_dir, step)
                m.update(
                    m_train,
                    **{
                        "train/lr": lr,
                        "time/update_s": t2 - t1,
                        "time/publish_s": time.perf_counter() - t2,
                    },
                )
            # ---- 4. compute clock, held-out eval, sigmoid fit, log, checkpoint
            dt = time.perf_counter() - t0
            if master:
                clock["gpu_hours"] += dt * devices / 3600
                clock["gen_tokens"] += m["gen/tokens"]
                clock["train_tokens"] += m_train["train/tokens"]
                clock["flops"] += (
                    2 * n_params * m["gen/tokens"] + 6 * n_params * m_train["train/tokens"]
                )
                m["time/step_s"] = dt
            if step % args.eval_every == 0 or step == args.steps:
                e = evaluate()
                if master:
                    clock["gpu_hours"] += (
                        e["time/eval_s"] * devices / 3600
                    )  # eval compute counts (PAPER.md 6.1)
                    history.append({"step": step, "gpu_hours": clock["gpu_hours"], **e})
                    m.update(e, **curve_fit(history, args.steps))
            log(m if master else {})
            stop_now = (
                all_reduce(torch.tensor([float(stop["requested"])]), dist.ReduceOp.MAX).item() > 0
            )
            if (args.save_every and step % args.save_every == 0) or step == args.steps or stop_now:
                run_state = {
                    "version": step,
                    "clock": clock,
                    "history": history,
                    "pool": pool.state_dict() if master else None,
                }
                checkpoint.save_checkpoint(run_dir, step, policy, optimizer, run_state)
            if stop_now:
                print(
                    f"[rank {rank}] stopped at step {step}; resume with --resume {run_dir}",
                    flush=True,
                )
                break
        # ---- the run's curve, fit on its first half (§5), and a Hugging Face export vLLM and transformers load
        if master and step == args.steps:
            print(json.dumps(final_fit(run_dir, history)), flush=True)
        sd = get_model_state_dict(
            policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if master and step == args.steps:
            export = os.path.join(run_dir, "final")
            lm.save_pretrained(export, state_dict={k.removeprefix("lm."): v for k, v in sd.items()})
            tokenizer.save_pretrained(export)
    finally:
        if pipe is not None:
            pipe.close()
        if start_dir is not None:
            shutil.rmtree(start_dir, ignore_errors=True)
        for f in (metrics_f, samples_f):
            if f is not None:
                f.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    main(parse_args())
