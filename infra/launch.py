"""A run's plumbing around the step loop: the process group (one code path for 1 or N ranks),
rank 0's long calls while the other ranks wait (rank0_call), the placement of trainer and vLLM on
the GPUs, the run directory with what produced it (args.json, meta.json), and the stop signal.

    python train.py --steps 2 --eval-every 2   # train.main calls each of these once
    torchrun --nproc_per_node 2 tests/dist_rank0_call.py rank0_call 5 10 OUT   # rank0_call's test

Every function here is called on every rank (most are collectives); rank 0 prints and writes.
"""

import dataclasses
import datetime
import json
import math
import os
import signal
import sys
import threading
import time

import torch
import torch.distributed as dist
from transformers import AutoConfig

from config import Args
from infra import checkpoint, placement

HEARTBEAT_S = 1.0  # rank0_call: the other ranks' poll while rank 0 waits (vLLM, rollouts, evals)
# torch 2.13's torchrun: on a signal the agent passes it to every worker once and SIGKILLs them
# after --shutdown-timeout s (else $PET_SHUTDOWN_TIMEOUT, else $TORCH_ELASTIC_SHUTDOWN_TIMEOUT, else
# 30: torch/distributed/run.py, launcher/api.py LaunchConfig)
TORCHRUN_GRACE_S = 30.0
# a checkpoint's bytes per parameter: the fp32 master weight and AdamW's two fp32 moments
CHECKPOINT_BYTES_PER_PARAM = 12
# the write speed grace_warning assumes: 1 GB/s, a network filesystem's or one local disk's
CHECKPOINT_WRITE_BYTES_PER_S = 1e9


def all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """All-reduce a small CPU tensor over ranks (through the GPU under NCCL); returns it on the
    CPU."""
    y = x.to("cuda") if dist.get_backend() == "nccl" else x.clone()
    dist.all_reduce(y, op=op)
    return y.cpu()


def free_port() -> int:
    """A TCP port free on every interface of this node (other nodes may connect to it)."""
    import socket

    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def setup_distributed(timeout_s: float = 1800.0):
    """torchrun sets RANK / WORLD_SIZE; a plain `python train.py` becomes a 1-rank group, so one
    code path (FSDP2) serves both. NCCL on GPU, gloo on CPU. timeout_s: how long a rank may wait in
    one collective (--dist-timeout); rank 0's long waits go through rank0_call, so this only has to
    catch a hung rank. Returns (rank, world, device)."""
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
    (rank 0's eval included). Returns fn's result on rank 0 (on every
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
    args: Args, path: str, world: int, gen_dtype, P: int, n_tasks: int = 1
) -> placement.Plan:
    """Rank 0 places the trainer ranks and vLLM on its node's GPUs and estimates their memory
    (placement.py) and prints the plan (n_tasks: held-out splits of eval_size prompts each); every
    rank gets it, and on a placement that cannot fit or overlaps trainer GPUs unasked every rank
    exits with the command to run instead."""
    plan = [None]
    cfg = AutoConfig.from_pretrained(path)
    if torch.cuda.is_available():  # on every rank alike: a plan that cannot count is refused
        placement.check_counted(cfg)
    shape = placement.Shape.from_config(cfg)
    if dist.get_rank() == 0:
        cuda = torch.cuda.is_available()
        plan[0] = placement.plan(
            shape,
            n_gpus=torch.cuda.device_count() if cuda else 0,
            gpu_bytes=torch.cuda.get_device_properties(0).total_memory if cuda else 0,
            cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
            world=world,
            local_world=int(os.environ.get("LOCAL_WORLD_SIZE", world)),  # torchrun sets it
            generator_gpus=args.generator_gpus,
            share_gpu=args.share_gpu,
            tp=args.tensor_parallel_size,
            utilization=args.gpu_memory_utilization,
            # tokens in one trainer forward: the token budget (train.plan_microbatches)
            microbatch_tokens=args.max_tokens_per_microbatch,
            max_model_len=args.max_model_len,
            checkpointing=args.activation_checkpointing,
            fp32_head=args.fp32_head,
            dtype_bytes=gen_dtype.itemsize,
            P=P,
            G=args.group_size,
            max_lag=args.max_lag,
            mode=args.async_mode,
            max_inflight=2 * P,  # the Pipeline's max_inflight below
            kv_cache_bytes=int((args.kv_cache_gib or placement.CPU_KV_CACHE_GIB) * 2**30),
            eval_gpus=args.eval_gpus,
            eval_seqs=n_tasks * args.eval_size * (args.eval_n + 1),  # + one greedy per prompt
            remote_engines=args.remote_engines,
            argv=sys.argv[1:],
        )
        print(placement.describe(plan[0]), flush=True)
    dist.broadcast_object_list(plan)
    placement.check(plan[0])
    return plan[0]


def open_run_dir(args: Args, world: int, master: bool) -> tuple[str, Args, dict | None]:
    """The run directory, made once the inputs have loaded: resolved args (args.json) and what
    produced them (meta.json). A resumed run keeps its directory; one whose run stopped before its
    first checkpoint starts again from step 0 (with --resume, under its saved flags), saying so.
    Returns (run_dir, args, meta on rank 0)."""
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
                f"train.py: {run_dir} holds no checkpoint yet (stopped before its first one); "
                f"starting it again from step 0{' with its saved flags' if args.resume else ''}",
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
    """Ctrl-C (SIGINT) or SIGTERM (torchrun passes Ctrl-C on as SIGTERM): the first one sets
    stop["requested"], and the step loop finishes or abandons the current step, checkpoints and
    exits 0; a second Ctrl-C exits at once (code 130), leaving the engine's processes to the
    pipeline's watchdog. A terminal's Ctrl-C reaches vLLM's processes too, which shut down on it:
    the pipeline then raises pipeline.Stopped rather than wait on them."""

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


def torchrun_grace_s(env=None, parent_argv: list[str] | None = None) -> float | None:
    """Seconds torchrun leaves this worker between passing on a stop signal and SIGKILL, or None
    when not started by torchrun (no TORCHELASTIC_RUN_ID). torchrun tells the workers nothing of it:
    read, as its agent does, from its command line (`parent_argv`: default, the parent process's,
    which is torchrun's), then the two environment variables a worker inherits, then the default
    (TORCHRUN_GRACE_S)."""
    env = os.environ if env is None else env
    if "TORCHELASTIC_RUN_ID" not in env:
        return None
    if parent_argv is None:
        import psutil  # a vLLM dependency

        parent_argv = psutil.Process().parent().cmdline()
    for i, arg in enumerate(parent_argv):
        name, _, value = arg.partition("=")
        if name in ("--shutdown-timeout", "--shutdown_timeout"):
            if not value and i + 1 < len(parent_argv):
                value = parent_argv[i + 1]
            return float(value)
        if arg == "--" or not arg.startswith("-") and arg.endswith(".py"):
            break  # the script's own flags follow
    for name in ("PET_SHUTDOWN_TIMEOUT", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"):
        if env.get(name):
            return float(env[name])
    return TORCHRUN_GRACE_S


def grace_warning(n_params: int, grace_s: float | None) -> str | None:
    """One line for rank 0 to print at start when a stop under torchrun (grace_s: torchrun_grace_s)
    would be SIGKILLed before this model's checkpoint is written: n_params x
    CHECKPOINT_BYTES_PER_PARAM at CHECKPOINT_WRITE_BYTES_PER_S, twice over for finishing the step
    first; the flag's value rounded up to a minute. None when the grace covers it or outside
    torchrun. Qwen3-8B (8.19e9 parameters): 98 GB, ~98 s to write, --shutdown-timeout 240."""
    if grace_s is None:
        return None
    write_s = n_params * CHECKPOINT_BYTES_PER_PARAM / CHECKPOINT_WRITE_BYTES_PER_S
    if grace_s >= 2 * write_s:
        return None
    need_s = 60 * math.ceil(2 * write_s / 60)
    gb = n_params * CHECKPOINT_BYTES_PER_PARAM / 1e9
    return (
        f"warning: torchrun kills the workers {grace_s:.0f} s after a Ctrl-C, and this model's "
        f"checkpoint ({gb:.0f} GB, ~{write_s:.0f} s at {CHECKPOINT_WRITE_BYTES_PER_S / 1e9:.0f} "
        f"GB/s) after finishing the step needs more: start torchrun with --shutdown-timeout "
        f"{need_s}"
    )


def stop_agreed(stop: dict) -> bool:
    """Every rank (a collective): whether any rank has had a stop request (on_stop_signal)."""
    requested = torch.tensor([float(stop["requested"])])
    return all_reduce(requested, dist.ReduceOp.MAX).item() > 0
