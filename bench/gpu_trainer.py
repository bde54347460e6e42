"""Benchmark on one GPU: the FSDP2 train step of a Qwen3-8B-wide decoder at 16k tokens, and the fp32 LM head.

Needs only torch >= 2.11 and transformers: no vLLM, no download (random weights from a Qwen3Config).
1. Train step, as train.py's Policy / shard / train_step run it, rebuilt here in a few visible lines: a 1-rank
   NCCL group, `fully_shard` on each decoder layer then the root with bf16 params and fp32 gradient reduction
   (torchtitan), fp32 master weights, AdamW. One step = decoder forward on --seqs sequences of --tokens / --seqs
   tokens (default 1 x 16,384, causal SDPA, no activation checkpointing), `loss.completion_logprobs` with the fp32
   head on every token but each sequence's first, the surrogate -mean(adv * logp) with random advantages,
   backward, grad-norm clip, AdamW step. Width = Qwen3-8B's (H 4,096, FFN 12,288, 32 query / 8 KV heads of 128,
   V 151,936, untied head); depth = --layers 8 of its 36, so fp32 weights + grads + AdamW (16 B / param, 2.8 B
   params) and the activations fit one 141 GB H200: estimated ~85 GiB, ~6 GiB per layer (2.9 states, 3.3
   activations at 16k tokens), ~27 GiB for the embedding, head and their transients; --layers 4 on an 80 GB H100.
   MFU = flops per step / step time / --peak-tflops, with flops per token = 6 * N + 6 * L * heads * head_dim * T:
   N = parameters except the input embedding (a lookup, no matmul; the LM head counts), the second term causal
   attention (QK^T and AV, forward + backward, half the T x T scores). torchtitan and PaLM count all the scores
   (12 instead of 6); that MFU is printed too. The fp32 head runs at fp32 matmul speed, far below the bf16 peak,
   and token_logprobs recomputes its logits in backward (8 V H flops per token, counted as 6 V H).
2. token_logprobs against the naive fp32 log_softmax(hidden @ W.T) at the same head (N = --tokens, V, H), bf16
   inputs, frozen and trainable head, forward + backward: bench/logprobs.py's workers, a fresh process per variant
   (run before part 1, so the trainer's memory is not held while they measure).

Prints library versions and the device, each timed step, and a markdown table of what a README would quote:
step time, tokens/s, MFU, peak memory, and the extra memory and time of chunked vs naive log-probs.

    python bench/gpu_trainer.py                           # one H200: 8 layers, 1 x 16k tokens (~2 min)
    python bench/gpu_trainer.py --layers 4 --seqs 4       # shallower, 4 x 4k tokens
    python bench/gpu_trainer.py --only train --head-dtype bf16   # the loo-fp32 ablation's head, no part 2
    python bench/gpu_trainer.py --device cpu --layers 1 --hidden 64 --intermediate 128 --heads 2 --kv-heads 1 \\
        --head-dim 32 --vocab 1000 --tokens 256 --peak-tflops 0.001  # CPU smoke test, gloo, fp32 (~1 min)
"""

import argparse
import os
import resource
import socket
import sys
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loss  # noqa: E402
from bench import logprobs as bench_logprobs  # noqa: E402  bench/ is a namespace package under the repo root


class Policy(torch.nn.Module):
    """train.Policy: the head runs inside the root's forward, so FSDP2 gathers and reduces its weight too."""

    def __init__(self, lm, head_dtype):
        super().__init__()
        self.lm, self.head_dtype = lm, head_dtype

    def forward(self, input_ids, mask):
        hidden = self.lm.model(
            input_ids=input_ids, use_cache=False
        ).last_hidden_state  # (S, T, H); causal, no pad
        return loss.completion_logprobs(
            hidden, self.lm.lm_head.weight, input_ids, mask, head_dtype=self.head_dtype
        )  # (S, T) float32


def train_step(policy, optimizer, input_ids, mask, adv):
    logp = policy(input_ids, mask)  # (S, T) float32, 0 off the mask
    l = (
        -(adv[:, None] * logp).sum() / mask.sum()
    )  # denominator: every predicted token of the batch, one rank
    l.backward()
    torch.nn.utils.clip_grad_norm_(
        policy.parameters(), 1.0
    )  # as train_step: a global norm over the shards
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return l.detach()


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def part_logprobs(a):
    """Part 2: {(trainable, variant): {extra_bytes, seconds, ...}} from bench/logprobs.py's fresh-process workers."""
    ns = argparse.Namespace(
        device=a.device,
        dtype="bf16",
        n=a.tokens,
        v=a.vocab,
        h=a.hidden,
        repeats=3 if a.device.startswith("cuda") else 1,
    )
    out = {}
    for trainable in (False, True):
        for variant in ("naive", "chunked"):
            r = out[trainable, variant] = bench_logprobs.run(ns, variant, trainable)
            print(
                f"token_logprobs {'trainable' if trainable else 'frozen':9s} head {variant:7s} extra memory "
                f"{r['extra_bytes'] / 2**30:7.3f} GiB  time {r['seconds']:.4f} s",
                flush=True,
            )
    return out


def part_train(a):
    """Part 1: returns step seconds (mean of the timed steps), peak bytes, flops per step (causal, full T^2)."""
    cuda = a.device.startswith("cuda")
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    S, T = a.seqs, a.tokens // a.seqs
    cfg = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        max_position_embeddings=max(40_960, T),
        tie_word_embeddings=False,
        use_cache=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    with (
        device
    ):  # initialised in place on the GPU: 2.8 B fp32 parameters are slow to build on the CPU
        lm = Qwen3ForCausalLM(cfg).float()  # fp32 master weights
    n_dense = sum(p.numel() for p in lm.parameters()) - lm.model.embed_tokens.weight.numel()
    policy = Policy(lm, torch.bfloat16 if a.head_dtype == "bf16" else torch.float32)
    # FSDP2 as train.shard / torchtitan: each decoder layer, then the root; bf16 compute, fp32 reduce (GPU only)
    kw = (
        dict(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
        if cuda
        else {}
    )
    for layer in lm.model.layers:
        fully_shard(layer, **kw)
    fully_shard(policy, **kw)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=1e-6, eps=1e-15, weight_decay=0.01
    )  # config.py's
    gen = torch.Generator(device).manual_seed(0)
    input_ids = torch.randint(0, a.vocab, (S, T), device=device, generator=gen)  # (S, T)
    mask = torch.ones(
        S, T, dtype=torch.bool, device=device
    )  # (S, T) every token a completion token ...
    mask[:, 0] = False  # ... but the first, which nothing predicts
    adv = torch.randn(S, device=device, generator=gen)  # (S,)
    print(
        f"train: {a.layers} layers x H {a.hidden}, {n_dense / 1e6:,.1f} M non-embedding params, S={S} x T={T}, "
        f"{a.head_dtype} head, {'NCCL, bf16 params / fp32 reduce' if cuda else 'gloo, fp32'}",
        flush=True,
    )
    times = []
    for i in range(a.warmup + a.steps):
        if cuda:
            torch.cuda.synchronize()
            if i == a.warmup:
                torch.cuda.reset_peak_memory_stats()
        t0 = time.perf_counter()
        l = train_step(policy, optimizer, input_ids, mask, adv)
        if cuda:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= a.warmup:
            times.append(dt)
        print(
            f"  step {i}{' (warmup)' if i < a.warmup else ''}: {dt:.3f} s, loss {l.item():+.4f}",
            flush=True,
        )
    # CUDA: peak allocated over the timed steps; CPU: peak RSS of the whole process (ru_maxrss is in KiB on Linux)
    peak = (
        torch.cuda.max_memory_allocated(device)
        if cuda
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    )
    attn = (
        6 * a.layers * a.heads * a.head_dim * T
    )  # causal attention flops per token, forward + backward
    flops = [
        S * T * (6 * n_dense + attn),
        S * T * (6 * n_dense + 2 * attn),
    ]  # causal, full T^2 (torchtitan)
    dist.destroy_process_group()
    return sum(times) / len(times), peak, flops


def main():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--device", default="cuda", help="cuda (NCCL, bf16 mixed precision) or cpu (gloo, fp32)"
    )
    p.add_argument("--layers", type=int, default=8, help="decoder layers (Qwen3-8B has 36)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden size H (Qwen3-8B)")
    p.add_argument("--intermediate", type=int, default=12_288, help="MLP size (Qwen3-8B)")
    p.add_argument("--heads", type=int, default=32, help="query heads (Qwen3-8B)")
    p.add_argument("--kv-heads", type=int, default=8, help="key / value heads (Qwen3-8B)")
    p.add_argument("--head-dim", type=int, default=128, help="attention head size (Qwen3-8B)")
    p.add_argument("--vocab", type=int, default=151_936, help="vocabulary V (Qwen3)")
    p.add_argument(
        "--tokens",
        type=int,
        default=16_384,
        help="tokens per step, all sequences together; part 2's N",
    )
    p.add_argument(
        "--seqs", type=int, default=1, help="sequences per step S, each --tokens / S long"
    )
    p.add_argument(
        "--head-dtype", default="fp32", choices=["fp32", "bf16"], help="LM head matmul dtype (§3.2)"
    )
    p.add_argument("--steps", type=int, default=5, help="timed train steps")
    p.add_argument("--warmup", type=int, default=2, help="untimed train steps first")
    p.add_argument(
        "--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 / H200 SXM: 989)"
    )
    p.add_argument("--only", choices=["train", "logprobs"], help="run one part (default both)")
    a = p.parse_args()
    assert a.tokens % a.seqs == 0 and a.steps >= 1 and a.warmup >= 0, (
        "--tokens % --seqs == 0, --steps >= 1"
    )
    cuda = a.device.startswith("cuda")
    where = (
        f"{torch.cuda.get_device_name()}, CUDA {torch.version.cuda}"
        if cuda
        else f"CPU, {os.cpu_count()} cores"
    )
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, {where}", flush=True
    )
    lp = part_logprobs(a) if a.only != "train" else None
    tr = part_train(a) if a.only != "logprobs" else None

    rows = []
    if tr:
        sec, peak, flops = tr
        mfu = [f / sec / (a.peak_tflops * 1e12) for f in flops]
        rows += [
            (
                f"train step: {a.layers} layers (Qwen3-8B: 36) x H {a.hidden}, V {a.vocab}, {a.seqs} x "
                f"{a.tokens // a.seqs} tokens, {a.head_dtype} head",
                f"{sec:.3f} s",
            ),
            ("tokens / s", f"{a.tokens / sec:,.0f}"),
            (
                f"MFU vs {a.peak_tflops:g} TFLOP/s (causal attention / full T^2)",
                f"{mfu[0]:.1%} / {mfu[1]:.1%}",
            ),
            ("peak memory (allocated)" if cuda else "peak memory (RSS)", f"{peak / 2**30:.2f} GiB"),
        ]
    for trainable in (False, True) if lp else ():
        naive, chunked = lp[trainable, "naive"], lp[trainable, "chunked"]
        head = "trainable" if trainable else "frozen"
        m, t = chunked["extra_bytes"] / naive["extra_bytes"], chunked["seconds"] / naive["seconds"]
        rows += [
            (
                f"token_logprobs vs naive, {head} head, N {a.tokens} V {a.vocab} H {a.hidden}: extra memory",
                f"{chunked['extra_bytes'] / 2**30:.2f} / {naive['extra_bytes'] / 2**30:.2f} GiB ({m:.1%})",
            ),
            (
                f"token_logprobs vs naive, {head} head: fwd + bwd time",
                f"{chunked['seconds']:.3f} / {naive['seconds']:.3f} s ({t:.2f}x)",
            ),
        ]
    if tr and lp and a.head_dtype == "fp32":
        rows.append(
            (
                "share of the train step in the fp32 head (part 2, trainable)",
                f"{lp[True, 'chunked']['seconds'] / tr[0]:.0%}",
            )
        )
    w = max(len(r[0]) for r in rows)
    print(f"\n| {'quantity':{w}s} | value |\n|{'-' * (w + 2)}|-------|")
    for k, v in rows:
        print(f"| {k:{w}s} | {v} |")


if __name__ == "__main__":
    main()
