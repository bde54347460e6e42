"""A stand-in for vLLM's `AsyncLLM` that models vLLM 0.32's scheduler in compressed time, so that
the project's Sampler, Pipeline and eval code can run at the paper's scale on a CPU (issue 25).

`SimEngine` has the `AsyncLLM` surface generate.py and infra/engine.py use (`generate`,
`pause_generation`, `resume_generation`, `update_weight_version`, `collective_rpc`,
`get_tokenizer`, `model_config`, `vllm_config`, `errored`, `shutdown`); behind it sit `dp` data-
parallel engines (`EngineCore`), each modelled on vLLM 0.32's source:
- the scheduler (vllm/v1/core/sched/scheduler.py, `Scheduler.schedule`): running requests first, in
  running order, each its remaining prefill chunk or one decode token, under
  max_num_batched_tokens; a request that cannot get its KV blocks preempts the last running one
  (fcfs) or the running one with the largest (priority, arrival) (priority), which goes back to the
  front of the waiting queue with its KV freed (recomputed on resume); then, only if this step
  preempted nothing, waiting requests in queue order while a slot (max_num_seqs), token budget and
  the KV blocks of the head's first chunk last (the head blocks the queue).
- the waiting queue (request_queue.py): a deque (fcfs) or a heap on (priority, arrival, id).
- the KV cache (kv_cache_manager.py, block_pool.py): 16-token blocks allocated as a request's
  tokens fill them; freed blocks join an LRU free queue (uncached ones at its front, cached ones at
  its back, a request's tail first) and keep their prefix-cache entry until reused.
- the prefix cache: full blocks keyed by a chain hash of (cache_salt, every token up to the block's
  end); a request's lookup takes the longest cached run of its blocks, at most (tokens - 1) // 16,
  from its own engine only; hits and queried tokens are counted.
- the DP load balancer (v1/engine/core_client.py, `DPLBAsyncMPClient.get_core_engine_for_request`,
  one client): score = max(in-flight requests, waiting + running) + waiting * 6 * max(0, KV use -
  0.5), lowest wins, scanning from a start index that rotates by one per request;
  `data_parallel_rank=r` pins engine r.
- step time: a roofline estimate (`step_time`): max(bytes / HBM bandwidth, FLOPs / peak) plus a
  fixed per-step overhead, bytes = all weights + the KV of every scheduled token's context, FLOPs =
  2 x params per token + attention (4 x layers x query heads x head_dim per query-key pair).
- time: simulated seconds. `time_scale=1000` runs them against the asyncio clock (one simulated
  hour is 3.6 s of wall time, so the project's code with its timeouts divided by 1,000 runs on it);
  `time_scale=None` is virtual time: the clock jumps to the next engine event once the clients have
  settled (deterministic; for tests and benches). Between events (an arrival that can be admitted,
  a finish, a preemption, a pause, the last chunk of a prefill) the steps are alike: every running
  request decodes one token, the last one perhaps prefilling a full chunk, so such a run is advanced
  in closed form (`EngineCore._run_plan`), not one Python step per token; `EngineConfig(bulk=False)`
  runs vLLM's schedule step by step instead, the reference the tests compare the runs with.

    python bench/vllm_sim.py                 # the eval workload, fcfs vs priority (simulated hours)
    python -m pytest tests/test_vllm_sim.py  # hand-worked scheduler, cache, balancer, roofline

Where it departs from vLLM, and why:
1. The model is not real: a request's length is drawn from `LengthModel` (seeded by the engine seed
   and the request id) and its tokens are synthetic: a marker token (`<|sim|>`, skipped on decode),
   8 letters unique to the request, '.' filler, 8 letters, then the stop token (`</think>` for a
   phase whose stop_token_ids hold it, else EOS). Log-probs are -1.0. Every request's lengths and
   letters come from (seed, request id), greedy ones too. The marker lets a prompt that extends an
   earlier output be hashed from that output's known structure instead of token by token, and be
   held as an `Extension` instead of a list (`PromptHasher`; the same keys, the match checked
   exactly): 17,000 pending answer phases would otherwise hold GBs of token lists. Such a request's
   RequestOutput has prompt_token_ids None.
2. Timing is a roofline, not a measurement: no kernel efficiency, CUDA graphs, sampler cost or
   tensor parallelism; the embedding table counts as read and multiplied like any weight. The
   per-step overhead and reload bandwidth are assumptions (constants below).
3. Not modelled: async scheduling, speculative decoding, long_prefill_token_threshold, the KV
   watermark, KV connectors, encoder inputs, LoRA; duplicate cached blocks (two identical prompts
   prefilled in the same step) are uncached in the simulator, where vLLM caches both copies.
4. The balancer reads each engine's exact waiting and running counts at the request's arrival
   (vLLM: a coordinator snapshot at most 100 ms old, bumped locally per routed request) and its KV
   use at the start of the engine's current decode run (vLLM: the snapshot's).
5. The priority policy preempts only as vLLM 0.32 does: when a running request cannot get a block,
   the victim is the running request with the largest (priority, arrival). A waiting request of
   higher priority never preempts a running one (0.32 has no such rule; it waits for a slot).
6. pause_generation takes only mode "keep" (the one generate.py uses; "abort" and "wait" raise);
   collective_rpc runs no worker code: a reload name takes weight bytes / `reload_bytes_per_s`
   with every engine blocked, any other name returns at once. Weight versions start at "0".
7. With a wall clock, simulated time runs only while the simulator waits for its next event: its
   own computing and asyncio's timer lateness are not counted, and a client's reaction costs its
   wall time x time_scale of simulated time. Virtual time (time_scale=None) suits code that only
   awaits the engine; code with timers of its own needs the wall clock.
8. Stats are the simulator's: prefill counts every token a step computes but a decode token (a
   prompt's last token too), and the time-averaged KV use of a run assumes its blocks grow linearly.
"""

import argparse
import asyncio
import collections
import dataclasses
import hashlib
import heapq
import itertools
import math
import random
import re
import selectors
import sys
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import numpy as np

BLOCK = 16  # vLLM's KV block size on CUDA (CacheConfig.block_size default)
# the stand-in tokenizer: ids 0-255 are bytes, then these
EOS, THINK_OPEN, THINK_CLOSE, MARK, IM_START = 256, 257, 258, 259, 260
SPECIAL = {
    "<|im_end|>": EOS,
    "<think>": THINK_OPEN,
    "</think>": THINK_CLOSE,
    "<|sim|>": MARK,
    "<|im_start|>": IM_START,
}
# what decode(skip_special_tokens=True) drops: Qwen3's tokenizer keeps <think> and </think>
SKIPPED = {EOS, MARK, IM_START}
FILL = ord(".")  # a synthetic output's filler token
LETTERS = list(range(ord("a"), ord("z") + 1))
HEAD = TAIL = 8  # letters unique to a request at each end of its output (departure 1)
LOGP = -1.0  # every sampled token's log-prob
FILL_HASH = hash((FILL,) * BLOCK)
MAX_BLOCKS = 1 << 17  # chain-key multipliers for sequences up to 2M tokens
# odd 64-bit multipliers, one per block position: a block's chain key is salt + sum over blocks so
# far of hash(block tokens) x multiplier (mod 2^64), equal for equal prefixes, distinct otherwise
# with probability 1 - 2^-64 per pair
_MULT = np.random.default_rng(0x5EED).integers(0, 2**63, MAX_BLOCKS, dtype=np.int64)
_MULT = (_MULT.view(np.uint64) << np.uint64(1)) | np.uint64(1)
KNOWN_PROMPT_MAX = 4096  # outputs of requests with longer prompts are not remembered (memory)
GIB = 2**30
# assumption, not a measurement: vLLM's CPU time per step beyond the roofline (scheduling, input
# preparation, sampling), of the order of the 1-2 ms gap between a roofline decode step and the
# inter-token latency reported for 8B models at small batch on H100
STEP_OVERHEAD_S = 1.5e-3
# assumption: a disk reload of safetensors from /dev/shm into GPU memory (page cache read + host to
# device copy), ~5 GB/s; 16.4 GB of Qwen3-8B bf16 weights then take ~3.3 s
RELOAD_BYTES_PER_S = 5e9
RELOADS = ("reload_weights", "reload_weights_retie")  # collective_rpc names that reload weights
VLLM_RESERVE_BYTES = 4 * GIB  # vLLM's activations and CUDA graphs (infra/placement.py's estimate)
FCFS, PRIORITY = "fcfs", "priority"
WAITING, RUNNING, FINISHED, ABORTED = "waiting", "running", "finished", "aborted"


@dataclass(frozen=True)
class GPU:
    """One accelerator's roofline numbers (datasheet peaks: an estimate, not a measurement)."""

    name: str
    hbm_bytes_per_s: float
    flops: float  # dense bf16 peak
    memory_bytes: float


# NVIDIA H100 SXM5 datasheet: 3.35 TB/s HBM3, 989 TFLOP/s bf16 dense (1,979 with sparsity), 80 GB
H100 = GPU("H100-SXM", 3.35e12, 989e12, 80e9)
# NVIDIA H200 SXM datasheet: 4.8 TB/s HBM3e, 989 TFLOP/s bf16 dense (same compute as H100), 141 GB
H200 = GPU("H200-SXM", 4.8e12, 989e12, 141e9)
GPUS = {"h100": H100, "h200": H200}


@dataclass(frozen=True)
class Model:
    """The sizes of a decoder that the roofline reads."""

    name: str
    params: float
    bytes_per_param: int
    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int = 2

    @property
    def weight_bytes(self) -> float:
        return self.params * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V of every layer
        return self.layers * self.kv_heads * self.head_dim * 2 * self.kv_dtype_bytes

    @property
    def attn_flops_per_pair(self) -> int:
        # QK^T and AV: one multiply-add (2 FLOPs) each per query head, head dim, layer
        return 4 * self.layers * self.q_heads * self.head_dim


# Qwen/Qwen3-8B config.json: 36 layers, 32 query heads, 8 KV heads, head_dim 128; 8.2B parameters
# (model card); bf16 weights and KV cache: 147,456 KV bytes per token
QWEN3_8B = Model("qwen3-8b", 8.2e9, 2, 36, 32, 8, 128)


@dataclass(frozen=True)
class LengthModel:
    """How long the simulated model writes. Assumptions, not measurements (the model is not real),
    chosen to mimic the qwen3-8b preset (config.py: thinking budget L ~ U{10240..12288}, answer
    budget 2048): a thinking phase (its stop_token_ids hold `</think>`) hits its budget with
    probability p_interrupt, else stops with `</think>` at a length uniform in [think_stop_lo x
    budget, budget); an answer phase writes U{answer_lo..answer_hi} tokens ending in EOS, or its
    budget ("length") if that is shorter."""

    p_interrupt: float = 0.4  # guess: Qwen3-8B thinks past 10k tokens on many hard math prompts
    think_stop_lo: float = 0.25  # guess: natural stops spread over the last 3/4 of the budget
    answer_lo: int = 200  # guess: an answer after thinking is a short summary
    answer_hi: int = 1000

    def draw(self, rng: random.Random, max_tokens: int, thinking: bool) -> tuple[int, bool]:
        """(tokens including the stop token, stopped) for one request."""
        if thinking:
            if max_tokens == 1 or rng.random() < self.p_interrupt:
                return max_tokens, False
            lo = max(1, math.ceil(self.think_stop_lo * max_tokens))
            return rng.randint(lo, max_tokens - 1), True
        n = rng.randint(self.answer_lo, self.answer_hi)
        return (n, True) if n < max_tokens else (max_tokens, False)


@dataclass(frozen=True)
class EngineConfig:
    """One data-parallel engine: vLLM's scheduler settings and the hardware its roofline uses."""

    gpu: GPU = H100
    model: Model = QWEN3_8B
    max_num_seqs: int = 256  # infra/engine.py's engine_args default
    # AsyncLLM.from_engine_args (UsageContext.ENGINE_CONTEXT) gets SchedulerConfig's 2048
    max_num_batched_tokens: int = 2048
    num_blocks: int | None = None  # default: `default_blocks(gpu, model)`
    policy: str = FCFS
    step_overhead_s: float = STEP_OVERHEAD_S
    bulk: bool = True  # decode runs in closed form; False: one step at a time (tests' reference)

    def blocks(self) -> int:
        return (
            self.num_blocks if self.num_blocks is not None else default_blocks(self.gpu, self.model)
        )


@dataclass
class EngineStats:
    """What one engine did, in simulated seconds and tokens."""

    busy_s: float = 0.0  # sum of step times
    steps: int = 0
    prefill_tokens: int = 0  # prompt (and recomputed) tokens computed
    decode_tokens: int = 0
    preemptions: int = 0
    prefix_queried_tokens: int = 0  # prompt tokens looked up at admission (vLLM's "queries")
    prefix_hit_tokens: int = 0
    evicted_blocks: int = 0  # cached blocks reused for new KV
    kv_block_seconds: float = 0.0  # KV blocks in use x step time: mean use = this / busy_s
    peak_kv_blocks: int = 0
    finished: int = 0
    aborted: int = 0


@dataclass
class RequestRecord:
    """One finished or aborted request, for benches: queue wait = first_scheduled - arrival."""

    request_id: str
    engine: int
    priority: int
    arrival: float
    first_scheduled: float | None
    finished: float
    prompt_tokens: int
    output_tokens: int
    first_hit_tokens: int  # prefix-cache hit at its first admission
    prefill_tokens: int  # tokens it had computed as prefill (recomputation included)
    preemptions: int
    state: str  # FINISHED or ABORTED
    thinking: bool = False  # a thinking phase (its stop_token_ids hold `</think>`), else an answer


# vLLM's output classes, as generate.py reads them (vllm/outputs.py, vllm/logprobs.py)
@dataclass
class WeightVersionSpan:
    """Output tokens [start, end) were sampled by weights labelled `version`."""

    version: str
    start: int
    end: int


@dataclass
class FlatLogprobs:
    token_ids: list[int]
    logprobs: list[float]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: FlatLogprobs | None
    finish_reason: str
    stop_reason: int | None
    weight_versions: list[WeightVersionSpan]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int] | None
    outputs: list[CompletionOutput]
    finished: bool = True


def default_blocks(gpu: GPU, model: Model, utilization: float = 0.9) -> int:
    """KV blocks of one engine, as infra/placement.py estimates them: utilization x memory - weights
    - VLLM_RESERVE_BYTES. H100 with Qwen3-8B: ~21,700 blocks (21 sequences of 16,512 tokens)."""
    kv = utilization * gpu.memory_bytes - model.weight_bytes - VLLM_RESERVE_BYTES
    return int(kv // (model.kv_bytes_per_token * BLOCK))


def roofline(gpu: GPU, model: Model, tokens: int, context: int, pairs: int) -> float:
    """Seconds of a forward pass over `tokens` new tokens whose KV context (read and written) is
    `context` tokens and whose attention has `pairs` query-key pairs: memory- or compute-bound."""
    mem = (model.weight_bytes + model.kv_bytes_per_token * context) / gpu.hbm_bytes_per_s
    flops = (2 * model.params * tokens + model.attn_flops_per_pair * pairs) / gpu.flops
    return max(mem, flops)


def step_time(gpu: GPU, model: Model, batch, overhead: float = STEP_OVERHEAD_S) -> float:
    """Seconds of one engine step (roofline estimate). batch: (computed, new) tokens per scheduled
    request: `computed` KV tokens in cache before the step, `new` computed by it (1: a decode)."""
    tokens = sum(n for _, n in batch)
    context = sum(c + n for c, n in batch)
    # causal attention: the i-th new token attends to c + i keys
    pairs = sum(n * c + n * (n + 1) // 2 for c, n in batch)
    return roofline(gpu, model, tokens, context, pairs) + overhead


def _sum_line(a: float, b: float, j0: int, j1: int) -> float:
    """sum of a + b j over j in [j0, j1)."""
    if j1 <= j0:
        return 0.0
    return a * (j1 - j0) + b * (j1 * (j1 - 1) - j0 * (j0 - 1)) / 2


def sum_max_lines(a1: float, b1: float, a2: float, b2: float, k: int) -> float:
    """sum over j < k of max(a1 + b1 j, a2 + b2 j): two lines cross at most once."""
    if b1 == b2:
        return _sum_line(max(a1, a2), b1, 0, k)
    split = min(k, max(0, math.ceil((a2 - a1) / (b1 - b2))))  # the first j past the crossing
    if b1 > b2:  # line 2 leads before the crossing, line 1 after
        return _sum_line(a2, b2, 0, split) + _sum_line(a1, b1, split, k)
    return _sum_line(a1, b1, 0, split) + _sum_line(a2, b2, split, k)


def dp_score(inflight: int, waiting: int, running: int, kv_usage: float) -> float:
    """vLLM 0.32's load score of one engine for one client (core_client.py)."""
    score = float(max(inflight, waiting + running))
    if waiting:  # a queue on a KV-bound engine drains slowly
        score += waiting * 6.0 * max(0.0, kv_usage - 0.5)
    return score


def pick_engine(counts, inflight, start: int) -> int:
    """The engine vLLM 0.32's DPLBAsyncMPClient picks: the lowest dp_score, scanning from `start`
    (ties: the first seen). counts: (waiting, running, kv_usage) per engine."""
    best, pick = math.inf, 0
    n = len(counts)
    for i in range(n):
        e = (start + i) % n
        score = dp_score(inflight[e], *counts[e])
        if score < best:
            best, pick = score, e
    return pick


def _salt_key(salt) -> np.uint64:
    return np.uint64(hash(("salt", salt)) & (2**64 - 1))


def _block_hashes(tokens: list[int]) -> np.ndarray:
    """(len(tokens) // BLOCK,) int64: hash of each full block's token tuple."""
    n = len(tokens) // BLOCK
    blocks = zip(*[iter(tokens)] * BLOCK, strict=False)  # a partial last block is dropped
    return np.fromiter(map(hash, blocks), np.int64, n)


def _chain(bh: np.ndarray, b0: int, prev: np.uint64) -> np.ndarray:
    """Chain keys of blocks b0 .. b0 + len(bh) - 1 given block hashes and the key before b0."""
    out = np.cumsum(bh.view(np.uint64) * _MULT[b0 : b0 + len(bh)])
    out += prev
    return out


def prompt_keys(prompt: list[int], salt) -> np.ndarray:
    """(len(prompt) // BLOCK,) uint64 chain keys of a prompt's full blocks, token by token."""
    n = len(prompt) // BLOCK
    return _chain(_block_hashes(prompt[: n * BLOCK]), 0, _salt_key(salt))


class Request:
    """One vLLM request: its prompt, its planned output (n_out tokens, the last one `stop` if not
    None) and its scheduling state. The output's letters come from (seed, request_id)."""

    __slots__ = tuple(
        "request_id prompt lp n_out stop priority salt arrival seq _keys _pre _fill _post "
        "_prompt_fill state engine num_out num_tokens computed nblocks reg_end prefill_end segs "
        "spans first_scheduled first_hit prefilled preemptions finished_at future logprobs "
        "thinking".split()
    )

    def __init__(
        self,
        request_id: str,
        prompt: "list[int] | Extension",
        n_out: int,
        *,
        stop: int | None = None,
        priority: int = 0,
        salt=None,
        seed: int = 0,
        keys: np.ndarray | None = None,
    ):
        if n_out < 1 or not prompt:
            raise ValueError(f"need a prompt and n_out >= 1, got {len(prompt)} and {n_out}")
        self.request_id = request_id
        self.prompt = prompt
        self.lp = len(prompt)
        self.n_out = n_out
        self.stop = stop
        self.priority = priority
        self.salt = salt
        self._keys = prompt_keys(prompt, salt) if keys is None else keys
        digest = hashlib.blake2b(f"{seed}:{request_id}".encode(), digest_size=HEAD + TAIL).digest()
        letters = [LETTERS[b % len(LETTERS)] for b in digest]
        body = n_out - (stop is not None)  # tokens before the stop token
        head = min(HEAD, body - 1)
        self._fill = max(0, body - 1 - HEAD - TAIL)
        self._pre = [MARK] + letters[:head] if body > 0 else []
        self._post = letters[HEAD : HEAD + body - 1 - head - self._fill] if body > 0 else []
        if stop is not None:
            self._post.append(stop)
        self._prompt_fill = None
        self.arrival = 0.0
        self.seq = 0  # arrival order on its engine
        self.state = WAITING
        self.engine = None
        self.num_out = self.computed = self.nblocks = self.reg_end = self.prefill_end = 0
        self.num_tokens = self.lp  # prompt + output so far
        self.segs: list[_Seg] = []  # the cached blocks it holds, in chain order
        self.spans: list[list] = []  # [version, start, end] over its output tokens
        self.first_scheduled = None
        self.first_hit = self.prefilled = self.preemptions = 0
        self.finished_at = None
        self.future = None
        self.logprobs = True
        self.thinking = False  # a thinking phase (SimEngine sets it): for RequestRecord

    def output_ids(self) -> list[int]:
        return self._out(0, self.n_out)

    def _out(self, a: int, b: int) -> list[int]:
        """Output tokens [a, b): pre (marker, head letters), filler, post (tail letters, stop)."""
        pre, post = self._pre, self._post
        f0 = len(pre)
        f1 = f0 + self._fill
        ids = pre[a:b] if a < f0 else []
        n = min(b, f1) - max(a, f0)
        if n > 0:
            ids = ids + [FILL] * n
        if b > f1:
            ids = ids + post[max(a - f1, 0) : b - f1]
        return ids

    def tokens(self, a: int, b: int) -> list[int]:
        """Tokens [a, b) of prompt + output."""
        ids = self.prompt[a:b] if a < self.lp else []
        if b > self.lp:
            ids = ids + self._out(max(a - self.lp, 0), b - self.lp)
        return ids

    def keys(self, nb: int) -> np.ndarray:
        """Chain keys of the first nb full blocks of prompt + output, built from the output's
        structure: blocks inside the filler share one hash, only the others are hashed."""
        k = self._keys
        if nb <= len(k):
            return k[:nb]
        b0 = len(k)
        f0 = self.lp + len(self._pre)  # the filler is [f0, f1)
        f1 = f0 + self._fill
        bh = np.full(nb - b0, FILL_HASH, np.int64)
        lo = min(nb, -(-f0 // BLOCK))  # blocks touching [0, f0)
        hi = max(lo, f1 // BLOCK, b0)  # blocks touching [f1, end)
        for b in itertools.chain(range(b0, lo), range(hi, nb)):
            bh[b - b0] = hash(tuple(self.tokens(b * BLOCK, b * BLOCK + BLOCK)))
        prev = k[-1] if b0 else _salt_key(self.salt)
        self._keys = np.concatenate([k, _chain(bh, b0, prev)])
        return self._keys[:nb]

    def add_span(self, version: str, n: int) -> None:
        """n more output tokens (num_out already counts them) sampled under `version`."""
        if self.spans and self.spans[-1][0] == version:
            self.spans[-1][2] += n
        else:
            self.spans.append([version, self.num_out - n, self.num_out])

    def extended_by(self, prompt: list[int], salt) -> bool:
        """Whether `prompt` starts with this finished request's prompt + output (exact: the filler
        region is checked by counting, at C speed, the filler in all of `prompt`)."""
        end = self.lp + self.n_out
        pre, post = self._pre, self._post
        return (
            salt == self.salt
            and len(prompt) >= end
            and prompt[self.lp : self.lp + len(pre)] == pre
            and prompt[end - len(post) : end] == post
            and prompt[: self.lp] == self.prompt
            and prompt.count(FILL) == self._prompt_fill + self._fill + prompt[end:].count(FILL)
        )


class Extension:
    """A prompt held without its tokens: a finished request's prompt + output, then `suffix` (a
    pending answer phase would otherwise keep a 12k-token list alive; 17,000 of them, GBs). Slices
    like the list it stands for."""

    __slots__ = ("base", "suffix", "n")

    def __init__(self, base: Request, suffix: list[int]):
        self.base = base
        self.suffix = suffix
        self.n = base.lp + base.n_out + len(suffix)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, s: slice) -> list[int]:
        a, b, _ = s.indices(self.n)
        m = self.base.lp + self.base.n_out
        ids = self.base.tokens(a, min(b, m)) if a < m else []
        if b > m:
            ids = ids + self.suffix[max(a - m, 0) : b - m]
        return ids


class PromptHasher:
    """Chain keys of incoming prompts. A prompt that starts with a remembered request's prompt +
    output (generate.py's answer phase: prompt + thinking + phrase) takes that request's keys from
    its output's structure, hashes only the rest, and is kept as an `Extension` (departure 1);
    others are hashed token by token. Remembers the last `capacity` finished requests whose
    prompts are lists of at most KNOWN_PROMPT_MAX tokens."""

    def __init__(self, capacity: int = 1 << 15):
        self.capacity = capacity
        self._known: collections.OrderedDict[tuple, Request] = collections.OrderedDict()

    def remember(self, r: Request) -> None:
        if r.lp > KNOWN_PROMPT_MAX or len(r._pre) != 1 + HEAD or not isinstance(r.prompt, list):
            return
        r._prompt_fill = r.prompt.count(FILL)
        self._known[tuple(r._pre[1:])] = r  # with its keys, until a prompt extends it
        if len(self._known) > self.capacity:
            self._known.popitem(last=False)

    def prompt(self, prompt: list[int], salt) -> tuple["list[int] | Extension", np.ndarray]:
        """(the prompt as the simulator keeps it, the chain keys of its full blocks)."""
        try:
            p0 = prompt.index(MARK)
        except ValueError:
            return prompt, prompt_keys(prompt, salt)
        r = self._known.get(tuple(prompt[p0 + 1 : p0 + 1 + HEAD]))
        if r is None or r.lp != p0 or not r.extended_by(prompt, salt):
            return prompt, prompt_keys(prompt, salt)
        end = r.lp + r.n_out
        nb = len(prompt) // BLOCK
        known = min(end // BLOCK, nb)
        base = r.keys(known)
        r._keys = r._keys[: r.lp // BLOCK].copy()  # memory: rebuilt on demand if needed again
        keys = base.copy()
        if known < nb:
            bh = _block_hashes(prompt[known * BLOCK : nb * BLOCK])
            prev = base[-1] if known else _salt_key(salt)
            keys = np.concatenate([base, _chain(bh, known, prev)])
        return Extension(r, prompt[end:]), keys


class _Node:
    """A run of blocks in the free queue: uncached ones (`_Node`, counted) or a `_Seg`."""

    __slots__ = ("prev", "next", "n")

    def __init__(self, n: int = 0):
        self.prev = self.next = None
        self.n = n

    def size(self) -> int:
        return self.n


class _Seg(_Node):
    """Cached blocks: consecutive chain positions of one sequence (their keys). Held by running
    requests (`holders`), or, with none, in the free queue."""

    __slots__ = ("keys", "holders")

    def __init__(self, keys: np.ndarray, holders: set):
        super().__init__()
        self.keys = keys
        self.holders = holders

    def size(self) -> int:
        return len(self.keys)


class PrefixCache:
    """One engine's KV blocks (vLLM's BlockPool with prefix caching): `free` blocks, of which the
    cached ones sit in an LRU free queue (evicted from its front; a segment from its tail end, as
    vLLM frees a request's tail block first), and an index of cached segments by their first key."""

    def __init__(self, num_blocks: int):
        self.num_blocks = self.free = num_blocks
        self.index: dict[int, _Seg] = {}
        self.head = _Node()  # sentinel of the circular free queue
        self.head.prev = self.head.next = self.head
        self.evicted = 0
        self._push(_Node(num_blocks), front=False)

    def _push(self, node: _Node, front: bool) -> None:
        at = self.head if front else self.head.prev
        node.prev, node.next = at, at.next
        at.next.prev = node
        at.next = node

    def _unlink(self, node: _Node) -> None:
        node.prev.next = node.next
        node.next.prev = node.prev
        node.prev = node.next = None

    def lookup(self, keys: np.ndarray, cap: int) -> list[tuple["_Seg", int]]:
        """The longest cached run of the first `cap` blocks of `keys`: (segment, blocks of it from
        its start) in order. A segment found by its first key matches up to the first differing
        key (equal chain keys mean equal prefixes)."""
        path, pos = [], 0
        while pos < cap:
            seg = self.index.get(int(keys[pos]))
            if seg is None:
                break
            n = min(len(seg.keys), cap - pos)
            if seg.keys[n - 1] == keys[pos + n - 1]:
                j = n
            else:
                j = int(np.argmin(seg.keys[:n] == keys[pos : pos + n]))
            if j == 0:  # only a 2^-64 collision of first keys gets here
                break
            path.append((seg, j))
            pos += j
        return path

    def hold(self, r: Request, path) -> None:
        """r takes the blocks of a lookup's path (vLLM's touch: free ones leave the free queue)."""
        for seg, j in path:
            was_free = not seg.holders
            if j < len(seg.keys):
                seg = self._split(seg, j)  # the head, not in the free queue
            elif was_free:
                self._unlink(seg)
            if was_free:
                self.free -= len(seg.keys)
            seg.holders.add(r)
            r.segs.append(seg)

    def _split(self, seg: _Seg, j: int) -> _Seg:
        """Cut off seg's first j blocks as a new segment (returned); seg keeps its place."""
        head = _Seg(seg.keys[:j], set(seg.holders))
        seg.keys = seg.keys[j:]
        self.index[int(head.keys[0])] = head
        self.index[int(seg.keys[0])] = seg
        for holder in head.holders:
            holder.segs.insert(holder.segs.index(seg), head)
        return head

    def register(self, r: Request, keys: np.ndarray) -> None:
        """Cache r's newly full blocks (held by r); a run whose first key is cached already (an
        identical prompt prefilled alongside) stays uncached (departure 3)."""
        k0 = int(keys[0])
        if k0 not in self.index:
            seg = _Seg(keys, {r})
            self.index[k0] = seg
            r.segs.append(seg)

    def allocate(self, n: int) -> None:
        """Take n free blocks (n <= free) from the front of the free queue, evicting cached ones."""
        self.free -= n
        while n:
            node = self.head.next
            size = node.size()
            take = min(n, size)
            n -= take
            if isinstance(node, _Seg):
                self.evicted += take
                if take == size:
                    self._unlink(node)
                    if self.index.get(int(node.keys[0])) is node:
                        del self.index[int(node.keys[0])]
                node.keys = node.keys[: size - take]  # the tail end goes first
            else:
                node.n -= take
                if not node.n:
                    self._unlink(node)

    def release(self, r: Request, new_keys: np.ndarray, uncached: int) -> None:
        """r frees its blocks: `uncached` ones to the front of the free queue; its newly full blocks
        (`new_keys`, cached now) and the segments no one else holds to the back, tail first."""
        if len(new_keys) and int(new_keys[0]) not in self.index:
            seg = _Seg(new_keys, set())
            self.index[int(new_keys[0])] = seg
            self._push(seg, front=False)
            self.free += len(new_keys)
        else:
            uncached += len(new_keys)
        if uncached:
            self._push(_Node(uncached), front=True)
            self.free += uncached
        for seg in reversed(r.segs):
            seg.holders.discard(r)
            if not seg.holders:
                self._push(seg, front=False)
                self.free += len(seg.keys)
        r.segs = []

    def clear(self) -> None:
        """Forget every free cached block (vLLM's reset_prefix_cache)."""
        node = self.head.next
        while node is not self.head:
            nxt = node.next
            if isinstance(node, _Seg):
                del self.index[int(node.keys[0])]
                self._unlink(node)
                self._push(_Node(len(node.keys)), front=True)
            node = nxt


class _Waiting:
    """vLLM's waiting queue: fcfs (a deque; preempted requests go back to the front) or priority (a
    heap on (priority, arrival, request id, arrival order))."""

    def __init__(self, policy: str):
        if policy not in (FCFS, PRIORITY):
            raise ValueError(f"policy must be {FCFS!r} or {PRIORITY!r}, got {policy!r}")
        self.fcfs = policy == FCFS
        self.q = collections.deque() if self.fcfs else []

    def __len__(self) -> int:
        return len(self.q)

    def add(self, r: Request, front: bool = False) -> None:
        if self.fcfs:
            self.q.appendleft(r) if front else self.q.append(r)
        else:
            heapq.heappush(self.q, (r.priority, r.arrival, r.request_id, r.seq, r))

    def peek(self) -> Request:
        return self.q[0] if self.fcfs else self.q[0][-1]

    def pop(self) -> Request:
        return self.q.popleft() if self.fcfs else heapq.heappop(self.q)[-1]

    def remove(self, r: Request) -> None:
        if self.fcfs:
            self.q.remove(r)
        else:
            self.q = [e for e in self.q if e[-1] is not r]
            heapq.heapify(self.q)


@dataclass
class _Step:
    """A scheduled engine step: [request, new tokens, computed before] per request, its end time,
    its weights version, the KV blocks in use."""

    sched: list
    end: float
    version: str
    used: int = 0


class EngineCore:
    """One data-parallel vLLM engine in simulated time: scheduler, KV cache, prefix cache and
    roofline clock (module docstring). Its state is at time `t`, with at most one step in flight
    (scheduled at t, ending at its `end`); `advance_to` moves it on, and the commands (add, abort,
    set_paused, set_version, block) first move it to their time. Finished requests collect in
    `outbox` (the caller empties it). Pure Python, no asyncio: tests drive it directly."""

    def __init__(self, config: EngineConfig = EngineConfig(), index: int = 0):
        self.cfg = config
        self.index = index
        self.cache = PrefixCache(config.blocks())
        self.running: list[Request] = []
        self.waiting = _Waiting(config.policy)
        self.t = 0.0
        self.paused = False
        self.blocked_until = 0.0
        self.version = "0"
        self.stats = EngineStats()
        self.outbox: list[Request] = []
        self._step: _Step | None = None
        self._plan = None
        self._seq = itertools.count()
        m, g = config.model, config.gpu
        # decode-run roofline lines (see _run_plan): bytes and FLOPs per context token and per token
        self._mem = (m.weight_bytes / g.hbm_bytes_per_s, m.kv_bytes_per_token / g.hbm_bytes_per_s)
        self._flop = (2 * m.params / g.flops, m.attn_flops_per_pair / g.flops)

    # --- commands (applied at the engine's current state)
    def add(self, r: Request, t: float) -> None:
        """r arrives at t. A decode run that r cannot join (no free slot) goes on uncut: its
        counts and its end stay what they were."""
        self.advance_to(t, cut=False)
        full = self._plan is not None and self._plan[0] == "run"
        if not (full and len(self.running) >= self.cfg.max_num_seqs):
            self.advance_to(t)
            self._plan = None
        r.arrival = t
        r.seq = next(self._seq)
        r.engine = self.index
        r.state = WAITING
        self.waiting.add(r)

    def abort(self, r: Request, t: float) -> None:
        self.advance_to(t)
        if r.state == RUNNING:
            self.running.remove(r)
            self._release(r)
        elif r.state == WAITING:
            self.waiting.remove(r)
        r.state = ABORTED
        r.finished_at = self.t
        self.stats.aborted += 1
        self._plan = None

    def set_paused(self, paused: bool, t: float, clear_cache: bool = False) -> float:
        """Pause ("keep": running requests keep their KV) or resume at t; returns when the step in
        flight, the last to produce tokens, ends."""
        self.advance_to(t)
        self.paused = paused
        if clear_cache:
            self.cache.clear()
        self._plan = None
        return self._step.end if self._step else self.t

    def set_version(self, version: str, t: float) -> None:
        """Tokens of steps scheduled from now on carry `version`."""
        self.advance_to(t)
        self.version = version

    def block(self, seconds: float, t: float) -> float:
        """Run an RPC of `seconds` after the step in flight; no step starts before it ends."""
        self.advance_to(t)
        start = self._step.end if self._step else self.t
        self.blocked_until = max(self.blocked_until, start + seconds)
        self._plan = None
        return self.blocked_until

    def counts(self) -> tuple[int, int, float]:
        """(waiting, running, KV use) for the DP balancer."""
        return len(self.waiting), len(self.running), 1.0 - self.cache.free / self.cache.num_blocks

    # --- time
    def next_time(self) -> float:
        """When this engine next has something to do: its step in flight ends, its decode run
        ends, a step is due now (t), it unblocks; inf when idle."""
        if self._step is not None:
            return self._step.end
        plan = self._classify()
        if plan[0] == "idle":
            return math.inf
        if plan[0] == "blocked":
            return self.blocked_until
        if plan[0] == "run":
            return self.t + plan[2]
        return self.t

    def advance_to(self, t: float, *, inclusive: bool = False, cut: bool = True) -> list[Request]:
        """Complete the steps that end by t and start those that start before t (at t too with
        `inclusive`); cut=False leaves a decode run that goes past t uncommitted (its counts hold
        until it ends). Returns the requests that finished, in finishing order (in `outbox` too)."""
        start = len(self.outbox)
        while True:
            if self._step is not None:
                if self._step.end > t:
                    break
                self._complete()
                continue
            plan = self._classify()
            kind = plan[0]
            if kind == "idle":
                self.t = max(self.t, t)
                break
            if kind == "blocked":
                if self.blocked_until > t or (self.blocked_until == t and not inclusive):
                    self.t = max(self.t, t)
                    break
                self.t = self.blocked_until
                self._plan = None
                continue
            if self.t > t or (self.t == t and not inclusive):
                break
            if kind == "run":
                if self.t + plan[2] <= t:
                    k = plan[1]
                elif not cut:
                    break
                else:
                    k = self._steps_by(plan, t - self.t)
                if k:
                    self._bulk(k, plan)
                    if k == plan[1]:
                        continue
                if self.t < t:  # the step that straddles t
                    self._step = self._schedule()
                    continue
                break
            self._step = self._schedule()
            if self._step is None:  # nothing fits (a request larger than the KV cache)
                self._plan = ("idle",)
        return self.outbox[start:]

    def run(self) -> list[Request]:
        """Advance until idle (tests). Returns the requests that finished."""
        start = len(self.outbox)
        while (t := self.next_time()) < math.inf:
            self.advance_to(t, inclusive=True)
        return self.outbox[start:]

    # --- planning
    def _classify(self):
        """("idle",) | ("blocked",) | ("step",) | ("run", K, seconds, coefficients)."""
        if self._plan is None:
            if self.t < self.blocked_until:
                self._plan = ("blocked",)
            elif self.paused or not (self.running or self.waiting):
                self._plan = ("idle",)
            else:
                self._plan = self._run_plan() or ("step",)
        return self._plan

    def _run_plan(self):
        """A run of like steps, done in closed form: every running request decodes one token per
        step, but the last one may be prefilling, a full chunk (the token budget the others leave)
        per step; no waiting request can be admitted. It ends at the first decoder's finish, or
        before the step whose block allocation would fail (a preemption, left to `_schedule`), or
        before the prefill's last chunk (it samples; `_schedule` does it). Step j costs max(a_m +
        b_m j, a_f + b_f j) + overhead: memory (weights + the KV of the context, which grows by
        the step's tokens) / bandwidth, FLOPs (2 params per token + attention pairs) / peak."""
        running, cfg = self.running, self.cfg
        B = len(running)
        budget = cfg.max_num_batched_tokens
        if not cfg.bulk or not B or B > budget:
            return None
        prefiller = running[-1] if running[-1].computed < running[-1].num_tokens - 1 else None
        if not prefiller and self.waiting and B < cfg.max_num_seqs and budget > B:
            if self._admission(self.waiting.peek(), budget - B) is not None:
                return None
        decoders = running[:-1] if prefiller else running
        C = 0  # context tokens of the decoders
        K = math.inf
        for r in decoders:
            n = r.num_tokens
            if r.computed != n - 1 or not r.num_out:
                return None  # a prefill (its last token too) other than the last request's
            C += n
            left = r.n_out - r.num_out
            if left < K:
                K = left
        chunk = cp = nbp = 0
        if prefiller:
            chunk = budget - len(decoders)  # no budget is left for an admission
            cp, nbp = prefiller.computed, prefiller.nblocks
            # full chunks before the last
            K = min(K, -(-(prefiller.num_tokens - cp) // chunk) - 1)
        if K == 0:
            return None
        # blocks allocated by the end of step j: a decoder needs ceil((N_r + j) / 16), the
        # prefiller ceil((computed + (j + 1) chunk) / 16)
        pairs = [(r.num_tokens, r.nblocks) for r in decoders]

        def demand(j):
            d = sum(max(0, -(-(n + j) // BLOCK) - nb) for n, nb in pairs)
            return d + max(0, -(-(cp + (j + 1) * chunk) // BLOCK) - nbp) if prefiller else d

        free = self.cache.free
        # a decoder gets at most ceil(K / 16) blocks in K steps: most runs need no search
        bound = len(decoders) * -(-K // BLOCK)
        if prefiller:
            bound += max(0, -(-(cp + K * chunk) // BLOCK) - nbp)
        if bound > free and demand(K - 1) > free:  # the first failing step ends the run before it
            lo, hi = 0, K - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if demand(mid) > free:
                    hi = mid
                else:
                    lo = mid + 1
            K = lo
        if K == 0:
            return None
        D = len(decoders)
        m0, m1 = self._mem
        f0, f1 = self._flop
        # context tokens C + cp + chunk + (D + chunk) j; attention pairs C + chunk cp +
        # chunk (chunk + 1) / 2 + (D + chunk^2) j; D + chunk tokens
        pairs0 = C + chunk * cp + chunk * (chunk + 1) // 2
        coef = (
            m0 + m1 * (C + cp + chunk),
            m1 * (D + chunk),
            f0 * (D + chunk) + f1 * pairs0,
            f1 * (D + chunk * chunk),
        )
        return ("run", K, self._run_seconds(coef, K), coef, prefiller, chunk)

    def _run_seconds(self, coef, k: int) -> float:
        return sum_max_lines(coef[0], coef[1], coef[2], coef[3], k) + self.cfg.step_overhead_s * k

    def _steps_by(self, plan, dt: float) -> int:
        """The most steps of the run that end within dt."""
        K, total, coef = plan[1], plan[2], plan[3]
        if total <= dt:
            return K
        lo, hi = 0, K
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._run_seconds(coef, mid) <= dt:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _bulk(self, k: int, plan) -> None:
        """Commit k steps of the run at once."""
        dt = self._run_seconds(plan[3], k)
        prefiller, chunk = plan[4], plan[5]
        decoders = self.running[:-1] if prefiller else self.running
        version = self.version
        new = 0
        for r in decoders:
            r.num_out += k
            r.num_tokens += k
            r.computed += k
            # add_span, inlined: this loop is the simulator's hottest
            if r.spans and r.spans[-1][0] == version:
                r.spans[-1][2] += k
            else:
                r.spans.append([version, r.num_out - k, r.num_out])
            # step j allocated blocks for computed + 1 tokens, the last one for the new computed
            nb = -(-r.computed // BLOCK)
            if nb > r.nblocks:
                new += nb - r.nblocks
                r.nblocks = nb
        st = self.stats
        if prefiller:
            prefiller.computed += k * chunk
            prefiller.prefilled += k * chunk
            st.prefill_tokens += k * chunk
            nb = -(-prefiller.computed // BLOCK)
            new += nb - prefiller.nblocks
            prefiller.nblocks = nb
        used0 = self.cache.num_blocks - self.cache.free
        self.cache.allocate(new)
        if prefiller:
            self._cache_prefill(prefiller, prefiller.computed)
        st.busy_s += dt
        st.steps += k
        st.decode_tokens += k * len(decoders)
        st.kv_block_seconds += (used0 + new / 2) * dt  # blocks grow about linearly over the run
        st.peak_kv_blocks = max(st.peak_kv_blocks, used0 + new)
        self.t += dt
        self._plan = None
        for r in [r for r in decoders if r.num_out == r.n_out]:
            self._finish(r)

    # --- one step, as vLLM's Scheduler.schedule
    def _schedule(self) -> _Step | None:
        cfg, running = self.cfg, self.running
        budget = cfg.max_num_batched_tokens
        sched = []  # [request, new tokens, computed before]
        preempted = False
        i = 0
        while i < len(running) and budget > 0:
            r = running[i]
            n = r.num_tokens - r.computed
            if n > budget:
                n = budget
            # a decode token inside its last block needs no allocation
            full = r.computed + n <= r.nblocks * BLOCK and r.reg_end == r.prefill_end // BLOCK
            while not full and not self._grow(r, r.computed + n):
                if cfg.policy == PRIORITY:
                    victim = max(running, key=lambda q: (q.priority, q.arrival))
                else:
                    victim = running[-1]
                j = running.index(victim)
                del running[j]
                if j < i:
                    i -= 1
                for s in sched:
                    if s[0] is victim:  # scheduled earlier in this step: give its tokens back
                        sched.remove(s)
                        budget += s[1]
                        break
                self._preempt(victim)
                preempted = True
                if victim is r:
                    break
            if r.state != RUNNING:
                break
            sched.append([r, n, r.computed])
            budget -= n
            i += 1
        if not preempted:
            while budget > 0 and self.waiting and len(running) < cfg.max_num_seqs:
                r = self.waiting.peek()
                n = self._admit(r, budget)
                if n is None:
                    break
                self.waiting.pop()
                running.append(r)
                sched.append([r, n, r.computed])
                budget -= n
        self._plan = None
        if not sched:
            # everything running preempted itself: vLLM's next (empty) step admits from waiting
            return self._schedule() if preempted else None
        tokens = context = pairs = decode = 0
        for r, n, c in sched:  # step_time's sums
            tokens += n
            context += c + n
            pairs += n * c + n * (n + 1) // 2
            if n == 1 and c == r.num_tokens - 1 and r.num_out:
                decode += 1
            else:
                r.prefilled += n
        self.stats.decode_tokens += decode
        self.stats.prefill_tokens += tokens - decode
        dt = roofline(cfg.gpu, cfg.model, tokens, context, pairs) + cfg.step_overhead_s
        used = self.cache.num_blocks - self.cache.free
        return _Step(sched, self.t + dt, self.version, used)

    def _complete(self) -> None:
        step, self._step = self._step, None
        dt = step.end - self.t
        self.t = step.end
        st = self.stats
        st.busy_s += dt
        st.steps += 1
        st.kv_block_seconds += step.used * dt
        st.peak_kv_blocks = max(st.peak_kv_blocks, step.used)
        self._plan = None
        done = []
        for r, n, _ in step.sched:
            if r.state != RUNNING:  # aborted meanwhile
                continue
            r.computed += n
            if r.computed == r.num_tokens:  # a decode token, or the last prefill chunk: sample
                r.num_out += 1
                r.num_tokens += 1
                r.add_span(step.version, 1)
                if r.num_out == r.n_out:
                    done.append(r)
        for r in done:
            self._finish(r)

    # --- KV
    def _admission(self, r: Request, budget: int):
        """(lookup path, hit blocks, new tokens) if r's first chunk fits now, else None."""
        cap = (r.num_tokens - 1) // BLOCK  # the last token is always recomputed (for its logits)
        path = self.cache.lookup(r.keys(cap), cap) if cap else []
        hit = sum(j for _, j in path)
        free_hit = sum(j for s, j in path if not s.holders)
        n = min(r.num_tokens - hit * BLOCK, budget)
        need = -(-(hit * BLOCK + n) // BLOCK) - hit + free_hit
        return None if need > self.cache.free else (path, hit, n)

    def _admit(self, r: Request, budget: int) -> int | None:
        """Admit r if its first chunk fits: hold its prefix hit, allocate the chunk. Returns the
        chunk's tokens."""
        got = self._admission(r, budget)
        if got is None:
            return None
        path, hit, n = got
        self.cache.hold(r, path)
        r.state = RUNNING
        r.nblocks = r.reg_end = hit
        r.computed = hit * BLOCK
        r.prefill_end = r.num_tokens
        self._grow(r, r.computed + n)  # fits: _admission counted its blocks
        st = self.stats
        st.prefix_queried_tokens += r.num_tokens
        st.prefix_hit_tokens += hit * BLOCK
        if r.first_scheduled is None:
            r.first_scheduled = self.t
            r.first_hit = hit * BLOCK
        return n

    def _grow(self, r: Request, tokens: int) -> bool:
        """Give r blocks for `tokens` tokens and cache its full prefill blocks; False if too few
        blocks are free."""
        need = -(-tokens // BLOCK) - r.nblocks
        if need > 0:
            if need > self.cache.free:
                return False
            self.cache.allocate(need)
            r.nblocks += need
        self._cache_prefill(r, tokens)
        return True

    def _cache_prefill(self, r: Request, tokens: int) -> None:
        """Cache r's full prefill blocks among its first `tokens` (vLLM caches full blocks as it
        allocates them; decoded ones are cached here when r frees them: no other prompt can hold
        them sooner)."""
        full = min(tokens, r.prefill_end) // BLOCK
        if full > r.reg_end:
            self.cache.register(r, r.keys(full)[r.reg_end : full])
            r.reg_end = full

    def _release(self, r: Request) -> None:
        """Free r's blocks; its computed full blocks stay cached."""
        full = r.computed // BLOCK
        new = r.keys(full)[r.reg_end : full] if full > r.reg_end else r.keys(0)
        held = sum(len(s.keys) for s in r.segs)
        self.cache.release(r, new, r.nblocks - held - len(new))
        r.nblocks = r.reg_end = 0

    def _preempt(self, r: Request) -> None:
        """vLLM's _preempt_request: free its KV, back to the front of the waiting queue."""
        self._release(r)
        r.computed = 0
        r.state = WAITING
        r.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.add(r, front=True)

    def _finish(self, r: Request) -> None:
        self.running.remove(r)
        self._release(r)
        r.state = FINISHED
        r.finished_at = self.t
        self.stats.finished += 1
        self.outbox.append(r)


class Tokenizer:
    """A byte tokenizer with Qwen3-like special tokens (`SPECIAL`), enough for generate.py:
    encode/decode, eos_token_id, `</think>` as one token."""

    eos_token_id = EOS
    vocab_size = max(SPECIAL.values()) + 1
    _split = re.compile("(" + "|".join(map(re.escape, SPECIAL)) + ")")
    _names = {v: k for k, v in SPECIAL.items()}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids = []
        for part in self._split.split(text):
            if part in SPECIAL:
                ids.append(SPECIAL[part])
            else:
                ids += part.encode()
        return ids

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        out, raw = [], bytearray()
        for i in ids:
            if i < 256:
                raw.append(i)
                continue
            out.append(raw.decode(errors="replace"))
            raw = bytearray()
            if not (skip_special_tokens and i in SKIPPED):
                out.append(self._names[i])
        out.append(raw.decode(errors="replace"))
        return "".join(out)

    def convert_tokens_to_ids(self, token: str) -> int:
        return SPECIAL[token]

    def __len__(self) -> int:
        return self.vocab_size


class _Clock:
    """Simulated seconds. time_scale=None: virtual (moved only by the simulator). Else the wall
    clock x time_scale since the last `set`: the simulator sets it at each event it reaches and
    after each of its own computations, so neither its CPU time nor timer lateness counts."""

    def __init__(self, time_scale: float | None):
        if time_scale is not None and time_scale <= 0:
            raise ValueError(f"time_scale must be > 0 or None, got {time_scale}")
        self.scale = time_scale
        self._t = 0.0
        self._wall = time.monotonic()

    def now(self) -> float:
        if self.scale is None:
            return self._t
        return self._t + (time.monotonic() - self._wall) * self.scale

    def set(self, t: float) -> None:
        self._t = t
        self._wall = time.monotonic()


class _IdleClock(_Clock):
    """Simulated time that runs only while the driving event loop waits with nothing to do:
    `idle()` gives the seconds that loop has spent waiting so far (a selector that times its
    select calls, bench/scale.py's); x time_scale is simulated time. Clients computing, in that loop
    or anywhere that keeps it from waiting, cost no simulated time, as in virtual time, while the
    clock still runs against the wall clock when they are done (`SimEngine(clock=idle)`). It is
    the driving loop's own clock too (bench/scale.py's IdleLoop: the project's timeouts run on it),
    so `set` never drops idle time: a timer that fires late (its loop thread waited for the GIL
    after its select returned) delivers its event late, as a busy client would see it, and the
    simulator's time and the timeouts stay one clock; one that fires early moves the clock to its
    time (within the clock's resolution)."""

    def __init__(self, time_scale: float, idle):
        super().__init__(time_scale)
        self.idle = idle
        self._idle0 = idle()

    def now(self) -> float:
        return self._t + (self.idle() - self._idle0) * self.scale

    def set(self, t: float) -> None:
        self._t = max(t, self.now())
        self._idle0 = self.idle()


class IdleSelector(selectors.DefaultSelector):
    """The default selector, timing its waits: `idle()` is the seconds its event loop has spent
    waiting for I/O or a timer (with nothing to run), the only time the simulators' clocks run."""

    def __init__(self):
        super().__init__()
        self._idle = 0.0
        self._since = None  # start of the wait in progress

    def select(self, timeout=None):
        self._since = time.monotonic()
        try:
            return super().select(timeout)
        finally:
            self._idle += time.monotonic() - self._since
            self._since = None

    def idle(self) -> float:
        since = self._since
        extra = 0.0 if since is None else time.monotonic() - since
        return self._idle + extra


class IdleLoop(asyncio.SelectorEventLoop):
    """An event loop on an IdleSelector whose clock (`time()`, what asyncio's timers,
    `asyncio.timeout` and `asyncio.wait(timeout=...)` read) is that selector's idle seconds: the
    project's timeouts, given divided by the time scale, then run on the simulators' time, exact
    whatever CPU time the clients take."""

    def __init__(self, selector: IdleSelector):
        super().__init__(selector)
        self.idle = selector.idle

    def time(self) -> float:
        return self.idle()


class SimEngine:
    """The `AsyncLLM` stand-in: `dp` EngineCores behind vLLM 0.32's DP load balancer, on a
    simulated clock (module docstring). Build it in the asyncio loop's thread; its coroutines run in
    that loop. Arguments: config (`EngineConfig`), or its fields as keywords (max_num_seqs=22,
    policy="priority", gpu=H200, ...); max_model_len; lengths (`LengthModel`); seed (length draws
    and output letters, per request id); time_scale (simulated seconds per wall second; None:
    virtual time); reload_bytes_per_s; settle (virtual time: loop turns the clients get to react
    before the clock jumps); clock ("wall": a client's reaction costs its wall time x time_scale;
    or `idle`, a callable giving the seconds the driving loop has waited: `_IdleClock`, it costs
    nothing). Raises ValueError if one max_model_len sequence does
    not fit the KV cache (vLLM refuses to start then)."""

    def __init__(
        self,
        *,
        dp: int = 1,
        config: EngineConfig = EngineConfig(),
        max_model_len: int = 16512,
        lengths: LengthModel = LengthModel(),
        seed: int = 0,
        time_scale: float | None = 1000.0,
        reload_bytes_per_s: float = RELOAD_BYTES_PER_S,
        settle: int = 2,
        clock="wall",
        **engine,
    ):
        config = dataclasses.replace(config, **engine)
        if dp < 1:
            raise ValueError(f"dp must be >= 1, got {dp}")
        if config.blocks() * BLOCK < max_model_len:
            raise ValueError(
                f"a KV cache of {config.blocks()} blocks cannot hold one sequence of "
                f"max_model_len {max_model_len} tokens"
            )
        self.config = config
        self.engines = [EngineCore(config, i) for i in range(dp)]
        self.lengths = lengths
        self.seed = seed
        self.settle = settle
        self.reload_bytes_per_s = reload_bytes_per_s
        if clock != "wall" and (not callable(clock) or time_scale is None):
            raise ValueError(f"clock must be 'wall' or a callable with a time_scale, got {clock!r}")
        self.clock = _Clock(time_scale) if clock == "wall" else _IdleClock(time_scale, clock)
        self.tokenizer = Tokenizer()
        self.model_config = SimpleNamespace(max_model_len=max_model_len, model=config.model.name)
        self.vllm_config = SimpleNamespace(
            model_config=self.model_config,
            # vLLM reports the blocks of all dp engines summed (infra/engine.py's kv_capacity)
            cache_config=SimpleNamespace(num_gpu_blocks=config.blocks() * dp, block_size=BLOCK),
            parallel_config=SimpleNamespace(data_parallel_size=dp),
            scheduler_config=SimpleNamespace(max_num_seqs=config.max_num_seqs),
        )
        self.errored = False
        self.records: list[RequestRecord] = []  # every finished or aborted request
        self.hasher = PromptHasher()
        self._inflight = [0] * dp  # the balancer's per-engine count of unfinished requests
        self._start = 0  # the balancer's rotating scan start
        self._pending: dict[int, Request] = {}
        self._commands: collections.deque = collections.deque()  # (stamp, command)
        self._timers: list = []  # heap of (t, seq, future)
        self._tseq = itertools.count()
        self._poke: asyncio.Future | None = None
        self._driver: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False

    # --- the AsyncLLM surface
    async def generate(
        self,
        prompt,
        sampling_params,
        request_id: str,
        *,
        priority: int = 0,
        data_parallel_rank: int | None = None,
    ):
        """One request, an async generator of its final RequestOutput. prompt: a TokensPrompt
        (prompt_token_ids, optional cache_salt); sampling_params: its max_tokens, stop_token_ids
        and logprobs are read. Cancelling the caller aborts the request (its slot and KV are
        freed). Raises ValueError for an empty prompt, one of max_model_len tokens or more, or a
        data_parallel_rank out of range."""
        if data_parallel_rank is not None and not 0 <= data_parallel_rank < len(self.engines):
            raise ValueError(f"data_parallel_rank {data_parallel_rank} out of range")
        r = self._request(prompt, sampling_params, request_id, priority)
        del prompt  # r holds what it needs (departure 1)
        fut = self._ensure_driver().create_future()
        r.future = fut
        self._pending[id(r)] = r
        self._command(("add", r, data_parallel_rank))
        try:
            out = await fut
        finally:
            if not fut.done() or fut.cancelled():
                self._command(("abort", r))
        yield out

    async def pause_generation(self, *, mode: str = "keep", clear_cache: bool = False) -> None:
        """Freeze every engine after its step in flight (mode "keep": running requests keep their
        KV); clear_cache also drops the free cached blocks."""
        if mode != "keep":
            raise ValueError(f"the simulator pauses with mode 'keep' only, got {mode!r}")
        await self._call(("pause", True, clear_cache))

    async def resume_generation(self) -> None:
        await self._call(("pause", False, False))

    async def update_weight_version(self, new_version: str) -> None:
        """Tokens of steps scheduled from now on carry this label."""
        await self._call(("version", str(new_version)))

    async def collective_rpc(self, method: str, timeout=None, args: tuple = (), kwargs=None):
        """A weight reload (`RELOADS`) blocks every engine for weight bytes / reload_bytes_per_s
        simulated seconds after its step in flight; other methods return at once. Returns one
        None per engine."""
        if method in RELOADS:
            await self._call(("block", self.config.model.weight_bytes / self.reload_bytes_per_s))
        return [None] * len(self.engines)

    def get_tokenizer(self) -> Tokenizer:
        return self.tokenizer

    def shutdown(self, timeout: float | None = None) -> None:
        """Stop the simulator; pending requests fail with RuntimeError. Any thread; idempotent."""
        if self._loop is None or self._closed:
            self._closed = True
            return
        try:
            here = asyncio.get_running_loop() is self._loop
        except RuntimeError:
            here = False
        error = RuntimeError("the simulated engine is shut down")
        if here:
            self._stop(error)
        else:
            self._loop.call_soon_threadsafe(self._stop, error)

    # --- beyond AsyncLLM, for benches and tests
    def now(self) -> float:
        """Simulated seconds since the first call."""
        return self.clock.now()

    async def sleep(self, seconds: float) -> None:
        """Sleep `seconds` of simulated time."""
        fut = self._ensure_driver().create_future()
        self._command(("timer", seconds, fut))
        await fut

    def stats(self) -> list[EngineStats]:
        for e in self.engines:
            e.stats.evicted_blocks = e.cache.evicted
        return [e.stats for e in self.engines]

    # --- the driver
    def _request(self, prompt, params, request_id: str, priority: int) -> Request:
        ids = prompt["prompt_token_ids"]
        ids = ids if isinstance(ids, list) else list(ids)
        limit = self.model_config.max_model_len
        if not ids or len(ids) >= limit:
            raise ValueError(f"prompt of {len(ids)} tokens: need 1 to {limit - 1} (max_model_len)")
        salt = prompt.get("cache_salt")
        max_tokens = params.max_tokens or limit - len(ids)
        thinking = THINK_CLOSE in (params.stop_token_ids or [])
        digest = hashlib.blake2b(f"{self.seed}:{request_id}".encode(), digest_size=8).digest()
        rng = random.Random(int.from_bytes(digest, "little"))
        n, stopped = self.lengths.draw(rng, max_tokens, thinking)
        if n > limit - len(ids):  # the scheduler stops a request at max_model_len
            n, stopped = limit - len(ids), False
        stop = None
        if stopped:
            stop = THINK_CLOSE if thinking else EOS
        ids, keys = self.hasher.prompt(ids, salt)
        r = Request(
            request_id, ids, n, stop=stop, priority=priority, salt=salt, seed=self.seed, keys=keys
        )
        r.logprobs = getattr(params, "logprobs", None) is not None
        r.thinking = thinking
        return r

    def _ensure_driver(self) -> asyncio.AbstractEventLoop:
        if self._closed:
            raise RuntimeError("the simulated engine is shut down")
        if self._driver is None:
            self._loop = asyncio.get_running_loop()
            self.clock.set(self.clock._t)  # time before the first call does not count
            self._driver = self._loop.create_task(self._drive())
        return self._loop

    def _command(self, cmd) -> None:
        self._commands.append((self.clock.now(), cmd))
        if self._poke is not None and not self._poke.done():
            self._poke.set_result(None)

    async def _call(self, cmd) -> None:
        fut = self._ensure_driver().create_future()
        self._command(cmd + (fut,))
        await fut

    def _stop(self, error: BaseException) -> None:
        self._closed = True
        if self._driver is not None:
            self._driver.cancel()
        futures = [r.future for r in self._pending.values()]
        futures += [fut for _, _, fut in self._timers]
        futures += [cmd[-1] for _, cmd in self._commands if isinstance(cmd[-1], asyncio.Future)]
        for fut in futures:
            if not fut.done():
                fut.set_exception(error)
        self._pending.clear()

    async def _drive(self) -> None:
        try:
            while True:
                now = self.clock.now()
                woke = self._process(now)
                self.clock.set(now)  # our computing is not simulated time
                if woke or self._commands:
                    await asyncio.sleep(0)  # the clients act on what they got
                    continue
                await self._wait(self._next_time())
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # a simulator bug: fail every caller rather than hang them
            self.errored = True
            self._stop(e)
            raise

    async def _wait(self, t: float) -> None:
        """Until simulated time t or a command. Virtual time: jump to t once `settle` loop turns
        passed without a command."""
        if self.clock.scale is None:
            for _ in range(self.settle):
                await asyncio.sleep(0)
                if self._commands:
                    return
            if t < math.inf:
                self.clock.set(t)
                return
        poke = self._poke = self._loop.create_future()
        handle = None
        if t < math.inf and self.clock.scale is not None:
            delay = max(0.0, (t - self.clock.now()) / self.clock.scale)
            handle = self._loop.call_later(delay, lambda: poke.done() or poke.set_result(t))
        try:
            reached = await poke
        finally:
            self._poke = None
            if handle is not None:
                handle.cancel()
        if reached is not None:
            self.clock.set(reached)  # asyncio's timer lateness is not simulated time

    def _next_time(self) -> float:
        t = min(e.next_time() for e in self.engines)
        return min(t, self._timers[0][0]) if self._timers else t

    def _process(self, now: float) -> bool:
        """Apply the commands, move the engines to now, deliver what finished, fire the timers due.
        Returns whether a client's future was resolved."""
        woke = False
        while self._commands:
            stamp, cmd = self._commands.popleft()
            woke |= self._apply(stamp, cmd)
            woke |= self._deliver()
        for e in self.engines:
            if e.next_time() <= now:
                e.advance_to(now, inclusive=True)
        woke |= self._deliver()
        while self._timers and self._timers[0][0] <= now:
            fut = heapq.heappop(self._timers)[2]
            if not fut.done():
                fut.set_result(None)
            woke = True
        return woke

    def _apply(self, stamp: float, cmd) -> bool:
        """Apply one command at its time; returns whether it resolved a future."""
        kind = cmd[0]
        if kind == "add":
            r, rank = cmd[1], cmd[2]
            for e in self.engines:  # their counts at the arrival
                e.advance_to(stamp, cut=False)
            if rank is None:
                rank = pick_engine([e.counts() for e in self.engines], self._inflight, self._start)
                self._start = (self._start + 1) % len(self.engines)
            self._inflight[rank] += 1
            self.engines[rank].add(r, stamp)
            return False
        if kind == "abort":
            r = cmd[1]
            self._pending.pop(id(r), None)
            if r.engine is not None and r.state in (WAITING, RUNNING):
                e = self.engines[r.engine]
                e.advance_to(stamp)
                self._deliver()  # it may have finished first
                if r.state in (WAITING, RUNNING):
                    e.abort(r, stamp)
                    self._inflight[r.engine] -= 1
                    self._record(r)
            return False
        if kind == "timer":
            heapq.heappush(self._timers, (stamp + cmd[1], next(self._tseq), cmd[2]))
            return False
        ends = [stamp]
        for e in self.engines:
            if kind == "pause":
                ends.append(e.set_paused(cmd[1], stamp, cmd[2]))
            elif kind == "version":
                e.set_version(cmd[1], stamp)
            else:  # "block"
                ends.append(e.block(cmd[1], stamp))
        # a pause returns once the steps in flight are out, a reload once it ran everywhere
        heapq.heappush(self._timers, (max(ends), next(self._tseq), cmd[-1]))
        return False

    def _record(self, r: Request) -> None:
        self.records.append(
            RequestRecord(
                r.request_id,
                r.engine,
                r.priority,
                r.arrival,
                r.first_scheduled,
                r.finished_at,
                r.lp,
                r.num_out,
                r.first_hit,
                r.prefilled,
                r.preemptions,
                r.state,
                thinking=r.thinking,
            )
        )

    def _deliver(self) -> bool:
        """Hand the engines' finished requests to their callers."""
        woke = False
        for e in self.engines:
            done, e.outbox = e.outbox, []
            for r in done:
                self._inflight[r.engine] -= 1
                self._pending.pop(id(r), None)
                self._record(r)
                self.hasher.remember(r)
                fut, r.future = r.future, None  # r may stay remembered; its output must not
                if not fut.done():
                    fut.set_result(self._output(r))
                    woke = True
        return woke

    def _output(self, r: Request) -> RequestOutput:
        ids = r.output_ids()
        logprobs = FlatLogprobs(ids, [LOGP] * len(ids)) if r.logprobs else None
        spans = [WeightVersionSpan(v, a, b) for v, a, b in r.spans]
        reason = "length" if r.stop is None else "stop"
        stop_reason = r.stop if r.stop not in (None, EOS) else None  # vLLM: the stop token id
        done = CompletionOutput(0, "", ids, LOGP * len(ids), logprobs, reason, stop_reason, spans)
        prompt = r.prompt if isinstance(r.prompt, list) else None  # an Extension: not rebuilt
        return RequestOutput(r.request_id, prompt, [done])


class SimHost:
    """`infra.engine.Engine`'s surface over a `SimEngine`, for `generate.Sampler(engine=SimHost(
    sim))`: the project's real Sampler then samples on the simulator. `client` is the SimEngine;
    weights arrive from disk (its reload RPC); `dead()` says why it stopped, if it did; `shutdown()`
    stops it; `kv_capacity`: max_model_len sequences one engine's KV cache holds."""

    weight_transfer = "disk"

    def __init__(self, sim: SimEngine):
        self.client = sim

    @property
    def kv_capacity(self) -> int:
        return self.client.config.blocks() * BLOCK // self.client.model_config.max_model_len

    def dead(self) -> str | None:
        if self.client.errored or self.client._closed:
            return "the simulated engine is shut down"
        return None

    def shutdown(self, timeout: float | None = None) -> None:
        self.client.shutdown(timeout)


# --- the bench: the eval workload of `train.py --model qwen3-8b`
@dataclass
class EvalResult:
    """One simulated eval (seconds are simulated)."""

    policy: str
    first_answer_done_s: float
    answer_wait_median_s: float
    answer_wait_p90_s: float
    makespan_s: float
    preemptions: int
    prefix_hit_rate: float
    busy_frac: list[float] = field(default_factory=list)
    records: list[RequestRecord] = field(default_factory=list)


async def _rollout(eng: SimEngine, prompt, budget, answer_budget, phrase, answer_priority, rid):
    """generate.Sampler._rollout's two phases: thinking to `</think>` or L tokens, then the answer
    (a new request: prompt + thinking (+ phrase when interrupted))."""
    think = SimpleNamespace(max_tokens=budget, stop_token_ids=[THINK_CLOSE], logprobs=0)
    salt = "0"  # one weights version for the whole eval
    outputs = eng.generate({"prompt_token_ids": prompt, "cache_salt": salt}, think, f"t{rid}")
    done = [out async for out in outputs][-1].outputs[0]
    if done.finish_reason == "length":
        context = prompt + done.token_ids + phrase
    elif done.token_ids[-1] == THINK_CLOSE:
        context = prompt + done.token_ids
    else:
        return
    del done  # what a pending answer holds is what the simulator holds (Extension)
    answer = SimpleNamespace(max_tokens=answer_budget, stop_token_ids=[], logprobs=0)
    prompt = {"prompt_token_ids": context, "cache_salt": salt}
    del context
    outputs = eng.generate(prompt, answer, f"a{rid}", priority=answer_priority)
    del prompt
    async for _ in outputs:
        pass


async def eval_workload(
    policy: str,
    *,
    prompts: int = 1000,
    n: int = 16,
    greedy: bool = True,
    dp: int = 3,
    max_num_seqs: int = 22,
    gpu: GPU = H100,
    seed: int = 0,
    think_budget: tuple[int, int] = (10240, 12288),
    answer_budget: int = 2048,
    prompt_len: tuple[int, int] = (150, 400),
) -> EvalResult:
    """All rollouts of one held-out eval (prompts x n, plus one greedy rollout per prompt) submitted
    at once to dp engines, in virtual time. Under "priority" answer phases get priority -1.
    Prompt lengths: U{prompt_len} tokens (an assumption: a math problem in a chat template)."""
    config = EngineConfig(gpu=gpu, max_num_seqs=max_num_seqs, policy=policy)
    eng = SimEngine(dp=dp, config=config, seed=seed, time_scale=None)
    rng = random.Random(seed)
    phrase = eng.tokenizer.encode(
        "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    )
    answer_priority = -1 if policy == PRIORITY else 0
    jobs = []
    for p in range(prompts):
        prompt = [IM_START] + rng.choices(LETTERS, k=rng.randint(*prompt_len))
        for i in range(n + greedy):
            budget = rng.randint(*think_budget)
            rid = f"{p}-{i}"
            jobs.append(_rollout(eng, prompt, budget, answer_budget, phrase, answer_priority, rid))
    await asyncio.gather(*jobs)
    eng.shutdown()
    answers = [r for r in eng.records if r.request_id.startswith("a")]
    waits = sorted(r.first_scheduled - r.arrival for r in answers)
    stats = eng.stats()
    makespan = max(r.finished for r in eng.records)
    queried = sum(s.prefix_queried_tokens for s in stats)
    return EvalResult(
        policy=policy,
        first_answer_done_s=min(r.finished for r in answers),
        answer_wait_median_s=waits[len(waits) // 2],
        answer_wait_p90_s=waits[int(len(waits) * 0.9)],
        makespan_s=makespan,
        preemptions=sum(s.preemptions for s in stats),
        prefix_hit_rate=sum(s.prefix_hit_tokens for s in stats) / max(1, queried),
        busy_frac=[s.busy_s / makespan for s in stats],
        records=eng.records,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=1000)
    parser.add_argument("--n", type=int, default=16)
    parser.add_argument("--dp", type=int, default=3)
    parser.add_argument("--max-num-seqs", type=int, default=22)
    parser.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args()
    print(
        f"simulated eval: {a.prompts} prompts x ({a.n} + 1 greedy) rollouts, two phases each, on "
        f"{a.dp} x {GPUS[a.gpu].name} engines, max_num_seqs {a.max_num_seqs}; simulated seconds"
    )
    print(
        "  policy    first answer done    answer queue wait median / p90    eval done  "
        "preemptions  prefix hits  busy"
    )
    for policy in (FCFS, PRIORITY):
        wall = time.perf_counter()
        kw = dict(prompts=a.prompts, n=a.n, dp=a.dp, max_num_seqs=a.max_num_seqs, seed=a.seed)
        res = asyncio.run(eval_workload(policy, gpu=GPUS[a.gpu], **kw))
        wall = time.perf_counter() - wall
        first = res.first_answer_done_s
        busy = ", ".join(f"{b:.2f}" for b in res.busy_frac)
        print(
            f"  {policy:8s}  {first / 3600:5.2f} h ({first:6,.0f} s)  "
            f"{res.answer_wait_median_s:8,.0f} s / {res.answer_wait_p90_s:8,.0f} s  "
            f"         {res.makespan_s / 3600:5.2f} h  {res.preemptions:11d}  "
            f"{res.prefix_hit_rate:10.1%}  {busy}  ({wall:.0f} s of wall time)"
        )


if __name__ == "__main__":
    sys.exit(main())
