"""Benchmark on one GPU: train.py's own trainer (train.py: Policy, shard, train_step) and its fp32
LM head.

Needs torch >= 2.11 and transformers only: tyro (config.py imports it) and vLLM are stubbed when
they are not installed (the trainer never calls them). No download: random weights from a
Qwen3Config. Issue 11; a GPU run's numbers go in the README.
1. LM head, fwd + bwd with a trainable head at N 16,384, V 151,936, H 4,096 (Qwen3-8B):
   loss.token_logprobs with bf16 operands (the GPU path: fp32-accumulated GEMMs, fp32 logits)
   against the same call on the fp32-upcast operands (the exact fp32 path, the baseline) and with
   bf16 logits (the loo-fp32 ablation); errors against a float64 reference. Contract: |d logp| <=
   5e-5 against the fp32 path. Target: <= 0.25 s.
2. Train step: a 1-rank process group, train.Policy + train.shard (FSDP2, bf16 params, fp32
   reduce on GPU), AdamW, and train.train_step on a batch of --seqs variable-length sequences
   drawn like the preset's rollouts (prompt U[64, 512] tokens, completion U[256, think_budget[1] +
   answer_budget]), for two shapes: `0.6b` = Qwen3-0.6B (28 layers, tied head) with the qwen3-0.6b
   preset's settings, `8b-8l` = 8 of Qwen3-8B's 36 layers (untied head) with the qwen3-8b
   preset's. Variants, measured in the same run: `before` = the trainer's layout and head before
   issue 11 as far as train.py still runs them (one sequence per micro-batch, activation
   checkpointing, the fp32 head on fp32-upcast operands: loss._low_precision_operands patched to
   False; neither the padding of each sequence to the batch's longest, whose layout left train.py,
   nor its per-micro-batch host syncs are restored), `after` = the preset's settings,
   `after-noac` = the same without activation checkpointing (where the preset has it).
   MFU = model flops / step time / --peak-tflops; model flops = 6 x (decoder parameters x tokens +
   head parameters x predicted tokens) + causal attention, 6 x layers x heads x head_dim x the sum
   of squared lengths; activation recompute is not counted. Targets (issue 11): 8b-8l >= 35%,
   0.6b >= 25%. Peak memory = max allocated over the timed steps, printed beside the estimate that
   config.py's presets are chosen by (memory_estimate).
3. --plan: that estimate for every GPU preset at its micro-batch token budget (no GPU needed).

    python bench/gpu_trainer.py                # one H200: head, then 0.6b and 8b-8l (not yet run)
    python bench/gpu_trainer.py --only head    # part 1 only
    python bench/gpu_trainer.py --shapes 0.6b --variants after --seqs 16
    python bench/gpu_trainer.py --plan         # the activation-memory estimate behind the presets
    python bench/gpu_trainer.py --tiny         # CPU smoke test of every part at toy sizes (~2 min)
"""

import argparse
import gc
import importlib.util
import os
import resource
import sys
import time
from unittest import mock

import torch
import transformers
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# a missing vllm / tyro is a MagicMock: config.py imports tyro, the trainer never calls either
for name in ("vllm", "tyro"):
    if importlib.util.find_spec(name) is None:
        sys.modules[name] = mock.MagicMock(name=name)
import config  # noqa: E402
import loss  # noqa: E402
import train  # noqa: E402
from infra import launch, placement  # noqa: E402

# Qwen3 shapes (Hugging Face configs): layers, hidden, intermediate, heads, kv heads, head dim,
# vocab, tied head
QWEN3 = {
    "qwen3-0.6b": (28, 1024, 3072, 16, 8, 128, 151_936, True),
    "qwen3-1.7b": (28, 2048, 6144, 16, 8, 128, 151_936, True),
    "qwen3-4b": (36, 2560, 9728, 32, 8, 128, 151_936, True),
    "qwen3-8b": (36, 4096, 12_288, 32, 8, 128, 151_936, False),
}
TINY = (2, 64, 128, 4, 2, 16, 1000, True)
PRESET = {"0.6b": "qwen3-0.6b", "8b-8l": "qwen3-8b"}  # train shape: the preset it runs with
GiB = 2**30


def n_params(shape):
    """(decoder + final norm, embedding, head) parameter counts; a tied head is the embedding."""
    L, H, inter, heads, kv, d, V, tied = shape
    layer = H * heads * d * 2 + H * kv * d * 2 + 3 * H * inter + 2 * H + 2 * d
    return L * layer + H, V * H, 0 if tied else V * H


def activation_bytes_per_token(shape, checkpointing):
    """Bytes autograd keeps per token, bf16 compute, SDPA without a mask (with a padding mask GQA's
    k and v are repeated first: + 4 (heads - kv) x head_dim). Per decoder layer: 2 RMSNorms x 8 H
    (fp32 input copy, bf16 normed, bf16 output), q and k norms 8 (q + k) (q = heads x head_dim, k =
    kv x head_dim), RoPE outputs 2 (q + k), v 2 k, the attention output twice (SDPA's and o_proj's
    contiguous input) 4 q, the SwiGLU MLP 8 x intermediate (gate, up, silu(gate), product).
    Checkpointing keeps each layer's bf16 input (2 H) plus one layer's activations while it
    recomputes."""
    L, H, inter, heads, kv, d, V, tied = shape
    q, k = heads * d, kv * d
    layer = 16 * H + 14 * q + 12 * k + 8 * inter
    return L * 2 * H + layer if checkpointing else L * layer


def memory_estimate(shape, tokens, ranks, checkpointing, chunk=1024):
    """GiB on one trainer GPU for a micro-batch of `tokens` tokens: fp32 weights, gradients and
    AdamW moments sharded over `ranks` (16 B / parameter), activations (above), and the head's
    transients: the unsharded bf16 embedding / head, their fp32 gradients and the head's fp32 (V, H)
    product, one (chunk, V) block of fp32 logits and its bf16 softmax. Allocator slack and the CUDA
    context (~1-2 GiB) are not included."""
    body, emb, head = n_params(shape)
    V, H = shape[6], shape[1]
    states = 16 * (body + emb + head) / ranks
    matrices = 1 if shape[7] else 2
    transients = matrices * V * H * (2 + 4) + V * H * 4 + chunk * V * (4 + 2)
    return (states + tokens * activation_bytes_per_token(shape, checkpointing) + transients) / GiB


def plan():
    """Part 3: the estimate behind config.py's activation_checkpointing choices, per GPU preset.
    Rule: no checkpointing where the estimate without it fits in 75% of the trainer's share of a
    rank-0 H200 that it shares with vLLM (--share-gpu), the rest left for the allocator, the CUDA
    context and NCCL."""
    gpus = {"H200": 143_771 * 2**20 / GiB, "H100-80GB": 81_559 * 2**20 / GiB}  # total memory, GiB
    print(
        "| preset | tokens / micro-batch | activations, no AC / AC (GiB) | total on 1 of 8 ranks, "
        "no AC / AC (GiB) | trainer share of a shared rank-0 H200 / H100-80GB (GiB) | AC by the "
        "rule | preset |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, shape in QWEN3.items():
        p = config.PRESETS[name]
        tokens = p["max_tokens_per_microbatch"]
        u = placement.vllm_utilization(p.get("gpu_memory_utilization"), beside_trainer=True)
        act = [tokens * activation_bytes_per_token(shape, c) / GiB for c in (False, True)]
        tot = [memory_estimate(shape, tokens, 8, c) for c in (False, True)]
        share = [(1 - u) * g for g in gpus.values()]
        rule = "on" if tot[0] > 0.75 * share[0] else "off"
        print(
            f"| {name} | {tokens:,} | {act[0]:.1f} / {act[1]:.1f} | {tot[0]:.1f} / {tot[1]:.1f} | "
            f"{share[0]:.0f} / {share[1]:.0f} | {rule} | "
            f"{'on' if p['activation_checkpointing'] else 'off'} |"
        )


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def peak_bytes(device):
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10  # CPU: peak RSS of the process


def reset_peak(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def reference_f64(h, w, t, g, chunk=1024):
    """float64 logp (N,), d(g . logp)/dh (N, H) and /dW (V, H), chunked, from the formulas (no
    autograd)."""
    w64 = w.double()
    logp = []
    gh = torch.empty(h.shape, dtype=torch.float64, device=h.device)
    gw = torch.zeros_like(w64)
    for s in range(0, len(t), chunk):
        h64, ts, gs = h[s : s + chunk].double(), t[s : s + chunk], g[s : s + chunk, None].double()
        lp = torch.log_softmax(h64 @ w64.T, -1)  # (c, V)
        logp.append(lp.gather(1, ts[:, None])[:, 0])
        d = lp.exp_().mul_(-gs).scatter_add_(1, ts[:, None], gs)  # (c, V) g (onehot - softmax)
        gh[s : s + chunk] = d @ w64
        gw.addmm_(d.T, h64)
        del lp, d
    return torch.cat(logp), gh, gw


def time_head(a, h, w, t, g, dtype, head_dtype, device):
    """Fastest of a.head_repeats fwd + bwd passes of loss.token_logprobs after one untimed, on fresh
    `dtype` copies of h (N, H), w (V, H). Returns (seconds, logp (N,) float64, grad_h, grad_W)."""
    times = []
    for _ in range(1 + a.head_repeats):  # the first pass warms up
        hh = h.to(dtype, copy=True).requires_grad_()  # fresh leaves: no gradient accumulates
        ww = w.to(dtype, copy=True).requires_grad_()
        sync(device)
        t0 = time.perf_counter()
        logp = loss.token_logprobs(hh, ww, t, head_dtype=head_dtype)
        (logp * g).sum().backward()
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times[1:]), logp.detach().double(), hh.grad, ww.grad


def head_rows(a, device) -> list[tuple[str, str]]:
    """Part 1: each variant's seconds, max |d logp| vs f64 and vs the fp32 path, and relative
    errors of grad_h and grad_W; printed, and returned as rows of the results table."""
    N, V, H = (512, 1000, 64) if a.tiny else (16_384, 151_936, 4096)
    gen = torch.Generator(device).manual_seed(0)
    h = torch.randn(N, H, device=device, generator=gen).bfloat16()
    w = (torch.randn(V, H, device=device, generator=gen) * 0.02).bfloat16()
    t = torch.randint(0, V, (N,), device=device, generator=gen)
    g = torch.randn(N, device=device, generator=gen)
    ref_logp, ref_gh, ref_gw = reference_f64(h, w, t, g)
    reset_peak(device)
    variants = {  # name: (operand dtype, head_dtype)
        "fp32 path (fp32 operands)": (torch.float32, torch.float32),  # the baseline: first
        "bf16 operands, fp32 logits": (torch.bfloat16, torch.float32),
        "bf16 logits (loo-fp32)": (torch.bfloat16, torch.bfloat16),
    }
    rows = []
    for name, (dtype, head_dtype) in variants.items():
        sec, logp, gh, gw = time_head(a, h, w, t, g, dtype, head_dtype, device)
        if name == "fp32 path (fp32 operands)":
            base = sec
            fp32_logp = logp
        e64 = (logp - ref_logp).abs().max().item()
        e32 = (logp - fp32_logp).abs().max().item()
        rh = ((gh.double() - ref_gh).norm() / ref_gh.norm()).item()
        rw = ((gw.double() - ref_gw).norm() / ref_gw.norm()).item()
        print(
            f"head {name:28s} fwd+bwd {sec * 1e3:8.1f} ms | max|d logp| vs f64 {e64:.1e}, vs fp32 "
            f"path {e32:.1e} | rel. err grad_h {rh:.1e} grad_W {rw:.1e}",
            flush=True,
        )
        value = f"{sec * 1e3:.0f} ms ({base / sec:.1f}x vs fp32 path); |d logp| {e64:.1e} vs f64, "
        value += f"{e32:.1e} vs fp32 path; grad rel. err h {rh:.1e}, W {rw:.1e}"
        rows.append((f"head fwd+bwd N {N} V {V} H {H}: {name}", value))
        if name == "bf16 operands, fp32 logits":
            ok = e32 <= 5e-5
        del logp, gh, gw
    rows.append(("head contract: bf16-operand log-probs within 5e-5 of the fp32 path", str(ok)))
    return rows


def make_batch(a, shape, args, gen):
    """A collated batch (train.collate's layout) of --seqs rollouts drawn like the preset's."""
    S, V = a.seqs, shape[6]
    if a.tiny:
        plen, clen = (8, 24), (16, 100)
    else:
        plen, clen = (64, 512), (256, args.think_budget[1] + args.answer_budget)
    p = torch.randint(plen[0], plen[1] + 1, (S,), generator=gen)
    c = torch.randint(clen[0], clen[1] + 1, (S,), generator=gen)
    lengths = p + c
    T = int(lengths.max())
    cols = torch.arange(T)
    real = cols < lengths[:, None]
    mask = real & (cols >= p[:, None])  # the completion tokens
    G = min(args.group_size, S)
    return dict(
        input_ids=torch.where(real, torch.randint(0, V, (S, T), generator=gen), 0),
        attention_mask=real.long(),
        mask=mask,
        old_logp=torch.where(mask, -12.0, 0.0),  # ~ -ln V: a random model's
        rewards=(torch.arange(S) % 2).double(),  # every group mixed: nothing filtered
        group_ids=torch.arange(S) // G,
    )


def bench_args(a, name, variant) -> config.Args:
    """The trainer's flags for one shape x variant: the shape's preset, changed as the variant says
    (`before`: one sequence per micro-batch, as before issue 11; `after-noac`: no activation
    checkpointing)."""
    preset = PRESET[name]
    # lr 1e-6 for every shape (the 8b preset: 5e-7): the printed losses compare, speed is the same
    settings = dict(config.PRESETS[preset], model=preset, lr=1e-6)
    if a.tiny:
        settings.update(max_tokens_per_microbatch=256, group_size=4)
    if variant == "before":
        settings.update(micro_batch_size=1, activation_checkpointing=True)
    elif variant == "after-noac":
        settings.update(activation_checkpointing=False)
    return config.Args(**settings)


def random_qwen3(shape, device):
    """A Qwen3 of `shape` with random fp32 weights (seed 0), built on `device`."""
    # the Hugging Face config fields of a shape's values, in order
    fields = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads")
    fields += ("num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
    cfg = dict(zip(fields, shape, strict=True))
    cfg.update(max_position_embeddings=40_960, attn_implementation="sdpa")
    torch.manual_seed(0)
    with device:  # initialised in place: billions of fp32 parameters are slow to build on the CPU
        return Qwen3ForCausalLM(Qwen3Config(**cfg)).float()


def time_steps(a, label, policy, optimizer, batch, args, device) -> list[float]:
    """Seconds of each of a.steps timed train steps, after a.warmup untimed ones (peak memory
    counted from the first timed step)."""
    times = []
    for i in range(a.warmup + a.steps):
        sync(device)
        if i == a.warmup:
            reset_peak(device)
        t0 = time.perf_counter()
        m = train.train_step(policy, optimizer, batch, args, device)
        sync(device)
        dt = time.perf_counter() - t0
        if i >= a.warmup:
            times.append(dt)
        warm = " (warmup)" if i < a.warmup else ""
        print(f"  {label} step {i}{warm}: {dt:.2f} s, loss {m['train/loss']:+.5f}", flush=True)
    return times


def part_train(a, name, variant, device):
    """Part 2, one shape x variant: {tokens/s, MFU, peak and estimated GiB, step s}."""
    shape = TINY if a.tiny else QWEN3[PRESET[name]]
    if name == "8b-8l" and not a.tiny:
        shape = (8, *shape[1:])  # 8 of Qwen3-8B's 36 layers
    args = bench_args(a, name, variant)
    L, H, inter, heads, kv, d, V, tied = shape
    # train.build: activation checkpointing as asked, Policy, shard (FSDP2), AdamW
    policy, optimizer = train.build(random_qwen3(shape, device), args, device)
    batch = make_batch(a, shape, args, torch.Generator().manual_seed(1))
    lengths = batch["attention_mask"].sum(1).double()
    body, emb, head = n_params(shape)
    n_pred = int(batch["mask"].sum())
    flops = 6 * (body * lengths.sum().item() + V * H * n_pred)
    flops += 6 * L * heads * d * (lengths**2).sum().item()  # causal: half of the T^2 scores
    tokens = int(lengths.sum())
    # `before`: the head before issue 11, fp32 products of the fp32-upcast operands
    low_precision = (lambda *_: False) if variant == "before" else loss._low_precision_operands
    with mock.patch.object(loss, "_low_precision_operands", low_precision):
        times = time_steps(a, f"{name} {variant}", policy, optimizer, batch, args, device)
    sec = sum(times) / len(times)
    # tokens in the largest micro-batch: the budget, or micro_batch_size rows of the longest
    mb_tokens = min(args.max_tokens_per_microbatch, args.micro_batch_size * int(lengths.max()))
    res = dict(
        step_s=sec,
        tokens_s=tokens / sec,
        mfu=flops / sec / (a.peak_tflops * 1e12),
        peak_gib=peak_bytes(device) / GiB,
        est_gib=memory_estimate(shape, mb_tokens, 1, args.activation_checkpointing),
        desc=f"{L} layers x H {H}, {a.seqs} seqs, {tokens:,} tokens ({n_pred:,} predicted), "
        f"budget {args.max_tokens_per_microbatch}, rows <= {args.micro_batch_size}, "
        f"AC {args.activation_checkpointing}",
    )
    del policy, optimizer
    gc.collect()
    reset_peak(device)
    return res


def train_rows(a, device) -> list[tuple[str, str]]:
    """Part 2's rows of the results table: every shape x variant asked for."""
    rows = []
    for name in a.shapes.split(","):
        has_ac = config.PRESETS[PRESET[name]]["activation_checkpointing"]
        # after-noac is `after` where the preset has no checkpointing
        variants = [v for v in a.variants.split(",") if v != "after-noac" or has_ac]
        res = {v: part_train(a, name, v, device) for v in variants}
        for v, r in res.items():
            ratio = ""
            if "before" in res:
                ratio = f", {res['before']['step_s'] / r['step_s']:.2f}x before"
            value = f"{r['step_s']:.2f} s{ratio}; {r['tokens_s']:,.0f} tokens/s; "
            value += (
                f"MFU {r['mfu']:.1%}; peak {r['peak_gib']:.1f} GiB (estimate {r['est_gib']:.1f})"
            )
            rows.append((f"train step {name} {v}: {r['desc']}", value))
    return rows


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--only", choices=["head", "train"], help="run one part (default both)")
    p.add_argument("--shapes", default="0.6b,8b-8l", help="train shapes: 0.6b, 8b-8l")
    p.add_argument("--variants", default="before,after,after-noac", help="train variants")
    p.add_argument("--seqs", type=int, default=8, help="sequences per train step")
    p.add_argument("--steps", type=int, default=2, help="timed train steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="untimed train steps first")
    p.add_argument("--head-repeats", type=int, default=3, help="timed head passes, fastest counts")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="bf16 peak, H100/H200 SXM")
    p.add_argument("--tiny", action="store_true", help="toy sizes: a CPU smoke test of every part")
    p.add_argument("--plan", action="store_true", help="print the presets' memory estimate, exit")
    return p.parse_args()


def main():
    a = parse_args()
    if a.plan:
        return plan()
    rank, world, device = launch.setup_distributed()  # 1 rank: NCCL on GPU, gloo on CPU
    where = f"CPU, {os.cpu_count()} cores"
    if device.type == "cuda":
        where = torch.cuda.get_device_name()
    versions = f"torch {torch.__version__}, transformers {transformers.__version__}"
    print(f"{versions}, {where}", flush=True)
    rows = []
    if a.only != "train":
        rows += head_rows(a, device)
    if a.only != "head":
        rows += train_rows(a, device)
    launch.dist.destroy_process_group()
    w = max(len(r[0]) for r in rows)
    print(f"\n| {'quantity':{w}s} | value |\n|{'-' * (w + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:{w}s} | {v} |")


if __name__ == "__main__":
    main()
