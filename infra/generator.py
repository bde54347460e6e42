"""The vLLM side of a run, driven from the trainer: rank 0's two engines (`Engines`: the pipeline's
training engine, pipeline.py, and the eval engine, infra/evals.py) started from the run's current
weights, with what they share (the weight directories, the watchdog over both engines' processes),
and each step's weights pushed to the pipeline (in flight, PipelineRL §3.1; or once per round,
PPO-off-policy-k, appendix A.11).

    python train.py --steps 2 --eval-every 2   # train.main starts the engines and pushes weights

Where it departs from the paper, and why:
1. Sampler weights are bf16 on GPU and fp32 on CPU (--gen-dtype auto); the trainer keeps fp32
   masters (the paper does not say).
2. On CPU the eval engine runs at the lowest CPU priority on one core, and evals may queue for
   many steps (`max_evals_pending`) rather than stall training.
Importing this module imports vLLM (~10 s): train.py does it once the inputs have loaded.
"""

import logging
import os
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass

import torch
import torch.distributed as dist

import filters
import generate
import pipeline
from config import Args, BadInput
from infra import checkpoint, engine, evals, launch, watchdog
from infra.launch import free_port, rank0_call
from infra.weight_dirs import VERSIONS_ALIVE, WeightDirs, weights_parent

EVAL_NICE = 19  # the eval engine's CPU priority when it shares the CPU with the trainer (lowest)
# the weight send's deadline: 1 GB/s, 10-100x below what NVLink or PCIe moves (a dead engine ends
# it sooner), and never under 2 minutes, which covers vLLM's pause and the first send's set-up
SEND_BYTES_PER_S = 1e9
SEND_TIMEOUT_MIN_S = 120.0


def weight_pusher(
    policy, pipe, backend: str, dtype, engine_ranks: int, stop: dict, address: str = "127.0.0.1"
):
    """push(version, snapshot=None), called on every rank after each step: the new weights to the
    sampler, as trainer version `version`. "disk": gathered per parameter in the sampler dtype
    (checkpoint.export_weights), saved by rank 0 into a fresh pipeline directory and loaded in
    flight (pipe.publish). "nccl" (NOT RUN YET, no GPU with vLLM so far): vLLM's weight-transfer
    engine, set up here once (checkpoint.nccl_sender, rendezvous on `address`: rank 0's node; rank
    0 sends to the engine's `engine_ranks` = tp x dp workers, every node's), broadcasts each
    parameter gathered in the sampler dtype on the GPU when the pipeline releases the version
    (nccl_pusher), every rank joining the gathers.
    snapshot (every rank or none; an eval step): called on rank 0 with a directory holding the
    version's weights (with None elsewhere) before the sampler may load and delete it, for
    the eval engine to snapshot (EvalEngine.submit). Under "nccl" that directory is written for it
    (an export, every rank joining, once per eval) and deleted after. stop: the run's stop flag
    (launch.on_stop_signal), which "nccl" reads and sets (nccl_pusher)."""
    if backend == "disk":

        def push(version: int, snapshot=None) -> None:
            out_dir = pipe.weights_dir(version) if pipe else None
            checkpoint.export_weights(policy, out_dir, dtype)
            if snapshot is not None:
                snapshot(out_dir)
            if pipe:
                pipe.publish(out_dir, version)

        return push
    client = pipe.sampler.sync_client(pipe.loop) if pipe else None
    sync = checkpoint.nccl_sender(
        policy,
        dtype,
        rank=dist.get_rank(),
        client=client,
        address=address,
        port=free_port(),
        world_size=1 + engine_ranks,
    )
    # numel of an FSDP2 shard (DTensor) is the whole parameter's
    weights_bytes = sum(p.numel() for p in policy.parameters()) * dtype.itemsize
    timeout = send_timeout(weights_bytes)
    return nccl_pusher(policy, pipe, sync, client, dtype, stop, timeout)


def send_timeout(weights_bytes: int) -> float:
    """Seconds rank 0's weight send may take (Pipeline.publish_by's deadline): `weights_bytes` (the
    sampler's weights, all of them) gathered and broadcast at SEND_BYTES_PER_S, at least
    SEND_TIMEOUT_MIN_S. Qwen3-8B in bf16 (16.4 GB): 164 s."""
    return max(SEND_TIMEOUT_MIN_S, weights_bytes / SEND_BYTES_PER_S)


def nccl_pusher(policy, pipe, sync, client, dtype, stop: dict, timeout: float | None):
    """The "nccl" push of weight_pusher over `sync`, anything with send_weights() (every rank, a
    collective: the parameters' gathers) and shutdown() (checkpoint.nccl_sender's engine; a fake in
    tests/test_stop_push.py), and `client` (rank 0's engine.SyncClient, None elsewhere).
    Rank 0 decides once whether this version is sent, and every rank follows (Pipeline.publish_by
    through launch.rank0_call): not under PPO-off-policy-k mid-round, nor once stop["requested"]
    (a Ctrl-C during the update: no rank enters the send, the step loop checkpoints and exits).
    Rank 0's send has a deadline (`timeout` s, and a dead engine ends it sooner): then the sender
    is shut down (its NCCL communicator aborted, the client's waits ended), what is left of the
    send (the gathers every rank joins) finishes, rank 0 says why in one line and sets
    stop["requested"] and stop["failed"], so that the step loop checkpoints this step and exits
    (train.main: exit code 1). If the send does not return even then, its error is raised."""

    def abort(why: str) -> None:
        aborted.append(why)
        if client is not None:
            client.abort(why)  # the RPCs to the engine stop waiting
        sync.shutdown()  # ncclCommAbort: the broadcast to a dead receiver ends; later ones no-ops

    def send() -> None:
        try:
            sync.send_weights()
        finally:
            ended.set()

    def agree(decide) -> bool:
        return rank0_call(decide, share=True)

    aborted = []  # why the watchdog ended a send
    ended = threading.Event()  # the send returned (or raised)

    def push(version: int, snapshot=None) -> None:
        if snapshot is not None:  # the eval engine loads from disk: one export per eval
            out_dir = pipe.weights_dir(version) if pipe else None
            checkpoint.export_weights(policy, out_dir, dtype)
            snapshot(out_dir)
            if pipe:
                shutil.rmtree(out_dir)
        if not pipe:  # rank 0's decision (publish_by): every rank sends, or none
            if agree(None):
                sync.send_weights()
            return
        aborted.clear()
        ended.clear()
        try:
            pipe.publish_by(version, send, agree=agree, abort=abort, timeout=timeout)
        except (RuntimeError, TimeoutError):
            # every rank left the send: they all reach the step's checkpoint
            if not (aborted and ended.is_set()):
                raise
            stop["requested"] = True
            stop["failed"] = aborted[-1]
            print(f"train.py: {aborted[-1]}: checkpoint, then exit", flush=True)

    return push


def start_weights(args: Args, run_dir: str, policy, inputs) -> str | None:
    """Where the sampler and the eval engine start from on --resume: the restored weights, exported
    in the sampler dtype with the config and tokenizer (inputs: loading.Inputs) into a temporary
    directory in the run directory (rank 0's path; None on the other ranks). None without
    --resume: the engines start from the model path."""
    if not args.resume:
        return None
    master = dist.get_rank() == 0
    start_dir = tempfile.mkdtemp(prefix="resume_", dir=run_dir) if master else None
    checkpoint.export_pretrained(policy, inputs.tokenizer, start_dir, inputs.gen_dtype)
    return start_dir


def sampler_kwargs(args: Args, plan, dtype: torch.dtype, backend: str, seed: int) -> tuple:
    """(sampler_kwargs, eval_sampler_kwargs): the keyword arguments of the two samplers
    (generate.Sampler, each with its vLLM engine), from the flags and the placement plan. On CPU
    the eval engine takes the cycles the trainer leaves (nice EVAL_NICE)."""
    train_kwargs = dict(
        think_budget=tuple(args.think_budget),
        answer_budget=args.answer_budget,
        phrase=args.phrase,
        temperature=args.temperature,
        seed=seed,
        dtype=str(dtype).removeprefix("torch."),
        max_model_len=args.max_model_len,
        gpus=plan.generator,
        tensor_parallel_size=plan.tp,
        data_parallel_size=plan.dp,
        gpu_memory_utilization=plan.utilization,
        kv_cache_gib=args.kv_cache_gib,
        max_num_seqs=plan.max_num_seqs,
        weight_transfer=backend,
        interruptions=args.interruptions,
        fp32_head=args.fp32_head,
        nodes=dp_nodes(args, plan),
        routing_replay=args.routing_replay,
    )
    eval_kwargs = dict(
        train_kwargs,
        nodes=None,  # on rank 0's node only
        routing_replay=False,  # evals score rollouts, never train on them
        gpus=plan.eval.gpus,
        tensor_parallel_size=plan.eval.tp,
        data_parallel_size=plan.eval.dp,
        gpu_memory_utilization=plan.eval.utilization,
        max_num_seqs=plan.eval.max_num_seqs,
        weight_transfer="disk",  # snapshots: an eval loads one version, once
        logprobs=False,  # evals grade text
    )
    if not torch.cuda.is_available():  # one device: the eval engine gets what the trainer leaves
        eval_kwargs.update(nice=EVAL_NICE, env={"VLLM_CPU_OMP_THREADS_BIND": generate.cpu_bind(1)})
    return train_kwargs, eval_kwargs


def dp_nodes(args: Args, plan) -> engine.DPNodes | None:
    """The training engine's share of a generator with --remote-engines on other nodes: rank 0's
    node runs DP ranks 0 .. local-1 as the head; None when every engine is on rank 0's node."""
    if not plan.remote:
        return None
    return engine.DPNodes(args.node_address, args.node_port, local=plan.dp - plan.remote)


def headless_commands(args: Args, plan, model: str, train_kwargs: dict) -> list[str]:
    """The command each other node runs (`engine.headless_command`): --remote-engines engines as
    one node's worth of GPUs each (placement.Plan.remote_nodes), with the training engine's
    arguments (`train_kwargs`, sampler_kwargs' first) and the start model `model`."""
    keys = engine.HEADLESS_KEYS + ("fp32_head",)
    kwargs = {k: train_kwargs[k] for k in keys if k in train_kwargs}
    kwargs["routed_experts"] = train_kwargs.get("routing_replay", False)  # the Sampler's name
    out = []
    rank = plan.dp - plan.remote
    for n in plan.remote_nodes:
        nodes = engine.DPNodes(args.node_address, args.node_port, local=n, start_rank=rank)
        out.append(engine.headless_command(model, nodes, **kwargs))
        rank += n
    return out


def max_evals_pending(args: Args, weights_bytes: int) -> int:
    """How many evals may queue before a step waits for one. On CPU the eval engine (nice 19) only
    gets the cycles the trainer leaves, so evals fall behind; rather than stall training they
    queue, each a snapshot of hard links to one published version, up to 1 GiB of them (the tiny
    model: every eval of the run); the run's end waits for them (issue 10)."""
    if torch.cuda.is_available():
        return evals.EVALS_PENDING
    queued = min(args.steps // args.eval_every + 2, 2**30 // weights_bytes)
    return max(evals.EVALS_PENDING, queued)


def transfer_backend(args: Args, plan) -> str:
    """How each step's weights reach the sampler: "disk" or "nccl"
    (engine.weight_transfer_backend: --weight-transfer, else NCCL only on GPU with dedicated
    generator GPUs)."""
    cuda = torch.cuda.is_available()
    # engines on other nodes: NCCL or nothing (config.check_nodes refused disk)
    requested = "nccl" if plan.remote else args.weight_transfer
    try:
        return engine.weight_transfer_backend(requested, cuda=cuda, dedicated=plan.dedicated)
    except ValueError as e:
        raise BadInput(f"--weight-transfer: {e}") from None


@dataclass
class Engines:
    """Rank 0's two vLLM engines and what they share; every field None on the other ranks. pipe:
    the pipeline, on the training engine; eval_engine: the held-out evals, on an engine of their
    own; weight_dirs: the directories published versions are saved in (the eval engine snapshots
    them there); dog: the watchdog (infra/watchdog.py) that ends both engines' processes and
    deletes weight_dirs if this process is killed. train.py's `finally` calls close()."""

    pipe: pipeline.Pipeline | None = None
    eval_engine: evals.EvalEngine | None = None
    weight_dirs: WeightDirs | None = None
    dog: subprocess.Popen | None = None
    lent: bool = False  # the training engine serves the evals (lend)

    def lend(self) -> None:
        """Rank 0 once the step loop has ended, on CPU: the training engine, idle from then on,
        serves the queued evals beside the eval engine (Pipeline.lend, EvalEngine.borrow). There
        the evals queue behind training all run (max_evals_pending) and the run's end waits for
        them, the eval engine on one core while the training engine's core idles; two engines
        clear the queue in about half the time. Not on GPU, where at most EVALS_PENDING evals
        queue, nor on the other ranks (no engines): a no-op there, as is a second call. A lend
        that fails (a dead or hung training engine) only says so: the eval engine serves alone."""
        if self.pipe is None or self.eval_engine is None or torch.cuda.is_available() or self.lent:
            return
        self.lent = True
        try:
            self.eval_engine.borrow(*self.pipe.lend())
        except Exception as e:  # a time saving only: the run goes on without it
            why = f"{type(e).__name__}: {e}"
            print(f"warning: the training engine serves no eval ({why})", flush=True)

    def close(self) -> None:
        """Close both engines side by side (each shutdown may take seconds; each returns within
        pipeline.CLOSE_TIMEOUT), then delete the weight directories and stop the watchdog, unless
        the eval engine was still starting: then the watchdog ends it once this process exits."""
        eval_down = []  # [True]: nothing of the eval engine runs; [False]: it is still starting
        closer = None
        if self.eval_engine is not None:
            closer = threading.Thread(
                target=lambda: eval_down.append(self.eval_engine.close()), daemon=True
            )
            closer.start()
        if self.pipe is not None:
            self.pipe.close()
        if closer is not None:
            closer.join(pipeline.CLOSE_TIMEOUT)
        if self.weight_dirs is not None:
            self.weight_dirs.close()
        if self.dog is None:
            return
        if self.eval_engine is None or eval_down == [True]:
            watchdog.stop(self.dog)


def new_engines(
    args: Args,
    inputs,
    weights: str,
    prompts,
    pool,
    version: int,
    run_dir: str,
    stop: dict,
    backend: str,
) -> Engines:
    """Rank 0: the weight directories (on /dev/shm if it holds every version alive and every eval
    snapshot, else in the run directory), the watchdog (before either engine's processes exist),
    the pipeline (pipeline.Pipeline) sampling `prompts` from `pool`, started from `weights` at
    trainer version `version`, and the eval engine (evals.EvalEngine), returned once it runs (so
    that no Ctrl-C meets it starting); all closed if any fails. inputs: loading.Inputs (placement
    plan, P, reward functions, sampler dtype)."""
    plan = inputs.plan
    P = inputs.P
    weights_bytes = inputs.n_params * inputs.gen_dtype.itemsize  # one version, as vLLM loads it
    seed = args.seed + version
    train_kwargs, eval_kwargs = sampler_kwargs(args, plan, inputs.gen_dtype, backend, seed=seed)
    # the head waits for the other nodes' engines (vLLM's handshake) before it serves
    # the model as given (a hub id, not rank 0's cache directory it resolved to)
    model = args.path or weights
    for i, command in enumerate(headless_commands(args, plan, model, train_kwargs)):
        print(f"generator node {i + 1}: run there (in this repository): {command}", flush=True)
    # a group may wait behind every rollout in flight, each up to max_model_len tokens
    gen_timeout = args.gen_timeout or pipeline.group_timeout(
        args.max_model_len, 2 * P * args.group_size, plan.max_num_seqs * plan.dp
    )
    pending = max_evals_pending(args, weights_bytes)
    parent = weights_parent(weights_bytes, run_dir, versions=VERSIONS_ALIVE + pending)
    engines = Engines(weight_dirs=WeightDirs(parent))
    try:
        engines.dog = watchdog.start([engines.weight_dirs.root])  # before any engine process
        engines.pipe = pipeline.Pipeline(
            weights,
            prompts,
            pool,
            group_size=args.group_size,
            prompts_per_step=P,
            max_lag=args.max_lag,
            mode=args.async_mode,
            max_inflight=2 * P,
            reward_fn=inputs.reward_fn,
            sampler_kwargs=train_kwargs,
            gen_timeout=gen_timeout,
            version=version,
            weight_dirs=engines.weight_dirs,
            stop=lambda: stop["requested"],
        )
        # after the training engine, in the background: their starts never mix
        engines.eval_engine = evals.EvalEngine(
            weights,
            sampler_kwargs=eval_kwargs,
            reward_fn=inputs.reward_fn,
            gen_timeout=gen_timeout,
            weight_dirs=engines.weight_dirs,
            max_evals_pending=pending,
            stop=lambda: stop["requested"],
        )
        engines.eval_engine.wait_started()
    except BaseException:
        engines.close()
        raise
    return engines


def warn_if_kv_short(pipe, plan, args: Args) -> None:
    """Rank 0: a warning when vLLM's measured KV cache holds fewer full-length sequences per engine
    than the plan's estimate (plan.kv_seqs), from which max_num_seqs was sized
    (placement.KV_OVERCOMMIT x that many): rollouts then preempt one another more than planned."""
    kv_capacity = pipe.sampler.engine.kv_capacity
    if kv_capacity < plan.kv_seqs:
        print(
            f"warning: vLLM's KV cache holds {kv_capacity} sequences of "
            f"{args.max_model_len} tokens per engine, fewer than the {plan.kv_seqs} that "
            f"max_num_seqs {plan.max_num_seqs} was sized for: expect more preemptions",
            flush=True,
        )


def run_line(
    args: Args, inputs, run_dir, meta, world, device, backend, eval_prompts, prompts
) -> str:
    """What this run is, in one line (args.json and meta.json hold the rest)."""
    P, G = inputs.P, args.group_size
    return (
        f"run {run_dir} | commit {meta['commit'][:7]} | torch {meta['torch']}, vllm {meta['vllm']}"
        f" | {world} rank(s) on {device.type} | {inputs.path}: {inputs.n_params / 1e6:.2f}M params"
        f" | {args.data}: {len(prompts)} train, {len(eval_prompts)} held-out prompts | {P} prompts"
        f" x {G} = {P * G} rollouts per step | recipe {args.recipe} | weights via {backend}"
    )


def start(
    args: Args,
    inputs,
    policy,
    pool,
    prompts,
    eval_prompts,
    run_dir: str,
    meta: dict,
    world: int,
    device,
    step: int,
    stop: dict,
):
    """Every rank: rank 0's engines (new_engines: the pipeline sampling `prompts` from `pool`, the
    eval engine), started from the current weights (the model path, or on --resume the restored
    weights exported to a temporary start directory) while the other ranks poll (rank0_call); the
    run's one-line description; and the function that pushes each step's weights to the sampler
    (weight_pusher). Returns (engines: Engines, all None except on rank 0, push_weights,
    start_dir: rank 0's, to delete at the end)."""
    master = dist.get_rank() == 0
    start_dir = start_weights(args, run_dir, policy, inputs)
    weights = start_dir or inputs.path
    backend = transfer_backend(args, inputs.plan)
    if master:  # the engine's processes: warnings and errors only
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        logging.getLogger("vllm").setLevel(os.environ["VLLM_LOGGING_LEVEL"])
    engines = rank0_call(
        lambda: new_engines(args, inputs, weights, prompts, pool, step, run_dir, stop, backend)
    )
    if engines is None:  # the other ranks: no engines
        engines = Engines()
    if master:
        # vLLM's handler, set up as the engine started: after a Ctrl-C, its death is no news
        for handler in logging.getLogger("vllm").handlers:
            handler.addFilter(lambda record: not stop["requested"])
        line = run_line(args, inputs, run_dir, meta, world, device, backend, eval_prompts, prompts)
        print(line, flush=True)
        warn_if_kv_short(engines.pipe, inputs.plan, args)
        grace = launch.grace_warning(inputs.n_params, launch.torchrun_grace_s())
        if grace:
            print(grace, flush=True)
    # the sampler's vLLM workers, on every node: tp x dp
    engine_ranks = inputs.plan.tp * inputs.plan.dp
    address = args.node_address if inputs.plan.remote else "127.0.0.1"
    push_weights = weight_pusher(
        policy, engines.pipe, backend, inputs.gen_dtype, engine_ranks, stop, address
    )
    return engines, push_weights, start_dir


def next_batch(pipe, version: int):
    """Rank 0: the pipeline's next batch for trainer version `version` (pipeline.Batch); None when a
    stop (Ctrl-C) cut the wait for rollouts short; filters.AllRetired's message (a str) when
    No-Positive-Resampling has retired every training prompt and no batch is left."""
    try:
        return pipe.get_batch(version)
    except pipeline.Stopped:
        return None
    except filters.AllRetired as e:  # not an error: rank0_call would fail the other ranks on it
        return str(e)
