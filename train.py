"""ScaleRL end to end: the RL loop of arXiv 2510.13786 (§4), composed from the pure modules.

    python train.py                                     # tiny embedded model on CPU, ~13 min, no download
    torchrun --nproc_per_node 2 train.py --steps 20     # the same with FSDP2 over 2 CPU ranks (gloo)
    torchrun --nproc_per_node 4 train.py --model qwen3-8b   # paper scale; 8 GPUs: 4 train, 4 vLLM
    python train.py --recipe loo-dapo                   # one of the paper's compared recipes / ablations
    python train.py --resume runs/NAME                  # continue a stopped run where it stopped
    # Ctrl-C: finish or abandon the step, checkpoint, exit 0 (twice: quit at once); a bad flag: one line, exit 2
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
2. Compute is counted in device-hours (`gpu_hours`): wall time x distinct devices (trainer and
   generator GPUs; on CPU the machine counts as one device). The paper counts GB200-hours.
3. Truncated rollouts stay in the batch with the reward the grader gives them (usually 0); the paper says only
   that they shrink the "effective batch" (PAPER.md 7.4).
4. Gradients are clipped at `max_grad_norm` (default 1.0); the paper does not say whether it clips.
5. The LR warmup is `warmup_steps` (100 in the paper, shorter for the tiny preset's few hundred steps).
"""

import os
import sys

import config

if (
    __name__ == "__main__"
):  # flags first: --help and a bad flag answer in ~1 s, before torch and vLLM load
    ARGS = config.cli()

import bisect
import collections
import dataclasses
import datetime
import functools
import json
import logging
import math
import re
import shutil
import signal
import tempfile
import threading
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import checkpoint
import code_reward
import data
import filters
import fit
import heldout
import loss
import placement
import reward
import sandbox
import tiny
from config import Args, BadInput


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HEARTBEAT_S = 1.0  # rank0_call: the other ranks' poll while rank 0 waits (vLLM, rollouts, evals)
EVAL_NICE = 19  # the eval engine's CPU priority when it shares the CPU with the trainer (lowest)


def setup_distributed(timeout_s: float = 1800.0):
    """torchrun sets RANK / WORLD_SIZE; a plain `python train.py` becomes a 1-rank group, so one code path (FSDP2)
    serves both. NCCL on GPU, gloo on CPU. timeout_s: how long a rank may wait in one collective
    (--dist-timeout); rank 0's long waits go through rank0_call, so this only has to catch a hung
    rank. Returns (rank, world, device)."""
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
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        device_id=device if cuda else None,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.get_rank(), dist.get_world_size(), device


def rank0_call(fn, share: bool = False):
    """fn() on rank 0, in a thread, while every rank waits in one small all-reduce per HEARTBEAT_S
    until it returns: rank 0's long waits (vLLM starting, a batch of rollouts, evals still running)
    never hold another rank in one collective for longer, so --dist-timeout need not cover them
    (issue 10: a 2 h timeout used to cover rank 0's eval). Returns fn's result on rank 0 (on every
    rank with `share`, broadcast: keep it small), None elsewhere. fn's exception is raised on rank 0
    (the original, with its traceback) and, as RuntimeError naming it, on the other ranks, which
    therefore stop at once instead of waiting in their next collective."""
    out, thread = {}, None
    if dist.get_rank() == 0:

        def run():
            try:
                out["value"] = fn()
            except BaseException as e:  # re-raised in the calling thread
                out["error"] = e

        thread = threading.Thread(target=run, name="rank0-call", daemon=True)
        thread.start()
    while True:
        if thread is not None:
            thread.join(HEARTBEAT_S)
        done = torch.tensor([float(thread is not None and not thread.is_alive())])
        if all_reduce(done, dist.ReduceOp.MAX).item() > 0:
            break
    error = out.get("error")
    box = [(error and f"{type(error).__name__}: {error}", out.get("value") if share else None)]
    if dist.get_world_size() > 1:
        dist.broadcast_object_list(box)
    if error is not None:
        raise error
    if box[0][0] is not None:
        raise RuntimeError(f"rank 0 failed: {box[0][0]}")
    return box[0][1] if share else out.get("value")


def plan_placement(
    args: Args, path: str, world: int, gen_dtype, P: int, tasks: int = 1
) -> placement.Plan:
    """Rank 0 places the trainer ranks and vLLM on its node's GPUs and estimates their memory
    (placement.py) and prints the plan (tasks: held-out splits of eval_size prompts each); every
    rank gets it, and on a placement that cannot fit or overlaps trainer GPUs unasked every rank
    exits with the command to run instead."""
    plan = [None]
    if dist.get_rank() == 0:
        cuda = torch.cuda.is_available()
        plan[0] = placement.plan(
            placement.Shape.from_config(AutoConfig.from_pretrained(path)),
            n_gpus=torch.cuda.device_count() if cuda else 0,
            gpu_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else 0,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            world=world,
            local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),  # torchrun sets it
            generator_gpus=args.generator_gpus,
            share_gpu=args.share_gpu,
            tp=args.tensor_parallel_size,
            utilization=args.gpu_memory_utilization,
            # tokens in one trainer forward: the token budget (plan_microbatches), else the legacy
            # layout's micro_batch_size padded sequences
            microbatch_tokens=args.max_tokens_per_microbatch
            or args.micro_batch_size * args.max_model_len,
            max_model_len=args.max_model_len,
            checkpointing=args.activation_checkpointing,
            fp32_head=args.fp32_head,
            dtype_bytes=gen_dtype.itemsize,
            P=P,
            G=args.group_size,
            k=args.max_lag,
            mode=args.async_mode,
            max_inflight=2 * P,  # the Pipeline's max_inflight below
            kv_cache_bytes=int((args.kv_cache_gib or placement.CPU_KV_CACHE_GIB) * 2**30),
            eval_gpus=args.eval_gpus,
            eval_seqs=tasks * args.eval_size * (args.eval_n + 1),  # + one greedy per prompt
            argv=sys.argv[1:],
        )
        print(placement.describe(plan[0]), flush=True)
    dist.broadcast_object_list(plan)
    placement.check(plan[0])
    return plan[0]


def weight_pusher(policy, pipe, backend: str, dtype, engine_ranks: int):
    """push(version, snapshot=None), called on every rank after each step: the new weights to the
    sampler, as trainer version `version`. "disk": gathered per parameter in the sampler dtype
    (checkpoint.export_weights), saved by rank 0 into a fresh pipeline directory and loaded in
    flight (pipe.publish). "nccl" (NOT RUN YET, no GPU with vLLM so far): vLLM's weight-transfer
    engine, set up here once (checkpoint.nccl_sender; rank 0 sends to the engine's `engine_ranks` =
    tp x dp workers), broadcasts each parameter gathered in the sampler dtype on the GPU when the
    pipeline releases the version (pipe.publish_by), every rank joining the gathers.
    snapshot (every rank or none; an eval step): called on rank 0 with a directory holding the
    version's weights (with None elsewhere) before the sampler may load and delete it, for
    pipe.submit_eval to snapshot. Under "nccl" that directory is written for it (an export, every
    rank joining, once per eval) and deleted after."""
    if backend == "disk":

        def push(version: int, snapshot=None) -> None:
            out_dir = pipe.weights_dir(version) if pipe else None
            checkpoint.export_weights(policy, out_dir, dtype)
            if snapshot is not None:
                snapshot(out_dir)
            if pipe:
                pipe.publish(out_dir, version)

        return push
    client = pipe.sampler.sync_client(pipe.loop) if pipe else None
    sync = checkpoint.nccl_sender(
        policy,
        dtype,
        rank=dist.get_rank(),
        client=client,
        port=free_port(),
        world_size=1 + engine_ranks,
    )

    def push(version: int, snapshot=None) -> None:
        if snapshot is not None:  # the eval engine loads from disk: one export per eval
            out_dir = pipe.weights_dir(version) if pipe else None
            checkpoint.export_weights(policy, out_dir, dtype)
            snapshot(out_dir)
            if pipe:
                shutil.rmtree(out_dir)
        go = [pipe.releases() if pipe else None]
        dist.broadcast_object_list(go)  # PPO-off-policy-k sends once per round: all ranks or none
        if pipe:
            pipe.publish_by(version, sync.send_weights)
        elif go[0]:
            sync.send_weights()

    return push


class Policy(torch.nn.Module):
    """The causal LM as the loss sees it: forward returns the log-probs of chosen tokens, (N,)
    float32, the head in fp32 (§3.2; from bf16 operands at tensor-core speed under FSDP2 mixed
    precision on GPU) or, with fp32_head=False, in the model's compute dtype. The head runs inside
    this module's forward, so FSDP2 gathers and reduces its weight like any other."""

    def __init__(self, lm, fp32_head: bool):
        super().__init__()
        self.lm, self.fp32_head = lm, fp32_head

    def forward(self, input_ids, attention_mask, position_ids, pred, targets, temperature: float):
        """input_ids (R, C): R right-padded rows with attention_mask (R, C) (None when no row is
        padded: causal attention, SDPA's flash kernel on GPU), or one packed row (R = 1) of several
        sequences with position_ids (1, C) restarting at 0 for each and no mask. pred (N,) long:
        flat indices into the R * C positions whose hidden state predicts targets (N,) long. Returns
        logp (N,) float32."""
        decoder = self.lm.get_decoder()
        hidden = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
        ).last_hidden_state  # (R, C, H)
        hidden = hidden.flatten(0, 1).index_select(0, pred)  # (N, H): only predicting positions
        weight = self.lm.get_output_embeddings().weight  # (V, H)
        head_dtype = torch.float32 if self.fp32_head else hidden.dtype
        return loss.token_logprobs(hidden, weight, targets, temperature, head_dtype=head_dtype)


def shard(policy: Policy, device) -> None:
    """FSDP2 as in torchtitan: `fully_shard` each decoder layer, then the root; bf16 compute with
    fp32 gradient reduction on GPU, fp32 throughout on CPU. Gradients are summed over ranks, not
    averaged (FSDP2's default): each rank's loss is its share of the full-batch loss."""
    kw = {}
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw["mp_policy"] = mp
    for module in [*policy.lm.get_decoder().layers, policy]:  # the root last
        fully_shard(module, **kw)
        # sum over ranks: divide factor 1, reduced with a plain SUM (without force_sum FSDP2 uses
        # PREMUL_SUM(1 / factor), which gloo does not have; torch 2.13, tests/dist_step.py)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


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
        dropped += len(g.completions) - len(keep)
        if len(keep) == len(g.completions):
            kept.append(g)
        elif keep:
            comps, rewards = [g.completions[j] for j in keep], [g.rewards[j] for j in keep]
            kept.append(dataclasses.replace(g, completions=comps, rewards=rewards))
    return kept, dropped


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


def varlen_attention(lm) -> bool:
    """True when the model's attention runs a packed row (sequences back to back, position ids
    restarting at 0) as separate sequences: transformers' flash-attention implementations read
    cu_seqlens off the position ids. SDPA and eager compute a packed row correctly too, but through
    a dense (C, C) block-diagonal mask over the whole row (transformers 5.19
    masking_utils.find_packed_sequence_indices), which costs more than padding, so they get
    length-sorted padded micro-batches instead. Same rule as transformers.utils.generic.
    is_flash_attention_requested; config._attn_implementation is where transformers keeps the
    choice."""
    return "flash" in (lm.config._attn_implementation or "")


def plan_microbatches(lengths, world: int, args: Args, pack: bool) -> list[list[list[int]]]:
    """Which samples each rank runs in which micro-batch: plan[rank][i] is a list of batch row
    indices. lengths: tokens per sample (prompt + completion). Samples go to ranks longest first,
    each to the rank with the fewest tokens so far; each rank's samples, longest first, fill a
    micro-batch while its computed tokens (packed: the sum of lengths; padded: rows x the longest)
    stay within --max-tokens-per-microbatch and its rows within --micro-batch-size. A sample longer
    than the budget runs alone. Every rank holds the whole batch, so every rank computes the same
    plan without communicating. --max-tokens-per-microbatch 0: the layout before issue 11 (rank r
    takes rows r, r + world, ...; --micro-batch-size rows at a time, batch order)."""
    S, budget, cap = len(lengths), args.max_tokens_per_microbatch, args.micro_batch_size
    if budget == 0:
        strided = [list(range(r, S, world)) for r in range(world)]
        return [[rows[i : i + cap] for i in range(0, len(rows), cap)] for rows in strided]
    load, mine = [0] * world, [[] for _ in range(world)]
    for i in sorted(range(S), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        mine[r].append(i)
    plan = []
    for rows in mine:
        mbs, cur, used = [], [], 0
        for i in rows:  # longest first, so a padded micro-batch is as long as its first row
            cost = used + lengths[i] if pack else (len(cur) + 1) * lengths[cur[0] if cur else i]
            if cur and (cost > budget or len(cur) == cap):
                mbs.append(cur)
                cur, used = [], 0
            cur.append(i)
            used += lengths[i]
        plan.append(mbs + [cur] if cur else mbs)
    return plan


def microbatch(batch: dict, rows, width: int, pack: bool, adv, weights) -> dict:
    """One micro-batch's CPU tensors from a right-padded batch (collate): the model input
    (Policy.forward's arguments: padded rows cut to `width` columns, or packed into one row) and the
    loss layout (s, width): old_logp, weights (s, width), adv (s,), dst (N,) where each of the N
    log-probs goes in it, sample (N,) each token's batch row. rows None: an empty micro-batch, one
    zero-weight token, for a rank with fewer than the others (FSDP2 needs the same forward /
    backward calls on every rank)."""
    if rows is None:
        S, one = len(adv), torch.ones(1, dtype=torch.long)
        return dict(
            input_ids=torch.zeros(1, 2, dtype=torch.long),
            attention_mask=None,
            position_ids=None,
            pred=one - 1,
            targets=one - 1,
            dst=one,
            sample=one * S,
            old_logp=torch.zeros(1, 2),
            weights=torch.zeros(1, 2),
            adv=torch.zeros(1),
        )
    idx = torch.tensor(rows)
    ids, mask = batch["input_ids"][idx, :width], batch["mask"][idx, :width]  # (s, width)
    real = batch["attention_mask"][idx, :width].bool()  # (s, width) prefix of each row
    r, t = mask.nonzero(as_tuple=True)  # completion tokens; t >= 1 (train_step checked mask[:, 0])
    if pack:  # sequences back to back, each with its own positions
        lengths = real.sum(1)
        offset = lengths.cumsum(0) - lengths  # (s,) where each sequence starts in the row
        model = dict(
            input_ids=ids[real][None],
            attention_mask=None,
            position_ids=torch.arange(width).expand_as(ids)[real][None],
        )
    else:
        offset = torch.arange(len(rows)) * width
        mask_or_none = None if real.all() else real.long()  # no mask: causal, SDPA's flash kernel
        model = dict(input_ids=ids, attention_mask=mask_or_none, position_ids=None)
    return dict(
        model,
        pred=offset[r] + t - 1,  # token t is predicted from position t - 1 of its own sequence
        targets=ids[r, t],
        dst=r * width + t,
        sample=idx[r],
        old_logp=batch["old_logp"][idx, :width],
        weights=weights[idx, :width],
        adv=adv[idx],
    )


def check_batch(batch: dict, weights, V: int) -> None:
    """Raises ValueError on a batch train_step would get wrong without a word: rows not right-padded
    or mask off the real tokens (collate's layout), mask on a first token (nothing predicts it),
    token ids outside [0, V), and what loss.check_values finds (a non-finite behaviour log-prob on
    a valid token, a negative weight). weights (S, T) from loss.aggregation_weights. Run once per
    step on the CPU: on a GPU each check would cost a host sync per micro-batch."""
    T = batch["input_ids"].shape[1]
    real = torch.arange(T) < batch["attention_mask"].sum(1)[:, None]  # (S, T) right-padded rows
    if not torch.equal(batch["attention_mask"].bool(), real) or (batch["mask"] & ~real).any():
        raise ValueError(
            "batch must be right-padded, with mask only on real tokens (collate's layout)"
        )
    if batch["mask"][:, 0].any():
        raise ValueError(
            "mask[:, 0] is True: the first token has no preceding position to predict it"
        )
    ids = batch["input_ids"][real]
    if ids.numel():
        lo = int(ids.min())
        hi = int(ids.max())
        if lo < 0 or hi >= V:
            raise ValueError(f"token ids must lie in [0, V={V}); got [{lo}, {hi}]")
    loss.check_values(batch["old_logp"], weights)


def to_device(mb: dict, device) -> dict:
    """A micro-batch's tensors on `device`; on CUDA through pinned memory, so that the copies need
    not wait for the host."""
    if device.type != "cuda":
        return mb
    return {
        k: None if v is None else v.pin_memory().to(device, non_blocking=True)
        for k, v in mb.items()
    }


def microbatch_loss(policy, mb: dict, args: Args):
    """Forward and loss of one micro-batch (microbatch's tensors, on the device). Returns (loss,
    metrics, logp): from loss.policy_loss the 0-dim loss, this micro-batch's share of the
    full-batch loss, and its metrics (sums over valid tokens, rho's extremes); logp (N,) float32,
    the log-probs of its completion tokens."""
    logp = policy(
        mb["input_ids"],
        mb["attention_mask"],
        mb["position_ids"],
        mb["pred"],
        mb["targets"],
        args.temperature,
    )  # (N,) float32
    w = mb["weights"]  # (s, width)
    # the N log-probs into the loss layout; the other positions are padding (weight 0)
    full = logp.new_zeros(w.numel()).index_copy(0, mb["dst"], logp).view_as(w)  # (s, width)
    l, metrics = loss.policy_loss(
        full,
        mb["old_logp"],
        mb["adv"],
        w,
        args.loss,
        eps_low=args.eps_low,
        eps_high=args.eps_high,
        cispo_cap=args.cispo_cap,
        validate=False,  # check_batch ran loss.check_values once, on the whole batch
    )
    return l, metrics, logp


def first_nonfinite_sample(records, S: int, device) -> int:
    """The first batch sample, over all ranks, with a non-finite log-prob or loss; S if none (the
    gradient norm alone). records: (sample (N,), logp (N,), loss) of each of this rank's
    micro-batches; a non-finite loss blames its micro-batch's first sample. Runs on the CPU once a
    step has failed, off the fast path; a collective, so every rank calls it."""
    first = S
    for sample, logp, l in records:
        bad = ~torch.isfinite(logp.cpu())  # (N,)
        if not torch.isfinite(l):  # the loss has no sample: blame the micro-batch's first
            first = min(first, int(sample.min()))
        elif bad.any():
            first = min(first, int(sample.cpu()[bad].min()))
    everywhere = torch.tensor(first, device=device)
    dist.all_reduce(everywhere, op=dist.ReduceOp.MIN)
    return int(everywhere)


def reduce_metrics(sums, extremes, finite, grad_norm) -> tuple[dict, bool]:
    """All-reduce one step's statistics over ranks and bring them to the host in one transfer, the
    step's one host sync. sums (4,) float64: loss, valid tokens, clipped tokens, rho summed over
    valid tokens; extremes (2,) float64: -rho_min, rho_max; finite 0-dim bool, this rank's flag;
    grad_norm 0-dim, already global. Returns (the step's train/ metrics, finite on every rank)."""
    dist.all_reduce(sums)
    # MAX: the extremes, and 1 if any rank saw a non-finite value (torchtitan's loss_is_finite)
    top = torch.cat([extremes, (~finite).double()[None]])
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    out = torch.cat([sums, top, grad_norm.double()[None]]).tolist()  # the step's one host sync
    loss_sum, n_tok, clipped, rho_sum, neg_rho_min, rho_max, nonfinite, grad_norm = out
    n = max(n_tok, 1.0)  # valid tokens in the batch, all ranks
    metrics = {
        "train/loss": loss_sum,
        "train/grad_norm": grad_norm,
        "train/tokens": int(n_tok),
        "train/clip_frac": clipped / n,
        "train/rho_mean": rho_sum / n,
        "train/rho_min": -neg_rho_min,
        "train/rho_max": rho_max,
    }
    return metrics, not nonfinite


def train_step(policy, optimizer, batch: dict, args: Args, device) -> dict:
    """One optimizer step on a collated batch, the same on 1 or N ranks: advantages and aggregation
    weights are computed on the whole batch (§4), each rank runs its share of the samples in
    micro-batches (plan_microbatches: token-budgeted, trimmed to their own length, packed where the
    attention kernel is varlen), and the shares sum to the full-batch loss and gradient. Metrics
    and the finite flag stay on the device until one transfer after backward. Returns the step's
    metrics, reduced over ranks. Raises ValueError on a batch check_batch rejects, and
    FloatingPointError on every rank, before the weights change, if a log-prob, the loss or the
    gradient norm is not finite (naming the first such batch sample)."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    # on the whole batch (§4), so that the micro-batches of all ranks sum to the full-batch loss
    adv = loss.group_advantages(batch["rewards"], batch["group_ids"], norm=args.adv_norm)  # (S,)
    weights = loss.aggregation_weights(batch["mask"], batch["group_ids"], agg=args.agg)  # (S, T)
    # once per step on the CPU: on a GPU each check would sync the host once per micro-batch
    check_batch(batch, weights, policy.lm.get_output_embeddings().weight.shape[0])
    S, T = batch["input_ids"].shape
    lengths = batch["attention_mask"].sum(1)  # (S,)
    pack = args.max_tokens_per_microbatch > 0 and varlen_attention(policy.lm)
    plan = plan_microbatches(lengths.tolist(), world, args, pack)
    # FSDP2: every rank runs the same number of forward / backward calls; short ranks add empty ones
    mine = plan[rank] + [None] * (max(map(len, plan)) - len(plan[rank]))
    f64 = dict(dtype=torch.float64, device=device)
    sums = torch.zeros(4, **f64)  # loss, valid tokens, clipped tokens, rho over valid tokens
    extremes = torch.full((2,), -math.inf, **f64)  # -rho_min, rho_max
    finite = torch.ones((), dtype=torch.bool, device=device)  # torchtitan's loss_is_finite
    records = []  # per micro-batch, to name the sample if the step fails
    for rows in mine:
        trimmed = rows is not None and args.max_tokens_per_microbatch > 0
        width = int(lengths[rows].max()) if trimmed else T  # the legacy layout pads to the batch
        mb = to_device(microbatch(batch, rows, width, pack, adv, weights), device)
        l, m, logp = microbatch_loss(policy, mb, args)
        # each rank's loss is its share of a sum, so shard() has FSDP2 sum gradients over ranks
        l.backward()
        sums += torch.stack([l.detach().double(), m["n_tokens"], m["clipped"], m["rho_sum"]])
        extremes = torch.maximum(extremes, torch.stack([-m["rho_min"], m["rho_max"]]))
        finite &= torch.isfinite(l)
        if rows is not None:  # an empty micro-batch's one token has weight 0: it cannot fail
            finite &= torch.isfinite(logp).all()
        records.append((mb["sample"], logp.detach(), l.detach()))
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    # under FSDP2 the norm is a DTensor: full_tensor() is its global value, the same on every rank
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    finite &= torch.isfinite(grad_norm)
    metrics, finite = reduce_metrics(sums, extremes, finite, grad_norm)
    if not finite:  # every rank raises, before the weights change
        optimizer.zero_grad(set_to_none=True)
        s = first_nonfinite_sample(records, S, device)
        where = f"log-prob or loss in batch sample {s}" if s < S else "loss or gradient"
        loss_sum = metrics["train/loss"]
        norm = metrics["train/grad_norm"]
        raise FloatingPointError(f"non-finite {where} (loss {loss_sum:.4g}, grad norm {norm:.4g})")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    metrics["train/adv_abs_mean"] = adv.abs().mean().item()
    return metrics


def reward_fns(prompts, unsafe_no_sandbox: bool) -> dict:
    """The reward function of each kind (data.Prompt.kind) among `prompts`, for the pipeline:
    math-verify for math, the problem's unit tests run in a bubblewrap sandbox for code. Raises
    BadInput (code 1) with sandbox.check's one-line error when code is present and no sandbox can
    be made here; --unsafe-no-sandbox runs code without one, with a warning at every start."""
    fns = {"math": reward.math_rewards}
    if any(p.kind == "code" for p in prompts):
        try:
            sandbox.check(sandboxed=not unsafe_no_sandbox)
        except RuntimeError as e:
            raise BadInput(str(e), 1) from None
        fns["code"] = functools.partial(code_reward.code_rewards, sandboxed=not unsafe_no_sandbox)
    return fns


def curve_fit(history: list[dict], steps: int) -> dict:
    """Fit Eq. 1 to the held-out curve so far (pass rate vs gpu_hours; R0 = the step-0 eval) and predict the pass
    rate at the last step, extrapolating compute linearly in steps. history: the evals finished so far, in compute
    order. {} until R0 and 4 points past step 0 have finished."""
    pts = [(h["gpu_hours"], h["eval/pass_rate"]) for h in history if h["step"] > 0]
    if len(pts) < 4 or history[0]["step"] != 0:
        return {}
    C, R = map(np.array, zip(*pts, strict=True))
    try:
        f = fit.fit_sigmoid(C, R, history[0]["eval/pass_rate"])
    except (ValueError, RuntimeError) as e:
        return {"fit/converged": 0.0, "fit/error": str(e)}
    c_end = history[-1]["gpu_hours"] * steps / max(history[-1]["step"], 1)
    return {  # converged = 0 also when A is not identified (fit.py's rule); A_lo, A_hi: its profile
        "fit/A": f.A,
        "fit/A_lo": f.A_interval[0],
        "fit/A_hi": f.A_interval[1],
        "fit/B": f.B,
        "fit/C_mid": f.C_mid,
        "fit/converged": float(f.converged),
        "fit/pred_final": float(f.predict(c_end)),
    }


def final_fit(run_dir: str, history: list[dict]) -> dict:
    """The paper's protocol (§5) on this run: fit on the first half of its compute, predict the second half (mean
    absolute error on the held-out evals); plot it like Figure 1 (fit.png) and save the numbers (fit.json).
    A run of several tasks (history with eval/<task>/pass_rate) also gets one fit per task, under
    "tasks" in fit.json (the paper's math curve and code curve), and fit.png draws those curves
    instead of the overall one. A fit that fails holds its "error" and is not drawn."""
    if not history or history[0]["step"] != 0:  # R0 was abandoned (Ctrl-C) and could not run again
        out = {"error": "no step-0 eval (R0): nothing to fit against"}
        with open(os.path.join(run_dir, "fit.json"), "w") as f:
            json.dump(out, f, indent=1)
        return out
    C = np.array([h["gpu_hours"] for h in history[1:]])
    half = C[-1] / 2 if len(C) else 0.0
    tasks = [m[1] for k in history[0] if (m := re.fullmatch(r"eval/(.+)/pass_rate", k))]
    curves = []  # (name, C, R, fit) for fit_cli.plot

    def one(name: str, key: str) -> dict:
        R = np.array([h[key] for h in history[1:]])
        R0 = history[0][key]
        out = {"R0": R0, "final_pass_rate": float(R[-1]) if len(R) else R0, "fit_until": half}
        try:
            f, mae, n_tail = fit.extrapolate(C, R, R0, fit_until=half)
        except (ValueError, RuntimeError) as e:
            return {**out, "error": str(e)}
        curves.append((name, C, R, f))
        out.update(
            A=f.A,
            A_interval=f.A_interval,
            B=f.B,
            C_mid=f.C_mid,
            converged=f.converged,
            message=f.message,
            tail_mae=mae,
            n_tail=n_tail,
            predicted_final=float(f.predict(C[-1:])[0]),
        )
        return out

    out = one(os.path.basename(run_dir), "eval/pass_rate")
    if tasks:
        curves.clear()  # one curve per task on the plot
        out["tasks"] = {t: one(t, f"eval/{t}/pass_rate") for t in tasks}
    if curves:
        import fit_cli  # the plot lives with fit.py's command line

        ylabel = "eval/<task>/pass_rate" if tasks else "eval/pass_rate"
        path = os.path.join(run_dir, "fit.png")
        fit_cli.plot(curves, path, xlabel="gpu_hours", ylabel=ylabel, fit_until=half)
    with open(os.path.join(run_dir, "fit.json"), "w") as f:
        json.dump(out, f, indent=1)
    return out


def one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


def hub_model(repo: str) -> str:
    """A hub model's cached snapshot directory (no network needed), else `repo` once one quick request has shown
    the hub serves it; without this, transformers retries an unreachable hub for about a minute. Raises BadInput
    (code 1) when the model is neither cached nor reachable."""
    from huggingface_hub import constants, model_info, snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError

    try:
        return snapshot_download(repo, local_files_only=True)
    except LocalEntryNotFoundError:
        pass
    if constants.HF_HUB_OFFLINE:
        raise BadInput(
            f"--model {repo}: not in the local Hugging Face cache (HF_HUB_OFFLINE is set)", 1
        )
    try:
        model_info(repo, timeout=10)
    except RepositoryNotFoundError as e:  # gated and private repos too
        raise BadInput(
            f"--model {repo}: no such model on the Hugging Face hub, or HF_TOKEN needed", 1
        ) from e
    except Exception as e:  # the hub client's connection errors
        raise BadInput(
            f"--model {repo}: not in the local Hugging Face cache, and the hub is unreachable ({one_line(e)})",
            1,
        ) from e
    return repo


def load_inputs(args: Args, master: bool):
    """Model path, tokenizer and prompts, each checked before the run directory exists, so a failed
    start leaves nothing behind (issue 13). The tiny model is built once and cached (rank 0 builds, the others
    wait). Whether the model thinks is read from its chat template (data.thinking_mode) unless --thinking
    forces it, and printed. Returns (path, tokenizer, prompts, thinking). Raises BadInput (code 1)
    naming the flag and its value."""
    path = [args.path, None]  # the model directory or hub id, and rank 0's error building it
    if path[0] is None and master:
        try:
            path[0] = tiny.build(seed=args.seed) if args.model == "tiny" else tiny.smollm2()
        except RuntimeError as e:  # smollm2 without its packages: the message gives the pip command
            path[1] = str(e)
    dist.broadcast_object_list(path)
    if path[1] is not None:
        raise BadInput(path[1], 1)
    path = hub_model(path[0]) if config.model_kind(path[0]) == "hub" else path[0]
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise BadInput(f"--model {args.model}: cannot load its tokenizer: {one_line(e)}", 1) from e
    try:
        thinking = data.thinking_mode(
            tokenizer, args.thinking
        )  # from the chat template unless forced
    except ValueError as e:
        raise BadInput(f"--thinking {args.thinking}: {one_line(e)}", 2) from e
    if master:
        how = "from the chat template" if args.thinking == "auto" else "forced"
        print(f"thinking {('off', 'on')[thinking]} (--thinking {args.thinking}: {how})", flush=True)
    try:
        prompts = data.load_prompts(
            args.data,
            tokenizer,
            thinking=thinking,
            max_prompt_len=args.max_prompt_len,
            question_key=args.question_key,
            answer_key=args.answer_key,
            seed=args.seed,
        )
    except (OSError, ValueError, ImportError) as e:  # data.py's messages start with the source
        msg = one_line(e)
        raise BadInput(
            f"--data {msg if msg.startswith(args.data) else f'{args.data}: {msg}'}", 1
        ) from e
    tasks = collections.Counter(p.task for p in prompts)
    task, n = min(tasks.items(), key=lambda item: item[1])
    if args.eval_size >= n:  # held out per task (heldout.split_heldout)
        of = f"task {task} of --data {args.data}" if len(tasks) > 1 else f"--data {args.data}"
        raise BadInput(
            f"--eval-size {args.eval_size}: must be less than the {n} prompts of {of}", 1
        )
    try:
        filters.task_weights(list(tasks), config.parse_task_weights(args.task_weights))
    except ValueError as e:
        raise BadInput(f"--task-weights {' '.join(args.task_weights)}: {e}", 1) from e
    return path, tokenizer, prompts, thinking


def load_model(args: Args, path: str):
    """The fp32 master weights (seeded by --seed). Raises BadInput (code 1) naming --model."""
    torch.manual_seed(args.seed)
    try:
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    except (OSError, ValueError) as e:
        raise BadInput(f"--model {args.model}: cannot load its weights: {one_line(e)}", 1) from e


def open_run_dir(args: Args, world: int, master: bool) -> tuple[str, Args, dict | None]:
    """The run directory, made once the inputs have loaded: resolved args (args.json) and what produced them
    (meta.json). A resumed run keeps its directory; one whose run stopped before its first checkpoint starts again
    from step 0 (with --resume, under its saved flags), saying so. Returns (run_dir, args, meta on rank 0)."""
    run_dir = [
        args.resume
        or args.run_dir
        or os.path.join(
            "runs", f"{os.path.basename(args.model)}-{args.recipe}-{time.strftime('%Y%m%d-%H%M%S')}"
        )
    ]
    dist.broadcast_object_list(run_dir)  # rank 0's name: the clock may tick between ranks
    run_dir, meta = run_dir[0], None
    # a checkpoint there without --resume stopped us in config.validate
    has_checkpoint = os.path.exists(os.path.join(run_dir, "state.json"))
    if not has_checkpoint and (args.resume or os.path.exists(os.path.join(run_dir, "args.json"))):
        if master:
            print(
                f"train.py: {run_dir} holds no checkpoint yet (stopped before its first one); starting it "
                f"again from step 0{' with its saved flags' if args.resume else ''}",
                flush=True,
            )
            checkpoint.clear_run(run_dir)
        args = dataclasses.replace(args, resume=None)
    if master:
        os.makedirs(run_dir, exist_ok=True)
        with open(os.path.join(run_dir, "args.json"), "w") as f:
            json.dump({**dataclasses.asdict(args), "resume": None}, f, indent=1)
        meta = checkpoint.run_metadata(world)
        with open(os.path.join(run_dir, "meta.json"), "w") as f:
            json.dump(meta, f, indent=1)
    return run_dir, args, meta


def on_stop_signal(stop: dict) -> None:
    """Ctrl-C (SIGINT) or SIGTERM (torchrun passes Ctrl-C on as SIGTERM): the first one sets stop["requested"],
    and the step loop finishes or abandons the current step, checkpoints and exits 0; a second Ctrl-C exits at once
    (code 130), leaving the engine's processes to the pipeline's watchdog. A terminal's Ctrl-C reaches vLLM's
    processes too, which shut down on it: the pipeline then raises pipeline.Stopped rather than wait on them."""

    def handler(signum, frame):  # os.write: print() is not safe to re-enter from a handler
        if not stop["requested"]:
            stop["requested"] = True
            os.write(
                2, b"\ntrain.py: stopping: checkpoint, then exit (Ctrl-C again to quit at once)\n"
            )
        elif signum == signal.SIGINT:
            os.write(2, b"\ntrain.py: second Ctrl-C: quitting now; the last checkpoint stays\n")
            os._exit(130)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def main(args: Args) -> None:
    rank, world, device = setup_distributed(args.dist_timeout)
    master = rank == 0
    cuda = device.type == "cuda"
    if master and not cuda and config.model_kind(args.model) in ("dir", "hub"):
        cpu = ", ".join(f"{k} {getattr(args, k)}" for k in config.PRESETS["hf-cpu"] if k != "path")
        print(f"--model {args.model} without CUDA: CPU-sized defaults ({cpu}); flags override them")
    # ---- model, tokenizer, prompts, checked before anything is written; then the run directory
    path, tokenizer, prompts, thinking = load_inputs(args, master)
    reward_fn = reward_fns(prompts, args.unsafe_no_sandbox)  # before any slow setup: it may exit
    # sampler weights: bf16 on GPU, fp32 on CPU (vLLM's own "auto" would pick bf16 there, and the
    # trainer is fp32)
    if args.gen_dtype == "auto":
        gen_dtype = torch.bfloat16 if cuda else torch.float32
    else:
        gen_dtype = getattr(torch, args.gen_dtype)
    P = round(args.prompts_per_step * args.batch_scale)  # P: prompt groups per batch
    tasks = len({p.task for p in prompts}) if prompts else 1  # each holds out eval_size prompts
    plan = plan_placement(args, path, world, gen_dtype, P, tasks)  # refuses before the model loads
    lm = load_model(args, path)
    run_dir, args, meta = open_run_dir(args, world, master)
    pad_id = (
        tokenizer.pad_token_id
        if tokenizer.pad_token_id is not None
        else tokenizer.eos_token_id or 0
    )  # masked
    for turn in (
        master,
        not master,
    ):  # rank 0 draws (or, resuming, restores) the held-out split; the others read it
        if turn:
            train_prompts, eval_prompts = heldout.split_heldout(
                prompts, args.eval_size, seed=args.seed, run_dir=run_dir
            )
        dist.barrier()
    pool = filters.prompt_pool(  # one PromptPool per task, tasks drawn by --task-weights
        [p.task for p in train_prompts],
        config.parse_task_weights(args.task_weights),
        threshold=args.npr_threshold,
        policy=args.prompt_sampling,
        seed=args.seed,
    )
    n_params = sum(p.numel() for p in lm.parameters())
    if args.activation_checkpointing:  # before fully_shard, as torchtitan applies it
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    policy = Policy(
        lm, args.fp32_head
    ).train()  # train mode: HF checkpoints layers only while training; no dropout
    # no policy.to(device) first: fully_shard moves one unit at a time to the mesh's device and
    # keeps only its shard (torch 2.13 _fsdp_init._move_states_to_device); a whole fp32 model moved
    # to GPU 0 first would stay cached there (~30 GiB for 8B)
    shard(policy, device)
    if cuda:
        torch.cuda.empty_cache()  # the largest unit's unsharded transient (the embedding and head)
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
        if master:  # evals logged after the checkpoint are not in its history: they go too
            done = {h["step"] for h in state["history"]}
            for name in ("metrics.jsonl", "samples.jsonl"):
                checkpoint.truncate_log(os.path.join(run_dir, name), state["step"], evals=done)
    step, clock, history = state["step"], state["clock"], state["history"]
    # ---- the generator: rank 0 owns the pipeline (producer thread + vLLM); it starts from the current weights
    stop = {"requested": False}  # set by the first Ctrl-C (on_stop_signal)
    devices = plan.devices  # distinct GPUs (trainer + generator, shared ones once); 1 on CPU
    start_dir = None
    if args.resume:
        start_dir = tempfile.mkdtemp(prefix="resume_", dir=run_dir) if master else None
        if master:  # config, tokenizer and generation config beside the exported weights (a hub id has no dir)
            lm.config.save_pretrained(start_dir)
            lm.generation_config.save_pretrained(start_dir)
            tokenizer.save_pretrained(start_dir)
        checkpoint.export_weights(policy, start_dir, gen_dtype)
    import generate  # vLLM (~10 s to import): only once the inputs have loaded
    import pipeline

    backend = generate.weight_transfer_backend(
        args.weight_transfer, cuda=cuda, dedicated=plan.dedicated
    )
    pipe = None
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
            gpus=plan.generator,
            tensor_parallel_size=plan.tp,
            data_parallel_size=plan.dp,
            gpu_memory_utilization=plan.utilization,
            kv_cache_gib=args.kv_cache_gib,
            max_num_seqs=plan.max_num_seqs,
            weight_transfer=backend,
            interruptions=args.interruptions,
            fp32_head=args.fp32_head,
        )
        eval_engine = dict(
            sampler_kwargs,
            gpus=plan.eval.gpus,
            tensor_parallel_size=plan.eval.tp,
            data_parallel_size=plan.eval.dp,
            gpu_memory_utilization=plan.eval.utilization,
            max_num_seqs=plan.eval.max_num_seqs,
            weight_transfer="disk",  # snapshots: an eval loads one version, once
        )
        if not cuda:  # one device: the eval engine takes the CPU the trainer leaves (EVAL_NICE)
            eval_engine.update(
                nice=EVAL_NICE, env={"VLLM_CPU_OMP_THREADS_BIND": generate.cpu_bind(1)}
            )
        # a group may wait behind every rollout in flight, each up to max_model_len tokens
        gen_timeout = args.gen_timeout or pipeline.group_timeout(
            args.max_model_len, 2 * P * args.group_size, plan.max_num_seqs * plan.dp
        )
    weights_bytes = n_params * gen_dtype.itemsize  # one weight version as the sampler loads it
    evals_pending = pipeline.EVALS_PENDING
    if not cuda:  # the CPU eval engine (nice 19) only gets the cycles the trainer leaves, so evals
        # fall behind; rather than stall training they queue, each a snapshot of hard links to one
        # published version, up to 1 GiB of them (the tiny model: every eval of the run); the run's
        # end waits for them (issue 10)
        evals_pending = max(
            evals_pending,
            min(args.steps // args.eval_every + 2, 2**30 // weights_bytes),
        )

    # vLLM's start, on rank 0, while the other ranks poll (rank0_call)
    def start_pipeline():  # and its eval engine, before the first step: no Ctrl-C meets it starting
        pipe = pipeline.Pipeline(
            start_dir or path,
            train_prompts,
            pool,
            group_size=args.group_size,
            prompts_per_batch=P,
            max_lag=args.max_lag,
            mode=args.async_mode,
            max_inflight=2 * P,
            reward_fn=reward_fn,
            sampler_kwargs=sampler_kwargs,
            gen_timeout=gen_timeout,
            version=step,
            weights_bytes=weights_bytes,
            spill_dir=run_dir,
            stop=lambda: stop["requested"],
            evaluator=start_dir or path,
            eval_sampler_kwargs=eval_engine,
            max_evals_pending=evals_pending,
        )
        try:
            pipe.wait_eval_engine()
        except BaseException:
            pipe.close()
            raise
        return pipe

    pipe = rank0_call(start_pipeline)
    if master:
        # vLLM's handler, set up as the engine started: after a Ctrl-C, the engine's death is no news
        for handler in logging.getLogger("vllm").handlers:
            handler.addFilter(lambda record: not stop["requested"])
        # what this run is, in one line (args.json and meta.json hold the rest)
        print(
            f"run {run_dir} | commit {meta['commit'][:7]} | torch {meta['torch']}, vllm {meta['vllm']} | {world} "
            f"rank(s) on {device.type} | {path}: {n_params / 1e6:.2f}M params | {args.data}: {len(train_prompts)} "
            f"train, {len(eval_prompts)} held-out prompts | {P} prompts x {args.group_size} = "
            f"{P * args.group_size} rollouts per step | recipe {args.recipe} | "
            f"weights via {backend}",
            flush=True,
        )
        if (
            pipe.sampler.kv_capacity < plan.max_num_seqs
        ):  # the plan estimated it; vLLM has now measured
            print(
                f"warning: vLLM's KV cache holds {pipe.sampler.kv_capacity} sequences of "
                f"{args.max_model_len} tokens per engine, fewer than max_num_seqs "
                f"{plan.max_num_seqs}: "
                f"long rollouts may preempt one another",
                flush=True,
            )
    push_weights = weight_pusher(policy, pipe, backend, gen_dtype, plan.tp * plan.dp)
    if args.wandb_project and master:
        import wandb

        wandb.init(
            project=args.wandb_project,
            name=os.path.basename(run_dir),
            config=dataclasses.asdict(args),
            resume="allow",
        )
        wandb.define_metric("eval/step")  # an eval's line comes steps after the step it measured
        for prefix in ("eval/*", "fit/*"):
            wandb.define_metric(prefix, step_metric="eval/step")
    on_stop_signal(stop)
    metrics_f = open(os.path.join(run_dir, "metrics.jsonl"), "a") if master else None
    samples_f = open(os.path.join(run_dir, "samples.jsonl"), "a") if master else None

    first_eval = [True]  # the thinking format is checked once, on the run's first finished eval
    is_eval_step = lambda s: s % args.eval_every == 0 or s == args.steps  # and step 0 (R0)

    def clock_fields(c: dict) -> dict:
        return {
            "gpu_hours": c["gpu_hours"],
            "tokens": c["gen_tokens"] + c["train_tokens"],
            "flops": c["flops"],
            "clock/gen_tokens": c["gen_tokens"],
            "clock/train_tokens": c["train_tokens"],
        }

    def write(line: dict) -> None:  # rank 0: one metrics.jsonl line, and W&B
        metrics_f.write(json.dumps(line) + "\n")
        metrics_f.flush()
        samples_f.flush()
        if args.wandb_project:  # eval lines come late: their charts run on eval/step
            wandb.log(
                {**line, "eval/step": line["step"]} if "eval/version" in line else line, step=step
            )

    def log(m: dict) -> None:
        if not master:
            return
        write({"step": step, **clock_fields(clock), **m})
        reward = f"{m['train/reward']:.3f}" if "train/reward" in m else "-"
        print(
            f"step {step:5d}/{args.steps} | reward {reward} | "
            f"lag {m.get('train/lag_max', 0):.0f} | zero-var {m.get('filter/zero_var_frac', 0):.2f} | active "
            f"{pool.num_active} | clip {m.get('train/clip_frac', 0):.3f} | {m.get('time/step_s', 0):.1f} s",
            flush=True,
        )

    def submit_eval(weights: str | None, tag: dict) -> None:
        """Rank 0: queue the eval of the weights in `weights` (trainer version tag["step"]) on the
        eval engine (pipeline.py); tag["clock"], the compute clock of that version, may be filled in
        later (before log_evals runs). The paper's metric: eval_n samples per held-out prompt at the
        training temperature; one greedy sample beside it, logged, never fitted."""
        try:
            pipe.submit_eval(
                eval_prompts,
                args.eval_n,
                version=tag["step"],
                weights=weights,
                greedy=True,
                tag=tag,
            )
        except pipeline.Stopped:  # Ctrl-C meanwhile: abandoned with the others (save)
            pass

    def log_evals() -> None:
        """Rank 0: every eval finished since the last call gets its metrics.jsonl line against the
        step, weight version and compute clock it measured (logged later, in the order submitted),
        its samples, its place in the history (compute order) and the live fit (fit/*)."""
        for r in pipe.eval_results():
            at, c = r.tag["step"], r.tag["clock"]
            if thinking and first_eval[0] and (warning := data.thinking_warning(r.records)):
                print(warning, flush=True)
            first_eval[0] = False
            shown = collections.Counter()  # the first log_samples records of each task
            for rec in r.records:
                shown[rec["task"]] += 1
                if shown[rec["task"]] <= args.log_samples:
                    samples_f.write(json.dumps({"step": at, "split": "eval", **rec}) + "\n")
            point = {"step": at, "gpu_hours": c["gpu_hours"], **r.metrics}
            bisect.insort(history, point, key=lambda h: (h["gpu_hours"], h["step"]))
            m = {
                **r.metrics,
                "eval/logged_at_step": step,
                "time/eval_s": r.eval_s,
                "time/eval_queued_s": r.queued_s,
                **curve_fit(history, args.steps),
            }
            write({"step": at, **clock_fields(c), **m})
            fitted = (
                f" | fit A {m['fit/A']:.3f} -> {m['fit/pred_final']:.3f}" if "fit/A" in m else ""
            )
            per_task = [
                (t[1], v) for k, v in m.items() if (t := re.fullmatch(r"eval/(.+)/pass_rate", k))
            ]  # a run of several tasks: each task's rate beside the overall one
            tasks = f" ({', '.join(f'{t} {v:.3f}' for t, v in per_task)})" if per_task else ""
            print(
                f"eval {at:5d}/{args.steps} | pass {m['eval/pass_rate']:.3f}{tasks} | greedy "
                f"{m['eval/greedy_pass_rate']:.3f}{fitted} | version {r.version} | {r.eval_s:.1f} s "
                f"after {r.queued_s:.1f} s queued, logged at step {step}",
                flush=True,
            )

    def await_evals(done, why: str, count: bool = True) -> bool:
        """Every rank (a collective): rank 0 waits until done(versions of the evals pending) holds,
        logging each eval as it finishes, while the other ranks poll (rank0_call); with `count`, the
        wait goes on the compute clock (the devices are held meanwhile; inside a step it is in the
        step's time already). False if a stop (Ctrl-C) cut it short."""

        def wait() -> bool:
            t0 = time.perf_counter()
            try:
                while not done(pipe.evals_pending()):
                    pipe.wait_evals(len(pipe.evals_pending()) - 1, timeout=HEARTBEAT_S)
                    log_evals()
            except pipeline.Stopped:
                log_evals()  # those that finished before the stop are kept
                return False
            finally:
                waited = time.perf_counter() - t0
                clock["gpu_hours"] += waited * devices / 3600 if count else 0.0
                if waited > HEARTBEAT_S:
                    print(f"waited {waited:.1f} s for {why}", flush=True)
            log_evals()
            return True

        return rank0_call(wait, share=True)

    saved = [step if args.resume else None]  # the step of the newest checkpoint

    def save(stopping: bool = False) -> None:  # a collective: every rank writes its shards
        """A checkpoint of this step. The evals of earlier versions finish first (pending ones are
        few: max_evals_pending), so that the history saved holds them; this step's own eval runs
        again on --resume, from the restored weights (the last step's is waited for: the run
        ends). On a stop (Ctrl-C) pending evals are abandoned and said so."""
        if saved[0] == step:
            return
        last = step + 1 if step == args.steps else step
        if stopping or not await_evals(
            lambda pending: all(v >= last for v in pending), "earlier evals at the checkpoint"
        ):
            lost = pipe.evals_pending() if master else []
            if lost:
                again = f"; step {step}'s runs again on --resume" if step in lost else ""
                print(
                    f"warning: the eval(s) of step(s) {lost} were still running: abandoned{again}",
                    flush=True,
                )
        if master:  # evals finished since the last step's log go in the history saved
            log_evals()
        run_state = {
            "version": step,
            "clock": clock,
            "history": history,
            "pool": pool.state_dict() if master else None,
        }
        checkpoint.save_checkpoint(run_dir, step, policy, optimizer, run_state)
        saved[0] = step

    def next_batch():  # rank 0, through rank0_call
        try:
            return pipe.get_batch(step)
        except pipeline.Stopped:  # Ctrl-C while waiting for rollouts
            return None

    stopped = False  # the loop ended on a stop (every rank alike)
    try:
        if master:  # R0, the curve's anchor (PAPER.md 8.1), from the start weights; on --resume
            # also the checkpoint's own eval if it had not finished (R0 if a Ctrl-C abandoned it)
            done = {h["step"] for h in history}
            zero = {"gpu_hours": 0.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
            if 0 not in done and (step == 0 or os.path.isdir(path)):
                submit_eval(path, {"step": 0, "clock": zero})
            elif 0 not in done:
                print(
                    f"warning: no step-0 eval (R0) and {path} is not a directory to rerun it from"
                )
            if step > 0 and is_eval_step(step) and step not in done:
                submit_eval(start_dir, {"step": step, "clock": dict(clock)})
        while step < args.steps:
            t0 = time.perf_counter()
            # ---- 1. rollouts: P groups with lag <= k, from the producer thread (rank 0), to every rank
            payload = [None]  # stays None when a stop abandons the step
            batch = rank0_call(next_batch)  # the other ranks poll meanwhile
            if master and batch is not None:
                m = dict(batch.metrics)
                groups, m["gen/nonfinite_logp"] = drop_nonfinite_logp(batch.groups)
                kept = [
                    g
                    for g in groups
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
            if payload[0] is None:  # every rank: checkpoint the last completed step, stop
                stopped = True
                save(stopping=True)
                print(
                    f"[rank {rank}] stopped at step {step}; resume with --resume {run_dir}",
                    flush=True,
                )
                break
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
            # ---- 3. in-flight weight update: full weights to the sampler, version = step; at an
            # eval step a snapshot of them goes to the eval engine first (never waited for, unless
            # max_evals_pending evals are still running: evals slower than eval_every steps)
            t2 = time.perf_counter()
            tag = {"step": step}  # the eval's; its clock is this step's, below
            evaluating = is_eval_step(step) and await_evals(
                lambda pending: len(pending) < pipe.max_evals_pending,
                "room in the eval queue (evals are slower than --eval-every steps)",
                count=False,
            )
            t3 = time.perf_counter()
            snapshot = None  # every rank or none: under NCCL, writing it is a collective
            if evaluating:
                snapshot = functools.partial(submit_eval, tag=tag) if master else lambda d: None
            push_weights(step, snapshot)
            if master:
                m.update(
                    m_train,
                    **{
                        "train/lr": lr,
                        "time/update_s": t2 - t1,
                        "time/eval_wait_s": t3 - t2,
                        "time/publish_s": time.perf_counter() - t3,
                    },
                )
            # ---- 4. compute clock (the eval engine's devices count: it runs meanwhile), log, checkpoint
            dt = time.perf_counter() - t0
            if master:
                clock["gpu_hours"] += dt * devices / 3600
                clock["gen_tokens"] += m["gen/tokens"]
                clock["train_tokens"] += m_train["train/tokens"]
                clock["flops"] += (
                    2 * n_params * m["gen/tokens"] + 6 * n_params * m_train["train/tokens"]
                )
                m["time/step_s"] = dt
                m["eval/pending"] = len(pipe.evals_pending())
                tag["clock"] = dict(clock)
            log(m if master else {})
            if master:
                log_evals()  # the evals finished meanwhile, with their live fit
            stop_now = (
                all_reduce(torch.tensor([float(stop["requested"])]), dist.ReduceOp.MAX).item() > 0
            )
            if (args.save_every and step % args.save_every == 0) or step == args.steps or stop_now:
                save(stopping=stop_now)
            if stop_now:
                stopped = True
                print(
                    f"[rank {rank}] stopped at step {step}; resume with --resume {run_dir}",
                    flush=True,
                )
                break
        # ---- the run's curve, fit on its first half (§5), and a Hugging Face export vLLM and transformers load
        # (a resumed finished run waits for its evals too); a stop meanwhile leaves the fit to --resume
        done = step == args.steps and not stopped
        done = done and await_evals(lambda pending: not pending, "the last evals")
        if master and done:
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
    try:
        main(ARGS)
    except BadInput as e:  # one line, no traceback, exit 1 (2 for flags, from config.cli above)
        config.exit_with(e)
    except (
        KeyboardInterrupt
    ):  # before the step loop installs its handler: nothing ran, nothing to save
        print("\ntrain.py: interrupted while starting up, before the first step", file=sys.stderr)
        sys.exit(130)
