"""The qwen3-8b preset on a simulated 8-GPU node (8 x H100 or 8 x H200): the project's own sampler,
pipeline, eval engine, rewards, timeouts, lag rules and placement driven by a simulated trainer,
with vLLM replaced by bench/vllm_sim.py's model of its scheduler, in compressed time (issue 25, "The
simulator"; the run of arXiv 2510.13786 §3.1 PipelineRL-k, §7.1 evals, A.3 sizes, A.10 budgets).

    python bench/scale.py                           # 3 splits x (H100, H200), 10 steps, 2 evals
    python bench/scale.py --gpu h200 --splits 4/3/1 --steps 12 --eval-every 6
    python bench/scale.py --quick                   # one split, a small eval: a smoke run

Real, as `torchrun ... train.py --model qwen3-8b` runs them: config.PRESETS["qwen3-8b"] (P = 48
prompts x G = 16, k = 8, budgets U{10240..12288} + 2048, 1,000 held-out prompts x (16 + 1 greedy));
infra/placement.plan's split of the node (trainer ranks, generator engines, eval engine, each
engine's max_num_seqs and KV cache); infra/engine.engine_args' scheduler settings (policy, token
budget); pipeline.group_timeout's gen_timeout; generate.Sampler (two requests per rollout, budgets,
phrase, salts); pipeline.Pipeline (its producer, may_start / accept lag rules, in-flight loads from
disk, the per-group gen_timeout); infra/evals.EvalEngine (snapshots, one eval at a time, its
no-progress timer); tasks/math_reward.math_rewards (the synthetic text has no \\boxed{}: every
reward is 0, which changes nothing here: the pool never retires a prompt, as early in a real run).
The trainer loop follows train.py's: get_batch, the update, an eval submitted every --eval-every
steps (and at step 0: R0) before the weights are published, finished evals collected after each
step (a failed one stops the run), and the last evals awaited at the end.

Simulated: vLLM (bench/vllm_sim.py: per-engine scheduler, KV cache, prefix cache, DP balancer,
roofline step times; its own departures) and the trainer's GPU math. A trainer step lasts the
FLOPs of its batch at MFU (40%, an ASSUMPTION, not a measurement) on the trainer GPUs' bf16 peak:
per token of every rollout (prompt + completion), 2 N for a forward pass plus the attention's
4 x layers x q_dim per query-key pair (causal: L (L + 1) / 2 pairs per sequence); one forward, a
backward of twice that, and with activation checkpointing (the preset) one more forward: 4 passes.
The behaviour log-probs come from vLLM (no separate old-policy forward). Then the weights are
written for the sampler (weights bytes at vllm_sim.RELOAD_BYTES_PER_S, an assumption) and published
from disk; the engine's reload costs its simulated load time.

Time: both samplers run in one event loop of the bench's, and the simulators' clocks run
`--time-scale` simulated seconds per wall second only while that loop waits with nothing to do
(`IdleSelector`; vllm_sim's idle clock): the clients' own CPU time (the sampler turns every rollout
into tensors and text) costs no simulated time. That loop's own clock is the same idle clock
(`IdleLoop`), and the project's timeouts in it (the Pipeline's per-group asyncio.timeout, the
EvalEngine's no-progress timer and its eval_s) read the loop's clock: given divided by the scale,
they are exact in simulated time. The trainer waits its step on the training engine's simulated
clock. Every number printed is simulated time except "wall" and "fidelity" (simulated seconds per
wall second x scale: the share of the wall time the loop waited; the rest was the clients' CPU).

Where this departs from a GPU run, and why:
1. Weights go through disk (Pipeline.publish) on every split, where train.py picks NCCL for
   dedicated generator GPUs: the NCCL path needs torch.distributed and a weight-transfer engine.
2. The trainer's time is FLOPs at an assumed MFU: no padding, optimizer step, FSDP communication
   or the trainer side of a collective weight send.
3. The pipeline is closed after the last step while the last evals finish (train.py keeps its
   producer sampling): it only saves CPU time here, as nothing trains on those groups.
4. Prompts are synthetic, U{150..400} tokens (an assumption for a templated math problem); the
   rollout lengths are vllm_sim.LengthModel's assumptions.
5. config.validate runs on each split and its complaint is printed, but the split is simulated
   anyway: a flag rule is not orchestration.
"""

import argparse
import asyncio
import dataclasses
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import config  # noqa: E402
import filters  # noqa: E402
import generate  # noqa: E402
import pipeline  # noqa: E402
from bench import vllm_sim  # noqa: E402
from infra import engine, evals, placement  # noqa: E402
from infra.weight_dirs import WeightDirs  # noqa: E402
from tasks import data, math_reward  # noqa: E402

# ASSUMPTION: model FLOPs utilization of a trainer step (FSDP2 bf16, activation checkpointing);
# 40% is a common figure for dense 8B training on H100, not measured by this project
MFU = 0.40
N_GPUS = 8
SPLITS = ((4, 3, 1), (3, 4, 1), (2, 5, 1))  # trainer / generator / eval GPUs
# simulated seconds per wall second: gen_timeout (5.5-12 h) becomes 1-2 wall minutes, long beside
# the CPU time a group's rollouts cost the sampler on a loaded 2-core machine (~seconds)
TIME_SCALE = 300.0
PROMPT_LEN = (150, 400)  # tokens of a synthetic templated prompt (assumption)
# Qwen/Qwen3-8B config.json (the sizes placement.Shape reads)
QWEN3_8B_CONFIG = SimpleNamespace(
    model_type="qwen3",
    hidden_size=4096,
    intermediate_size=12288,
    num_hidden_layers=36,
    vocab_size=151936,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    tie_word_embeddings=False,
)
SHAPE = placement.Shape.from_config(QWEN3_8B_CONFIG)
DUMMY_WEIGHTS = "model.safetensors"  # what Sampler.update_weights looks for; never read


class FastTokenizer(vllm_sim.Tokenizer):
    """vllm_sim's tokenizer with the same decode done at C speed (numpy): the sampler decodes every
    ~11k-token rollout, and a Python loop per token would be most of the bench's CPU time."""

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        arr = np.asarray(ids, dtype=np.int64)
        special = np.flatnonzero(arr >= 256)
        out = []
        start = 0
        for i in special.tolist():
            out.append(arr[start:i].astype(np.uint8).tobytes().decode(errors="replace"))
            token = int(arr[i])
            if not (skip_special_tokens and token in vllm_sim.SKIPPED):
                out.append(self._names[token])
            start = i + 1
        out.append(arr[start:].astype(np.uint8).tobytes().decode(errors="replace"))
        return "".join(out)


def parse_splits(text: str) -> list[tuple[int, int, int]]:
    """ "4/3/1,3/4/1" -> [(4, 3, 1), (3, 4, 1)]: trainer / generator / eval GPUs, 8 in all. Raises
    ValueError otherwise."""
    out = []
    for item in text.split(","):
        parts = tuple(int(x) for x in item.strip().split("/"))
        if len(parts) != 3 or min(parts) < 1 or sum(parts) != N_GPUS:
            raise ValueError(f"split {item!r}: need T/G/E >= 1 each, summing to {N_GPUS}")
        out.append(parts)
    return out


def trainer_flops(seq_lens: list[int], *, params: int, checkpointing: bool) -> float:
    """FLOPs of one policy update over sequences of `seq_lens` tokens (prompt + completion): per
    pass 2 params per token plus attention, 4 x layers x q_dim per causal query-key pair (QK^T and
    AV, a multiply-add each); forward + backward (2x) = 3 passes, 4 with activation checkpointing's
    recomputed forward."""
    tokens = sum(seq_lens)
    pairs = sum(n * (n + 1) // 2 for n in seq_lens)
    attn = 4 * SHAPE.layers * SHAPE.q_dim
    passes = 4 if checkpointing else 3
    return passes * (2 * params * tokens + attn * pairs)


def synthetic_prompts(n: int, rng: random.Random, first_index: int = 0) -> list[data.Prompt]:
    """n thinking prompts of U{PROMPT_LEN} stand-in tokens (vllm_sim's tokenizer: <|im_start|> and
    letters), gold "1"."""
    out = []
    for i in range(n):
        ids = [vllm_sim.IM_START] + rng.choices(vllm_sim.LETTERS, k=rng.randint(*PROMPT_LEN))
        out.append(data.Prompt(first_index + i, "", "1", tuple(ids), thinking=True))
    return out


def preset_args(model: str = "qwen3-8b", **overrides) -> config.Args:
    """The preset's Args (config.preset_args, recipe scalerl) with `overrides` (Args fields)."""
    return dataclasses.replace(config.preset_args(model, "scalerl"), **overrides)


@dataclass
class Layout:
    """One split of the node, as the project places and configures it."""

    split: tuple[int, int, int]
    gpu: vllm_sim.GPU
    plan: placement.Plan
    gen: vllm_sim.EngineConfig  # the training engine's, per dp engine
    eval: vllm_sim.EngineConfig
    gen_timeout: float  # simulated seconds (pipeline.group_timeout, as infra/generator.py)
    refused: str | None  # config.validate's complaint for this many trainer ranks, if any


def kv_blocks(share_util: float, gpu: vllm_sim.GPU, args: config.Args) -> int:
    """KV blocks of one engine as placement estimates its share of a GPU (generator_bytes)."""
    parts = placement.generator_bytes(
        SHAPE,
        gpu_bytes=int(gpu.memory_bytes),
        utilization=share_util,
        tp=args.tensor_parallel_size,
        dtype_bytes=2,
        fp32_head=args.fp32_head,
    )
    per_block = placement.kv_bytes_per_token(SHAPE, 2, args.tensor_parallel_size) * vllm_sim.BLOCK
    return parts["kv"] // per_block


def engine_config(gpu, args, *, dp: int, max_num_seqs: int, blocks: int) -> vllm_sim.EngineConfig:
    """The simulated engine as infra/engine.engine_args configures vLLM's scheduler."""
    ea = engine.engine_args(
        args.path,
        cuda=True,
        max_model_len=args.max_model_len,
        max_num_seqs=max_num_seqs,
        data_parallel_size=dp,
        tensor_parallel_size=args.tensor_parallel_size,
    )
    kw = dict(gpu=gpu, max_num_seqs=ea.max_num_seqs, num_blocks=blocks)
    kw["policy"] = getattr(ea, "scheduling_policy", None) or vllm_sim.FCFS
    if getattr(ea, "max_num_batched_tokens", None):
        kw["max_num_batched_tokens"] = ea.max_num_batched_tokens
    return vllm_sim.EngineConfig(**kw)


def layout(args: config.Args, split: tuple[int, int, int], gpu: vllm_sim.GPU) -> Layout:
    """placement.plan for `split` on 8 GPUs of `gpu`, the engines' configs and the gen_timeout."""
    trainers, generators, n_eval = split
    P = config.groups_per_step(args)
    plan = placement.plan(
        SHAPE,
        n_gpus=N_GPUS,
        gpu_bytes=int(gpu.memory_bytes),
        cuda_visible_devices=None,
        world=trainers,
        local_world=trainers,
        generator_gpus=None,
        share_gpu=False,
        tp=args.tensor_parallel_size,
        utilization=args.gpu_memory_utilization,
        microbatch_tokens=args.max_tokens_per_microbatch,
        max_model_len=args.max_model_len,
        checkpointing=args.activation_checkpointing,
        fp32_head=args.fp32_head,
        dtype_bytes=2,
        P=P,
        G=args.group_size,
        max_lag=args.max_lag,
        mode=args.async_mode,
        max_inflight=2 * P,
        eval_gpus=n_eval,
        eval_seqs=args.eval_size * (args.eval_n + 1),
    )
    if plan.errors:
        raise ValueError(f"placement refused split {split}: {plan.errors}")
    if plan.dp * plan.tp != generators:
        raise ValueError(f"placement gave the generator {plan.dp * plan.tp} GPUs, not {generators}")
    gen = engine_config(
        gpu,
        args,
        dp=plan.dp,
        max_num_seqs=plan.max_num_seqs,
        blocks=kv_blocks(plan.utilization, gpu, args),
    )
    ev = plan.eval
    ev_cfg = engine_config(
        gpu,
        args,
        dp=ev.dp,
        max_num_seqs=ev.max_num_seqs,
        blocks=kv_blocks(ev.utilization, gpu, args),
    )
    # as infra/generator.new_engines: a group may wait behind every rollout in flight
    gen_timeout = args.gen_timeout or pipeline.group_timeout(
        args.max_model_len, 2 * P * args.group_size, plan.max_num_seqs * plan.dp
    )
    refused = None
    try:
        config.validate(args, trainers)
    except config.BadInput as e:
        refused = str(e)
    return Layout(split, gpu, plan, gen, ev_cfg, gen_timeout, refused)


@dataclass
class StepRow:
    """One trainer step; seconds and shares are simulated."""

    step: int
    end_s: float  # simulated time at the step's end, from the training engine's start
    step_s: float
    train_s: float  # the trainer's compute + weight export
    gen_busy: float  # training engines' busy time / (dp x step_s)
    trainer_idle: float  # 1 - train_s / step_s
    answer_wait: list[float]  # queue waits of the answer phases that finished in the step
    preemptions: int
    lags: tuple[float, float, float]  # train/lag_min, _mean, _max
    eval_wait_s: float  # waiting for room in the eval queue
    evals: list = field(default_factory=list)  # (version, queued_s, eval_s) finished this step


@dataclass
class RunReport:
    layout: Layout
    rows: list[StepRow] = field(default_factory=list)
    evals: list = field(default_factory=list)  # (version, queued_s, eval_s, done_at_s)
    error: str | None = None  # the first line of what stopped the run
    timed_out: bool = False  # that was a project timeout (TimeoutError)
    where: str = ""
    sim_s: float = 0.0
    wall_s: float = 0.0
    fidelity: tuple[float, float] = (math.nan, math.nan)  # training engine, eval engine
    prefix_hit: float = math.nan  # training engines' prefix-cache hit rate


class SimTrainer:
    """train.py's loop on rank 0 with the GPU math replaced by waits on the training engine's
    simulated clock. Drives a Pipeline and an EvalEngine, each on a SimEngine of its own."""

    def __init__(self, args, lay: Layout, *, time_scale: float, seed: int, safety_s: float, out):
        self.args = args
        self.lay = lay
        self.K = time_scale
        self.seed = seed
        self.safety_s = safety_s  # wall seconds of any one wait before the bench calls it a hang
        self.out = out
        self.P = config.groups_per_step(args)
        max_len = args.max_model_len
        self.selector = vllm_sim.IdleSelector()
        self.loop = None  # the engines' event loop, once started
        kw = dict(max_model_len=max_len, time_scale=time_scale, clock=self.selector.idle)
        self.tsim = vllm_sim.SimEngine(dp=lay.plan.dp, config=lay.gen, seed=seed, **kw)
        self.esim = vllm_sim.SimEngine(dp=lay.plan.eval.dp, config=lay.eval, seed=seed + 1, **kw)
        for sim in (self.tsim, self.esim):
            sim.tokenizer = FastTokenizer()
        rng = random.Random(seed)
        n_train = max(2000, 4 * self.P * (args.max_lag + 2))
        self.prompts = synthetic_prompts(n_train, rng)
        self.eval_prompts = synthetic_prompts(args.eval_size, rng, first_index=n_train)
        self.pool = filters.PromptPool(
            n_train, threshold=args.npr_threshold, policy=args.prompt_sampling, seed=seed
        )
        self.export_s = vllm_sim.QWEN3_8B.weight_bytes / vllm_sim.RELOAD_BYTES_PER_S

    def sampler_kwargs(self, sim) -> dict:
        a = self.args
        return dict(
            think_budget=tuple(a.think_budget),
            answer_budget=a.answer_budget,
            phrase=a.phrase,
            temperature=a.temperature,
            seed=self.seed,
            interruptions=a.interruptions,
            engine=vllm_sim.SimHost(sim),
        )

    def now(self) -> float:
        """The training engine's simulated time, read in its loop (its clock is set there)."""
        if self.loop is None:
            return self.tsim.now()

        async def read() -> float:
            return self.tsim.now()

        return asyncio.run_coroutine_threadsafe(read(), self.loop).result(self.safety_s)

    def sleep(self, loop, seconds: float) -> None:
        """Wait `seconds` of the training engine's simulated time (the trainer's GPU work)."""
        future = asyncio.run_coroutine_threadsafe(self.tsim.sleep(seconds), loop)
        future.result(self.safety_s + seconds / self.K)

    def run(self, steps: int, eval_every: int) -> RunReport:
        a = self.args
        rep = RunReport(self.lay)
        K = self.K
        tmp = tempfile.mkdtemp(prefix="scale_")
        start_dir = os.path.join(tmp, "start")  # the start model: read in place, never deleted
        os.makedirs(start_dir)
        open(os.path.join(start_dir, DUMMY_WEIGHTS), "w").close()
        dirs = WeightDirs(tmp)
        pipe = eval_engine = None
        # both samplers in one loop of ours (borrowed, as the tests' shared engine), whose waits
        # are the simulators' time: both clocks stay in step, and no client's work is simulated time
        self.loop = vllm_sim.IdleLoop(self.selector)
        worker = threading.Thread(target=self.loop.run_forever, name="sim-engines", daemon=True)
        worker.start()
        thread = engine.SamplerThread("sim-engines", None, self.loop)
        wall0 = time.monotonic()
        sim0 = 0.0
        esim0 = 0.0
        step = 0
        rep.where = "start"
        try:
            make = generate.Sampler.create
            tsampler = thread.run(make(f"{a.model}-sim", **self.sampler_kwargs(self.tsim)))
            ekw = dict(self.sampler_kwargs(self.esim), logprobs=False)  # as infra/generator.py's
            esampler = thread.run(make(f"{a.model}-sim-eval", **ekw))
            pipe = pipeline.Pipeline(
                tsampler,
                self.prompts,
                self.pool,
                group_size=a.group_size,
                prompts_per_step=self.P,
                max_lag=a.max_lag,
                mode=a.async_mode,
                max_inflight=2 * self.P,
                reward_fn=math_reward.math_rewards,
                loop=thread.loop,
                gen_timeout=self.lay.gen_timeout / K,
                weight_dirs=dirs,
            )
            eval_engine = evals.EvalEngine(
                esampler,
                loop=thread.loop,
                reward_fn=math_reward.math_rewards,
                gen_timeout=self.lay.gen_timeout / K,
                weight_dirs=dirs,
                max_evals_pending=evals.EVALS_PENDING,
            )
            wall0 = time.monotonic()
            sim0 = self.now()
            esim0 = self.esim.now()
            # R0: the start weights, before the first step (RunLog.submit_start_evals)
            self.submit(eval_engine, 0, start_dir)
            while step < steps:
                rep.where = f"step {step + 1}"
                row = self.step(pipe, eval_engine, step, steps, eval_every, sim0)
                step += 1
                rep.rows.append(row)
                rep.evals += [(*e, row.end_s) for e in row.evals]
                self.out(self.format_row(row))
            # the last evals (train.py's await_evals); the producer has nothing left to feed
            rep.where = "awaiting the last evals"
            pipe.close()
            deadline = time.monotonic() + 10 * self.safety_s
            while eval_engine.pending():
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"bench: evals {eval_engine.pending()} still pending (hang?)"
                    )
                eval_engine.wait(0, timeout=0.2)
                for e in self.collect(eval_engine):
                    rep.evals.append((*e, self.now() - sim0))
                    self.out(
                        f"    eval of version {e[0]} done at {fmt_h(self.now() - sim0)}: "
                        f"ran {fmt_h(e[2])} (simulated)"
                    )
            for e in self.collect(eval_engine):
                rep.evals.append((*e, self.now() - sim0))
        except Exception as exc:  # a project timeout or error: reported, the next split runs
            rep.error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            rep.timed_out = isinstance(exc, TimeoutError)
            self.out(
                f"    STOPPED at {rep.where} ({fmt_h(self.now() - sim0)} simulated): {rep.error}"
            )
            if not isinstance(exc, TimeoutError | RuntimeError | pipeline.Stopped):
                self.out(traceback.format_exc())
        finally:
            rep.wall_s = time.monotonic() - wall0
            rep.sim_s = self.now() - sim0
            esim_s = self.esim.now() - esim0
            rep.fidelity = (rep.sim_s / (rep.wall_s * K), esim_s / (rep.wall_s * K))
            stats = self.tsim.stats()
            queried = sum(s.prefix_queried_tokens for s in stats)
            rep.prefix_hit = sum(s.prefix_hit_tokens for s in stats) / max(1, queried)
            for closer in (pipe, eval_engine):
                if closer is not None:
                    closer.close()
            self.loop = None

            async def shutdown() -> None:  # in the loop: the drivers' cancellations run there
                for sim in (self.tsim, self.esim):
                    sim.shutdown()
                for _ in range(3):
                    await asyncio.sleep(0)

            thread.try_run(shutdown(), pipeline.CLOSE_TIMEOUT)
            loop = thread.loop
            loop.call_soon_threadsafe(loop.stop)
            worker.join(pipeline.CLOSE_TIMEOUT)
            loop.close()
            dirs.close()
            shutil.rmtree(tmp, ignore_errors=True)
        return rep

    def submit(self, eval_engine, version: int, weights: str) -> None:
        """RunLog.submit_eval: eval_n samples per held-out prompt and one greedy."""
        a = self.args
        eval_engine.submit(
            self.eval_prompts,
            a.eval_n,
            version=version,
            weights=weights,
            greedy=True,
            tag={"step": version},
        )

    def collect(self, eval_engine) -> list[tuple[int, float, float]]:
        """The evals finished since the last call: (version, queued_s, eval_s). eval_s is
        simulated (the EvalEngine times an eval on its loop's clock, IdleLoop's); queued_s is its
        wall seconds x time scale, the trainer thread's clock, which counts the clients' CPU time:
        not printed. Raises a failed eval's
        error (RunLog.log_evals: the run stops)."""
        return [(r.version, r.queued_s * self.K, r.eval_s * self.K) for r in eval_engine.results()]

    def step(self, pipe, eval_engine, step, steps, eval_every, sim0) -> StepRow:
        """One trainer step (train.py's loop body), timed on the training engine's clock."""
        tsim = self.tsim
        t0 = self.now()
        n_rec = len(tsim.records)
        stats0 = [dataclasses.replace(s) for s in tsim.stats()]
        batch = pipe.get_batch(step, timeout=self.safety_s)
        for g in batch.groups:  # train.py: No-Positive-Resampling's record of every group
            self.pool.record(g.index, sum(r >= 1.0 for r in g.rewards), len(g.rewards))
        lens = [
            len(c.prompt_ids) + len(c.completion_ids) for g in batch.groups for c in g.completions
        ]
        flops = trainer_flops(
            lens, params=SHAPE.active, checkpointing=self.args.activation_checkpointing
        )
        trainers = self.lay.split[0]
        train_s = flops / (trainers * self.lay.gpu.flops * MFU) + self.export_s
        self.sleep(pipe.loop, train_s)
        version = step + 1
        # an eval step waits for room in the eval queue (RunLog.await_eval_room)
        evaluating = version % eval_every == 0 or version == steps
        eval_wait = 0.0
        if evaluating:
            t_wait = self.now()
            eval_engine.wait(eval_engine.max_evals_pending - 1, timeout=self.safety_s)
            eval_wait = self.now() - t_wait
        out_dir = pipe.weights_dir(version)
        open(os.path.join(out_dir, DUMMY_WEIGHTS), "w").close()
        if evaluating:  # before publish: the sampler deletes the directory once loaded
            self.submit(eval_engine, version, out_dir)
        pipe.publish(out_dir, version)
        done = self.collect(eval_engine)
        t1 = self.now()
        stats1 = tsim.stats()
        records = tsim.records[n_rec:]
        waits = [
            r.first_scheduled - r.arrival
            for r in records
            if not r.thinking and r.first_scheduled is not None and r.state == vllm_sim.FINISHED
        ]
        busy = sum(b.busy_s - a.busy_s for a, b in zip(stats0, stats1, strict=True))
        step_s = t1 - t0
        m = batch.metrics
        return StepRow(
            step=version,
            end_s=t1 - sim0,
            step_s=step_s,
            train_s=train_s,
            gen_busy=busy / (len(stats1) * step_s),
            trainer_idle=1 - train_s / step_s,
            answer_wait=waits,
            preemptions=sum(
                b.preemptions - a.preemptions for a, b in zip(stats0, stats1, strict=True)
            ),
            lags=(m["train/lag_min"], m["train/lag_mean"], m["train/lag_max"]),
            eval_wait_s=eval_wait,
            evals=done,
        )

    @staticmethod
    def format_row(r: StepRow) -> str:
        wait = "-"
        if r.answer_wait:
            wait = f"{statistics.fmean(r.answer_wait):6.0f} / {max(r.answer_wait):6.0f}"
        evs = " ".join(f"v{v}: {fmt_h(s)}" for v, _, s in r.evals) or "-"
        lag = f"{r.lags[0]:.0f} / {r.lags[1]:.2f} / {r.lags[2]:.0f}"
        return (
            f"  {r.step:4d} {fmt_h(r.end_s):>8s} {r.step_s:7.0f} {r.train_s:7.0f} "
            f"{r.gen_busy:6.0%} {r.trainer_idle:7.0%} {wait:>15s} {r.preemptions:7d} "
            f"{lag:>14s} {r.eval_wait_s:6.0f}  {evs}"
        )


HEADER = (
    "  step    end    step s  train s  gen    trainer  answer wait s    preempt  "
    "lag min/mean/max  eval   evals done (version: run time)\n"
    "                                  busy   idle     mean / max                "
    "                  wait s"
)


def fmt_h(seconds: float) -> str:
    return f"{seconds / 3600:.2f} h"


def describe(lay: Layout, K: float) -> str:
    t, g, e = lay.split
    p = lay.plan
    lines = [
        f"simulated 8 x {lay.gpu.name}, split {t}/{g}/{e} (trainer / generator / eval GPUs): "
        f"generator dp {p.dp} x max_num_seqs {lay.gen.max_num_seqs} (KV ~{p.kv_seqs} full-length "
        f"seqs, {lay.gen.policy}), eval dp {p.eval.dp} x max_num_seqs {lay.eval.max_num_seqs} "
        f"({lay.eval.policy}); gen_timeout {fmt_h(lay.gen_timeout)}; trainer at MFU {MFU:.0%} "
        f"(assumption); time scale {K:g}; every time below is simulated"
    ]
    if lay.refused:
        lines.append(f"  note: train.py would refuse this split today: {lay.refused}")
    return "\n".join(lines)


def summary(reports: list[RunReport]) -> str:
    lines = [
        "summary (simulated; trainer at MFU 40%, an assumption):",
        "  gpu       split  steps  mean step  gen busy  trainer idle  answer wait  evals done  "
        "  sim time  wall   fidelity  prefix hits  outcome",
    ]
    for r in reports:
        lay = r.layout
        rows = r.rows
        step = statistics.fmean(x.step_s for x in rows) if rows else math.nan
        busy = statistics.fmean(x.gen_busy for x in rows) if rows else math.nan
        idle = statistics.fmean(x.trainer_idle for x in rows) if rows else math.nan
        waits = [w for x in rows for w in x.answer_wait]
        wait = statistics.fmean(waits) if waits else math.nan
        done = ", ".join(f"v{v} {fmt_h(s)}" for v, _, s, _ in r.evals) or "none"
        outcome = "ok"
        if r.error:
            outcome = ("TIMEOUT " if r.timed_out else "ERROR ") + f"at {r.where}: {r.error}"
        split = "/".join(map(str, lay.split))
        lines.append(
            f"  {lay.gpu.name:9s} {split:6s} {len(rows):5d}  {step:7.0f} s  {busy:7.0%}  "
            f"{idle:11.0%}  {wait:9.0f} s  {done:10s}  {fmt_h(r.sim_s):>9s}  {r.wall_s:4.0f} s  "
            f"{r.fidelity[0]:.2f}/{r.fidelity[1]:.2f}  {r.prefix_hit:10.1%}  {outcome}"
        )
    return "\n".join(lines)


def main(argv=None) -> list[RunReport]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", choices=["h100", "h200", "both"], default="both")
    parser.add_argument("--splits", default=",".join("/".join(map(str, s)) for s in SPLITS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--eval-every", type=int, default=None, help="default: --steps")
    parser.add_argument("--eval-size", type=int, default=None, help="default: the preset's")
    parser.add_argument("--time-scale", type=float, default=TIME_SCALE)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="the first split only, 3 steps, 100 held-out prompts: a smoke run (too small an eval "
        "to time out)",
    )
    a = parser.parse_args(argv)
    splits = parse_splits(a.splits)
    if a.quick:
        splits = splits[:1]
        a.steps = 3
        a.eval_size = a.eval_size or 100
    gpus = ["h100", "h200"] if a.gpu == "both" else [a.gpu]
    eval_every = a.eval_every or a.steps
    overrides = {}
    if a.eval_size:
        overrides["eval_size"] = a.eval_size
    args = preset_args(**overrides)
    safety = max(120.0, 3 * pipeline.group_timeout(args.max_model_len, 1, 1) / a.time_scale)
    reports = []
    for name in gpus:
        gpu = vllm_sim.GPUS[name]
        for split in splits:
            try:
                lay = layout(args, split, gpu)
            except ValueError as e:  # the split does not fit: what train.py would refuse
                print(f"simulated 8 x {gpu.name}, split {split}: not run: {e}\n", flush=True)
                continue
            print(describe(lay, a.time_scale), flush=True)
            print(HEADER, flush=True)
            sim = SimTrainer(
                args,
                lay,
                time_scale=a.time_scale,
                seed=a.seed,
                safety_s=max(safety, 4 * lay.gen_timeout / a.time_scale),
                out=lambda s: print(s, flush=True),
            )
            rep = sim.run(a.steps, eval_every)
            reports.append(rep)
            print(flush=True)
    print(summary(reports), flush=True)
    return reports


if __name__ == "__main__":
    main()
