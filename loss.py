"""ScaleRL's loss math: fp32-head token log-probs, advantages, aggregation weights, CISPO / GSPO / DAPO / GRPO.

Implements arXiv 2510.13786 §3.2 and §4 (digest: PAPER.md sections 1-3 and 5): the fp32 LM head (§3.2, Fig 5b),
group-centred advantages with batch / prompt / no normalization (A.9), prompt / sample / token loss aggregation
(A.9, Eq. 8) and the four losses (Eq. 4, A.2, A.17). Pure: tensors in, tensors out. One training step in
train.py calls group_advantages and aggregation_weights once on the whole batch, then per micro-batch
completion_logprobs -> policy_loss -> backward. Exercised by `python -m pytest tests/test_loss.py` and
`python bench/logprobs.py`.

Where this departs from the paper, and why:
1. GSPO's sequence ratio is length-normalized, exp(mean over valid tokens of log rho) (GSPO, arXiv 2507.18071).
   The paper writes the ratio without the 1/|y| exponent, but its 1e-3 clip widths only make sense normalized.
2. No epsilon is added to an advantage std (the paper writes std + eps). A std below 1e-6 counts as zero and
   those advantages are exactly 0, so float residue of a zero-variance group is never blown up to unit size.
   Both stds are population stds (the paper does not say which).
3. `grpo` and `dapo` share one clipped surrogate. GRPO's symmetric eps, sample aggregation and prompt-level
   normalization are the caller's choices of eps_high, agg and norm (A.2, Eqs. 7-8).
4. P and S in the aggregation weights count only groups / samples with at least one valid token (the paper's
   batch-level 1/P is inferred from its prose, and an empty completion has no 1/|y| term).
"""

import torch

# a group std below this is float residue of a zero-variance group, not signal (DESIGN.md); the
# zero-variance filter (filters.py) uses the same floor
STD_FLOOR = 1e-6


def _check(ok, msg, exc=ValueError):
    if not ok:
        raise exc(msg)


class _FP32HeadLogprobs(torch.autograd.Function):
    """log_softmax(hidden @ weight.T / temperature)[targets] in fp32, `chunk_size` rows at a time.

    logp_n depends only on row n, so d logp_n / d hidden_n = (W[t_n] - softmax_n @ W) / temperature is formed in
    forward as one (N, H) tensor and backward just scales it by the incoming gradient: the frozen-head path does
    the same two matmuls as the naive one. The weight gradient needs the softmax again, so backward recomputes
    each chunk's logits from the saved log-partition. The largest temporary is one (chunk, V) fp32 block.

    Two fp32 heads. fp32 operands: every product in fp32 (the exact path, CPU training). bf16 / fp16
    hidden and weight (FSDP2 mixed precision on GPU): the logits are one low-precision GEMM
    accumulated and returned in fp32 (_mm_f32: tensor cores on CUDA), and the products with the
    softmax (softmax @ W, dlogits.T @ hidden) take the softmax in the operands' dtype, accumulated
    in fp32 (issue 11; measured on an H200 at N 16k, V 152k, H 4k: |d logp| 3.3e-5 vs float64,
    against 6.2e-6 for the exact path, 9x faster).
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
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        ctx.need_dh, ctx.need_dw, ctx.head_dtype, ctx.low = need_dh, need_dw, head_dtype, low
        ctx.save_for_backward(hidden, weight, targets, lse, dlogp_dh)
        return logp

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, g):  # g (N,) upstream gradient of logp
        hidden, weight, targets, lse, dlogp_dh = ctx.saved_tensors
        T, g, low = ctx.temperature, g.float(), ctx.low
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
                # d logp / d logits = (onehot(t) - softmax) / T, built in place in the recomputed logits
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
    return (
        head_dtype == torch.float32
        and hidden.dtype == weight.dtype
        and hidden.dtype in (torch.bfloat16, torch.float16)
    )


def _mm_f32(a, b):
    """(n, k) @ (k, m) -> (n, m) fp32 from bf16 / fp16 operands, accumulated in fp32: the one
    device-specific call of the head. CUDA: one tensor-core GEMM with fp32 output, `torch.mm(a, b,
    out_dtype=torch.float32)` (CUDA only in torch 2.11-2.13; fp32 out from fp16 / bf16 in).
    Elsewhere: the same product of the exactly upcast operands, so CPU tests run every other line of
    the CUDA path."""
    if a.is_cuda:
        return torch.mm(a, b, out_dtype=torch.float32)
    return a.float() @ b.float()


def _matmul(h, w_head):
    """(c, V) fp32 logits of fp32 rows h (c, H): in fp32, or rounded through w_head's dtype (the
    loo-fp32 ablation)."""
    return (
        h @ w_head.T if w_head.dtype == torch.float32 else (h.to(w_head.dtype) @ w_head.T).float()
    )


def token_logprobs(
    hidden, weight, targets, temperature=1.0, chunk_size=1024, head_dtype=torch.float32
):
    """Log-probabilities of `targets` under an fp32 LM head, without ever forming an (N, V) tensor (§3.2, Fig 5b).

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
    Raises ValueError / TypeError on bad shapes, dtypes, devices, temperature, chunk_size or
    head_dtype, and on ids outside [0, V) when targets are on the CPU (on an accelerator that scan
    would cost a host sync on every call: train.train_step checks the whole batch's ids once per
    step on the CPU instead).
    """
    _check(
        head_dtype in (torch.float32, torch.bfloat16, torch.float16),
        f"head_dtype must be float32, bfloat16 or float16; got {head_dtype}",
        TypeError,
    )
    _check(
        hidden.dim() == 2 and weight.dim() == 2,
        f"hidden must be (N, H) and weight (V, H); got "
        f"{tuple(hidden.shape)} and {tuple(weight.shape)}",
    )
    _check(
        hidden.shape[1] == weight.shape[1],
        f"hidden size mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}",
    )
    _check(
        hidden.is_floating_point() and weight.is_floating_point(),
        f"hidden and weight must be float; got {hidden.dtype}, {weight.dtype}",
        TypeError,
    )
    _check(
        targets.shape == hidden.shape[:1],
        f"targets must be ({hidden.shape[0]},); got {tuple(targets.shape)}",
    )
    _check(
        not targets.is_floating_point() and targets.dtype != torch.bool,
        f"targets must be integer token ids; got {targets.dtype}",
        TypeError,
    )
    _check(
        hidden.device == weight.device == targets.device,
        "hidden, weight and targets must share a device",
    )
    _check(temperature > 0, f"temperature must be > 0; got {temperature}")
    _check(int(chunk_size) >= 1, f"chunk_size must be >= 1; got {chunk_size}")
    if targets.numel() and targets.device.type == "cpu":
        lo, hi = int(targets.min()), int(targets.max())
        _check(
            lo >= 0 and hi < weight.shape[0],
            f"targets must lie in [0, V={weight.shape[0]}); got [{lo}, {hi}]",
        )
    grad_on = torch.is_grad_enabled()  # inside forward() grad mode is always off, so decide here
    return _FP32HeadLogprobs.apply(
        hidden,
        weight,
        targets.long(),
        float(temperature),
        int(chunk_size),
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
        head_dtype,
    )


def completion_logprobs(
    hidden, weight, input_ids, mask, temperature=1.0, chunk_size=1024, head_dtype=torch.float32
):
    """Per-token log-probs of a right- or left-padded batch from a causal LM's final hidden states.

    hidden (S, T, H) final-layer hidden states (after the last norm) for input_ids (S, T); weight (V, H) the LM
    head; mask (S, T) bool, True on the tokens whose log-prob is wanted (the completion). Token t is predicted
    from position t - 1. Returns logp (S, T) float32 aligned with input_ids: logp[s, t] = log p(input_ids[s, t] |
    input_ids[s, :t]) where mask, exactly 0 elsewhere; only masked tokens go through the head (token_logprobs,
    with its head_dtype).
    Raises ValueError if shapes disagree or mask[:, 0] is set (the first token has no preceding position).
    """
    _check(
        hidden.dim() == 3 and input_ids.shape == hidden.shape[:2] and mask.shape == input_ids.shape,
        f"need hidden (S, T, H), input_ids and mask (S, T); got {tuple(hidden.shape)}, "
        f"{tuple(input_ids.shape)}, {tuple(mask.shape)}",
    )
    _check(mask.dtype == torch.bool, f"mask must be bool; got {mask.dtype}", TypeError)
    _check(
        not mask[:, 0].any(),
        "mask[:, 0] is True: the first token has no preceding position to predict it",
    )
    sel = mask[:, 1:]  # (S, T-1): token t+1 is predicted from position t
    logp = token_logprobs(
        hidden[:, :-1][sel], weight, input_ids[:, 1:][sel], temperature, chunk_size, head_dtype
    )  # (N,)
    shifted = logp.new_zeros(sel.shape).masked_scatter(sel, logp)  # (S, T-1)
    return torch.cat([logp.new_zeros(sel.shape[0], 1), shifted], 1)  # (S, T)


def group_advantages(rewards, group_ids, norm="batch"):
    """Group-centred advantages, normalized per batch, per prompt or not at all (§3.2, §4, A.9 Fig 14b).

    rewards (S,) real, group_ids (S,) integer labels (any values; equal label = same prompt). Centres each
    reward by its group mean; "batch" divides by the population std of the centred values over all S samples
    passed in (ScaleRL, §4), "prompt" by the group's own population std (GRPO, Eq. 5), "none" leaves them
    centred (Dr. GRPO). A group whose std is below 1e-6 gets exactly 0; if the batch std is below 1e-6 every
    advantage is 0. Never NaN or inf. Returns (S,) float64 for float64 rewards, else float32.
    Raises ValueError on an unknown norm, an empty batch, mismatched shapes or non-finite rewards.
    """
    _check(
        norm in ("batch", "prompt", "none"),
        f"norm must be 'batch', 'prompt' or 'none'; got {norm!r}",
    )
    _check(
        rewards.dim() == 1 and rewards.numel() > 0,
        f"rewards must be a non-empty (S,); got {tuple(rewards.shape)}",
    )
    _check(
        group_ids.shape == rewards.shape,
        f"group_ids {tuple(group_ids.shape)} must match rewards {tuple(rewards.shape)}",
    )
    _check(
        not group_ids.is_floating_point(),
        f"group_ids must be integers; got {group_ids.dtype}",
        TypeError,
    )
    r = rewards.double()  # (S,) float64: a group of equal float32 rewards centres to exactly 0
    _check(bool(torch.isfinite(r).all()), "rewards contain NaN or inf")
    _, gid = torch.unique(group_ids, return_inverse=True)  # (S,) group index in 0..P-1
    count = torch.bincount(gid).double()  # (P,) samples in each group
    mean = torch.zeros_like(count).index_add_(0, gid, r) / count  # (P,) group mean reward
    centred = r - mean[gid]  # (S,)
    std_g = (torch.zeros_like(count).index_add_(0, gid, centred**2) / count).sqrt()[
        gid
    ]  # (S,) group pop. std
    adv = torch.where(std_g < STD_FLOOR, 0.0, centred)  # zero-variance group: exactly 0
    if norm == "prompt":
        adv = adv / std_g.clamp_min(STD_FLOOR)  # Eq. 5 without + eps; zeroed groups stay 0
    elif norm == "batch":
        std_b = adv.std(
            correction=0
        )  # population std over the S samples passed in (§4: std of all A_i)
        adv = adv / std_b if std_b >= STD_FLOOR else torch.zeros_like(adv)
    return adv.to(torch.float64 if rewards.dtype == torch.float64 else torch.float32)


def aggregation_weights(mask, group_ids, agg="prompt"):
    """Per-token weights whose weighted sum of per-token terms is the loss (§3.2, A.9 Fig 14a, Eq. 8).

    mask (S, T) bool (True on valid completion tokens), group_ids (S,) integer labels. Returns (S, T) float32,
    0 where mask is False: "prompt" = 1 / (P * tokens in the sample's group) (ScaleRL, DAPO Eq. 8), "sample" =
    1 / (S * tokens in the sample) (GRPO Eq. 7), "token" = 1 / (tokens in the batch). P and S count groups and
    samples with at least one valid token, so the weights sum to 1 (or are all 0 if no token is valid).
    Computed once on the whole batch: micro-batches and ranks sum their share and get the full-batch loss.
    Raises ValueError / TypeError on an unknown agg or bad shapes / dtypes.
    """
    _check(
        agg in ("prompt", "sample", "token"),
        f"agg must be 'prompt', 'sample' or 'token'; got {agg!r}",
    )
    _check(
        mask.dim() == 2 and group_ids.shape == mask.shape[:1],
        f"need mask (S, T) and group_ids (S,); got "
        f"{tuple(mask.shape)} and {tuple(group_ids.shape)}",
    )
    _check(mask.dtype == torch.bool, f"mask must be bool; got {mask.dtype}", TypeError)
    _check(
        not group_ids.is_floating_point(),
        f"group_ids must be integers; got {group_ids.dtype}",
        TypeError,
    )
    lens = mask.sum(1).double()  # (S,) valid tokens per sample
    if agg == "token":
        denom = lens.sum().expand_as(lens)  # (S,) every valid token in the batch
    elif agg == "sample":
        denom = (lens > 0).sum() * lens  # (S,) samples with a token x this sample's tokens
    else:
        _, gid = torch.unique(group_ids, return_inverse=True)  # (S,) group index in 0..P-1
        group_tokens = torch.zeros(int(gid.max()) + 1, dtype=torch.float64).index_add_(
            0, gid, lens
        )  # (P,)
        denom = (group_tokens > 0).sum() * group_tokens[
            gid
        ]  # (S,) groups with a token x tokens in this group
    return torch.where(mask, 1.0 / denom.clamp_min(1)[:, None], 0.0).float()  # (S, T)


def check_values(old_logp: torch.Tensor, weights: torch.Tensor) -> None:
    """The value checks of `policy_loss`, in one host sync: weights (S, T) >= 0, and old_logp (S, T)
    finite wherever weight > 0. Raises ValueError naming the first sample s and token t of a
    non-finite behaviour log-prob (a sampler fault; see policy_loss), or on a negative weight."""
    bad = (weights > 0) & ~torch.isfinite(old_logp)  # (S, T)
    negative, nonfinite = torch.stack([(weights < 0).any(), bad.any()]).tolist()  # one host sync
    _check(not negative, "weights must be >= 0")
    if nonfinite:
        s, t = (int(i) for i in bad.nonzero()[0])
        raise ValueError(
            f"old_logp is {old_logp[s, t].item()} at sample {s}, token {t} (a valid token): the "
            "sampler's behaviour log-probs must be finite; drop that sample before the loss"
        )


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
    validate=True,
):
    """Policy-gradient loss (to minimize) and its metrics: CISPO (Eq. 4, §4), GSPO (A.17.3), DAPO / GRPO (A.2).

    logp (S, T) float, the trainer's log-probs with gradient; old_logp (S, T) float, the sampler's behaviour
    log-probs, a constant: rho = exp(logp - old_logp) always measures the sampler, never a recompute (Eq. 2).
    adv (S,), weights (S, T) from aggregation_weights (>= 0; a token is valid where weight > 0; padding may hold
    any value, NaN included, in logp / old_logp). Per-token term:
      cispo: sg(min(rho, cispo_cap)) * A * logp, no lower bound;
      dapo / grpo: min(rho * A, clip(rho, 1 - eps_low, 1 + eps_high) * A);
      gspo: one ratio per sequence, s = exp(mean of log rho over its valid tokens), clipped with the gspo eps,
        weighted by the sum of the sequence's token weights.
    loss = -sum(weights * term), a 0-dim tensor in logp's dtype.
    metrics: 0-dim float32 tensors, detached. clip_frac = share of valid tokens whose ratio is truncated (CISPO:
    rho > cap) or whose clipped branch is active (gradient zeroed; GSPO: every token of a clipped sequence);
    rho_mean / rho_min / rho_max = token rho over valid tokens; n_tokens = number of valid tokens. To combine
    micro-batches or ranks, weight clip_frac and rho_mean by n_tokens, reduce rho_min / rho_max by min / max
    (with no valid token they are 0, 0, +inf, -inf).
    Raises ValueError / TypeError on an unknown loss_type, bad shapes / dtypes, negative weights, or
    an old_logp that requires grad or shares memory with logp (rho would be identically 1).
    Raises ValueError naming the first sample s and token position t (indices into these tensors)
    where old_logp is NaN or +-inf on a valid token: a sampler fault, which would make the loss NaN
    or, under CISPO's cap, pass silently as rho = cap. train.py drops such samples before the batch
    is formed (train.drop_nonfinite_logp), so it never reaches this error.
    validate=False skips the checks that read every value (weights >= 0, finite old_logp), a host
    sync on an accelerator: for a caller that ran them once on the whole batch (train.train_step
    does, on the CPU, per step) and then calls this per micro-batch.
    """
    _check(loss_type in ("cispo", "gspo", "dapo", "grpo"), f"unknown loss_type {loss_type!r}")
    _check(
        logp.dim() == 2
        and logp.numel() > 0
        and old_logp.shape == logp.shape
        and weights.shape == logp.shape
        and adv.shape == logp.shape[:1],
        f"need non-empty logp, old_logp, weights (S, T) and adv (S,); got "
        f"{tuple(logp.shape)}, {tuple(old_logp.shape)}, {tuple(weights.shape)}, {tuple(adv.shape)}",
    )
    for name, x in (("logp", logp), ("old_logp", old_logp), ("adv", adv), ("weights", weights)):
        _check(x.is_floating_point(), f"{name} must be float; got {x.dtype}", TypeError)
    _check(
        not old_logp.requires_grad,
        "old_logp requires grad: pass the sampler's behaviour log-probs (a constant)",
    )
    _check(
        old_logp.untyped_storage().data_ptr() != logp.untyped_storage().data_ptr(),
        "old_logp shares memory "
        "with logp, so rho = 1 everywhere: pass the sampler's behaviour log-probs, not a detached logp",
    )
    if validate:  # value checks: one host sync on an accelerator
        check_values(old_logp, weights)
    _check(
        eps_low >= 0
        and eps_high >= 0
        and gspo_eps_low >= 0
        and gspo_eps_high >= 0
        and cispo_cap > 0,
        "clip widths must be >= 0 and cispo_cap > 0",
    )
    valid = weights > 0  # (S, T)
    lp = torch.where(
        valid, logp, 0.0
    )  # (S, T) padding zeroed so nothing there reaches the loss or grads
    log_rho = lp - torch.where(valid, old_logp, 0.0)  # (S, T)
    rho = log_rho.exp()  # (S, T) token IS ratio against the sampler, Eq. 2
    A = adv.to(logp.dtype)[:, None]  # (S, 1)
    if loss_type == "cispo":
        term = (
            rho.detach().clamp(max=cispo_cap) * A * lp
        )  # (S, T) Eq. 4: sg(min(rho, cap)) A log pi
        loss = -(weights * term).sum()
        clipped = rho.detach() > cispo_cap  # (S, T)
    elif loss_type == "gspo":
        n_i = valid.sum(1)  # (S,) valid tokens per sequence
        s = (log_rho.sum(1) / n_i.clamp_min(1)).exp()  # (S,) GSPO length-normalized sequence ratio
        lo, hi = 1 - gspo_eps_low, 1 + gspo_eps_high
        term = torch.minimum(s * A[:, 0], s.clamp(lo, hi) * A[:, 0])  # (S,)
        loss = -(weights.sum(1) * term).sum()  # a sequence weighs the sum of its token weights
        seq_clipped = ((A[:, 0] > 0) & (s.detach() > hi)) | (
            (A[:, 0] < 0) & (s.detach() < lo)
        )  # (S,)
        clipped = seq_clipped[:, None].expand_as(valid)  # (S, T)
    else:
        lo, hi = 1 - eps_low, 1 + eps_high
        term = torch.minimum(
            rho * A, rho.clamp(lo, hi) * A
        )  # (S, T) Eq. 8 (Eq. 7 with eps_low = eps_high)
        loss = -(weights * term).sum()
        r = rho.detach()
        clipped = ((A > 0) & (r > hi)) | (
            (A < 0) & (r < lo)
        )  # (S, T) the constant branch is the minimum
    with torch.no_grad():
        r, n = rho.detach().float(), valid.sum().float()
        metrics = {
            "clip_frac": (clipped & valid).sum() / n.clamp_min(1),
            "rho_mean": torch.where(valid, r, 0.0).sum() / n.clamp_min(1),
            "rho_min": torch.where(valid, r, float("inf")).amin(),
            "rho_max": torch.where(valid, r, float("-inf")).amax(),
            "n_tokens": n,
        }
    return loss, metrics
