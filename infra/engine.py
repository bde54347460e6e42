"""The vLLM engine under `generate.Sampler`: its arguments, processes, the thread its client runs
in, and where new weights land.

Part of the ScaleRL generator (arXiv 2510.13786): PipelineRL in-flight weight updates (§3.1, A.11)
and the FP32 LM head (§3.2, A.19). "Engine" means one thing here and everywhere: `Engine`, one vLLM
engine, its client (`AsyncLLM`, vLLM's engine client) built from `engine_args` and the processes it
started (`start_engine`: EngineCore, Workers). A `generate.Sampler` has one. `SamplerThread` is the
one place a sampler's thread and asyncio loop are started and shut down (the pipeline's training
engine, the eval engine, the tests' shared engine). vLLM adds `WorkerExtension`'s methods to each
of its workers, where weight updates load. Each reach into vLLM's internals is one named function
with the vLLM version it was checked on, pinned by `pytest tests/test_generate.py`.

Where it departs from the paper, and why (the paper does not say how its generators take weights):
1. New weights reach the engine from disk (a safetensors directory and vLLM's `reload_weights`)
   everywhere, or by NCCL from trainer rank 0 when the generator has GPUs of its own
   (`weight_transfer_backend`); the NCCL path is written against vLLM `NCCL_CHECKED_ON` and has not
   run on a GPU yet.
"""

import asyncio
import concurrent.futures
import contextlib
import logging
import multiprocessing
import os
import signal
import threading
import time

import psutil  # a vLLM dependency
import torch
import vllm
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

from config import BadInput
from infra.loading import check_cpu_memory
from infra.placement import CPU_KV_CACHE_GIB  # the KV cache on CPU when no size is given

# seconds Engine.shutdown waits in all for the engine's processes before killing them
SHUTDOWN_TIMEOUT = 20.0
# vLLM minor version whose weight-transfer API (vllm.distributed.weight_transfer) we drive
NCCL_CHECKED_ON = "0.32"
# renice's passes at most (2-3 were needed against threads starting threads every 2 ms)
RENICE_PASSES = 100
# SyncClient's waits check for an abort (a dead engine, Pipeline.publish_by) this often
ABORT_POLL_S = 0.5
# os.environ is the process's: engines started from two threads at once must not mix their variables
_SPAWN_LOCK = threading.Lock()


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
    nccl_ok = cuda and dedicated and vllm_version.split(".")[:2] == NCCL_CHECKED_ON.split(".")
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
) -> AsyncEngineArgs:
    """vLLM engine arguments for RL sampling ("auto" dtype on CPU means bfloat16). CPU defaults:
    eager mode and a 1 GiB KV cache (a fraction of RAM fails whenever other processes hold memory);
    GPU: CUDA graphs, 85% memory. Requests are served by priority (`generate.ANSWER_PRIORITY`).
    fp32_head=False leaves the LM head in the model dtype (the paper's `loo-fp32` ablation)."""
    if not cuda and gpu_memory_utilization is None and kv_cache_gib is None:
        kv_cache_gib = CPU_KV_CACHE_GIB
    kv_cache_bytes = None if kv_cache_gib is None else int(kv_cache_gib * 2**30)
    head = {"head_dtype": "float32"} if fp32_head else {}  # §3.2, A.19; vLLM 0.32 refuses None
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
        worker_extension_cls=f"{__name__}.WorkerExtension",  # vLLM's hook for extra RPCs
        # on a GPU vLLM's stats (KV cache use, preemptions) are what tunes max_num_seqs
        disable_log_stats=not cuda,
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
    vLLM's workers), for `Engine`. Raises ValueError for a bad nice before anything starts;
    BadInput (code 1), one line naming the flag that sizes vLLM's memory, when the engine fails to
    start (vLLM's engine-core process prints the cause above: most often too little free memory)."""
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
        data_parallel_size (the engine uses tp * dp devices), gpu_memory_utilization, kv_cache_gib.
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
        devices = kwargs.get("tensor_parallel_size", 1) * kwargs.get("data_parallel_size", 1)
        if gpus is not None and len(gpus) != devices:
            raise ValueError(
                f"gpus={gpus} must list tensor_parallel_size * data_parallel_size devices"
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
