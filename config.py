"""What a run is: the command line resolved into `Args` (every flag: flags.py, parsed by tyro) over
the `--model` presets and the `--recipe` bundles of the paper (presets.py), and the checks every
flag passes before any work (validate).

    python train.py --help                   # every flag with its default and docstring
    python train.py --recipe loo-dapo        # ScaleRL with one choice swapped (Figure 7)
    python train.py --model qwen3-8b         # the paper's lengths and batch (PAPER.md 9)

Precedence: the ScaleRL defaults (Args), then the --model preset, then the --recipe, then (with
--resume) the run's saved args; a flag given on the command line wins over all of them. The run
directory's args.json records the resolved values. Adding an ablation is a field in flags.py, its
use in train.py, and (optionally) a RECIPES row in presets.py.
"""

import argparse
import json
import math
import os
import re
import sys

import tyro

# light (no torch, vLLM or transformers): `--help` and flag errors answer before they load
import data
from flags import Args
from presets import PRESETS, RECIPES


class BadInput(Exception):
    """A mistake train.py reports in one line, `train.py: <message>`, with no traceback: exit code 2
    for a bad flag value (the argparse / tyro convention), 1 for an input found unusable while
    loading (data, model)."""

    def __init__(self, message: str, code: int = 2):
        super().__init__(message)
        self.code = code


def exit_with(error: BadInput) -> None:
    """Print the error's one line on stderr (once: rank 0 under torchrun) and exit with its code."""
    if os.environ.get("RANK", "0") == "0":
        print(f"train.py: {error}", file=sys.stderr, flush=True)
    raise SystemExit(error.code)


def has_cuda() -> bool:
    """torch.cuda.is_available(), importing torch (seconds) only on a machine with a GPU device node
    (NVIDIA's /dev/nvidiactl, ROCm's /dev/kfd): without one the driver cannot reach a GPU, so flag
    errors stay fast."""
    if not (os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")):
        return False
    import torch

    return torch.cuda.is_available()


def model_kind(model: str) -> str:
    """What a --model (or --path) value names: "preset" (a PRESETS row), "dir" (a local path:
    data.is_local_path), "hub" (org/name) or "unknown"."""
    # "hf" and "hf-cpu" are the rows an unknown model gets, not names to pass
    if model in PRESETS and not model.startswith("hf"):
        return "preset"
    if data.is_local_path(model):
        return "dir"
    if re.fullmatch(r"[\w.-]+/[\w.-]+", model):
        return "hub"
    return "unknown"


def parse_args(argv=None) -> Args:
    """Defaults = ScaleRL, then the --model preset, then the --recipe, then (with --resume) the
    run's saved args; explicit flags win over all of them. An unknown model (hub id or directory)
    gets the "hf" row with CUDA and the "hf-cpu" row without. Raises BadInput (code 2) for an
    unknown preset or recipe or a --resume directory that holds no run; tyro exits 2 on a malformed
    flag and 0 after --help."""
    argv = sys.argv[1:] if argv is None else argv
    # a first pass reads the three flags that pick the defaults the full parse starts from
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--model", default="tiny")
    pre.add_argument("--recipe", default="scalerl")
    pre.add_argument("--resume", default=None)
    known, _ = pre.parse_known_args(argv)
    if known.resume:
        default = saved_args(known.resume)
    else:
        default = preset_args(known.model, known.recipe)
    return tyro.cli(Args, args=argv, default=default)


def saved_args(run_dir: str) -> Args:
    """The Args a run saved in `run_dir`/args.json, with `resume` set to `run_dir`. Raises BadInput
    (code 2) when `run_dir` is missing or holds no args.json."""
    path = os.path.join(run_dir, "args.json")
    if not os.path.exists(path):
        if os.path.isdir(run_dir):
            raise BadInput(f"--resume {run_dir}: not a run directory (no args.json in it)")
        raise BadInput(f"--resume {run_dir}: no such directory")
    with open(path) as f:
        saved = json.load(f)
    # JSON has no tuples: give tuple fields (think_budget) their type back, as tyro expects
    for k, v in saved.items():
        if isinstance(getattr(Args, k, None), tuple):
            saved[k] = tuple(v)
    return Args(**{**saved, "resume": run_dir})


def preset_args(model: str, recipe: str) -> Args:
    """Args with the --model preset's row, then the --recipe's flags, over the ScaleRL defaults. An
    unknown model (hub id or directory) gets the "hf" row with CUDA, the "hf-cpu" row without.
    Raises BadInput (code 2) for an unknown recipe, or a model that is no preset, hub id or path."""
    if recipe not in RECIPES:
        raise BadInput(f"--recipe {recipe}: unknown; choose from {', '.join(RECIPES)}")
    kind = model_kind(model)
    if kind == "unknown":
        names = ", ".join(k for k in PRESETS if not k.startswith("hf"))
        raise BadInput(
            f"--model {model}: not a preset ({names}), a hub id (org/name) or a directory"
        )
    if kind == "preset":
        preset = dict(PRESETS[model])
    else:
        row = "hf" if has_cuda() else "hf-cpu"
        preset = dict(PRESETS[row], path=model)
    return Args(**{**preset, **RECIPES[recipe], "model": model, "recipe": recipe})


def parse_task_weights(items: list[str] | None) -> dict[str, float] | None:
    """--task-weights' TASK=WEIGHT items as {task: weight} (None stays None). Raises BadInput
    (code 2) naming an item that is not TASK=WEIGHT with a finite number >= 0, a task given twice,
    or no weight > 0 (none given, or all 0). Whether the tasks are the data's is checked once the
    data has loaded (filters.task_weights)."""
    if items is None:
        return None
    weights = {}
    for item in items:
        task, _, w = item.rpartition("=")
        try:
            weight = float(w)
        except ValueError:
            weight = math.nan
        if not task or not math.isfinite(weight) or weight < 0:
            raise BadInput(f"--task-weights {item}: must be TASK=WEIGHT, a number >= 0")
        if task in weights:
            raise BadInput(f"--task-weights {item}: task {task} given twice")
        weights[task] = weight
    if not any(weights.values()):
        raise BadInput(f"--task-weights {' '.join(items)}: needs a weight > 0")
    return weights


# ---- checks: one (flag, value, ok, why) per rule; validate raises on the first that fails --------
# Each group returns its checks in a fixed order, so the first bad flag reported never changes;
# `a` is `args`, short so that a check fits one line.


def schedule_checks(args: Args) -> list[tuple]:
    """The run's length, evaluations, timeouts, checkpoints and logs."""
    a = args
    return [
        ("--steps", a.steps, a.steps >= 1, "must be >= 1"),
        ("--eval-every", a.eval_every, a.eval_every >= 1, "must be >= 1"),
        ("--eval-size", a.eval_size, a.eval_size >= 1, "must be >= 1"),
        ("--eval-n", a.eval_n, a.eval_n >= 1, "must be >= 1"),
        ("--eval-gpus", a.eval_gpus, a.eval_gpus is None or a.eval_gpus >= 0, "must be >= 0"),
        ("--dist-timeout", a.dist_timeout, a.dist_timeout > 0, "must be > 0 (seconds)"),
        (
            "--gen-timeout",
            a.gen_timeout,
            a.gen_timeout is None or a.gen_timeout > 0,
            "must be > 0 (seconds)",
        ),
        ("--save-every", a.save_every, a.save_every >= 0, "must be >= 0 (0: only at the end)"),
        ("--log-samples", a.log_samples, a.log_samples >= 0, "must be >= 0"),
    ]


def groups_per_step(args: Args) -> int:
    """P, the prompt groups in one batch: --prompts-per-step scaled by --batch-scale (the DAPO and
    MiniMax recipes ran 80 prompts where ScaleRL runs 48)."""
    return round(args.prompts_per_step * args.batch_scale)


def size_checks(args: Args, world: int) -> list[tuple]:
    """Batch sizes: prompts and groups per step, micro-batches."""
    a = args
    P = groups_per_step(a)
    return [
        ("--prompts-per-step", a.prompts_per_step, a.prompts_per_step >= 1, "must be >= 1"),
        ("--batch-scale", a.batch_scale, P >= 1, "must leave >= 1 prompt per step"),
        ("--group-size", a.group_size, a.group_size >= 2, "must be >= 2 (group advantages)"),
        (
            "--group-size",
            a.group_size,
            a.group_size % world == 0,
            f"must divide across {world} ranks",
        ),
        ("--micro-batch-size", a.micro_batch_size, a.micro_batch_size >= 1, "must be >= 1"),
        (
            "--max-tokens-per-microbatch",
            a.max_tokens_per_microbatch,
            a.max_tokens_per_microbatch >= 0,
            "must be >= 0 (0: micro-batches of --micro-batch-size padded sequences)",
        ),
    ]


def length_checks(args: Args) -> list[tuple]:
    """Token budgets, and that a whole rollout fits vLLM's context."""
    a = args
    lo, hi = a.think_budget
    # the longest rollout: prompt, thinking, the phrase (at most one token per character), answer
    need = a.max_prompt_len + hi + len(a.phrase) + a.answer_budget
    return [
        ("--think-budget", f"{lo} {hi}", 0 < lo <= hi, "needs 0 < lo <= hi"),
        ("--answer-budget", a.answer_budget, a.answer_budget >= 1, "must be >= 1"),
        ("--max-prompt-len", a.max_prompt_len, a.max_prompt_len >= 1, "must be >= 1"),
        (
            "--max-model-len",
            a.max_model_len,
            need <= a.max_model_len,
            f"< max_prompt_len + think_budget[1] + phrase + answer_budget = {need}",
        ),
    ]


def algorithm_checks(args: Args) -> list[tuple]:
    """Sampling, off-policyness, filters, loss and optimizer."""
    a = args
    # PPO-off-policy-k trains k batches per weight version, so it needs k >= 1
    min_lag = 1 if a.async_mode == "ppo" else 0
    return [
        ("--temperature", a.temperature, a.temperature > 0, "must be > 0"),
        (
            "--max-lag",
            a.max_lag,
            a.max_lag >= min_lag,
            f"must be >= {min_lag} with --async-mode {a.async_mode}",
        ),
        ("--npr-threshold", a.npr_threshold, 0 < a.npr_threshold <= 1, "must be in (0, 1]"),
        ("--cispo-cap", a.cispo_cap, a.cispo_cap > 0, "must be > 0"),
        ("--eps-low", a.eps_low, a.eps_low >= 0, "must be >= 0"),
        ("--eps-high", a.eps_high, a.eps_high >= 0, "must be >= 0"),
        ("--lr", a.lr, a.lr > 0, "must be > 0"),
        ("--warmup-steps", a.warmup_steps, a.warmup_steps >= 0, "must be >= 0"),
        ("--weight-decay", a.weight_decay, a.weight_decay >= 0, "must be >= 0"),
        ("--adam-eps", a.adam_eps, a.adam_eps > 0, "must be > 0"),
        ("--max-grad-norm", a.max_grad_norm, a.max_grad_norm > 0, "must be > 0"),
    ]


def device_checks(args: Args) -> list[tuple]:
    """vLLM's dtype, parallelism and memory."""
    a = args
    dtypes = ("auto", "float32", "bfloat16", "float16")
    tp = a.tensor_parallel_size
    n_gpus = len(a.generator_gpus or [])
    mem = a.gpu_memory_utilization
    return [
        (
            "--gen-dtype",
            a.gen_dtype,
            a.gen_dtype in dtypes,
            "must be auto, float32, bfloat16 or float16",
        ),
        (
            "--tensor-parallel-size",
            tp,
            tp >= 1 and n_gpus % tp == 0,
            f"must be >= 1 and divide the {n_gpus} --generator-gpus",
        ),
        ("--gpu-memory-utilization", mem, mem is None or 0 < mem <= 1, "must be in (0, 1]"),
        (
            "--kv-cache-gib",
            a.kv_cache_gib,
            a.kv_cache_gib is None or a.kv_cache_gib > 0,
            "must be > 0",
        ),
    ]


def path_checks(args: Args) -> list[tuple]:
    """The recipe's name, the run directory, and a local model directory."""
    recipes = ", ".join(RECIPES)
    checks = [("--recipe", args.recipe, args.recipe in RECIPES, f"unknown; choose from {recipes}")]
    # with --resume a checkpoint in the run directory is expected, not refused
    run_dir = args.run_dir if not args.resume else None
    has_checkpoint = bool(run_dir) and os.path.exists(os.path.join(run_dir, "state.json"))
    checks.append(
        (
            "--run-dir",
            run_dir,
            not has_checkpoint,
            f"holds a run with a checkpoint; continue it with --resume {run_dir}, or pick another "
            "--run-dir",
        )
    )
    if args.path is not None and model_kind(args.path) == "dir":
        flag = "--model" if args.path == args.model else "--path"
        path = os.path.expanduser(args.path)
        exists = os.path.isdir(path)
        is_model = not exists or os.path.exists(os.path.join(path, "config.json"))
        checks.append((flag, args.path, exists, "no such directory"))
        checks.append((flag, args.path, is_model, "not a model directory (no config.json in it)"))
    return checks


def validate(args: Args, world: int) -> None:
    """One check per flag, before any expensive work, in the order of the groups above. Raises
    BadInput (code 2) naming the first bad flag and its value: `--steps 0: must be >= 1`."""
    checks = (
        schedule_checks(args)
        + size_checks(args, world)
        + length_checks(args)
        + algorithm_checks(args)
        + device_checks(args)
        + path_checks(args)
    )
    for flag, value, ok, why in checks:
        if not ok:
            raise BadInput(f"{flag} {value}: {why}")
    parse_task_weights(args.task_weights)


def cli(argv=None) -> Args:
    """train.py's command line: parse_args + validate (world size from torchrun's WORLD_SIZE),
    before torch loads. On a bad flag prints one line on stderr and exits 2."""
    try:
        args = parse_args(argv)
        validate(args, int(os.environ.get("WORLD_SIZE", "1")))
    except BadInput as e:
        exit_with(e)
    return args
