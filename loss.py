"""ScaleRL's loss math: fp32-head token log-probs, advantages, aggregation weights, and the CISPO
/ GSPO / DAPO / GRPO losses.

Implements arXiv 2510.13786 §3.2 and §4: the fp32 LM head (§3.2, Fig 5b), group-centred
advantages with batch / prompt / no normalization (§3.2, A.9 Fig 14b), prompt / sample / token
loss aggregation (§3.2, A.9 Fig 14a, Eq. 8) and the four losses (CISPO Eq. 4 and A.17.2, GSPO
A.17.3, DAPO / GRPO A.2). Pure: tensors in, tensors out. One training step in train.py calls
group_advantages, aggregation_weights and check_values once on the whole batch, then per
micro-batch token_logprobs (inside train.Policy) -> policy_loss -> backward. Exercised by
`python -m pytest tests/test_loss.py` and `python bench/logprobs.py`.

Where this departs from the paper, and why:
1. GSPO's sequence ratio is length-normalized, exp(mean over valid tokens of log rho) (GSPO, arXiv
   2507.18071). The paper writes the ratio without the 1/|y| exponent, but its 1e-3 clip widths
   only make sense normalized.
2. No epsilon is added to an advantage std (the paper writes std + eps). A std below 1e-6 counts as
   zero and those advantages are exactly 0, so float residue of a zero-variance group is never
   blown up to unit size. Both stds are population stds (the paper does not say which).
3. `grpo` and `dapo` share one clipped surrogate. GRPO's symmetric eps, sample aggregation and
   prompt-level normalization are the caller's choices of eps_high, agg and norm (A.2, Eqs. 7-8).
4. P and S in the aggregation weights count only groups / samples with a valid token (the paper's
   batch-level 1/P is inferred from its prose, and an empty completion has no 1/|y| term).
5. GSPO takes sample aggregation only. GSPO's objective (A.17.3) averages one clipped term per
   sequence; policy_loss weighs a sequence by the sum of its token weights, which is that 1/S under
   --agg sample but the sequence's length share under prompt or token aggregation, so
   config.validate refuses --loss gspo with another --agg.
"""

import torch

# a group std below this is float residue of a zero-variance group, not signal (departure 2); the
# zero-variance filter (filters.py) uses the same floor
STD_FLOOR = 1e-6


class _FP32HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T / temperature)[targets] in fp32, `chunk_size` rows at a time.

    logp_n depends only on row n, so d logp_n / d hidden_n = (W[t_n] - softmax_n @ W) / temperature
    is formed in forward as one (N, H) tensor and backward just scales it by the incoming gradient:
    the frozen-head path does the same two matmuls as the naive one. The weight gradient needs the
    softmax again, so backward recomputes each chunk's logits from the saved log-partition. The
    largest temporary is one (chunk, V) fp32 block. The two fp32 heads (fp32 or bf16 / fp16
    operands) are token_logprobs'; the bf16-operand one measured on an H200 at N 16k, V 152k, H 4k:
    |d logp| 3.3e-5 vs float64, against 6.2e-6 for the exact path, 9x faster (issue 11).
    """

    @staticmethod
    def forward(
        ctx, hidden, weight, targets, temperature, chunk_size, need_dh, need_dw, head_dtype
    ):
        low = _low_precision_operands(hidden, weight, head_dtype)
        w32 = None if low else weight.float()  # (V, H); no copy for an fp32 head
        w_head = w32 if head_dtype == torch.float32 else weight.to(head_dtype)  # (V, H) operand
        N, H = hidden.shape
        logp = torch.empty(N, dtype=torch.float32, device=hidden.device)  # (N,)
        lse = torch.empty_like(logp)  # (N,) log-partition, reused by backward
        dlogp_dh = torch.empty(N, H, dtype=torch.float32, device=hidden.device) if need_dh else None
        for s in range(0, N, chunk_size):
            e = min(s + chunk_size, N)
            t = targets[s:e]  # (c,)
            h = hidden[s:e] if low else hidden[s:e].float()  # (c, H)
            # (c, V) fp32 logits; temperature divides logits, not log-probs
            logits = (_mm_f32(h, weight.T) if low else _matmul(h, w_head)).div_(temperature)
            picked = logits.gather(1, t[:, None])[:, 0]  # (c,)
            m = logits.amax(1, keepdim=True)  # (c, 1)
            probs = logits.sub_(m).exp_()  # (c, V) unnormalized, in place: one (c, V) buffer
            z = probs.sum(1, keepdim=True)  # (c, 1)
            lse[s:e] = (z.log() + m)[:, 0]
            logp[s:e] = picked - lse[s:e]
            if need_dh and low:  # softmax rounded to the operands' dtype, the product in fp32
                sm_w = _mm_f32(probs.div_(z).to(weight.dtype), weight)  # (c, H)
                dlogp_dh[s:e] = (weight[t].float() - sm_w).div_(temperature)
            elif need_dh:
                dlogp_dh[s:e] = (w32[t] - probs.div_(z) @ w32).div_(temperature)  # (c, H)
            del logits, probs  # free this block before the next matmul allocates one
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        ctx.need_dh = need_dh
        ctx.need_dw = need_dw
        ctx.head_dtype = head_dtype
        ctx.low = low
        ctx.save_for_backward(hidden, weight, targets, lse, dlogp_dh)
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # g (N,) upstream gradient of logp
        hidden, weight, targets, lse, dlogp_dh = ctx.saved_tensors
        T = ctx.temperature
        g = g.float()
        low = ctx.low
        grad_h = (g[:, None] * dlogp_dh).to(hidden.dtype) if ctx.need_dh else None  # (N, H)
        grad_w = None
        if ctx.need_dw:
            w32 = None if low else weight.float()  # (V, H)
            w_head = w32 if ctx.head_dtype == torch.float32 else weight.to(ctx.head_dtype)
            gw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)  # (V, H)
            for s in range(0, hidden.shape[0], ctx.chunk_size):
                e = min(s + ctx.chunk_size, hidden.shape[0])
                h = hidden[s:e] if low else hidden[s:e].float()  # (c, H)
                t, gs = targets[s:e], g[s:e, None] / T  # (c,), (c, 1)
                logits = _mm_f32(h, weight.T) if low else _matmul(h, w_head)  # (c, V) fp32
                # d logp / d logits = (onehot(t) - softmax) / T, in place in the recomputed logits
                dlogits = logits.div_(T).sub_(lse[s:e, None]).exp_().mul_(-gs)  # (c, V)
                dlogits.scatter_add_(1, t[:, None], gs)
                if low:
                    gw += _mm_f32(dlogits.to(weight.dtype).T, h)
                else:
                    gw.addmm_(dlogits.T, h)
                del logits, dlogits  # free this block before the next matmul allocates one
            grad_w = gw.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None, None


def _low_precision_operands(hidden, weight, head_dtype):
    """True when an fp32 head gets bf16 / fp16 hidden and weight of one dtype (tensor cores)."""
    low = hidden.dtype == weight.dtype and hidden.dtype in (torch.bfloat16, torch.float16)
    return head_dtype == torch.float32 and low


def _mm_f32(a, b):
    """(n, k) @ (k, m) -> (n, m) fp32 from bf16 / fp16 operands, accumulated in fp32: the one
    device-specific call of the head. CUDA: one tensor-core GEMM with fp32 output, `torch.mm(a, b,
    out_dtype=torch.float32)` (CUDA only in torch 2.11-2.13; fp32 out from fp16 / bf16 in).
    Elsewhere: the product of the exactly upcast operands; CPU tests run the rest of the path."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _matmul(h, w_head):
    """(c, V) fp32 logits of fp32 rows h (c, H): in fp32, or rounded through w_head's dtype (the
    loo-fp32 ablation)."""
    if w_head.dtype == torch.float32:
        return h @ w_head.T
    return (h.to(w_head.dtype) @ w_head.T).float()


def token_logprobs(
    hidden, weight, targets, temperature=1.0, chunk_size=1024, head_dtype=torch.float32
):
    """Log-probabilities of `targets` under an fp32 LM head, without ever forming an (N, V) tensor
    (§3.2, Fig 5b).

    hidden (N, H) and weight (V, H) in any float dtype, targets (N,) integer ids in [0, V). Returns
    logp (N,) float32 = log_softmax(hidden @ weight.T / temperature)[targets], with fp32 logits,
    `chunk_size` rows at a time. fp32 hidden and weight: every product in fp32. bf16 (or fp16)
    hidden and weight of one dtype, as FSDP2 mixed precision gives them: the logits are the exact
    product of the operands accumulated in fp32 (tensor cores on CUDA, fp32 output), and the
    gradient products take the softmax rounded to that dtype, accumulated in fp32. Contract:
    log-probs within 5e-5 of the fp32 path on the same bf16 values (tests/test_loss.py on CPU,
    bench/gpu_trainer.py on CUDA). Gradients flow to hidden and weight in their own dtypes; a frozen
    weight (requires_grad False) costs no weight gradient. Memory beyond the inputs: one
    (chunk_size, V) fp32 block, (N, H) fp32 for the hidden gradient, and (V, H) fp32 for a trainable
    weight (and for an fp32 copy of a bf16 weight under head_dtype=bf16).
    head_dtype=torch.bfloat16 (or float16) rounds the logits to that dtype instead, then log-softmax
    in fp32: the paper's `loo-fp32` ablation (no FP32 head); the gradients stay as above.
    Raises ValueError on bad shapes or chunk_size < 1; TypeError on float or bool targets, or
    another head_dtype (temperature > 0: config.validate's --temperature rule). torch raises by
    itself on mixed devices and, on the CPU, on ids outside [0, V) (RuntimeError); on an
    accelerator such an id is a device-side assert, so train.check_batch checks the whole batch's
    ids once per step, on the CPU.
    """
    # each check stops what would pass silently: another head precision, extra targets never read,
    # float ids truncated by .long(), an unwritten logp (no chunk to run)
    if head_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"head_dtype must be float32, bfloat16 or float16; got {head_dtype}")
    shape = hidden.shape  # (N, H)
    if len(shape) != 2 or weight.shape[1:] != shape[1:] or targets.shape != shape[:1]:
        raise ValueError(
            f"hidden must be (N, H), weight (V, H) and targets (N,); got {tuple(shape)}, "
            f"{tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if targets.is_floating_point() or targets.dtype == torch.bool:
        raise TypeError(f"targets must be integer token ids; got {targets.dtype}")
    if int(chunk_size) < 1:
        raise ValueError(f"chunk_size must be >= 1; got {chunk_size}")
    grad_on = torch.is_grad_enabled()  # inside forward() grad mode is always off, so decide here
    need_dh = grad_on and hidden.requires_grad
    need_dw = grad_on and weight.requires_grad
    ids = targets.long()
    return _FP32HeadLogprobs.apply(
        hidden, weight, ids, float(temperature), int(chunk_size), need_dh, need_dw, head_dtype
    )


def group_advantages(rewards, group_ids, norm="batch"):
    """Group-centred advantages, normalized per batch, per prompt or not at all (§3.2, §4, A.9 Fig
    14b).

    rewards (S,) real, group_ids (S,) integer labels (any values; equal label = same prompt).
    Centres each reward by its group mean; "batch" divides by the population std of the centred
    values over all S samples passed in (ScaleRL, §4), "prompt" by the group's own population std
    (GRPO, Eq. 5), "none" leaves them centred (Dr. GRPO). A group whose std is below 1e-6 gets
    exactly 0; if the batch std is below 1e-6 every advantage is 0. Never NaN or inf. Returns (S,)
    float64 for float64 rewards, else float32.
    Raises ValueError on an unknown norm, an empty batch, mismatched shapes or non-finite rewards.
    """
    if norm not in ("batch", "prompt", "none"):
        raise ValueError(f"norm must be 'batch', 'prompt' or 'none'; got {norm!r}")
    if rewards.dim() != 1 or rewards.numel() == 0 or group_ids.shape != rewards.shape:
        raise ValueError(
            f"rewards must be a non-empty (S,) and group_ids must match it; got "
            f"{tuple(rewards.shape)} and {tuple(group_ids.shape)}"
        )
    if group_ids.is_floating_point():
        raise TypeError(f"group_ids must be integers; got {group_ids.dtype}")
    r = rewards.double()  # (S,) float64: a group of equal float32 rewards centres to exactly 0
    if not torch.isfinite(r).all():  # once per step, on the CPU (train.train_step)
        raise ValueError("rewards contain NaN or inf")
    _, gid = torch.unique(group_ids, return_inverse=True)  # (S,) group index in 0..P-1
    count = torch.bincount(gid).double()  # (P,) samples in each group
    mean = torch.zeros_like(count).index_add_(0, gid, r) / count  # (P,) group mean reward
    centred = r - mean[gid]  # (S,)
    var_g = torch.zeros_like(count).index_add_(0, gid, centred**2) / count  # (P,) pop. variance
    std_g = var_g.sqrt()[gid]  # (S,) the population std of the sample's group
    adv = torch.where(std_g < STD_FLOOR, 0.0, centred)  # zero-variance group: exactly 0
    if norm == "prompt":
        adv = adv / std_g.clamp_min(STD_FLOOR)  # Eq. 5 without + eps; zeroed groups stay 0
    elif norm == "batch":
        std_b = adv.std(correction=0)  # population std over the S samples (§4: std of all A_i)
        adv = adv / std_b if std_b >= STD_FLOOR else torch.zeros_like(adv)
    return adv.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def aggregation_weights(mask, group_ids, agg="prompt"):
    """Per-token weights whose weighted sum of per-token terms is the loss (§3.2, A.9 Fig 14a,
    Eq. 8).

    mask (S, T) bool (True on valid completion tokens), group_ids (S,) integer labels. Returns
    (S, T) float32, 0 where mask is False: "prompt" = 1 / (P * tokens in the sample's group)
    (ScaleRL, DAPO Eq. 8), "sample" = 1 / (S * tokens in the sample) (GRPO Eq. 7), "token" =
    1 / (tokens in the batch). P and S count groups and samples with at least one valid token, so
    the weights sum to 1 (or are all 0 if no token is valid). Computed once on the whole batch:
    micro-batches and ranks sum their share and get the full-batch loss.
    Raises ValueError / TypeError on an unknown agg or bad shapes / dtypes.
    """
    if agg not in ("prompt", "sample", "token"):
        raise ValueError(f"agg must be 'prompt', 'sample' or 'token'; got {agg!r}")
    if mask.dim() != 2 or group_ids.shape != mask.shape[:1]:
        raise ValueError(
            f"need mask (S, T), group_ids (S,); got {tuple(mask.shape)} and "
            f"{tuple(group_ids.shape)}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"mask must be bool; got {mask.dtype}")
    if group_ids.is_floating_point():
        raise TypeError(f"group_ids must be integers; got {group_ids.dtype}")
    lens = mask.sum(1).double()  # (S,) valid tokens per sample
    if agg == "token":
        denom = lens.sum().expand_as(lens)  # (S,) every valid token in the batch
    elif agg == "sample":
        denom = (lens > 0).sum() * lens  # (S,) samples with a token x this sample's tokens
    else:
        _, gid = torch.unique(group_ids, return_inverse=True)  # (S,) group index in 0..P-1
        P = int(gid.max()) + 1
        group_tokens = torch.zeros(P, dtype=torch.float64).index_add_(0, gid, lens)  # (P,)
        # (S,) groups with a token x tokens in this sample's group
        denom = (group_tokens > 0).sum() * group_tokens[gid]
    return torch.where(mask, 1.0 / denom.clamp_min(1)[:, None], 0.0).float()  # (S, T)


def check_values(old_logp: torch.Tensor, weights: torch.Tensor) -> None:
    """The value contract of `policy_loss`, checked once per batch in one host sync
    (train.check_batch), never per micro-batch: weights (S, T) >= 0, old_logp (S, T) finite where
    weight > 0. Raises ValueError on a negative weight, or naming the first sample s and token t
    where old_logp is NaN or +-inf on a valid token: a sampler fault that would make the loss NaN
    or, under CISPO's cap, pass silently as rho = cap (filters.drop_nonfinite_logp drops such
    samples before the batch is formed)."""
    bad = (weights > 0) & ~torch.isfinite(old_logp)  # (S, T)
    negative, nonfinite = torch.stack([(weights < 0).any(), bad.any()]).tolist()  # one host sync
    if negative:
        raise ValueError("weights must be >= 0")
    if nonfinite:
        s, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"old_logp is {old_logp[s, t].item()} at sample {s}, token {t} (a valid token): the "
            "sampler's behaviour log-probs must be finite; drop that sample before the loss"
        )


def clipped_surrogate(ratio, A, lo, hi):
    """PPO's clipped surrogate min(ratio * A, clip(ratio, lo, hi) * A) (DAPO Eq. 8, GSPO A.17.3)
    and clipped, bool: where the constant branch is the minimum, which zeroes the gradient (A > 0
    above hi, A < 0 below lo). ratio and A broadcast: (S, T) and (S, 1), or (S,) and (S,)."""
    term = torch.minimum(ratio * A, ratio.clamp(lo, hi) * A)
    r = ratio.detach()
    return term, ((A > 0) & (r > hi)) | ((A < 0) & (r < lo))


def rho_stats(rho, valid, clipped) -> dict:
    """policy_loss's metrics from rho, valid and clipped (S, T), 0-dim float64, detached. Sums over
    valid tokens, to add over micro-batches and ranks: n_tokens; clipped, tokens whose ratio is
    truncated (CISPO: rho > cap) or whose clipped branch is active (gradient zeroed; GSPO: every
    token of a clipped sequence); rho_sum. To reduce by min / max: rho_min, rho_max (+inf, -inf
    with no valid token)."""
    with torch.no_grad():
        r = rho.detach().double()  # (S, T)
        return {
            "n_tokens": valid.sum().double(),
            "clipped": (clipped & valid).sum().double(),
            "rho_sum": torch.where(valid, r, 0.0).sum(),
            "rho_min": torch.where(valid, r, float("inf")).amin(),
            "rho_max": torch.where(valid, r, float("-inf")).amax(),
        }


def policy_loss(
    logp,
    old_logp,
    adv,
    weights,
    loss_type="cispo",
    *,
    eps_low=0.2,
    eps_high=0.28,
    cispo_cap=4.0,
    gspo_eps_low=3e-3,
    gspo_eps_high=5e-3,
):
    """Policy-gradient loss (to minimize) and its metrics: CISPO (Eq. 4, §4), GSPO (A.17.3), DAPO /
    GRPO (A.2). rho = exp(logp - old_logp) always measures the sampler, never a recompute (Eq. 2).

    logp (S, T) float, the trainer's log-probs with gradient; old_logp (S, T) float, the sampler's
    behaviour log-probs (a constant); adv (S,); weights (S, T) float from aggregation_weights (>= 0;
    a token is valid where weight > 0; padding may hold any value, NaN included, in logp, old_logp).
    Per-token term: cispo sg(min(rho, cispo_cap)) * A * logp, no lower bound; dapo / grpo
    min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A); gspo the same clip (gspo eps) of one
    ratio per sequence, exp(mean log rho over its valid tokens), weighted by its summed weights
    (1/S with sample aggregation weights: GSPO's mean over sequences, departure 5).
    Returns loss = -sum(weights * term), 0-dim in logp's dtype, and metrics (rho_stats): n_tokens,
    clipped, rho_sum, rho_min, rho_max. Raises ValueError / TypeError on an unknown loss_type, bad
    shapes, non-float weights, or an old_logp that requires grad or shares memory with logp: checks
    that read no value, so none syncs the host. The values (check_values) are checked once per
    batch by train.check_batch; clip widths and cap by config.validate.
    """
    if loss_type not in ("cispo", "gspo", "dapo", "grpo"):
        raise ValueError(f"unknown loss_type {loss_type!r}")
    full = tuple(logp.shape)  # (S, T)
    shapes = [full, tuple(old_logp.shape), tuple(weights.shape), tuple(adv.shape)]
    # adv (1,) or weights (1, T) would broadcast silently
    if logp.dim() != 2 or logp.numel() == 0 or shapes != [full, full, full, full[:1]]:
        raise ValueError(
            f"need non-empty logp, old_logp, weights (S, T) and adv (S,); got {shapes}"
        )
    # silent otherwise: a mask passed as weights, a gradient through old_logp, rho = 1 everywhere
    if not weights.is_floating_point():
        raise TypeError(f"weights must be float; got {weights.dtype}")
    if old_logp.requires_grad:
        raise ValueError("old_logp requires grad: pass the sampler's log-probs")
    if old_logp.untyped_storage().data_ptr() == logp.untyped_storage().data_ptr():
        raise ValueError("old_logp shares memory with logp (rho = 1): pass the sampler's log-probs")
    valid = weights > 0  # (S, T)
    lp = torch.where(valid, logp, 0.0)  # (S, T) padding zeroed: it never reaches loss or gradients
    log_rho = lp - torch.where(valid, old_logp, 0.0)  # (S, T)
    rho = log_rho.exp()  # (S, T) token IS ratio against the sampler, Eq. 2
    A = adv.to(logp.dtype)[:, None]  # (S, 1)
    if loss_type == "cispo":
        term = rho.detach().clamp(max=cispo_cap) * A * lp  # (S, T) Eq. 4: sg(min(rho, cap)) A logp
        loss = -(weights * term).sum()
        clipped = rho.detach() > cispo_cap  # (S, T)
    elif loss_type == "gspo":
        s = (log_rho.sum(1) / valid.sum(1).clamp_min(1)).exp()  # (S,) length-normalized ratio
        term, seq_clipped = clipped_surrogate(s, A[:, 0], 1 - gspo_eps_low, 1 + gspo_eps_high)
        # a sequence weighs the sum of its token weights: 1/S under sample aggregation (departure 5)
        loss = -(weights.sum(1) * term).sum()
        clipped = seq_clipped[:, None].expand_as(valid)  # (S, T)
    else:  # dapo / grpo: Eq. 8 (Eq. 7 with eps_low = eps_high)
        term, clipped = clipped_surrogate(rho, A, 1 - eps_low, 1 + eps_high)  # (S, T)
        loss = -(weights * term).sum()
    return loss, rho_stats(rho, valid, clipped)
