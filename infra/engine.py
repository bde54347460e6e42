"""The vLLM engine under `generate.Sampler`: its arguments, processes, the thread its client runs
in, and where new weights land.

Part of the ScaleRL generator (arXiv 2510.13786): PipelineRL in-flight weight updates (§3.1, A.11)
and the FP32 LM head (§3.2, A.19). "Engine" means one thing here and everywhere: `Engine`, one vLLM
engine, its client (`AsyncLLM`, vLLM's engine client) built from `engine_args` and the processes it
started (`start_engine`: EngineCore, and Workers where vLLM runs them apart; on CPU the worker is
in EngineCore, `UniProcCPUExecutor`). A `generate.Sampler` has one. `SamplerThread` is the
one place a sampler's thread and asyncio loop are started and shut down (the pipeline's training
engine, the eval engine, the tests' shared engine). vLLM adds `WorkerExtension`'s methods to each
of its workers, where weight updates load. Each reach into vLLM's internals is one named function
with the vLLM version it was checked on, pinned by `pytest tests/test_generate.py`.
A generator on several nodes is one vLLM data-parallel engine: rank 0's `Engine` is its head and
each other node runs the command rank 0 prints (`headless_command`), the head's own arguments:

    python -m infra.engine --headless --model M ... --address HEAD --port P --local N --start-rank R

Where it departs from the paper, and why (the paper does not say how its generators take weights):
1. New weights reach the engine from disk (a safetensors directory and vLLM's `reload_weights`)
   everywhere, or by NCCL from trainer rank 0 when the generator has GPUs of its own
   (`weight_transfer_backend`); the NCCL path is written against vLLM `NCCL_CHECKED_ON` and has not
   run on a GPU yet.
"""

import asyncio
import concurrent.futures
import contextlib
import functools
import logging
import multiprocessing
import os
import shlex
import signal
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import psutil  # a vLLM dependency
import torch
import vllm
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.executor.uniproc_executor import UniProcExecutor

from config import BadInput
from infra.loading import check_cpu_memory
from infra.placement import CPU_KV_CACHE_GIB  # the KV cache on CPU when no size is given

# seconds Engine.shutdown waits in all for the engine's processes before killing them
SHUTDOWN_TIMEOUT = 20.0
# vLLM minor version whose weight-transfer API (vllm.distributed.weight_transfer) we drive
NCCL_CHECKED_ON = "0.32"
# vLLM minor version whose MoE routers and V1 model runner `capture_routes` reads
ROUTES_CHECKED_ON = "0.32"
# vLLM minor version whose CPU executor and OpenMP binding `UniProcCPUExecutor` follows
UNIPROC_CHECKED_ON = "0.32"
# renice's passes at most (2-3 were needed against threads starting threads every 2 ms)
RENICE_PASSES = 100
# SyncClient's waits check for an abort (a dead engine, Pipeline.publish_by) this often
ABORT_POLL_S = 0.5
# os.environ is the process's: engines started from two threads at once must not mix their variables
_SPAWN_LOCK = threading.Lock()


@dataclass(frozen=True)
class DPNodes:
    """A data-parallel generator spread over nodes (vLLM's multi-node DP): the head (rank 0's
    `Engine`, vLLM's DP rank 0 with its front end) runs `local` engines from DP rank 0 on, and each
    other node runs vLLM's headless engines (`serve_headless`, `python -m infra.engine --headless`)
    from its `start_rank` on; together `data_parallel_size` engines. address: the head node's
    address every node reaches (vLLM's DP handshake on `port`, the NCCL weight broadcast's
    rendezvous); never a loopback address across real nodes (one machine's tests use 127.0.0.1)."""

    address: str
    port: int  # vLLM's data_parallel_rpc_port: the head's handshake socket
    local: int  # engines on this node (data_parallel_size_local)
    start_rank: int = 0  # the first DP rank on this node: 0 on the head

    def vllm_kwargs(self) -> dict:
        """`AsyncEngineArgs` keywords (vLLM 0.32's names) for this node's share."""
        out = dict(
            data_parallel_address=self.address,
            data_parallel_rpc_port=self.port,
            data_parallel_size_local=self.local,
        )
        if self.start_rank:  # on the head vLLM would read a start rank as hybrid load balancing
            out["data_parallel_start_rank"] = self.start_rank
        return out


def weight_transfer_backend(
    requested: str = "auto",
    *,
    cuda: bool,
    dedicated: bool,
    vllm_version: str = vllm.__version__,
) -> str:
    """How new weights reach the engine, decided once from the placement and used by both sides:
    "disk" (a safetensors directory + vLLM `reload_weights`; works everywhere) or "nccl" (vLLM's
    weight-transfer engine, broadcast from trainer rank 0; CUDA only, and only when the generator
    has GPUs of its own: NCCL cannot put the sender and a receiver on one GPU). "auto" picks "nccl"
    on CUDA with `dedicated` generator GPUs when vLLM is the minor version the NCCL path was written
    against (`NCCL_CHECKED_ON`), "disk" otherwise. Raises ValueError for an unknown name, or "nccl"
    without CUDA, on a shared GPU or on another vLLM version."""
    if requested not in ("auto", "disk", "nccl"):
        raise ValueError(f"weight_transfer must be 'auto', 'disk' or 'nccl', got {requested!r}")
    nccl_ok = cuda and dedicated and checked_on(NCCL_CHECKED_ON, vllm_version)
    if requested == "nccl" and not nccl_ok:
        raise ValueError(
            f"weight_transfer='nccl' needs CUDA, generator GPUs no trainer rank uses and vLLM "
            f"{NCCL_CHECKED_ON}.x (cuda={cuda}, dedicated={dedicated}, vllm {vllm_version}); "
            "use 'disk'"
        )
    if requested != "auto":
        return requested
    if nccl_ok:
        return "nccl"
    return "disk"


def engine_args(
    model: str,
    *,
    cuda: bool,
    seed: int = 0,
    dtype: str = "auto",
    max_model_len: int | None = None,
    max_num_seqs: int = 256,
    tensor_parallel_size: int = 1,
    data_parallel_size: int = 1,
    gpu_memory_utilization: float | None = None,
    kv_cache_gib: float | None = None,
    weight_transfer: str = "disk",
    fp32_head: bool = True,
    nodes: DPNodes | None = None,
    routed_experts: bool = False,
) -> AsyncEngineArgs:
    """vLLM engine arguments for RL sampling ("auto" dtype on CPU means bfloat16). CPU defaults:
    eager mode and a 1 GiB KV cache (a fraction of RAM fails whenever other processes hold memory);
    GPU: CUDA graphs, 85% memory. Requests are served by priority (`generate.ANSWER_PRIORITY`).
    fp32_head=False leaves the LM head in the model dtype (the paper's `loo-fp32` ablation).
    nodes: data-parallel engines across nodes (`DPNodes`): data_parallel_size counts every engine,
    of which nodes.local run here (the head's) or, headless, from nodes.start_rank on.
    routed_experts: on CUDA, vLLM returns each token's routed experts (--routing-replay; Model
    Runner V2, which needs Triton: on CPU the workers record them instead, `capture_routes`)."""
    if not cuda and gpu_memory_utilization is None and kv_cache_gib is None:
        kv_cache_gib = CPU_KV_CACHE_GIB
    kv_cache_bytes = None if kv_cache_gib is None else int(kv_cache_gib * 2**30)
    head = {"head_dtype": "float32"} if fp32_head else {}  # §3.2, A.19; vLLM 0.32 refuses None
    # UniProcCPUExecutor: CPU, one worker, a checked vLLM
    one_process = not cuda and tensor_parallel_size == 1 and checked_on(UNIPROC_CHECKED_ON)
    return AsyncEngineArgs(
        model=model,
        seed=seed,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization or 0.85,
        kv_cache_memory_bytes=kv_cache_bytes,
        enforce_eager=not cuda,
        # the answer phase of an interrupted rollout reuses its thinking's KV
        enable_prefix_caching=True,
        # generate.ANSWER_PRIORITY: answer phases before waiting thinking phases (issue 25)
        scheduling_policy="priority",
        # log-probs of the distribution actually sampled (after temperature)
        logprobs_mode="processed_logprobs",
        hf_overrides=head,
        weight_transfer_config={"backend": "nccl"} if weight_transfer == "nccl" else None,
        use_tqdm_on_load=False,  # no loading bars at every in-flight weight update
        # vLLM's hook for extra RPCs; by its module's name, which `python -m infra.engine` is too
        worker_extension_cls="infra.engine.WorkerExtension",
        # on a GPU vLLM's stats (KV cache use, preemptions) are what tunes max_num_seqs
        disable_log_stats=not cuda,
        enable_return_routed_experts=routed_experts and cuda,
        # CPU: the worker in the engine-core process; otherwise vLLM's own choice
        distributed_executor_backend=UniProcCPUExecutor if one_process else None,
        **(nodes.vllm_kwargs() if nodes else {}),
    )


async def log_stats(client, interval: float | None = None) -> None:
    """Print vLLM's stats line (KV cache use, preemptions, prefix-cache hits, throughput) every
    `interval` s (None: vLLM's VLLM_LOG_STATS_INTERVAL, 10 s) while the engine lives: `AsyncLLM`
    collects its stats when started with them on (engine_args: on CUDA) but prints them only for
    a caller that asks, as vLLM 0.32's API server does (entrypoints/launchers/utils/
    server_utils.py). For a first GPU run to tune max_num_seqs by. Runs until cancelled."""
    if interval is None:
        interval = vllm.envs.VLLM_LOG_STATS_INTERVAL
    while not client.errored:
        await asyncio.sleep(interval)
        await client.do_log_stats()


def versions_from_spans(spans, n: int) -> list[int]:
    """Expand vLLM's weight-version spans of one request (`CompletionOutput.weight_versions`, vLLM
    >= 0.32: version labels over [start, end) output-token ranges, stamped by the engine core, which
    only changes labels while paused) into one int per token. Raises RuntimeError unless the spans
    tile [0, n) exactly."""
    out: list[int] = []
    for span in spans or []:
        if span.start != len(out):
            break
        out += [int(span.version)] * (span.end - span.start)
    if len(out) != n:
        raise RuntimeError(f"weight-version spans {spans} do not cover the {n} generated tokens")
    return out


def renice(pids, nice: int) -> int:
    """Lower every thread of the processes `pids` to nice `nice` (no privilege needed for our own
    children). Linux keeps a nice value per thread and a new thread inherits its starter's, so
    passes over /proc/PID/task (50x faster than psutil's) repeat until one changes nothing: a
    thread started mid-pass by one not yet lowered is caught by the next. Returns the threads
    changed; ones gone meanwhile are skipped. Raises ValueError unless 1 <= nice <= 19."""
    if not 1 <= nice <= 19:  # Linux caps nice at 19: a larger value is never reached
        raise ValueError(f"nice must be in [1, 19], got {nice}")
    changed = 0
    for _ in range(RENICE_PASSES):
        last = 0
        for pid in pids:
            with contextlib.suppress(FileNotFoundError):  # the process ended
                for tid in map(int, os.listdir(f"/proc/{pid}/task")):
                    with contextlib.suppress(OSError):  # the thread ended (or is not ours)
                        if os.getpriority(os.PRIO_PROCESS, tid) < nice:
                            os.setpriority(os.PRIO_PROCESS, tid, nice)
                            last += 1
        changed += last
        if not last:
            break
    return changed


def start_engine(
    args: AsyncEngineArgs, env: dict[str, str], nice: int = 0
) -> tuple[AsyncLLM, list[multiprocessing.Process], list[psutil.Process]]:
    """Start vLLM's `AsyncLLM` from `args`, with the variables `env` in os.environ while its
    processes spawn (they inherit them; ours are put back after). nice: if not 0, `renice` every
    thread of the new processes. Returns (the engine's client, its processes: our children, theirs:
    vLLM's worker processes, none on CPU), for `Engine`. Raises ValueError for a bad nice before
    anything starts; BadInput (code 1), one line naming the flag that sizes vLLM's memory, when the
    engine fails to start (vLLM's engine-core process prints the cause above: most often too
    little free memory)."""
    if nice:
        renice([], nice)  # checks nice only: it cannot raise once the engine runs
    with _SPAWN_LOCK:
        before = multiprocessing.active_children()
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)
        try:
            client = AsyncLLM.from_engine_args(args)
        except RuntimeError as e:
            # vLLM 0.32's parent-side error when the engine core died while starting; its cause
            # (e.g. cpu_worker's "Available memory ... is less than requested memory for kv") was
            # raised in that process and printed there
            if "Engine core initialization failed" not in str(e):
                raise
            raise BadInput(
                f"the vLLM engine did not start (its error is above); {_memory_hint(args)}", 1
            ) from None
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k)
                else:
                    os.environ[k] = v
        # listed under the lock, so another thread's engine is not counted as ours
        procs = [p for p in multiprocessing.active_children() if p not in before]
        workers = []
        for p in procs:
            if p.is_alive():
                workers += psutil.Process(p.pid).children(True)
    if nice:
        renice([p.pid for p in procs] + [w.pid for w in workers], nice)
    return client, procs, workers


def _memory_hint(args: AsyncEngineArgs) -> str:
    """What the engine asked of memory and the flag that sizes it, for a failed start."""
    if args.kv_cache_memory_bytes is not None:
        asked = args.kv_cache_memory_bytes / 2**30
        return f"if it is memory: lower --kv-cache-gib (asked {asked:g} GiB of KV cache per worker)"
    utilization = args.gpu_memory_utilization
    return f"if it is memory: lower --gpu-memory-utilization (asked {utilization:g} of each GPU)"


class EngineLinks:
    """Watches the connections of a data-parallel head's engines, on every node, to its front end,
    for `Engine.dead`: vLLM 0.32's head notices a remote engine's death only when that engine core
    fails cleanly (its ENGINE_CORE_DEAD message: `AsyncLLM.errored`); one killed outright (SIGKILL,
    the OOM killer, a lost node's process) says nothing, its requests never finish and its weight
    RPCs never answer; its own node's process manager watches only that node's engines. A killed
    process's TCP connection closes, though: a ZMQ monitor on the head's input socket (vLLM
    internals: `client.engine_core.resources.input_socket`, the ROUTER every engine's DEALER
    connects to; checked on vLLM 0.32, pinned by tests/test_nodes.py) reports it, within a second.
    A node cut off without closing its connections is left to the pipeline's generation timeout
    and the weight send's deadline. `lost` says what was seen, or None."""

    def __init__(self, client):
        import zmq

        self.lost: str | None = None
        self.closing = False  # set by Engine.shutdown: disconnections from then on are expected
        sock = client.engine_core.resources.input_socket
        address = f"inproc://scalerl-engine-links-{id(self)}"
        sock.monitor(address, zmq.EVENT_DISCONNECTED)
        # a plain (not asyncio) socket in the same ZMQ context: inproc needs the same one
        context = zmq.Context.shadow(sock.context.underlying)
        self._monitor = context.socket(zmq.PAIR)
        self._monitor.connect(address)
        self._thread = threading.Thread(target=self._watch, name="engine-links", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        try:
            while True:
                event = recv_monitor_message(self._monitor)
                if event["event"] == zmq.EVENT_MONITOR_STOPPED:
                    return  # the head's socket closed: the engine is shutting down
                if event["event"] == zmq.EVENT_DISCONNECTED and self.lost is None:
                    self.lost = "a vLLM data-parallel engine's connection to the head closed"
        except zmq.ZMQError:  # the context ended under us: shut down
            return
        finally:
            self._monitor.close(linger=0)


class Engine:
    """One vLLM engine: `client` (vLLM's `AsyncLLM`, which requests, RPCs and weight loads go
    through) and the processes it started, which `dead` watches and `shutdown` stops. A
    `generate.Sampler` has one (`sampler.engine`). Arguments:
      model: a local directory or a hub id, with its tokenizer. seed: the engine's seed.
      gpus: physical device ids (or UUIDs) for the engine processes: CUDA_VISIBLE_DEVICES is set
        to them while they are spawned (this process's CUDA is unaffected); placement.plan maps
        visible indices to these.
      weight_transfer: "disk" or "nccl" (`generate.Sampler.sync_client`), from the caller's
        `weight_transfer_backend`; "auto" takes `gpus` given as GPUs no trainer uses.
      nice: CPU priority of the engine's processes, every thread (`renice`; 19 = the lowest), for
        an engine that shares the CPU with the trainer (the eval engine on CPU).
      env: environment variables for the engine's processes (set while they start), e.g.
        VLLM_CPU_OMP_THREADS_BIND (`generate.cpu_bind`) for an engine with fewer threads.
      **kwargs: `engine_args` keywords: dtype, max_model_len, max_num_seqs, tensor_parallel_size,
        data_parallel_size (the engine uses tp * dp devices), gpu_memory_utilization, kv_cache_gib,
        nodes (`DPNodes`: some of the dp engines on other nodes; tp * nodes.local devices here).
    Raises ValueError for bad settings; BadInput (code 1), one line, for a KV cache larger than the
    free memory on CPU (before anything starts) or an engine that did not start (`start_engine`).
    """

    def __init__(
        self,
        model: str,
        *,
        seed: int = 0,
        gpus: list[int | str] | None = None,
        weight_transfer: str = "disk",
        nice: int = 0,
        env: dict[str, str] | None = None,
        **kwargs,
    ):
        nodes = kwargs.get("nodes")
        local = nodes.local if nodes else kwargs.get("data_parallel_size", 1)  # engines here
        devices = kwargs.get("tensor_parallel_size", 1) * local
        if gpus is not None and len(gpus) != devices:
            raise ValueError(
                f"gpus={gpus} must list tensor_parallel_size x the engines on this node devices"
            )
        cuda = torch.cuda.is_available()
        self.weight_transfer = weight_transfer_backend(
            weight_transfer, cuda=cuda, dedicated=gpus is not None
        )
        args = engine_args(
            model, cuda=cuda, seed=seed, weight_transfer=self.weight_transfer, **kwargs
        )
        if not cuda and args.kv_cache_memory_bytes is not None:  # None: a fraction of RAM
            check_cpu_memory(args.kv_cache_memory_bytes, devices)
        env = dict(env or {})
        if gpus is not None:  # inherited by the engine processes spawned below
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        # procs: our children (EngineCore); workers: theirs (vLLM's workers); shutdown ends both
        self.client, self.procs, self.workers = start_engine(args, env, nice)
        # engines on other nodes: their deaths seen by their connections (EngineLinks)
        self.links = EngineLinks(self.client) if nodes else None

    @property
    def kv_capacity(self) -> int:
        """Sequences of max_model_len tokens the KV cache of one engine holds, from vLLM's config
        after start (num_gpu_blocks, summed over the dp engines by vLLM, x block_size): so many
        never preempt one another."""
        config = self.client.vllm_config
        blocks = config.cache_config.num_gpu_blocks or 0
        blocks //= config.parallel_config.data_parallel_size
        return blocks * config.cache_config.block_size // config.model_config.max_model_len

    def dead(self) -> str | None:
        """Why the engine can no longer serve (shut down; its client saw it die; one of its
        processes exited), or None while it can. Any thread; cheap enough to poll."""
        if self.client is None:
            return "the vLLM engine is shut down"
        if self.client.errored:
            return "the vLLM engine died"
        if self.links is not None and self.links.lost and not self.links.closing:
            return f"{self.links.lost} (an engine process died, here or on another node)"
        exited = [
            f"{p.name} (exit code {p.exitcode})" for p in self.procs if p.exitcode is not None
        ]
        if exited:
            return f"vLLM engine process {', '.join(exited)} exited"
        return None

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Stop the engine and wait for its processes to end (idempotent; safe from any thread).
        vLLM's own shutdown can return while its engine-core process is still exiting; what is
        alive after `timeout` s in all is killed, so no process outlives this call (which returns
        within about timeout + 2 s)."""
        deadline = time.monotonic() + timeout
        left = lambda: max(0.0, deadline - time.monotonic())
        if self.links is not None:  # engines disconnecting now are shutting down, not dying
            self.links.closing = True
        if self.client is not None:
            logger = logging.getLogger("vllm")
            level = logger.level
            logger.setLevel(logging.CRITICAL)  # a dying engine core's errors are expected
            try:
                self.client.shutdown(timeout=min(5.0, left()))  # vLLM's own default grace: 5 s
            finally:
                logger.setLevel(level)
            self.client = None
        # our children: join them, so multiprocessing reaps them
        for proc in self.procs:
            proc.join(left())
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        # their children (vLLM workers)
        for proc in psutil.wait_procs(self.workers, timeout=left())[1]:
            proc.kill()
        self.procs = []
        self.workers = []


class SamplerThread:
    """Where a `generate.Sampler` runs: the asyncio loop every coroutine of it must run in, and the
    thread running that loop. Owned (no `loop` given): a new loop in a new daemon thread named
    `name`; `start` makes the sampler in it, `close` shuts both down. Borrowed (`sampler` running in
    `loop`, another thread's, as the tests' shared engine): used as is, never closed here. Other
    threads hand the loop coroutines with `submit` / `run`."""

    def __init__(self, name: str, sampler=None, loop: asyncio.AbstractEventLoop | None = None):
        self.owned = loop is None
        self.sampler = sampler
        self.loop = loop
        self._thread = None
        self._start = None  # start()'s future
        self._stats = None  # the log_stats task of a sampler whose engine collects stats
        self._made = threading.Event()  # set once start()'s coroutine ended, however it ended
        self._closed = False
        self._lock = threading.Lock()  # sampler and _closed, between start() and close()
        if self.owned:
            self.loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
            self._thread.start()

    def start(self, create) -> concurrent.futures.Future:
        """Make the sampler in the loop and return at once: `create` is the coroutine that makes it
        (`generate.Sampler.create(model, **kwargs)`, which blocks the loop while vLLM starts). The
        future's result() is the sampler (blocking start) or raises its start error. A sampler that
        is made after `close` stopped waiting for it is shut down here."""

        async def make():
            try:
                sampler = await create
                with self._lock:
                    self.sampler = sampler
                    closed = self._closed
                if closed:  # close() stopped waiting for the start: nothing else will stop it
                    sampler.engine.shutdown()
                elif getattr(sampler.engine.client, "log_stats", False):
                    self._stats = asyncio.ensure_future(log_stats(sampler.engine.client))
                return sampler
            finally:
                self._made.set()

        self._start = self.submit(make())
        return self._start

    def submit(self, coro) -> concurrent.futures.Future:
        """Run the coroutine `coro` in the loop, from another thread; its future."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        """Run `coro` in the loop and wait for its result (TimeoutError after `timeout` s)."""
        return self.submit(coro).result(timeout)

    def try_run(self, coro, timeout: float) -> None:
        """`run` for a shutdown path, where a stuck loop or a failing coroutine must not keep the
        rest from shutting down: errors are dropped, and the coroutine is cancelled after
        `timeout` s (one never started is closed with it)."""
        future = self.submit(coro)
        with contextlib.suppress(Exception):
            future.result(timeout)
        future.cancel()

    def wake(self, event: asyncio.Event) -> None:
        """Set `event`, an asyncio.Event of this loop, from any thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nothing left to wake
            self.loop.call_soon_threadsafe(event.set)

    def close(self, timeout: float) -> bool:
        """An owned one: shut the sampler's engine down (what is left of it killed), let vLLM's
        cancelled tasks finish, stop the loop, join the thread and close the loop, within about
        `timeout` s in all. True once nothing of it runs (at once if borrowed); False if the
        sampler is still starting after `timeout` s: `start` shuts it down once made, and the run's
        watchdog ends its processes if this process exits first."""
        if not self.owned:
            return True
        deadline = time.monotonic() + timeout
        left = lambda: max(0.0, deadline - time.monotonic())
        with self._lock:
            self._closed = True
        # (not the future: a caller's cancel marks it done while vLLM may still be starting)
        if self._start is not None and not self._made.wait(left()):
            return False
        if self._stats is not None:
            self.loop.call_soon_threadsafe(self._stats.cancel)
        if self.sampler is not None:
            self.sampler.engine.shutdown(timeout=max(left(), 1.0))  # kills what is left after it
            self.try_run(asyncio.sleep(0.2), left())  # vLLM's cancelled tasks end before the loop
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(left())
        if not self._thread.is_alive():
            self.loop.close()
        return True


async def every_engine_rpc(client, method: str, args: tuple = ()) -> list:
    """`collective_rpc` on every worker of every data-parallel engine, with every answer (a flat
    list, engine by engine, worker by worker). vLLM 0.32's `AsyncLLM.collective_rpc` reaches every
    engine too but returns engine 0's answers only (core_client.py: `call_utility_async` keeps
    `call_utility_all_async(...)[0]`); the client's `call_utility_all_async` is a vLLM internal,
    checked on vLLM `ROUTES_CHECKED_ON` and pinned by tests/test_nodes.py (two engines)."""
    answers = await client.engine_core.call_utility_all_async(
        "collective_rpc", method, None, args, None
    )
    return [a for engine in answers for a in engine]


def capture_routes(model_runner, store: dict) -> tuple[int, int]:
    """Record, in a vLLM worker, the experts each MoE layer routes every computed token to (issue
    27, `--routing-replay`): vLLM internals, checked on vLLM `ROUTES_CHECKED_ON` (V1 model runner,
    eager: the CPU build) and pinned by tests/test_routing.py. vLLM's own capture
    (`enable_return_routed_experts`) needs Model Runner V2, which needs Triton, so the CPU build
    refuses it; this one hooks the same place: each MoE layer's router `set_capture_fn`
    (fused_moe/router/base_router.py calls it with the logical top-k ids, (n, k), before any
    expert-parallel remapping), and at the last MoE layer of a forward maps its n rows to requests
    and positions with the runner's batch layout of that step (`input_batch.req_ids`,
    `query_start_loc`, `positions`, set by `_prepare_inputs` before the forward). Appends to
    `store[internal request id]` one (positions (m,) int64, experts (m, layers, k) int16) pair per
    step; `WorkerExtension.take_routes` pops them. Tokens served from the prefix cache are not
    computed, so they get no entry. Returns (MoE layers hooked, k); raises RuntimeError on
    another vLLM minor version, a Model Runner V2, or a model with no MoE layer."""
    from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter
    from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner

    if not checked_on(ROUTES_CHECKED_ON):
        raise RuntimeError(
            f"routing capture reads vLLM {ROUTES_CHECKED_ON}'s model runner; this is vLLM "
            f"{vllm.__version__}"
        )
    if not hasattr(model_runner, "input_batch"):
        raise RuntimeError(
            "routing capture needs vLLM's V1 model runner (VLLM_USE_V2_MODEL_RUNNER=0)"
        )
    if not model_runner.model_config.enforce_eager:  # a replayed CUDA graph runs no Python hook
        raise RuntimeError("routing capture needs an eager engine (on CUDA vLLM returns routes)")
    runners = [m for m in model_runner.get_model().modules() if isinstance(m, MoERunner)]
    runners = [m for m in runners if isinstance(m.router, BaseRouter)]
    if not runners:
        raise RuntimeError("routing capture: the model has no MoE layer with a vLLM router")
    order = {m.layer_id: i for i, m in enumerate(sorted(runners, key=lambda m: m.layer_id))}
    last = max(order)
    step: list = [None] * len(order)  # this forward's (n, k) ids, one per MoE layer

    def capture(layer_id: int, topk_ids: torch.Tensor) -> None:
        step[order[layer_id]] = topk_ids.to("cpu", torch.int16)
        if layer_id != last:
            return
        batch = model_runner.input_batch
        n_reqs = batch.num_reqs
        starts = model_runner.query_start_loc.np[: n_reqs + 1]  # each request's rows
        n = int(starts[-1])
        positions = model_runner.positions[:n].cpu().numpy()  # (n,) each row's place in its request
        experts = torch.stack(step, 1)[:n].numpy()  # (n, layers, k)
        for i, rid in enumerate(batch.req_ids[:n_reqs]):
            a, b = int(starts[i]), int(starts[i + 1])
            if b > a:
                store.setdefault(rid, []).append((positions[a:b].copy(), experts[a:b]))

    for m in runners:
        m.router.set_capture_fn(functools.partial(capture, m.layer_id))
    return len(runners), runners[0].router.top_k


def checked_on(minor: str, version: str = vllm.__version__) -> bool:
    """Whether vLLM `version` (e.g. "0.32.1") is of the minor version `minor` (e.g. "0.32") that
    code reading vLLM's internals was checked on (NCCL_, ROUTES_ and UNIPROC_CHECKED_ON)."""
    return version.split(".")[:2] == minor.split(".")


def bind_threads(cpus: set[int]) -> None:
    """Run this process on `cpus` only, with as many torch (OpenMP) threads: every thread's CPU
    affinity (threads started later inherit their starter's), then torch's thread count."""
    for tid in map(int, os.listdir("/proc/self/task")):
        with contextlib.suppress(ProcessLookupError):  # the thread ended
            os.sched_setaffinity(tid, cpus)
    torch.set_num_threads(len(cpus))


class UniProcCPUExecutor(UniProcExecutor):
    """vLLM's one-process executor (engine argument distributed_executor_backend) for a CPU engine
    of one worker: the worker runs in the engine-core process, bound to the CPUs vLLM's
    multiprocess executor would give it. vLLM 0.32 refuses "uni" on CPU and starts each worker in
    a process of its own, whose OpenMP binding it sets by environment variables before the process
    starts; that second process costs start-up and shutdown time and CPU time per sampled token
    (the engine core and its worker pass every step through a shared-memory queue; measured by
    bench/sampler.py, docs/results.md "Run time", issue 28). The binding is set at run time
    instead: vLLM's own CPU list for the worker (vllm.utils.ompmultiprocessing.OMPProcessManager,
    from VLLM_CPU_OMP_THREADS_BIND: "auto", a list such as `generate.cpu_bind`'s, or "nobind":
    none) as the process's affinity and torch's thread count (`bind_threads`), before the worker
    starts. A mask, not vLLM's one CPU per OpenMP thread (nor its KMP_ settings with Intel's
    OpenMP preloaded); the CPU "auto" reserves for vLLM's scheduler process is left to the others.
    vLLM internals, checked on UNIPROC_CHECKED_ON (another version: `engine_args` leaves vLLM's
    executor); pinned by tests/test_generate.py and tests/test_pipeline.py."""

    def _init_executor(self) -> None:
        from vllm.utils.ompmultiprocessing import OMPProcessManager

        # one list per worker, ours first; none off the CPU platform (it returns before making any)
        cpu_lists = getattr(OMPProcessManager(self.vllm_config), "cpu_lists", [])
        if cpu_lists:
            bind_threads(set(cpu_lists[0]))
        super()._init_executor()


class _NothingToReload(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" warning (model_loader/reload/layerwise.py,
    vLLM 0.32; logged for a layer that got no weights in a reload, whose tensors it then keeps) for
    the layers no checkpoint holds, so that in-flight updates do not read as failed ones:
    RotaryEmbedding (its cos/sin cache is computed) and a tied ParallelLMHead (its weight is the
    embedding's, saved once, as checkpoint.export_weights does). Others, untied heads too, warn."""

    def __init__(self, tied: bool):
        super().__init__()
        self.quiet = {"RotaryEmbedding", "ParallelLMHead"} if tied else {"RotaryEmbedding"}

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args[0] in self.quiet)


def quiet_reload_warnings(tied: bool) -> None:
    """Install `_NothingToReload` on vLLM's reload logger in this process (once)."""
    logger = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")
    if not any(isinstance(f, _NothingToReload) for f in logger.filters):
        logger.addFilter(_NothingToReload(tied))


class WorkerExtension:
    """Methods vLLM adds to each of its workers (engine argument `worker_extension_cls`), run by
    `collective_rpc`."""

    def ignore_sigint(self) -> None:
        """Ignore SIGINT in this worker. A terminal's Ctrl-C reaches every process of its foreground
        group, the engine's too; vLLM's worker handler (worker_main, checked on vLLM 0.32) then ends
        the worker mid-step, and its engine core fails with pages of tracebacks. Ignoring it, the
        engine core (its own SIGINT handler) aborts its requests and stops its workers with
        SIGTERM, or, with the worker in the engine-core process (one device), the engine serves on
        and the trainer stops it (Engine.shutdown). RPCs run in the worker's main thread, as
        signal.signal requires; pinned by tests/test_generate.py."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def capture_routes(self) -> tuple[int, int]:
        """Start recording each computed token's routed experts (`capture_routes`, once per
        worker); returns (MoE layers, k)."""
        if not hasattr(self, "_routes"):
            self._routes = {}
            self._route_shape = capture_routes(self.model_runner, self._routes)
        return self._route_shape

    def take_routes(self, request_id: str) -> tuple:
        """Pop what `capture_routes` recorded for the request vLLM calls `request_id` (vLLM 0.32
        appends "-" and 8 random characters to the caller's id: input_processor.assign_request_id):
        (positions, experts, shape) with positions and experts as int64 / int16 bytes (what vLLM's
        RPC serialisation passes through intact), experts of `shape` (m, layers, k), in
        computation order; m may be 0."""
        taken = []
        for rid in [r for r in self._routes if r.rpartition("-")[0] == request_id]:
            taken += self._routes.pop(rid)
        positions = np.zeros(0, np.int64)
        experts = np.zeros((0, *self._route_shape), np.int16)
        if taken:
            positions = np.concatenate([p for p, _ in taken]).astype(np.int64)
            experts = np.concatenate([e for _, e in taken])
        return positions.tobytes(), experts.tobytes(), experts.shape

    def reload_weights_retie(self, weights_path: str) -> None:
        """vLLM's `reload_weights`, then re-prepare a tied LM head (`_retie`). The warnings vLLM
        logs for the layers a checkpoint never holds are dropped (`_NothingToReload`)."""
        model = self.model_runner.get_model()
        quiet_reload_warnings(bool(model.config.tie_word_embeddings))
        self._forget_moe_kernels()
        self.reload_weights(weights_path=weights_path)
        self._retie()

    def load_named_weights(self, path: str, chunk: int = 4) -> None:
        """What vLLM's NCCL weight-transfer engine does with what it receives
        (NCCLWeightTransferEngine, vLLM 0.32: start_weight_update, then `model.load_weights` once
        per received buffer, then finish_weight_update), fed from a torch.save'd list of (name,
        tensor) pairs instead of a broadcast, `chunk` pairs per call, so the names and tensors the
        trainer would send are checked by the real model loader where there is no GPU."""
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        pairs = torch.load(path, weights_only=True)
        model = self.model_runner.get_model()
        quiet_reload_warnings(bool(model.config.tie_word_embeddings))
        self._forget_moe_kernels()
        initialize_layerwise_reload(model)
        for i in range(0, len(pairs), chunk):
            model.load_weights(pairs[i : i + chunk])
        finalize_layerwise_reload(model, self.model_runner.model_config)
        self._retie()

    def _forget_moe_kernels(self) -> None:
        """Before a reload on CPU, drop each MoE layer's kernel so that the reload prepacks the
        new experts: vLLM internals, checked on vLLM 0.32 and pinned by the tiny-moe reload test
        in tests/test_train.py. A reload re-runs UnquantizedFusedMoEMethod's
        process_weights_after_loading, which, finding its kernel built (moe_kernel not None: "a
        weight update"), skips the experts' own process_weights_after_loading: on CPU the padding
        and prepacking of w13 / w2 into the grouped-GEMM layout (experts/cpu_moe.py), so the
        kernel read the new weights unpacked (log-probs off by ~8 nats from the first reload on).
        Without a kernel the reload takes the first load's path (pad, prepack, a new kernel) and
        its result is copied into the old storage as for any layer. GPU backends prepack nothing
        there: left alone."""
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return
        for module in self.model_runner.get_model().modules():
            method = getattr(module, "quant_method", None)
            if type(method).__name__ == "UnquantizedFusedMoEMethod":
                method.moe_kernel = None

    def _retie(self) -> None:
        """Re-prepare a tied LM head after a reload: vLLM internals, checked on vLLM 0.32 and pinned
        by the tied-weights test in tests/test_generate.py. On CPU a reload refreshes the embedding
        the head shares, but the head loads no weights of its own, so its GEMM keeps the copy
        `dispatch_cpu_unquantized_gemm` prepacked from the old weights; re-running
        `process_weights_after_loading` repacks it (on GPU it does nothing)."""
        model = self.model_runner.get_model()
        head = model.lm_head
        if (
            model.config.tie_word_embeddings
            and type(head.quant_method).__name__ == "UnquantizedEmbeddingMethod"
        ):
            head.quant_method.process_weights_after_loading(head)


class SyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol (vllm.distributed.weight_transfer.base, checked on
    vLLM 0.32) over a `generate.Sampler` whose engine's client runs in another thread's loop; each
    call blocks until done, or until `abort` (the weight send's watchdog, Pipeline.publish_by: an
    RPC to a dead engine may never answer). The whole engine-side update happens in
    `update_weights` (the NCCL backend sends one payload per round), so the pause spans exactly
    that."""

    def __init__(self, sampler, loop: asyncio.AbstractEventLoop):
        self.sampler = sampler
        self.client = sampler.engine.client  # the AsyncLLM that receives
        self.loop = loop
        self._aborted: str | None = None  # why, once abort() was called

    def abort(self, why: str) -> None:
        """From any thread: the call in progress and every later one raise RuntimeError(why)
        instead of waiting for the engine."""
        self._aborted = why

    def _call(self, coro):
        """Run `coro` in the engine's loop and wait for its result, checking every
        ABORT_POLL_S whether abort() was called (then the coroutine is cancelled)."""
        if self._aborted:
            coro.close()
            raise RuntimeError(self._aborted)
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            with contextlib.suppress(concurrent.futures.TimeoutError):
                return future.result(ABORT_POLL_S)
            if self._aborted:
                future.cancel()
                raise RuntimeError(self._aborted)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call(
            self.client.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        )

    def start_weight_update(self) -> None:
        pass  # done inside update_weights, under the pause

    def update_weights(self, update_info) -> None:
        async def transfer():
            await self.client.start_weight_update()
            await self.client.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            await self.client.finish_weight_update()

        version = self.sampler.next_version  # Pipeline.publish_by's label (None: + 1)
        self.sampler.next_version = None  # taken: a later update must not reuse it
        self._call(self.sampler._swap(transfer(), version))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass  # done inside update_weights, which labels the weights with Sampler.next_version


def serve_headless(args: AsyncEngineArgs) -> None:
    """Run this node's share of a multi-node data-parallel generator:
    `args.data_parallel_size_local` engines, DP ranks from `args.data_parallel_start_rank` on,
    which join the head (rank 0's `Engine`) at `args.data_parallel_address` and
    `args.data_parallel_rpc_port`, then take requests, RPCs and weight updates from it exactly as
    its local engines do. Blocks until one of them exits
    (then stops the others) or SIGTERM / SIGINT. vLLM 0.32's `vllm serve --headless`
    (entrypoints/cli/serve.py, run_headless) on our `AsyncEngineArgs`, which that command only takes
    as its own flags (the worker extension, weight transfer and fp32-head overrides as JSON);
    internals checked on vLLM 0.32 and pinned by tests/test_nodes.py."""
    from vllm.usage.usage_lib import UsageContext
    from vllm.utils.network_utils import get_tcp_uri
    from vllm.v1.engine.utils import CoreEngineProcManager
    from vllm.v1.executor import Executor

    config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER, headless=True)
    parallel = config.parallel_config

    def stop(signum, frame):
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    manager = CoreEngineProcManager(
        local_engine_count=parallel.data_parallel_size_local,
        start_index=parallel.data_parallel_rank,
        local_start_index=0,
        vllm_config=config,
        local_client=False,
        handshake_address=get_tcp_uri(
            parallel.data_parallel_master_ip, parallel.data_parallel_rpc_port
        ),
        executor_class=Executor.get_class(config),
        log_stats=not args.disable_log_stats,
    )
    try:
        manager.monitor_engine_liveness()  # returns once one engine process exited
    finally:
        manager.shutdown(timeout=SHUTDOWN_TIMEOUT)
    if manager.failed_proc_name:
        raise SystemExit(f"infra.engine --headless: {manager.failed_proc_name} died")


# engine_args keywords the headless command carries, in its flags' order
HEADLESS_KEYS = (
    "seed",
    "dtype",
    "max_model_len",
    "max_num_seqs",
    "tensor_parallel_size",
    "data_parallel_size",
    "gpu_memory_utilization",
    "kv_cache_gib",
    "weight_transfer",
    "routed_experts",
)


def headless_command(model: str, nodes: DPNodes, **kwargs) -> str:
    """The command that starts `nodes`' engines on another node (`serve_headless`) with the same
    engine arguments as the head's: `model` and the `engine_args` keywords `kwargs` (HEADLESS_KEYS
    and fp32_head; others are refused with ValueError). Rank 0 prints it for each other node."""
    unknown = set(kwargs) - set(HEADLESS_KEYS) - {"fp32_head"}
    if unknown:
        raise ValueError(f"headless_command: not an engine argument it carries: {sorted(unknown)}")
    words = ["python -m infra.engine --headless", f"--model {shlex.quote(model)}"]
    for key in HEADLESS_KEYS:
        value = kwargs.get(key)
        if isinstance(value, bool):  # a switch: its flag alone when on
            words += [f"--{key.replace('_', '-')}"] if value else []
        elif value is not None:
            words.append(f"--{key.replace('_', '-')} {value}")
    if not kwargs.get("fp32_head", True):
        words.append("--no-fp32-head")
    words.append(f"--address {nodes.address} --port {nodes.port}")
    words.append(f"--local {nodes.local} --start-rank {nodes.start_rank}")
    return " ".join(words)


def headless_args(argv: list[str], cuda: bool | None = None) -> AsyncEngineArgs:
    """The engine arguments of `python -m infra.engine ARGV` (the words after the module name, as
    `headless_command` writes them): `engine_args` with this node's `DPNodes`. cuda: None = this
    machine's."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m infra.engine", description=main.__doc__)
    parser.add_argument("--headless", action="store_true", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int)
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--tensor-parallel-size", type=int, default=1)
    parser.add_argument("--data-parallel-size", type=int, required=True)
    parser.add_argument("--gpu-memory-utilization", type=float)
    parser.add_argument("--kv-cache-gib", type=float)
    parser.add_argument("--weight-transfer", default="nccl", choices=["disk", "nccl"])
    parser.add_argument("--routed-experts", action="store_true")
    parser.add_argument("--no-fp32-head", dest="fp32_head", action="store_false")
    parser.add_argument("--address", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--local", type=int, required=True)
    parser.add_argument("--start-rank", type=int, required=True)
    a = parser.parse_args(argv)
    nodes = DPNodes(a.address, a.port, a.local, a.start_rank)
    kwargs = {k: getattr(a, k) for k in HEADLESS_KEYS} | {"fp32_head": a.fp32_head}
    if cuda is None:
        cuda = torch.cuda.is_available()
    return engine_args(a.model, cuda=cuda, nodes=nodes, **kwargs)


def main() -> None:
    """`python -m infra.engine --headless ...`, the command `headless_command` writes: this node's
    engines of a multi-node generator (`serve_headless`)."""
    serve_headless(headless_args(sys.argv[1:]))


if __name__ == "__main__":
    main()
