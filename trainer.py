"""The trainer: the policy under FSDP2 and one optimizer step on a batch of rollouts (§4).

    torchrun --nproc_per_node 2 tests/dist_step.py MODEL_DIR BATCH.pt OUT.pt  # one train_step
    python bench/gpu_trainer.py --only train   # its speed and memory on one GPU (--tiny: CPU)

Policy is the causal LM as the loss sees it (log-probs of the chosen tokens, fp32 LM head, §3.2);
shard applies FSDP2 as torchtitan does; collate pads a batch of groups into the trainer's tensors
(rank 0; broadcast); train_step computes advantages and aggregation weights on the whole batch,
runs each rank's share in token-budgeted micro-batches (plan_microbatches, microbatch) and steps
AdamW. train.py composes them.

Where it departs from the paper, and why:
1. Micro-batches are packed into one row where the attention kernel is varlen (flash attention),
   else length-sorted and padded: a memory and speed choice, the same loss either way.
2. Gradients are clipped at `max_grad_norm` (default 1.0); the paper does not say whether it clips.
"""

import math

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

import loss
from config import Args


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


def build(lm, args: Args, device) -> tuple[Policy, torch.optim.Optimizer]:
    """The policy to train, from the fp32 master weights `lm`: activation checkpointing when asked,
    Policy (its LM head in fp32 with --fp32-head), FSDP2 (shard), and its AdamW. Returns (policy,
    optimizer)."""
    if args.activation_checkpointing:  # before fully_shard, as torchtitan applies it
        lm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    # train mode: HF checkpoints layers only while training; the model has no dropout
    policy = Policy(lm, args.fp32_head).train()
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
    rewards (float64) and group_ids (long: the group's place in `groups`) are (S,)."""
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
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        old_logp=old_logp,
        rewards=rewards,
        group_ids=group_ids,
    )


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small CPU tensor over ranks (through the GPU under NCCL); returns it on the
    CPU."""
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


def train_step(policy, optimizer, batch: dict, args: Args, device) -> dict:
    """One optimizer step on a collated batch, the same on 1 or N ranks: advantages and aggregation
    weights are computed on the whole batch (§4), each rank runs its share of the samples in
    micro-batches (plan_microbatches: token-budgeted, trimmed to their own length, packed where the
    attention kernel is varlen), and the shares sum to the full-batch loss. Metrics and the
    finiteness flag stay on the device until one transfer after backward. Returns the step's
    metrics, reduced over ranks. Raises ValueError on a batch that is not right-padded or has token
    ids outside the vocabulary, and FloatingPointError on every rank, before the weights change, if
    a log-prob, the loss or the gradient norm is not finite."""
    rank, world = dist.get_rank(), dist.get_world_size()
    adv = loss.group_advantages(batch["rewards"], batch["group_ids"], norm=args.adv_norm)  # (S,)
    weights = loss.aggregation_weights(batch["mask"], batch["group_ids"], agg=args.agg)  # (S, T)
    # once per step on the CPU: checks that would each cost a host sync per micro-batch on a GPU
    S, T = batch["input_ids"].shape
    V = policy.lm.get_output_embeddings().weight.shape[0]
    lengths = batch["attention_mask"].sum(1)  # (S,)
    real = torch.arange(T) < lengths[:, None]  # (S, T)
    ids = batch["input_ids"][real]
    if not torch.equal(batch["attention_mask"].bool(), real) or (batch["mask"] & ~real).any():
        raise ValueError(
            "batch must be right-padded, with mask only on real tokens (collate's layout)"
        )
    if batch["mask"][:, 0].any():
        raise ValueError(
            "mask[:, 0] is True: the first token has no preceding position to predict it"
        )
    if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < V:
        raise ValueError(
            f"token ids must lie in [0, V={V}); got [{int(ids.min())}, {int(ids.max())}]"
        )
    loss.check_values(batch["old_logp"], weights)  # finite behaviour log-probs, weights >= 0
    pack = args.max_tokens_per_microbatch > 0 and varlen_attention(policy.lm)
    plan = plan_microbatches(lengths.tolist(), world, args, pack)
    # FSDP2: every rank runs the same number of forward / backward calls; short ranks add empty ones
    mine = plan[rank] + [None] * (max(map(len, plan)) - len(plan[rank]))
    cuda = device.type == "cuda"
    f64 = dict(dtype=torch.float64, device=device)
    sums = torch.zeros(4, **f64)  # loss, valid tokens, clipped tokens, rho summed over tokens
    ext = torch.full((2,), -math.inf, **f64)  # -rho_min, rho_max
    # first batch sample with a non-finite log-prob or loss, S if none (torchtitan's loss_is_finite)
    bad = torch.full((), S, dtype=torch.long, device=device)
    for rows in mine:
        trimmed = rows is not None and args.max_tokens_per_microbatch > 0
        width = int(lengths[rows].max()) if trimmed else T  # the legacy layout pads to the batch
        mb = microbatch(batch, rows, width, pack, adv, weights)
        # pinned memory: the copies to the GPU need not wait for it
        mb = {
            k: (v.pin_memory().to(device, non_blocking=True) if cuda else v) if v is not None else v
            for k, v in mb.items()
        }
        logp = policy(
            mb["input_ids"],
            mb["attention_mask"],
            mb["position_ids"],
            mb["pred"],
            mb["targets"],
            args.temperature,
        )  # (N,) float32
        w_mb = mb["weights"]  # (s, width)
        full = logp.new_zeros(w_mb.numel()).index_copy(0, mb["dst"], logp).view_as(w_mb)
        l, m = loss.policy_loss(
            full,
            mb["old_logp"],
            mb["adv"],
            w_mb,
            args.loss,
            eps_low=args.eps_low,
            eps_high=args.eps_high,
            cispo_cap=args.cispo_cap,
            validate=False,  # loss.check_values ran once above, on the whole batch
        )
        # a non-finite log-prob blames its sample; a non-finite loss the micro-batch's first sample
        blame = torch.cat([torch.where(torch.isfinite(logp), S, mb["sample"]), bad[None]]).amin()
        first = torch.cat([mb["sample"], bad[None]]).amin()
        bad = torch.where(torch.isfinite(l), blame, first)
        # FSDP2 averages gradients over ranks; each rank's loss is a share of a sum
        (l * world).backward()
        n = m["n_tokens"].double()
        sums += torch.stack([l.detach().double(), n, m["clip_frac"] * n, m["rho_mean"] * n])
        ext = torch.maximum(ext, torch.stack([-m["rho_min"], m["rho_max"]]).double())
    grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), args.max_grad_norm)
    grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
    dist.all_reduce(sums)
    top = torch.cat([ext, -bad.double()[None]])
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    out = torch.cat([sums, top, grad_norm.double()[None]]).tolist()  # the step's one host sync
    (loss_sum, n_tok, clipped, rho_sum, neg_rho_min, rho_max, neg_bad, grad_norm) = out
    if -neg_bad < S or not math.isfinite(loss_sum) or not math.isfinite(grad_norm):
        optimizer.zero_grad(set_to_none=True)
        s = int(-neg_bad)
        where = f"log-prob or loss in batch sample {s}" if s < S else "loss or gradient"
        raise FloatingPointError(
            f"non-finite {where} (loss {loss_sum:.4g}, grad norm {grad_norm:.4g})"
        )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    n = max(n_tok, 1.0)
    return {
        "train/loss": loss_sum,
        "train/grad_norm": grad_norm,
        "train/tokens": int(n_tok),
        "train/clip_frac": clipped / n,
        "train/rho_mean": rho_sum / n,
        "train/rho_min": -neg_rho_min,
        "train/rho_max": rho_max,
        "train/adv_abs_mean": adv.abs().mean().item(),
    }
