"""ScaleRL end to end: the RL loop of arXiv 2510.13786 (§4) and its policy update, composed from
the pure modules.

    python train.py                                       # tiny model, CPU, 12-16 min, no download
    torchrun --nproc_per_node 2 train.py --steps 20       # the same, FSDP2 over 2 CPU ranks (gloo)
    torchrun --nproc_per_node 4 train.py --model qwen3-8b # 8 GPUs: 4 train, 3 sample, 1 eval
    python train.py --recipe loo-dapo                     # one of the paper's compared recipes
    python train.py --resume runs/NAME                    # continue a stopped run where it stopped
    python fit.py runs/NAME/metrics.jsonl --fit-until X   # the sigmoid fit of a finished run
    torchrun --nproc_per_node 2 tests/dist_step.py MODEL_DIR BATCH.pt OUT.pt  # one train_step
    python bench/gpu_trainer.py --only train              # its speed and memory on one GPU
    # Ctrl-C: finish or abandon the step, checkpoint, exit 0 (twice: quit at once);
    # a bad flag: one line, exit 2

One step (the asynchronous setup of §2 and A.3, PipelineRL-k of §3.1): the pipeline's producer
thread samples groups with vLLM (forced interruptions, in-flight weight updates) and grades them;
the trainer takes a batch of P groups with lag <= k, drops rollouts with a non-finite behaviour
log-prob and zero-variance groups, records pass rates for No-Positive-Resampling, adds DAPO's
length penalty if a recipe asks (get_batch, filters.py), computes batch-normalized advantages and
prompt-level aggregation weights on the whole batch, runs fp32-head log-probs -> CISPO -> backward
per micro-batch on every rank, steps AdamW (train_step), and hands the new weights to the sampler
(version = step). The compute clock advances every step. Every `eval_every` steps a snapshot of
the new weights goes to the eval engine, whose held-out pass rate is logged (with the live sigmoid
fit of the curve so far) when it finishes; a checkpoint every `save_every`. Flags, presets and
recipes: config.py; inputs: infra/loading.py; process group, placement, run directory:
infra/launch.py; the vLLM side: infra/generator.py; logs, evals and checkpoints: infra/records.py,
infra/evals.py and infra/checkpoint.py. Here: the policy (Policy, shard, build), the batch
(collate, get_batch), the micro-batches (plan_microbatches, microbatch) and the update
(train_step).

Where it departs from the paper, and why:
1. Scale: the `tiny` preset is a 0.43M-parameter Qwen3 on a synthetic task (tasks/arith.py
   `arith`) with 10^4x smaller budgets, so the whole recipe runs on a laptop; the GPU presets keep
   the paper's lengths and batch.
2. Compute is counted in device-hours (`gpu_hours`): wall time x distinct devices (trainer and
   generator GPUs; on CPU the machine counts as one device). The paper counts GB200-hours.
3. Truncated rollouts stay in the batch with the reward the grader gives them (usually 0); the
   paper says only that they shrink the "effective batch" (A.15).
4. Gradients are clipped at `max_grad_norm` (default 1.0); the paper does not say whether it clips.
5. The LR warmup is `warmup_steps` (100 in the paper, shorter for the tiny preset's few hundred
   steps).
6. Micro-batches are packed into one row where the attention kernel is varlen (flash attention),
   else length-sorted and padded: a memory and speed choice, the same loss either way.
7. A rollout whose behaviour log-prob is NaN or +-inf on a policy token (a sampler fault the paper
   does not discuss) leaves the batch before advantages are computed, counted and named.
"""

import sys

import config

# flags first: --help and a bad flag answer in ~1 s, before torch and vLLM load
if __name__ == "__main__":
    ARGS = config.cli()

import math
import os
import shutil
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

import filters
import loss
from config import Args, BadInput
from infra import checkpoint, fit_report, launch, loading, placement
from infra.launch import rank0_call
from tasks import math_reward


class Policy(torch.nn.Module):
    """The causal LM as the loss sees it: forward returns the log-probs of chosen tokens, (N,)
    float32, the head in fp32 (§3.2; from bf16 operands at tensor-core speed under FSDP2 mixed
    precision on GPU) or, with fp32_head=False, in the model's compute dtype. The head runs inside
    this module's forward, so FSDP2 gathers and reduces its weight like any other. It is the
    model's own: a head that scales its logits by a config value (Cohere, Granite:
    loading.logit_scale) gets the same factor; one it cannot reproduce raises ValueError here
    (loading.load_model refuses it first, in one line). routing_replay: an MoE model's routers
    take the experts forward's `routes` give (loading.replay_routing, --routing-replay)."""

    def __init__(self, lm, fp32_head: bool, routing_replay: bool = False):
        super().__init__()
        self.lm, self.fp32_head = lm, fp32_head
        self.logit_scale = loading.logit_scale(lm)
        # the routes of the last forward: kept until the next, for activation checkpointing's
        # recompute in backward
        self.routes = None
        if routing_replay:
            loading.replay_routing(lm, lambda: self.routes)

    def forward(
        self,
        input_ids,
        attention_mask,
        position_ids,
        pred,
        targets,
        temperature: float,
        routes=None,
        router_aux: bool = False,
    ):
        """input_ids (R, C): R right-padded rows with attention_mask (R, C) (None when no row is
        padded: causal attention, SDPA's flash kernel on GPU), or one packed row (R = 1) of several
        sequences with position_ids (1, C) restarting at 0 for each and no mask. pred (N,) long:
        flat indices into the R * C positions whose hidden state predicts targets (N,) long.
        routes (R * C, layers, k) int16 or None: with routing replay, the experts of each position
        (-1: the trainer's own). Returns logp (N,) float32; with router_aux (an MoE:
        loading.router_experts), (logp, aux): aux the 0-dim load-balancing loss of every layer's
        router over the real tokens (transformers' load_balancing_loss_func, Switch Transformer
        eqs. 4-6, as Qwen3MoeForCausalLM computes it with output_router_logits)."""
        self.routes = routes
        decoder = self.lm.get_decoder()
        out = decoder(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            use_cache=False,
            **({"output_router_logits": True} if router_aux else {}),
        )
        hidden = out.last_hidden_state  # (R, C, H)
        hidden = hidden.flatten(0, 1).index_select(0, pred)  # (N, H): only predicting positions
        weight = self.lm.get_output_embeddings().weight  # (V, H)
        head_dtype = torch.float32 if self.fp32_head else hidden.dtype
        # the model's logit scale s folded into the temperature: vLLM samples from
        # softmax(logits * s / T) = softmax(logits / (T / s)) (LogitsProcessor(scale), then T)
        t = temperature / self.logit_scale
        logp = loss.token_logprobs(hidden, weight, targets, t, head_dtype=head_dtype)
        if not router_aux:
            return logp
        experts, top_k = loading.router_experts(self.lm.config)
        # out.router_logits: one (R * C, experts) tensor per sparse layer
        aux = load_balancing_loss_func(out.router_logits, experts, top_k, attention_mask)
        return logp, aux


def shard(policy: Policy, device) -> None:
    """FSDP2 as in torchtitan: `fully_shard` each decoder layer (loading.decoder_layers: wherever
    the family keeps them), then the root; bf16 compute with fp32 gradient reduction on GPU, fp32
    throughout on CPU. Gradients are summed over ranks, not averaged (FSDP2's default): each rank's
    loss is its share of the full-batch loss."""
    kw = {}
    if device.type == "cuda":
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        kw["mp_policy"] = mp
    for module in [*loading.decoder_layers(policy.lm), policy]:  # the root last
        fully_shard(module, **kw)
        # sum over ranks: divide factor 1, reduced with a plain SUM (without force_sum FSDP2 uses
        # PREMUL_SUM(1 / factor), which gloo does not have; torch 2.13, tests/dist_step.py)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)


def build(lm, args: Args, device) -> tuple[Policy, torch.optim.Optimizer]:
    """The policy to train, from the fp32 master weights `lm`: activation checkpointing when asked,
    Policy (its LM head in fp32 with --fp32-head), FSDP2 (shard), and its AdamW. Returns (policy,
    optimizer)."""
    if args.activation_checkpointing:  # before fully_shard, as torchtitan applies it
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # train mode: HF checkpoints layers only while training; dropout is off in the model's
    # config (loading.without_dropout)
    policy = Policy(lm, args.fp32_head, args.routing_replay).train()
    # no policy.to(device) first: fully_shard moves one unit at a time to the mesh's device and
    # keeps only its shard (torch 2.13 _fsdp_init._move_states_to_device); a whole fp32 model moved
    # to GPU 0 first would stay cached there (~30 GiB for 8B)
    shard(policy, device)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the largest unit's unsharded transient (the embedding and head)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay
    )
    return policy, optimizer


def collate(groups, pad_id: int) -> dict:
    """Pad a batch of groups into the trainer's tensors (rank 0; broadcast to the others),
    right-padded with `pad_id` (masked): input_ids, attention_mask (long), mask (bool: the policy
    tokens of each completion) and old_logp (float32: the sampler's behaviour log-probs) are (S, T);
    rewards (float64) and group_ids (long: the group's place in `groups`) are (S,). Rollouts that
    carry routes (--routing-replay) add routes (S, T, layers, k) int16, -1 where unknown."""
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
    group_ids = torch.tensor([i for i, *_ in comps], dtype=torch.long)
    batch = dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        old_logp=old_logp,
        rewards=rewards,
        group_ids=group_ids,
    )
    routed = [c.routes for _, c, _ in comps if getattr(c, "routes", None) is not None]
    if routed:
        routes = torch.full((S, T, *routed[0].shape[1:]), -1, dtype=torch.int16)
        for s, (_, c, _) in enumerate(comps):
            if c.routes is not None:
                routes[s, : len(c.routes)] = torch.from_numpy(c.routes)
        batch["routes"] = routes
    return batch


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
    plan without communicating."""
    budget = args.max_tokens_per_microbatch
    max_rows = args.micro_batch_size
    load = [0] * world  # tokens given to each rank so far
    mine = [[] for _ in range(world)]  # each rank's samples, longest first
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world), key=lambda r: (load[r], r))
        load[r] += lengths[i]
        mine[r].append(i)
    plan = []
    for rows in mine:
        mbs = []
        cur = []  # the micro-batch being filled
        used = 0  # its tokens
        for i in rows:
            if pack:
                cost = used + lengths[i]
            else:  # longest first, so a padded micro-batch is as long as its first row
                longest = lengths[cur[0]] if cur else lengths[i]
                cost = (len(cur) + 1) * longest
            if cur and (cost > budget or len(cur) == max_rows):
                mbs.append(cur)
                cur = []
                used = 0
            cur.append(i)
            used += lengths[i]
        if cur:
            mbs.append(cur)
        plan.append(mbs)
    return plan


def microbatch(batch: dict, rows, width: int, pack: bool, adv, weights) -> dict:
    """One micro-batch's CPU tensors from a right-padded batch (collate): the model input
    (Policy.forward's arguments: padded rows cut to `width` columns, or packed into one row) and the
    loss layout (s, width): old_logp, weights (s, width), adv (s,), dst (N,) where each of the N
    log-probs goes in it, sample (N,) each token's batch row. A batch with routes (--routing-replay)
    gives routes too, (positions, layers, k) in the model input's flattened order, cut and packed as
    input_ids are (None in an empty micro-batch). rows None: an empty micro-batch, one zero-weight
    token, for a rank with fewer than the others (FSDP2 needs the same forward / backward calls on
    every rank)."""
    if rows is None:
        S = len(adv)  # the batch's rollouts: `sample` S points past every real one
        one = torch.ones(1, dtype=torch.long)
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
            routes=None,
        )
    idx = torch.tensor(rows)
    ids, mask = batch["input_ids"][idx, :width], batch["mask"][idx, :width]  # (s, width)
    real = batch["attention_mask"][idx, :width].bool()  # (s, width) prefix of each row
    r, t = mask.nonzero(as_tuple=True)  # completion tokens; t >= 1 (check_batch checked mask[:, 0])
    routes = batch.get("routes")
    if routes is not None:
        routes = routes[idx, :width]  # (s, width, layers, k): routes travel as input_ids do
    if pack:  # sequences back to back, each with its own positions
        lengths = real.sum(1)
        offset = lengths.cumsum(0) - lengths  # (s,) where each sequence starts in the row
        model = dict(
            input_ids=ids[real][None],
            attention_mask=None,
            position_ids=torch.arange(width).expand_as(ids)[real][None],
            routes=None if routes is None else routes[real],  # (tokens, layers, k)
        )
    else:
        offset = torch.arange(len(rows)) * width
        mask_or_none = None if real.all() else real.long()  # no mask: causal, SDPA's flash kernel
        flat = None if routes is None else routes.flatten(0, 1)  # (s * width, layers, k)
        model = dict(input_ids=ids, attention_mask=mask_or_none, position_ids=None, routes=flat)
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
    the log-probs of its completion tokens. With --router-aux-loss-coef c > 0 (an MoE) the loss
    adds c x the routers' load-balancing loss of the micro-batch (Policy.forward) weighted by its
    share of the batch's aggregation weights (w.sum(), which sums to 1 over the batch: an empty
    micro-batch adds nothing), so that micro-batches and ranks sum to one batch-level term."""
    inputs = (mb["input_ids"], mb["attention_mask"], mb["position_ids"], mb["pred"], mb["targets"])
    inputs += (args.temperature, mb.get("routes"))
    w = mb["weights"]  # (s, width)
    if args.router_aux_loss_coef:
        logp, aux = policy(*inputs, router_aux=True)  # (N,) float32, 0-dim
    else:
        logp = policy(*inputs)  # (N,) float32
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
        gspo_eps_low=args.gspo_eps_low,
        gspo_eps_high=args.gspo_eps_high,
    )
    if args.router_aux_loss_coef:
        l = l + args.router_aux_loss_coef * w.sum() * aux
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
    # the names of out's values, in the order of sums, then top, then the norm
    names = ("loss", "tokens", "clipped", "rho_sum", "neg_rho_min", "rho_max", "nonfinite", "norm")
    v = dict(zip(names, out, strict=True))
    n = max(v["tokens"], 1.0)  # valid tokens in the batch, all ranks
    metrics = {
        "train/loss": v["loss"],
        "train/grad_norm": v["norm"],
        "train/tokens": int(v["tokens"]),
        "train/clip_frac": v["clipped"] / n,
        "train/rho_mean": v["rho_sum"] / n,
        "train/rho_min": -v["neg_rho_min"],
        "train/rho_max": v["rho_max"],
    }
    return metrics, not v["nonfinite"]


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
    pack = varlen_attention(policy.lm)
    plan = plan_microbatches(lengths.tolist(), world, args, pack)
    # FSDP2: every rank runs the same number of forward / backward calls; short ranks add empty ones
    mine = plan[rank] + [None] * (max(map(len, plan)) - len(plan[rank]))
    f64 = dict(dtype=torch.float64, device=device)
    sums = torch.zeros(4, **f64)  # loss, valid tokens, clipped tokens, rho over valid tokens
    extremes = torch.full((2,), -math.inf, **f64)  # -rho_min, rho_max
    finite = torch.ones((), dtype=torch.bool, device=device)  # torchtitan's loss_is_finite
    records = []  # per micro-batch, to name the sample if the step fails
    for rows in mine:
        # each micro-batch cut to its own longest row (an empty one ignores the width)
        width = T if rows is None else int(lengths[rows].max())
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


def get_batch(args: Args, step: int, pipe, pool, pad_id: int, log) -> tuple[dict | None, dict]:
    """Phase 1 of a step, every rank (a collective): rank 0 takes the pipeline's next batch of P
    groups with lag <= k (its producer thread sampled and graded them meanwhile), then
    1. drops rollouts with a non-finite behaviour log-prob (filters.drop_nonfinite_logp),
    2. drops zero-variance groups (--zero-var-filter, §3.2),
    3. records every scored group's pass rate for No-Positive-Resampling (§3.2),
    4. adds DAPO's overlong penalty to correct rollouts (--length-penalty, A.10),
    5. pads what is left into the trainer's tensors (collate) and logs the batch's first
       rollouts to samples.jsonl.
    Every rank gets the padded batch. Returns (batch, metrics): batch None on every rank when a
    stop (Ctrl-C) abandoned the step; metrics rank 0's gen/*, filter/* and train/reward ({} on the
    other ranks). Raises filters.AllRetired on every rank once No-Positive-Resampling has retired
    every training prompt and no batch is left."""
    from infra import generator  # loaded by main already (it imports vLLM): a name lookup here

    m = {}
    payload = [None]  # stays None when a stop abandons the step
    # rank 0 waits for the groups while the other ranks poll (rank0_call); None: a stop meanwhile
    batch = rank0_call(lambda: generator.next_batch(pipe, step))
    if isinstance(batch, str):  # rank 0: every training prompt retired, said why
        payload = [batch]
    elif batch is not None:  # rank 0
        m = dict(batch.metrics)
        # math-verify's graded / timed-out counts since the last step
        m.update(math_reward.pop_stats())
        # 1. a NaN or inf behaviour log-prob is a sampler fault: its rollout leaves the batch
        groups, m["gen/nonfinite_logp"] = filters.drop_nonfinite_logp(batch.groups)
        # 2. all correct or all wrong: zero advantage everywhere, so no gradient, only noise
        if args.zero_var_filter:
            groups = [g for g in groups if filters.has_variance(g)]
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
            # 0, then a ramp to -1 over the last answer_budget tokens the sampler allows
            max_len = args.think_budget[1] + args.answer_budget
            groups = filters.dapo_length_penalty(
                groups, max_len=max_len, cache_len=args.answer_budget
            )
        # 5. (S, T) right-padded tensors: S rollouts, T the longest prompt + completion
        payload = [collate(groups, pad_id)]
        log.train_samples(step + 1, batch.groups)
    # every rank holds the whole batch, so each computes the same micro-batch plan
    dist.broadcast_object_list(payload)
    if isinstance(payload[0], str):
        raise filters.AllRetired(payload[0])
    return payload[0], m


def restore(args: Args, run_dir: str, policy, optimizer, pool, master: bool) -> dict:
    """The run's state at its start: step 0, a zero compute clock and no evals; on --resume the
    checkpoint's, with the weights, optimizer and prompt pool restored in place and metrics.jsonl
    and samples.jsonl cut back to it (checkpoint.resume_logs: an eval still running at the
    checkpoint that finished after it stays, with its place in the history; one that never finished
    is said lost, unless RunLog.submit_start_evals runs it again: R0 and the checkpoint's own).
    Returns {"step", "clock", "history", "pool", "pending_evals"}."""
    if not args.resume:
        clock = {"gpu_hours": 0.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
        return {"step": 0, "clock": clock, "history": [], "pool": None}
    # a collective: every rank reads its own shards of the weights and the optimizer state
    state = checkpoint.load_checkpoint(run_dir, policy, optimizer)
    pool.load_state_dict(state["pool"])
    # the logs go back to the checkpoint: the steps after it run again
    if master:
        unfinished = checkpoint.resume_logs(run_dir, state)
        lost = [v for v in unfinished if v not in (0, state["step"])]
        if lost:
            print(
                f"warning: the eval(s) of step(s) {lost} were still running at the checkpoint of "
                f"step {state['step']} and never finished: lost (their weights are gone)",
                flush=True,
            )
    return state


def set_lr(optimizer, args: Args, step: int) -> float:
    """The learning rate of step `step` (0-based): linear warmup, then constant (A.3)."""
    # step + 1: the first step already trains at lr / warmup_steps, never at 0
    lr = args.lr * min(1.0, (step + 1) / max(args.warmup_steps, 1))
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr


def update(policy, optimizer, batch: dict, args: Args, device) -> dict:
    """Phase 2, every rank: one optimizer step on the batch (train_step: advantages,
    aggregation weights, fp32-head log-probs, CISPO, AdamW); none when every group had zero
    variance, as there is nothing to learn. Returns the step's train/* metrics."""
    # every rank sees the same (broadcast) batch, so all ranks skip the step together
    if len(batch["rewards"]) == 0:
        return {"train/tokens": 0}
    return train_step(policy, optimizer, batch, args, device)


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
    policy, optimizer = build(inputs.lm, args, device)
    state = restore(args, run_dir, policy, optimizer, pool, master)
    step = state["step"]
    # ---- the generator: rank 0 owns the engines (the pipeline's producer + vLLM, the eval
    # engine), started from the current weights; then the run's records (metrics.jsonl,
    # samples.jsonl, evals, checkpoints)
    # these two import vLLM (~10 s): only now that the inputs have loaded
    from infra import generator, records

    stop = {"requested": False}  # set by the first Ctrl-C (launch.on_stop_signal)
    if device.type == "cpu":  # from here vLLM's engines share the cores (the model is built)
        torch.set_num_threads(
            placement.cpu_trainer_threads(os.environ, len(os.sched_getaffinity(0)))
        )
    engines, push_weights, start_dir = generator.start(
        args, inputs, policy, pool, prompts, eval_prompts, run_dir, meta, world, device, step, stop
    )
    pipe = engines.pipe  # rank 0's; None elsewhere
    log = records.RunLog(args, run_dir, engines.eval_engine, eval_prompts, state, inputs)
    launch.on_stop_signal(stop)
    pad_id = loading.pad_token_id(inputs.tokenizer)  # masked: never trained
    stopped = False  # the loop ended on a stop (every rank alike)
    retired = False  # the loop ended with every training prompt retired: a finished run
    try:
        log.submit_start_evals(step, inputs.path, start_dir)
        while step < args.steps:
            t0 = time.perf_counter()
            # ---- 1. rollouts: P groups with lag <= k from the producer thread, filtered and padded
            try:
                batch, m = get_batch(args, step, pipe, pool, pad_id, log)
            except filters.AllRetired as e:  # nothing left to learn from: the run ends here
                if master:
                    print(f"step {step}: {e}; the run ends here", flush=True)
                retired = True
                break
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
            log.end_step(step, m, time.perf_counter() - t0, inputs.n_active, tag, pool.num_active)
            stop_now = launch.stop_agreed(stop)
            # no batch left to sample: on CPU the idle training engine joins the eval engine on
            # the queued evals, which the last checkpoint awaits
            if step == args.steps and not stop_now:
                engines.lend()
            # a checkpoint every save_every steps, at the last step, and before a stop
            if (args.save_every and step % args.save_every == 0) or step == args.steps or stop_now:
                log.save(step, policy, optimizer, pool, stopping=stop_now)
            if stop_now:
                stopped = True
                say_stopped(rank, step, run_dir)
                break
        # ---- the run's curve, fit whole and on its first half (§5), printed in words, and a HF
        # export that vLLM and transformers load (a resumed finished run waits for its evals too);
        # a stop meanwhile leaves the fit to --resume. A run whose prompts all retired ends as if
        # its step were the last: its weights exported and evaluated, then its checkpoint.
        ended = step == args.steps or retired
        if ended:
            final = os.path.join(run_dir, "final") if master else None
            checkpoint.export_pretrained(policy, inputs.tokenizer, final, None)  # as trained
            log.submit_last_eval(step, final)
            if not stopped:  # (a run whose prompts all retired: lent here)
                engines.lend()
        done = ended and not stopped
        done = done and log.await_evals(step, lambda pending: not pending, "the last evals")
        if retired:
            log.save(step, policy, optimizer, pool, stopping=not done)
        if master and done:
            print(
                fit_report.summary(run_dir, records.final_fit(run_dir, log.history, args.fit_from)),
                flush=True,
            )
    finally:
        engines.close()
        if start_dir is not None:
            shutil.rmtree(start_dir, ignore_errors=True)
        log.close()
        dist.destroy_process_group()
    if stop.get("failed"):  # rank 0: the engine failed the weight send; checkpointed above
        sys.exit(1)


if __name__ == "__main__":
    try:
        main(ARGS)
    except BadInput as e:  # one line, no traceback, exit 1 (2 for flags, from config.cli above)
        config.exit_with(e)
    except KeyboardInterrupt:  # before the step loop installs its handler: nothing to save
        print("\ntrain.py: interrupted while starting up, before the first step", file=sys.stderr)
        sys.exit(130)
