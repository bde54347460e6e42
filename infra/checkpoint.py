"""The run directory's durable state: sharded checkpoints (torch.distributed.checkpoint), the
full-weight export the sampler reloads after every step (and the final Hugging Face export), the
logs and eval history on resume (resume_logs), and what produced the run (meta.json).

    runs/NAME/checkpoints/step_000050/   model + optimizer, one shard file per rank (DCP)
    runs/NAME/state.json                 step, weight version, prompt pool, held-out eval history,
                                         evals still running, compute clock
    runs/NAME/metrics.jsonl, samples.jsonl, args.json, meta.json, heldout.json, fit.json, fit.png,
    runs/NAME/final/                     the trained weights, loadable by transformers and vLLM

A checkpoint exists once its state.json is written (atomically, after every rank's shards), so a
run killed at any moment resumes from the last complete one. export_weights, export_pretrained,
save_checkpoint and load_checkpoint are collectives: call them on every rank.
"""

import bisect
import json
import math
import os
import platform
import shutil
import subprocess
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict


def sampler_weights(policy: torch.nn.Module, dtype: torch.dtype | None):
    """Yield (name, tensor) for every weight of `train.Policy` as the sampler loads it: HF
    names (no `lm.` prefix; a tied head once, as the input embedding, since named_parameters()
    lists a shared tensor once), each tensor full (unsharded) on the parameter's device and cast to
    `dtype` there (None: each parameter's own dtype, no cast). An FSDP2 shard is cast before the
    all-gather (DTensor.full_tensor(), a collective: every rank iterates in the same order), so one
    parameter at a time exists unsharded, in the sampler dtype, and nothing is gathered in fp32 or
    copied to the CPU."""
    for name, p in policy.named_parameters():
        t = p.detach()
        if dtype is not None:
            # elementwise, so cast-then-gather equals gather-then-cast bit for bit
            t = t.to(dtype)
        if hasattr(t, "full_tensor"):  # an FSDP2 shard (DTensor): the all-gather
            t = t.full_tensor()
        yield name.removeprefix("lm."), t


def export_weights(
    policy: torch.nn.Module, out_dir: str | None, dtype: torch.dtype | None = None
) -> None:
    """Gather the full weights of `train.Policy` one parameter at a time, cast to `dtype` on their
    device (None: as trained, each in its own dtype) with `sampler_weights` (a collective: every
    rank calls it) and, on rank 0 (the one rank whose `out_dir` is not None), copy each to the CPU
    and save them all to `out_dir/model.safetensors` (the directory is created if missing) under the
    Hugging Face names, with save_pretrained's metadata: what vLLM reloads after each step (the disk
    path, in the sampler's dtype), and the weights of the final export, which transformers loads
    once the caller writes config and tokenizer beside them. CPU memory on rank 0: one copy of the
    weights in `dtype`; on the GPU: one unsharded parameter at a time."""
    sd = {}
    for name, t in sampler_weights(policy, dtype):
        if out_dir is not None:
            # no copy on CPU: full_tensor() is fresh, and a plain parameter is only read until saved
            sd[name] = t.to("cpu").contiguous()
    if out_dir is not None:
        os.makedirs(out_dir, exist_ok=True)
        # the header save_pretrained writes, which some transformers versions check on loading
        save_file(sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})


def export_pretrained(policy, tokenizer, out_dir: str | None, dtype: torch.dtype | None) -> None:
    """A directory that transformers' from_pretrained and vLLM load: on rank 0 (the one rank whose
    `out_dir` is not None) the config and generation config of `policy.lm` and the tokenizer,
    then `export_weights(policy, out_dir, dtype)` (a collective: every rank calls it). For the
    sampler's start after a resume (dtype: the sampler's) and the final export (None: as
    trained)."""
    if out_dir is not None:
        policy.lm.config.save_pretrained(out_dir)  # creates out_dir if missing
        policy.lm.generation_config.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
    export_weights(policy, out_dir, dtype)


def nccl_sender(
    policy, dtype: torch.dtype, *, rank: int, client, address: str, port: int, world_size: int
):
    """The GPU fast path, trainer side (NOT RUN YET: no GPU with vLLM has been available): vLLM
    0.32's NCCL weight-transfer engine (vllm.distributed.weight_transfer) over `sampler_weights`.
    Call on every trainer rank once the engine runs: rank 0 is the sender and rendezvouses with the
    engine's tp x dp workers, on every node (vLLM ranks worker w of DP engine d as 1 + d x tp + w:
    nccl_common.worker_init_process_group), over a TCPStore on `address`:`port` (rank 0's node:
    127.0.0.1 when every engine is there; world_size = 1 + tp x dp; `client`
    = the Sampler's sync_client, None on other ranks, which only join the FSDP2 gathers). Returns
    the engine; its send_weights() (every rank, after each step) pauses vLLM, gathers each parameter
    in `dtype` on the GPU and broadcasts it, loads it and resumes."""
    from vllm.distributed.weight_transfer.nccl_engine import (
        NCCLTrainerInitInfo,
        NCCLTrainerWeightTransferEngine,
    )

    info = NCCLTrainerInitInfo(
        master_address=address, master_port=port, world_size=world_size, rank=rank
    )
    source = sampler_source(policy, dtype)
    return NCCLTrainerWeightTransferEngine.trainer_init(info, client=client, source=source)


def sampler_source(policy, dtype: torch.dtype):
    """`sampler_weights` as vLLM's `WeightSource` (metadata without a gather, then a fresh pass per
    round); its metadata and iteration agree name for name, dtype for dtype, shape for shape, as the
    NCCL engine requires."""
    from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource

    class Source(WeightSource):
        def metadata(self):
            params = policy.named_parameters()
            return [ParamMeta(n.removeprefix("lm."), dtype, tuple(p.shape)) for n, p in params]

        def __iter__(self):
            return sampler_weights(policy, dtype)

    return Source()


def save_checkpoint(run_dir: str, step: int, policy, optimizer, state: dict) -> None:
    """Model and optimizer, sharded, with torch.distributed.checkpoint (every rank writes its
    shards), then the run state (state.json, atomically: a checkpoint without it does not exist),
    then older checkpoints are deleted."""
    checkpoints = os.path.join(run_dir, "checkpoints")
    name = f"step_{step:06d}"
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=os.path.join(checkpoints, name))
    dist.barrier()
    if dist.get_rank() == 0:
        tmp = os.path.join(run_dir, "state.json.tmp")
        with open(tmp, "w") as f:
            # the checkpoint's name, not its path: a run directory may be moved
            json.dump({**state, "step": step, "checkpoint": name}, f)
        os.replace(tmp, os.path.join(run_dir, "state.json"))  # atomic: the checkpoint now exists
        for old in os.listdir(checkpoints):
            if old != name:
                shutil.rmtree(os.path.join(checkpoints, old), ignore_errors=True)
    dist.barrier()


def load_checkpoint(run_dir: str, policy, optimizer) -> dict:
    """Restore model and optimizer in place from the run's last checkpoint; returns its run state
    (state.json)."""
    with open(os.path.join(run_dir, "state.json")) as f:
        state = json.load(f)
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=os.path.join(run_dir, "checkpoints", state["checkpoint"]))
    set_state_dict(policy, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return state


def _kept(line: str, step: int, evals: set[int] | None) -> dict | None:
    try:
        rec = json.loads(line)
    except ValueError:  # the half-written last line of a killed run
        return None
    if rec.get("step", math.inf) > step:
        return None
    eval_line = "eval/version" in rec or rec.get("split") == "eval"
    if evals is None or not eval_line or rec["step"] in evals:
        return rec
    return None


def truncate_log(path: str, step: int, evals: set[int] | None = None) -> list[dict]:
    """Keep the lines of steps <= `step` (a resumed run rewrites what came after its checkpoint, and
    drops a line cut off by a kill) and return them, parsed. evals: the steps whose eval lines stay
    (metrics.jsonl lines with eval/version, samples.jsonl records of split "eval"): an eval
    finishes after the step it measured, so its line can come after the checkpoint and still carry
    a step <= `step`; the lines of an eval of any other step go (resume_logs says which stay)."""
    if not os.path.exists(path):
        return []
    keep, recs = [], []
    with open(path) as f:
        for line in f:
            rec = _kept(line, step, evals)
            if rec is not None:
                keep.append(line)
                recs.append(rec)
    with open(path, "w") as f:
        f.writelines(keep)
    return recs


def eval_point(line: dict) -> dict:
    """An eval's point in the run's eval history, from its metrics.jsonl line: the step (weight
    version) and gpu_hours it measured and its own metrics (eval/*), without eval/logged_at_step,
    which only says when it finished."""
    own = {k: v for k, v in line.items() if k.startswith("eval/") and k != "eval/logged_at_step"}
    return {"step": line["step"], "gpu_hours": line["gpu_hours"], **own}


def add_eval(history: list[dict], line: dict) -> None:
    """Insert the eval of metrics.jsonl line `line` into `history`, the finished evals in compute
    order (gpu_hours, then step), as eval_point: RunLog.log_evals as an eval finishes, resume_logs
    for one that finished after its checkpoint; the same point in the same place either way."""
    bisect.insort(history, eval_point(line), key=lambda h: (h["gpu_hours"], h["step"]))


def resume_logs(run_dir: str, state: dict) -> list[int]:
    """On --resume (rank 0): metrics.jsonl and samples.jsonl cut back to the checkpoint whose run
    state (state.json) is `state`; the lines of evals after it go, they run again. A checkpoint
    waits for no eval, so evals of its weights or earlier ones may still be running
    (state["pending_evals"], steps <= the checkpoint's): the line of one that finished after the
    checkpoint measured those weights, so it stays and joins state["history"] (in place) where the
    live run put it; an eval's samples stay with its line. Returns the pending evals' steps that
    never finished (no line): their weights are gone, except R0's and the checkpoint's own."""
    step = state["step"]
    done = {h["step"] for h in state["history"]}
    pending = set(state.get("pending_evals") or ()) - done  # none in a checkpoint from before
    lines = truncate_log(os.path.join(run_dir, "metrics.jsonl"), step, evals=done | pending)
    finished = set()
    for line in lines:
        if "eval/version" in line and line["step"] in pending - finished:
            add_eval(state["history"], line)
            finished.add(line["step"])
    # RunLog.write flushes an eval's samples before its line: with a line, its samples are whole
    truncate_log(os.path.join(run_dir, "samples.jsonl"), step, evals=done | finished)
    return sorted(pending - finished)


def clear_run(run_dir: str) -> None:
    """Delete what a run writes into its directory (logs, held-out split, partial checkpoints,
    fits, export), so a run that stopped before its first checkpoint starts again from step 0 in
    the same directory. Other files stay."""
    for name in (
        "metrics.jsonl",
        "samples.jsonl",
        "heldout.json",
        "state.json.tmp",
        "fit.json",
        "fit.png",
    ):
        if os.path.exists(os.path.join(run_dir, name)):
            os.remove(os.path.join(run_dir, name))
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        if name in ("checkpoints", "final") or name.startswith("resume_"):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)


def run_metadata(world: int) -> dict:
    """What made this run (modded-nanogpt style): code version, libraries, hardware, command
    line."""
    import transformers
    import vllm

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = "unknown"
    gpus = []
    if torch.cuda.is_available():
        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return {
        "commit": commit,
        "argv": sys.argv,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": vllm.__version__,
        "world_size": world,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "gpus": gpus,
    }
