"""ScaleRL end to end: the RL loop of arXiv 2510.13786 (§4), composed from the pure modules.

    python train.py                                       # tiny model on CPU, ~13 min, no download
    torchrun --nproc_per_node 2 train.py --steps 20       # the same, FSDP2 over 2 CPU ranks (gloo)
    torchrun --nproc_per_node 4 train.py --model qwen3-8b # 8 GPUs: 4 train, 3 sample, 1 eval
    python train.py --recipe loo-dapo                     # one of the paper's compared recipes
    python train.py --resume runs/NAME                    # continue a stopped run where it stopped
    python fit.py runs/NAME/metrics.jsonl --fit-until X   # the sigmoid fit of a finished run
    # Ctrl-C: finish or abandon the step, checkpoint, exit 0 (twice: quit at once);
    # a bad flag: one line, exit 2

One step (DESIGN.md): the pipeline's producer thread samples groups with vLLM (forced
interruptions, in-flight weight updates) and grades them; the trainer takes a batch of P groups
with lag <= k, drops rollouts with a non-finite behaviour log-prob and zero-variance groups,
records pass rates for No-Positive-Resampling, adds DAPO's length penalty if a recipe asks,
computes batch-normalized advantages and prompt-level aggregation weights on the whole batch, runs
fp32-head log-probs -> CISPO -> backward per micro-batch on every rank, steps AdamW, and hands the
new weights to the sampler (version = step). The compute clock advances every step. Every
`eval_every` steps a snapshot of the new weights goes to the eval engine, whose held-out pass rate
is logged (with the live sigmoid fit of the curve so far) when it finishes; a checkpoint every
`save_every`. Flags, presets and recipes: config.py, flags.py, presets.py; inputs: loading.py;
process group, placement, run directory: launch.py; the policy and its optimizer step: trainer.py;
the vLLM side: rollouts.py; logs, evals and checkpoints: records.py and checkpoint.py.

Where it departs from the paper, and why:
1. Scale: the `tiny` preset is a 0.43M-parameter Qwen3 on a synthetic task (arith.py `arith`) with
   10^4x smaller budgets, so the whole recipe runs on a laptop; the GPU presets keep the paper's
   lengths and batch.
2. Compute is counted in device-hours (`gpu_hours`): wall time x distinct devices (trainer and
   generator GPUs; on CPU the machine counts as one device). The paper counts GB200-hours.
3. Truncated rollouts stay in the batch with the reward the grader gives them (usually 0); the
   paper says only that they shrink the "effective batch" (PAPER.md 7.4).
4. Gradients are clipped at `max_grad_norm` (default 1.0); the paper does not say whether it clips.
5. The LR warmup is `warmup_steps` (100 in the paper, shorter for the tiny preset's few hundred
   steps).
"""

import sys

import config

# flags first: --help and a bad flag answer in ~1 s, before torch and vLLM load
if __name__ == "__main__":
    ARGS = config.cli()

import dataclasses
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist

import checkpoint
import filters
import fit_cli
import launch
import loading
import reward
import trainer
from config import Args, BadInput
from launch import rank0_call


def drop_nonfinite_logp(groups) -> tuple[list, int]:
    """(groups, n): the groups without their rollouts whose behaviour log-prob (Completion.logp) is
    NaN or +-inf on a policy token (mask True), and n, how many rollouts were dropped (logged as
    gen/nonfinite_logp). That is a sampler fault: rho against such a log-prob is NaN or silently
    capped, and loss.policy_loss raises on it. Runs on rank 0 before collate, so advantages and
    aggregation weights are computed without the dropped rollouts; a group left with no rollout is
    dropped whole. Prints one warning line per dropped rollout naming its prompt (the data index,
    as in samples.jsonl) and the token's position in the completion. The input is not modified."""
    kept, dropped = [], 0
    for g in groups:
        keep = []
        for j, c in enumerate(g.completions):
            bad = (c.mask & ~torch.isfinite(c.logp)).nonzero()  # (n, 1) positions in the completion
            if len(bad):
                t = int(bad[0, 0])
                print(
                    f"warning: dropped rollout {j} of prompt {g.prompt.index}: behaviour log-prob "
                    f"{c.logp[t].item()} at completion token {t} (a sampler fault)",
                    flush=True,
                )
            else:
                keep.append(j)
        # a group keeps its place with fewer rollouts; its advantages use only those left
        dropped += len(g.completions) - len(keep)
        if len(keep) == len(g.completions):
            kept.append(g)
        elif keep:
            comps, rewards = [g.completions[j] for j in keep], [g.rewards[j] for j in keep]
            kept.append(dataclasses.replace(g, completions=comps, rewards=rewards))
    return kept, dropped


def has_variance(g) -> bool:
    """Whether a group's rewards differ (True: it is kept). A zero-variance group has zero advantage
    everywhere, so it adds nothing to the gradient (§3.2, Fig 6a; DAPO's dynamic sampling without
    the resampling)."""
    rewards = torch.tensor(g.rewards)
    # one group: every rollout gets group id 0; the mask (True: kept) is True on all or on none
    return bool(filters.zero_variance_mask(rewards, torch.zeros(len(g.rewards))).any())


def dapo_length_penalty(groups, args: Args) -> list:
    """The groups with DAPO's overlong penalty (A.10 Eq. 9, filters.length_penalty: 0, then a ramp
    to -1 over the last answer_budget tokens before the longest completion the sampler allows,
    think_budget[1] + answer_budget) added to the reward of each correct rollout (reward > 0:
    "added only to correct traces", A.10). The input is not modified."""
    max_len = args.think_budget[1] + args.answer_budget
    out = []
    for g in groups:
        lengths = torch.tensor([len(c.completion_ids) for c in g.completions])
        pen = filters.length_penalty(lengths, max_len, args.answer_budget)  # (G,) float32
        rewards = torch.tensor(g.rewards, dtype=torch.float64)  # (G,)
        # in float64, as collate keeps rewards (the penalty itself is float32)
        shaped = torch.where(rewards > 0, rewards + pen.double(), rewards)
        out.append(dataclasses.replace(g, rewards=shaped.tolist()))
    return out


def get_batch(args: Args, step: int, pipe, pool, pad_id: int, log) -> tuple[dict | None, dict]:
    """Phase 1 of a step, every rank (a collective): rank 0 takes the pipeline's next batch of P
    groups with lag <= k (its producer thread sampled and graded them meanwhile), then
    1. drops rollouts with a non-finite behaviour log-prob (drop_nonfinite_logp),
    2. drops zero-variance groups (--zero-var-filter, §3.2),
    3. records every scored group's pass rate for No-Positive-Resampling (§3.2),
    4. adds DAPO's overlong penalty to correct rollouts (--length-penalty, A.10),
    5. pads what is left into the trainer's tensors (trainer.collate) and logs the batch's first
       rollouts to samples.jsonl.
    Every rank gets the padded batch. Returns (batch, metrics): batch None on every rank when a
    stop (Ctrl-C) abandoned the step; metrics rank 0's gen/*, filter/* and train/reward ({} on the
    other ranks)."""
    import rollouts  # loaded by main already (it imports vLLM): a name lookup here

    m = {}
    payload = [None]  # stays None when a stop abandons the step
    # rank 0 waits for the groups while the other ranks poll (rank0_call); None: a stop meanwhile
    batch = rank0_call(lambda: rollouts.next_batch(pipe, step))
    if batch is not None:  # rank 0
        m = dict(batch.metrics)
        m.update(reward.pop_stats())  # math-verify's graded / timed-out counts since the last step
        # 1. a NaN or inf behaviour log-prob is a sampler fault: its rollout leaves the batch
        groups, m["gen/nonfinite_logp"] = drop_nonfinite_logp(batch.groups)
        # 2. all correct or all wrong: zero advantage everywhere, so no gradient, only noise
        if args.zero_var_filter:
            groups = [g for g in groups if has_variance(g)]
        # 3. every scored group counts, even one dropped above: a prompt whose pass rate reaches
        # --npr-threshold leaves the pool for good
        for g in batch.groups:
            pool.record(g.index, sum(r >= 1.0 for r in g.rewards), len(g.rewards))
        # the reward is the sampler's, over every group, before the filters and the penalty
        m["train/reward"] = float(np.mean([r for g in batch.groups for r in g.rewards]))
        m["filter/zero_var_frac"] = 1 - len(groups) / len(batch.groups)
        m["filter/active_prompts"] = pool.num_active
        # 4. reward shaping after the filters: a penalized group still counts as it was sampled
        if args.length_penalty:
            groups = dapo_length_penalty(groups, args)
        # 5. (S, T) right-padded tensors: S rollouts, T the longest prompt + completion
        payload = [trainer.collate(groups, pad_id)]
        log.train_samples(step + 1, batch.groups)
    # every rank holds the whole batch, so each computes the same micro-batch plan (trainer.py)
    dist.broadcast_object_list(payload)
    return payload[0], m


def restore(args: Args, run_dir: str, policy, optimizer, pool, master: bool) -> dict:
    """The run's state at its start: step 0, a zero compute clock and no evals; on --resume the
    checkpoint's, with the weights, optimizer and prompt pool restored in place and metrics.jsonl
    and samples.jsonl cut back to it (evals logged after it are not in its history: they go too).
    Returns {"step", "clock", "history", "pool"}."""
    if not args.resume:
        clock = {"gpu_hours": 0.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
        return {"step": 0, "clock": clock, "history": [], "pool": None}
    # a collective: every rank reads its own shards of the weights and the optimizer state
    state = checkpoint.load_checkpoint(run_dir, policy, optimizer)
    pool.load_state_dict(state["pool"])
    # the logs go back to the checkpoint: the steps after it run again
    if master:
        done = {h["step"] for h in state["history"]}
        for name in ("metrics.jsonl", "samples.jsonl"):
            checkpoint.truncate_log(os.path.join(run_dir, name), state["step"], evals=done)
    return state


def set_lr(optimizer, args: Args, step: int) -> float:
    """The learning rate of step `step` (0-based): linear warmup, then constant (A.3)."""
    # step + 1: the first step already trains at lr / warmup_steps, never at 0
    lr = args.lr * min(1.0, (step + 1) / max(args.warmup_steps, 1))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def update(policy, optimizer, batch: dict, args: Args, device) -> dict:
    """Phase 2, every rank: one optimizer step on the batch (trainer.train_step: advantages,
    aggregation weights, fp32-head log-probs, CISPO, AdamW); none when every group had zero
    variance, as there is nothing to learn. Returns the step's train/* metrics."""
    # every rank sees the same (broadcast) batch, so all ranks skip the step together
    if len(batch["rewards"]) == 0:
        return {"train/tokens": 0}
    return trainer.train_step(policy, optimizer, batch, args, device)


def say_stopped(rank: int, step: int, run_dir: str) -> None:
    print(f"[rank {rank}] stopped at step {step}; resume with --resume {run_dir}", flush=True)


def main(args: Args) -> None:
    rank, world, device = launch.setup_distributed(args.dist_timeout)
    master = rank == 0
    # ---- setup: the inputs, checked before anything is written; the run directory and its
    # metadata; the held-out split and prompt pool; the policy under FSDP2; a resumed run's state
    inputs = loading.load_inputs(args, world, device)
    run_dir, args, meta = launch.open_run_dir(args, world, master)
    prompts, eval_prompts, pool = loading.heldout_and_pool(args, inputs.prompts, run_dir, master)
    policy, optimizer = trainer.build(inputs.lm, args, device)
    state = restore(args, run_dir, policy, optimizer, pool, master)
    step = state["step"]
    # ---- the generator: rank 0 owns the pipeline (producer thread + vLLM), started from the
    # current weights; then the run's records (metrics.jsonl, samples.jsonl, evals, checkpoints)
    # these two import vLLM (~10 s): only now that the inputs have loaded
    import records
    import rollouts

    stop = {"requested": False}  # set by the first Ctrl-C (launch.on_stop_signal)
    pipe, push_weights, start_dir = rollouts.start(
        args, inputs, policy, pool, prompts, eval_prompts, run_dir, meta, world, device, step, stop
    )
    log = records.RunLog(args, run_dir, pipe, eval_prompts, state, inputs)
    launch.on_stop_signal(stop)
    pad_id = loading.pad_token_id(inputs.tokenizer)  # masked: never trained
    stopped = False  # the loop ended on a stop (every rank alike)
    try:
        log.submit_start_evals(step, inputs.path, start_dir)
        while step < args.steps:
            t0 = time.perf_counter()
            # ---- 1. rollouts: P groups with lag <= k from the producer thread, filtered and padded
            batch, m = get_batch(args, step, pipe, pool, pad_id, log)
            if batch is None:  # a stop abandoned the step: checkpoint the last completed one
                stopped = True
                log.save(step, policy, optimizer, pool, stopping=True)
                say_stopped(rank, step, run_dir)
                break
            # ---- 2. update: advantages, aggregation weights, fp32-head log-probs, CISPO, AdamW
            lr = set_lr(optimizer, args, step)
            t1 = time.perf_counter()
            m_train = update(policy, optimizer, batch, args, device)
            step += 1
            # ---- 3. in-flight weight update: full weights to the sampler, version = step; at an
            # eval step a snapshot of them goes to the eval engine first (never waited for, unless
            # max_evals_pending evals are still running: evals slower than eval_every steps)
            t2 = time.perf_counter()
            tag = {"step": step}  # the eval's; its clock is this step's (log.end_step)
            evaluating = log.is_eval_step(step) and log.await_eval_room(step)
            t3 = time.perf_counter()
            # every rank or none: under NCCL, writing the snapshot is a collective
            push_weights(step, log.snapshot(tag) if evaluating else None)
            m.update(m_train, **{"train/lr": lr, "time/update_s": t2 - t1})
            m.update({"time/eval_wait_s": t3 - t2, "time/publish_s": time.perf_counter() - t3})
            # ---- 4. compute clock (the eval engine's devices count: it runs meanwhile), log,
            # checkpoint; a stop (Ctrl-C on any rank) ends the run after its checkpoint
            log.end_step(step, m, time.perf_counter() - t0, inputs.n_params, tag, pool.num_active)
            stop_now = launch.stop_agreed(stop)
            # a checkpoint every save_every steps, at the last step, and before a stop
            if (args.save_every and step % args.save_every == 0) or step == args.steps or stop_now:
                log.save(step, policy, optimizer, pool, stopping=stop_now)
            if stop_now:
                stopped = True
                say_stopped(rank, step, run_dir)
                break
        # ---- the run's curve, fit whole and on its first half (§5), printed in words, and a HF
        # export that vLLM and transformers load (a resumed finished run waits for its evals too);
        # a stop meanwhile leaves the fit to --resume
        done = step == args.steps and not stopped
        done = done and log.await_evals(step, lambda pending: not pending, "the last evals")
        if master and done:
            print(fit_cli.summary(run_dir, records.final_fit(run_dir, log.history)), flush=True)
        if step == args.steps:
            final = os.path.join(run_dir, "final") if master else None
            checkpoint.export_pretrained(policy, inputs.tokenizer, final, None)  # as trained
    finally:
        if pipe is not None:
            pipe.close()
        if start_dir is not None:
            shutil.rmtree(start_dir, ignore_errors=True)
        log.close()
        dist.destroy_process_group()


if __name__ == "__main__":
    try:
        main(ARGS)
    except BadInput as e:  # one line, no traceback, exit 1 (2 for flags, from config.cli above)
        config.exit_with(e)
    except KeyboardInterrupt:  # before the step loop installs its handler: nothing to save
        print("\ntrain.py: interrupted while starting up, before the first step", file=sys.stderr)
        sys.exit(130)
