"""Benchmark: loss.token_logprobs (chunked fp32 head) against the naive path, forward + backward.

Naive = full fp32 logits, log_softmax, gather, autograd. Shapes default to Qwen3-0.6B's head
(V=151,936, H=1,024) and N=4,096 tokens; token_logprobs runs with its default chunk_size. Each
variant runs in a fresh subprocess so allocator state cannot leak between them. Memory = peak above
what the inputs take (CPU: peak RSS, ru_maxrss, minus RSS after the inputs exist; CUDA: peak
allocated minus allocated after the inputs); it includes the gradients. Time = the fastest of
--repeats forward+backward passes, over --rounds alternating fresh processes. Prints chunked /
naive ratios against the targets of issue 2, once with the head frozen and once trainable, and
checks that both variants agree.

    python bench/logprobs.py                             # CPU, fp32 inputs (8-12 min, 2 busy cores)
    python bench/logprobs.py --rounds 2                  # steadier time ratio on a shared machine
    python bench/logprobs.py --device cuda --dtype bf16  # GPU, bf16 hidden / head as in training
"""

import argparse
import inspect
import json
import os
import resource
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import loss  # noqa: E402

# extra memory, chunked / naive, by whether the head is trainable (issue 2)
TARGETS = {False: 0.15, True: 0.25}
TIME_TARGET = 1.5  # chunked / naive wall time


def naive_logprobs(hidden, weight, targets):
    logits = (
        hidden.float() @ weight.float().T
    )  # (N, V) fp32, the tensor token_logprobs never builds
    return torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]  # (N,)


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def worker(a):
    """One variant's passes in this process; prints `RESULT {json}` for `run` to read."""
    dev = torch.device(a.device)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[a.dtype]
    gen = torch.Generator(dev).manual_seed(0)
    # generated in place: no temporary would inflate the baseline peak
    hidden = torch.empty(a.n, a.h, device=dev, dtype=dtype).normal_(0, 1, generator=gen)
    hidden.requires_grad_()
    weight = torch.empty(a.v, a.h, device=dev, dtype=dtype).normal_(0, 0.02, generator=gen)
    weight.requires_grad_(a.trainable)
    targets = torch.randint(0, a.v, (a.n,), device=dev, generator=gen)
    up = torch.randn(a.n, device=dev, generator=gen)  # upstream gradient, as a loss would send
    fn = loss.token_logprobs if a.worker == "chunked" else naive_logprobs
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = rss_bytes()
    times = []
    for _ in range(a.repeats):
        hidden.grad = None
        weight.grad = None
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        logp = fn(hidden, weight, targets)
        (logp * up).sum().backward()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    if cuda:
        peak = torch.cuda.max_memory_allocated()
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    out = {
        "extra_bytes": peak - base,
        "seconds": min(times),
        "logp_sum": logp.double().sum().item(),
        "grad_h_norm": hidden.grad.double().norm().item(),
        "grad_w_norm": weight.grad.double().norm().item() if a.trainable else 0.0,
    }
    print("RESULT " + json.dumps(out))


def run(a, variant, trainable):
    """`worker`'s result for one variant, run in a fresh process."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", variant]
    cmd += ["--device", a.device, "--dtype", a.dtype, "--n", str(a.n), "--v", str(a.v)]
    cmd += ["--h", str(a.h), "--repeats", str(a.repeats)]
    if trainable:
        cmd.append("--trainable")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    if proc.returncode or not lines:
        raise SystemExit(
            f"{variant} worker failed (exit {proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
        )
    return json.loads(lines[-1][len("RESULT ") :])


def best_of_rounds(a, trainable):
    """(naive, chunked): each variant's last result with the fastest time and the largest extra
    memory of --rounds runs."""
    runs = {"naive": [], "chunked": []}
    for _ in range(a.rounds):  # alternate, so a load change on a shared machine hits both variants
        for variant in runs:
            runs[variant].append(run(a, variant, trainable))
    best = {}
    for variant, rs in runs.items():
        seconds = min(r["seconds"] for r in rs)
        extra_bytes = max(r["extra_bytes"] for r in rs)
        best[variant] = {**rs[-1], "seconds": seconds, "extra_bytes": extra_bytes}
    return best["naive"], best["chunked"]


def compare(a, trainable):
    """Prints both variants and their ratios against the targets; True if all are met and the
    outputs and gradients agree."""
    naive, chunked = best_of_rounds(a, trainable)
    head = "trainable" if trainable else "frozen"
    for name, r in (("naive", naive), ("chunked", chunked)):
        print(
            f"  {head:9s} head  {name:7s}  extra memory {r['extra_bytes'] / 2**30:6.2f} GiB  "
            f"time {r['seconds']:7.2f} s"
        )
    mem = chunked["extra_bytes"] / naive["extra_bytes"]
    t = chunked["seconds"] / naive["seconds"]
    agree = all(
        abs(chunked[k] - naive[k]) <= 1e-4 * max(1.0, abs(naive[k]))
        for k in ("logp_sum", "grad_h_norm", "grad_w_norm")
    )
    print(
        f"{head} head: extra memory chunked/naive = {mem:.1%} (target <= "
        f"{TARGETS[trainable]:.0%}), time chunked/naive = {t:.2f}x (target <= {TIME_TARGET}x), "
        f"outputs and grads agree: {agree}"
    )
    return agree and mem <= TARGETS[trainable] and t <= TIME_TARGET


def parse_args():
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    dtypes = ["fp32", "bf16"]
    p.add_argument(
        "--dtype", default="fp32", choices=dtypes, help="dtype of hidden states and head"
    )
    p.add_argument("--n", type=int, default=4096, help="tokens N")
    p.add_argument("--v", type=int, default=151_936, help="vocabulary V (Qwen3)")
    p.add_argument("--h", type=int, default=1024, help="hidden size H (Qwen3-0.6B)")
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="passes per variant, fastest counts (cpu 1, cuda 3)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="alternating fresh-process runs per variant, fastest counts",
    )
    p.add_argument("--worker", choices=["naive", "chunked"], help=argparse.SUPPRESS)
    p.add_argument("--trainable", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    a.repeats = a.repeats or (3 if a.device.startswith("cuda") else 1)
    return a


def main():
    a = parse_args()
    if a.worker:
        return worker(a)
    chunk = inspect.signature(loss.token_logprobs).parameters["chunk_size"].default
    print(
        f"token_logprobs vs naive, fwd+bwd: N={a.n} V={a.v} H={a.h} {a.dtype} on {a.device}, "
        f"chunk_size={chunk}, torch {torch.__version__}, {torch.get_num_threads()} threads, "
        f"repeats={a.repeats}, rounds={a.rounds}"
    )
    ok = True
    for trainable in (False, True):
        ok &= compare(a, trainable)
    print("all targets met" if ok else "TARGET MISSED")


if __name__ == "__main__":
    main()
