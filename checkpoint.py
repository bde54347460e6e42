"""The run directory's durable state: sharded checkpoints (torch.distributed.checkpoint), the full-weight export
the sampler reloads after every step, log truncation on resume, and what produced the run (meta.json).

    runs/NAME/checkpoints/step_000050/   model + optimizer, one shard file per rank (DCP)
    runs/NAME/state.json                 step, weight version, prompt pool, held-out eval history, compute clock
    runs/NAME/metrics.jsonl, samples.jsonl, args.json, meta.json, heldout.json, fit.json, fit.png, final/

A checkpoint exists once its state.json is written (atomically, after every rank's shards), so a run killed at any
moment resumes from the last complete one. export_weights, save_checkpoint and load_checkpoint are collectives:
call them on every rank.
"""

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
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)


def export_weights(policy: torch.nn.Module, out_dir: str | None, dtype: torch.dtype) -> None:
    """Gather `train.Policy`'s full, unsharded weights (a collective: every rank calls it) and, on rank 0, save them to
    `out_dir/model.safetensors` under the Hugging Face names vLLM reloads; a tied head is saved once, as the
    input embedding. FSDP2 DTensors and plain tensors alike (StateDictOptions(full_state_dict=True))."""
    sd = get_model_state_dict(
        policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if out_dir is None:
        return
    sd = {k.removeprefix("lm."): v.to(dtype).contiguous() for k, v in sd.items()}
    if policy.lm.config.tie_word_embeddings:
        sd.pop("lm_head.weight", None)
    save_file(sd, os.path.join(out_dir, "model.safetensors"))


def save_checkpoint(run_dir: str, step: int, policy, optimizer, state: dict) -> None:
    """Model and optimizer, sharded, with torch.distributed.checkpoint (every rank writes its shards), then the run
    state (state.json, atomically: a checkpoint without it does not exist), then older checkpoints are deleted."""
    path = os.path.join(run_dir, "checkpoints", f"step_{step:06d}")
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=path)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(run_dir, "state.json.tmp"), "w") as f:
            json.dump(
                {**state, "step": step, "checkpoint": os.path.basename(path)}, f
            )  # run_dir-relative
        os.replace(os.path.join(run_dir, "state.json.tmp"), os.path.join(run_dir, "state.json"))
        for old in os.listdir(os.path.dirname(path)):
            if old != os.path.basename(path):
                shutil.rmtree(os.path.join(os.path.dirname(path), old), ignore_errors=True)
    dist.barrier()


def load_checkpoint(run_dir: str, policy, optimizer) -> dict:
    """Restore model and optimizer in place from the run's last checkpoint; returns its run state."""
    with open(os.path.join(run_dir, "state.json")) as f:
        state = json.load(f)
    model_sd, optim_sd = get_state_dict(policy, optimizer)
    sd = {"model": model_sd, "optim": optim_sd}
    dcp.load(sd, checkpoint_id=os.path.join(run_dir, "checkpoints", state["checkpoint"]))
    set_state_dict(policy, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return state


def _step_of(line: str) -> float:
    try:
        return json.loads(line).get("step", math.inf)
    except ValueError:  # the half-written last line of a killed run
        return math.inf


def truncate_log(path: str, step: int) -> None:
    """Keep the lines of steps <= `step` (a resumed run rewrites what came after its checkpoint, and drops a line
    cut off by a kill)."""
    if os.path.exists(path):
        with open(path) as f:
            keep = [line for line in f if _step_of(line) <= step]
        with open(path, "w") as f:
            f.writelines(keep)


def clear_run(run_dir: str) -> None:
    """Delete what a run writes into its directory (logs, held-out split, partial checkpoints, fits, export), so a
    run that stopped before its first checkpoint starts again from step 0 in the same directory. Other files stay."""
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
    """What made this run (modded-nanogpt style): code version, libraries, hardware, command line."""
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
    cuda = torch.cuda.is_available()
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
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if cuda
        else [],
    }
