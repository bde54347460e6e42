"""Where a run's processes go, and whether they fit: the start-up plan rank 0 prints (issue 10).

    torchrun --nproc_per_node 4 train.py --model qwen3-8b   # 8 GPUs: trainers 0-3, vLLM 4-6, eval 7

Default: trainer rank r uses visible GPU r of its node (torchrun's LOCAL_RANK), and the generator
(vLLM) gets every visible GPU of rank 0's node that no trainer rank uses, as dp engines of tp GPUs
each. `--share-gpu` puts the generator on rank 0's GPU beside its trainer instead (small models
only). `--generator-gpus` indexes the visible list, as CUDA itself does under an inherited
CUDA_VISIBLE_DEVICES; the plan maps those indices to the physical ids the engine's processes get.
Evaluation has an engine of its own (pipeline.py: an eval is a snapshot of one weight version, so
it cannot share the engine that takes in-flight updates): `--eval-gpus` of the generator GPUs, the
last ones (default: tp of them when the generator has at least 2 x tp, so training generation never
waits for an eval), else (0) it shares the generator's first tp GPUs, taking what holds its weights
and EVAL_SHARED_SEQS sequences out of vLLM's memory share there. On CPU it shares the
cores (at low priority: generate.Sampler's `nice`).
Pure: GPU count and memory are arguments; nothing here touches CUDA or imports vLLM. The memory
of each process per GPU is estimated in bytes from a decoder-only LM's sizes (`Shape`, read from a
Hugging Face config). Pinned by `python -m pytest tests/test_placement.py`.

Where the estimates depart from a measurement, and why:
1. Trainer: FSDP2 shards fp32 parameters, fp32 gradients and AdamW's two fp32 moments over all
   trainer ranks (16 B per parameter / world); transient: the largest FSDP unit gathered in bf16
   twice (prefetch) plus its unsharded gradient in bf16 and fp32 (reduce_dtype); activations of one
   micro-batch of max_model_len tokens: with activation checkpointing each layer keeps its bf16
   input and one layer at a time holds everything it saves for backward; without, every layer does.
   Saved per token and layer (bf16, counted from the Qwen3 layer: two RMSNorms in fp32, q/k norms,
   RoPE, SDPA inputs and output, SwiGLU): 2 (6 H + 5 H_q + 5 H_kv + 4 I) bytes, ~194 KiB at
   Qwen3-8B's width (bench/gpu_trainer.py's estimate: ~206 KiB); an MoE layer (Qwen3-MoE) with
   I = top_k x the expert width, plus 2 (2 top_k H) for each token's routed copies. The fp32
   head (loss.token_logprobs) adds two (1024, V) fp32 blocks, the hidden gradient and a fp32 copy
   of the head weight and its gradient. Plus CONTEXT_BYTES per process. Not measured on a GPU by
   this project yet.
2. Generator: vLLM takes `utilization` of the GPU (its own rule): weights / tp (the fp32 LM head in
   fp32), VLLM_RESERVE_BYTES for activations and CUDA graphs, and the rest for the KV cache.
3. Concurrency: an engine's max_num_seqs is KV_OVERCOMMIT (3) x the max_model_len sequences its KV
   cache holds, not 1 x: a rollout holds about a third of max_model_len on average over its life
   (KV_OVERCOMMIT's comment), and when the cache runs out vLLM preempts a sequence and recomputes
   it later, which costs far less than the decoding the extra concurrency adds; 4 x adds little
   throughput for many more preemptions (simulated with bench/vllm_sim.py: docs/results.md).
"""

import math
import shlex
from dataclasses import dataclass, field, replace

from config import BadInput

GIB = 2**30
CONTEXT_BYTES = 2 * GIB  # CUDA context, NCCL buffers and allocator slack of one process (estimate)
VLLM_RESERVE_BYTES = 4 * GIB  # vLLM's activations, CUDA graphs and sampler buffers (estimate)
HEAD_CHUNK = 1024  # loss.token_logprobs' chunk_size: rows of (chunk, V) fp32 logits at a time
DEDICATED_UTILIZATION = 0.9  # vLLM's share of a GPU it has to itself
SHARED_UTILIZATION = 0.5  # ... of a GPU it shares with trainer rank 0 (--share-gpu)
# max_num_seqs per max_model_len sequence the KV cache holds. A rollout's context grows from its
# prompt to prompt + L + phrase + answer, so over its life it holds about half its final length;
# in the qwen3 presets that length is mostly thinking, L ~ U[10240, 12288] (config.PAPER_GEN),
# 11,264 tokens on average, 68% of max_model_len 16,512 (assumed: the prompt and the answer, a few
# hundred tokens each, add about what thinking that stops before L takes away): 11,264 / 2 /
# 16,512 = 0.34 of max_model_len held on average, so 3 rollouts per full-length sequence fill the
# cache (the simulator's check: module docstring, 3).
KV_OVERCOMMIT = 3
# full-length sequences the eval engine's KV cache holds on a GPU it shares with the training
# engine (--eval-gpus 0): it takes its weights, reserve and so much KV cache (at most half of vLLM's
# share); the training engine the rest. Few: there the eval slows training generation anyway
EVAL_SHARED_SEQS = 4


# config fields of mixture-of-experts families sparse_layers does not count
UNCOUNTED_MOE = ("num_local_experts", "n_routed_experts", "shared_expert_intermediate_size")


def check_counted(cfg) -> None:
    """Raise BadInput, one line, for a mixture of experts whose parameters `Shape.from_config`
    cannot count (Mixtral's num_local_experts, DeepSeek's n_routed_experts, Qwen2-MoE's shared
    expert): counted as dense, its GPU memory would be underestimated several times over. (On CPU
    they train, their FLOPs per token counted as if dense.)"""
    uncounted = [k for k in UNCOUNTED_MOE if getattr(cfg, k, None)]
    if uncounted and cfg.model_type != "qwen3_moe":  # Qwen3-MoE aliases num_local_experts
        raise BadInput(
            f"--model: {cfg.model_type} is a mixture of experts whose parameters the memory plan "
            f"cannot count ({uncounted[0]}); it counts Qwen3-MoE's"
        )


def sparse_layers(cfg) -> list[int]:
    """The decoder layers whose MLP is a mixture of experts in a Qwen3-MoE (or Qwen2-MoE) config:
    layer i unless it is in mlp_only_layers, when (i + 1) % decoder_sparse_step == 0 (transformers
    5.19 Qwen3MoeDecoderLayer; the others keep a dense MLP of intermediate_size). [] for a dense
    config, and for any other family (Mixtral's experts have no moe_intermediate_size:
    check_counted)."""
    if cfg.model_type not in ("qwen3_moe", "qwen2_moe") or not getattr(cfg, "num_experts", 0):
        return []
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    dense = set(getattr(cfg, "mlp_only_layers", None) or ())
    return [i for i in range(cfg.num_hidden_layers) if i not in dense and (i + 1) % step == 0]


def inactive_params(cfg) -> int:
    """The parameters a token does not run through: an MoE's (Qwen3-MoE) num_experts - top_k
    experts of each sparse layer, 3 H x moe_intermediate_size each; 0 for a dense config. Total
    minus this is what FLOPs per token count (2 N generated, 6 N trained)."""
    sparse = len(sparse_layers(cfg))
    if not sparse:
        return 0
    unused = cfg.num_experts - cfg.num_experts_per_tok
    return sparse * unused * 3 * cfg.hidden_size * cfg.moe_intermediate_size


@dataclass(frozen=True)
class Shape:
    """What the memory estimate needs of a decoder-only LM (a Hugging Face config's sizes)."""

    params: int  # all of them: what memory holds (an MoE's every expert)
    hidden: int  # H
    intermediate: int  # I, the SwiGLU width one token runs through (an MoE: top_k x expert width)
    layers: int
    vocab: int  # V
    q_dim: int  # attention heads x head_dim (H_q)
    kv_dim: int  # key-value heads x head_dim (H_kv)
    tied: bool  # the LM head is the input embedding
    # the parameters one token runs through, what FLOPs count (an MoE: its top_k routed experts
    # per sparse layer, not all of them); None: all (a dense model)
    active_params: int | None = None
    top_k: int = 0  # experts per token (num_experts_per_tok); 0: a dense model

    @property
    def active(self) -> int:
        """Parameters per token (active_params, else params)."""
        return self.params if self.active_params is None else self.active_params

    @classmethod
    def from_config(cls, cfg) -> "Shape":
        """From a transformers config (Qwen3, Qwen2, Llama; Qwen3-MoE: sparse_layers hold
        num_experts SwiGLU experts of moe_intermediate_size and a router of num_experts x H, the
        other layers a dense MLP); parameters counted from the sizes. An MoE's `intermediate` is
        the widest per-token MLP of its layers (top_k x moe_intermediate_size on a sparse one)."""
        H, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
        head_dim = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        q = cfg.num_attention_heads * head_dim
        kv = cfg.num_key_value_heads * head_dim
        qk_norm = 2 * head_dim if cfg.model_type in ("qwen3", "qwen3_moe") else 0
        attn = H * q + 2 * H * kv + q * H + qk_norm + 2 * H  # and the two RMSNorms
        tied = bool(cfg.tie_word_embeddings)
        outside = V * H * (1 if tied else 2) + H  # embedding, head, final norm
        sparse = len(sparse_layers(cfg))
        if not sparse:
            return cls(outside + L * (attn + 3 * H * I), H, I, L, V, q, kv, tied)
        E, k, I_e = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
        dense = (L - sparse) * (attn + 3 * H * I)
        params = outside + dense + sparse * (attn + E * 3 * H * I_e + E * H)
        active = outside + dense + sparse * (attn + k * 3 * H * I_e + E * H)
        width = max(k * I_e, I if sparse < L else 0)
        return cls(params, H, width, L, V, q, kv, tied, active, k)


def trainer_bytes(
    shape: Shape, *, world: int, tokens: int, checkpointing: bool, fp32_head: bool = True
) -> dict[str, int]:
    """Estimated peak bytes of one trainer GPU (module docstring, 1): params, grads, adamw (sharded
    over `world` ranks), gathers (FSDP2 transients), activations (one micro-batch of `tokens`, with
    or without activation checkpointing), head (the LM head's transients), context."""
    H = shape.hidden
    V = shape.vocab
    per_token_layer = 2 * (6 * H + 5 * shape.q_dim + 5 * shape.kv_dim + 4 * shape.intermediate)
    # an MoE layer also keeps each token's top_k gathered copies of its input and weighted outputs
    # (transformers' experts forward): 2 top_k H more
    per_token_layer += 2 * 2 * shape.top_k * H
    embeddings = 1 if shape.tied else 2  # (V, H) matrices: the input embedding, an untied head
    root_params = V * H * embeddings + H  # embedding, head, final norm: the root FSDP unit
    layer_params = (shape.params - root_params) // shape.layers
    unit = max(layer_params, root_params)  # the largest unit FSDP2 gathers
    one_layer = tokens * per_token_layer
    if checkpointing:  # every layer's bf16 input, and one layer's saved tensors at a time
        activations = shape.layers * tokens * 2 * H + one_layer
    else:
        activations = shape.layers * one_layer
    # two (HEAD_CHUNK, V) fp32 logit blocks and the hidden states' fp32 gradient
    head = 2 * HEAD_CHUNK * V * 4 + tokens * H * 4
    if fp32_head:  # an fp32 copy of the head weight and its gradient
        head += 2 * V * H * 4
    return {
        "params": 4 * shape.params // world,
        "grads": 4 * shape.params // world,
        "adamw": 8 * shape.params // world,
        "gathers": 2 * 2 * unit + (2 + 4) * unit,
        "activations": activations,
        "head": head,
        "context": CONTEXT_BYTES,
    }


def kv_bytes_per_token(shape: Shape, dtype_bytes: int, tp: int = 1) -> int:
    """KV cache bytes per token on one GPU of a tp group: K and V of every layer (vLLM's cache dtype
    "auto" is the model dtype)."""
    return 2 * shape.layers * shape.kv_dim * dtype_bytes // tp


def generator_bytes(
    shape: Shape, *, gpu_bytes: int, utilization: float, tp: int, dtype_bytes: int, fp32_head: bool
) -> dict[str, int]:
    """vLLM's use of one generator GPU (module docstring, 2): weights, reserve, kv (what is left of
    its share, may be negative when the weights do not fit)."""
    head_extra = 0
    if fp32_head and not shape.tied:  # the untied head in fp32: its bytes beyond dtype_bytes
        head_extra = shape.vocab * shape.hidden * (4 - dtype_bytes)
    weights = (shape.params * dtype_bytes + head_extra) // tp
    budget = int(utilization * gpu_bytes)
    return {
        "weights": weights,
        "reserve": VLLM_RESERVE_BYTES,
        "kv": budget - weights - VLLM_RESERVE_BYTES,
    }


def vllm_utilization(utilization: float | None, *, beside_trainer: bool) -> float:
    """vLLM's share of each GPU of an engine (its gpu_memory_utilization): the run's
    --gpu-memory-utilization if set (and not 0), else SHARED_UTILIZATION where the engine shares a
    GPU with a trainer rank and DEDICATED_UTILIZATION where it has its GPUs to itself."""
    if utilization:
        return utilization
    if beside_trainer:
        return SHARED_UTILIZATION
    return DEDICATED_UTILIZATION


def eval_utilization(
    shape: Shape,
    *,
    utilization: float,
    per_seq: int,
    gpu_bytes: int,
    tp: int,
    dtype_bytes: int,
    fp32_head: bool,
) -> float:
    """The eval engine's share of a GPU where it sits beside the training engine, taken out of the
    training engine's `utilization`: its weights, the reserve and EVAL_SHARED_SEQS sequences of
    `per_seq` bytes, rounded up to 1e-4 (so at least that many bytes), at most half."""
    kw = dict(gpu_bytes=gpu_bytes, tp=tp, dtype_bytes=dtype_bytes, fp32_head=fp32_head)
    weights = generator_bytes(shape, utilization=0.0, **kw)["weights"]
    need = weights + VLLM_RESERVE_BYTES + EVAL_SHARED_SEQS * per_seq
    return min(utilization / 2, math.ceil(need / gpu_bytes * 1e4) / 1e4)


def max_num_seqs(
    *, P: int, G: int, max_lag: int, mode: str, max_inflight: int, dp: int, kv_seqs: int
) -> int:
    """vLLM's max_num_seqs per engine: the rollouts the pipeline can have in flight, split over dp
    engines, capped at KV_OVERCOMMIT x kv_seqs (module docstring, 3). P prompt groups per batch
    (after --batch-scale), G rollouts each; batches in flight: max_lag + 1 for PipelineRL-k (k =
    max_lag: the pipeline's may_start rule lets groups of the next k batches start), k for
    PPO-off-policy-k (k batches per weight version), either way at most max_inflight / P
    (pipeline.Pipeline's cap on groups at once). kv_seqs: sequences of max_model_len tokens the
    engine's KV cache holds (blocks x block size / max_model_len); vLLM allocates blocks as
    sequences grow, and a rollout holds about a third of max_model_len over its life, so about
    KV_OVERCOMMIT x that many fill the cache, preempting (and recomputing) a few when long ones
    meet. At least 1."""
    if mode == "pipeline":
        batches = min(max_lag + 1, max_inflight / P)
    else:
        batches = min(max_lag, max_inflight / P)
    demand = -(-round(P * G * batches) // dp)  # ceil over dp engines
    return max(1, min(demand, KV_OVERCOMMIT * kv_seqs))


# vLLM's KV cache on CPU when neither --kv-cache-gib nor a GPU memory share is given (GiB)
CPU_KV_CACHE_GIB = 1.0


def visible_gpus(cuda_visible_devices: str | None, n: int) -> list[str]:
    """The physical ids (or UUIDs) behind visible GPUs 0..n-1: CUDA numbers visible devices in the
    order CUDA_VISIBLE_DEVICES lists them; unset, visible = physical."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(n)]
    ids = [s.strip() for s in cuda_visible_devices.split(",") if s.strip()]
    if len(ids) < n:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} lists fewer than {n} GPUs")
    return ids[:n]


@dataclass(frozen=True)
class Request:
    """What `plan` places, passed to it as keywords: rank 0's node, the run's sizes and flags."""

    n_gpus: int  # visible GPUs (0 = CPU: one device runs everything, nothing is checked)
    gpu_bytes: int  # each visible GPU's memory
    cuda_visible_devices: str | None  # as inherited (None: unset)
    world: int  # trainer ranks in all
    local_world: int  # trainer ranks on rank 0's node: visible GPUs 0..local_world-1
    generator_gpus: list[int] | None  # visible indices; None: the default placement
    share_gpu: bool  # allow (and by default use) trainer GPUs for the generator
    tp: int  # GPUs per vLLM engine (--tensor-parallel-size)
    utilization: float | None  # vLLM's share of a GPU; None: DEDICATED_ or SHARED_UTILIZATION
    microbatch_tokens: int  # tokens per trainer forward (the micro-batch token budget)
    max_model_len: int
    checkpointing: bool  # activation checkpointing
    fp32_head: bool  # the LM head in fp32, in the trainer and in vLLM
    dtype_bytes: int  # the sampler's weight dtype
    P: int  # P, G, max_lag, mode, max_inflight: see `max_num_seqs`
    G: int
    max_lag: int
    mode: str
    max_inflight: int
    kv_cache_bytes: int | None = None  # the CPU engines' KV cache (None: 1 GiB)
    # generator GPUs (the last ones) given to the eval engine; 0: it shares the generator's first
    # tp GPUs; None: tp of them when the generator has >= 2 tp, else 0
    eval_gpus: int | None = None
    # sequences one eval samples (prompts x (samples + 1 greedy)), for its max_num_seqs
    eval_seqs: int = 1
    # training engines (tp GPUs each) on other nodes with as many GPUs of gpu_bytes as this one
    # (--remote-engines): vLLM's headless DP engines, which join rank 0's node's engine
    remote_engines: int = 0

    def seqs(self) -> dict:
        """`max_num_seqs`' keywords that come from the run."""
        return dict(
            P=self.P, G=self.G, max_lag=self.max_lag, mode=self.mode, max_inflight=self.max_inflight
        )


@dataclass
class Row:
    gpu: int  # visible index on its node
    physical: str  # its id in the parent's CUDA_VISIBLE_DEVICES terms (rank 0's node)
    role: str
    parts: dict[str, int]  # bytes by item
    total: int
    node: int = 0  # 0: rank 0's node; k: the k-th other node (Plan.remote_nodes)


@dataclass
class EvalPlacement:
    """The eval engine's placement (the training engine's is Plan's own fields)."""

    gpus: list[str] | None  # physical ids for its CUDA_VISIBLE_DEVICES; None on CPU
    tp: int
    dp: int
    utilization: float | None  # its gpu_memory_utilization; None on CPU
    shared: bool  # on the training engine's GPUs (or the CPU): an eval slows training generation
    max_num_seqs: int
    kv_seqs: int  # KV capacity in max_model_len sequences per engine (estimate)


@dataclass
class Plan:
    """The placement decided at start-up (rank 0's node); non-empty `errors`: it must not run."""

    rows: list[Row]
    generator: list[str] | None  # physical ids for the engine's CUDA_VISIBLE_DEVICES; None on CPU
    tp: int
    dp: int
    utilization: float | None  # vLLM's gpu_memory_utilization; None on CPU
    dedicated: bool  # the generator has GPUs no trainer rank uses (the NCCL weight path needs this)
    # distinct devices for gpu_hours: trainer GPUs + generator GPUs not shared; 1 on CPU
    devices: int
    max_num_seqs: int
    kv_seqs: int  # KV capacity in max_model_len sequences per engine (estimate)
    eval: EvalPlacement | None = None
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    fix: str | None = None  # the command to run instead
    remote: int = 0  # of the dp engines, those on other nodes (vLLM's headless DP engines)
    remote_nodes: list[int] = field(default_factory=list)  # engines on each other node
    needs: str | None = None  # where no placement on this node fits: what would (_needs)


@dataclass
class _Share:
    """One vLLM engine's use of each of its GPUs."""

    gpus: list[int]  # visible indices
    utilization: float  # its gpu_memory_utilization
    parts: dict[str, int]  # generator_bytes
    kv_seqs: int  # KV capacity in max_model_len sequences per engine


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}"


def plan(shape: Shape, *, argv: list[str] = (), **request) -> Plan:
    """Place trainer ranks, the generator and the eval engine on rank 0's node and check that they
    fit (module docstring). `request`: the fields of Request, as keywords (n_gpus, gpu_bytes, ...);
    argv: train.py's arguments, for the command `fix` suggests.

    Returns a Plan and never raises on a bad placement (`errors` say why, `fix` what to run
    instead); ValueError for a CUDA_VISIBLE_DEVICES shorter than n_gpus, TypeError for a missing or
    unknown keyword.
    """
    req = Request(**request)
    if req.n_gpus == 0:
        return _cpu_plan(shape, req)
    out = _gpu_plan(shape, req)
    if out.errors and req.world == req.local_world:
        out.fix = _suggestion(shape, req, list(argv))
        if out.fix is None:
            out.needs = _needs(shape, req)
    return out


def _cpu_plan(shape, req):
    """No GPU: one device runs the trainer ranks and both engines; nothing to check."""
    per_seq = kv_bytes_per_token(shape, req.dtype_bytes) * req.max_model_len
    kv = (req.kv_cache_bytes or GIB) // per_seq
    ev = EvalPlacement(None, 1, 1, None, True, max(1, min(req.eval_seqs, KV_OVERCOMMIT * kv)), kv)
    row = Row(-1, "cpu", f"{req.world} trainer rank(s) + generator + eval engine", {}, 0)
    n = max_num_seqs(**req.seqs(), dp=1, kv_seqs=kv)
    out = Plan([row], None, 1, 1, None, False, 1, n, kv, ev)
    if req.remote_engines:  # weights reach other nodes by NCCL only (config.check_nodes)
        out.errors.append(f"--remote-engines {req.remote_engines}: needs GPUs (NCCL weights)")
    return out


def cpu_trainer_threads(env, cpus: int) -> int:
    """Torch threads for a trainer rank on the CPU, where vLLM's engines share the cores: half
    the `cpus` this process may use, at least 1; an OMP_NUM_THREADS in `env` (the user's, or the
    1 torchrun sets for several ranks; of a list, its first number) wins. More threads than that
    spin at their OpenMP barriers while the engines hold the cores (measured in
    docs/history-presets.md, issue 28). Pure: the caller passes os.environ and the CPU count."""
    first = env.get("OMP_NUM_THREADS", "").split(",")[0].strip()
    if first.isdigit() and int(first) > 0:
        return int(first)
    return max(1, cpus // 2)


def _gpu_plan(shape, req):
    """`plan` on rank 0's GPUs, without the suggested command."""
    physical = visible_gpus(req.cuda_visible_devices, req.n_gpus)
    trainer = list(range(min(req.local_world, req.n_gpus)))
    errors = []
    notes = []
    gen_gpus, eval_gpus, n_eval = _split_gpus(req, trainer, errors, notes)
    gen, ev = _vllm_shares(shape, req, gen_gpus, eval_gpus, trainer, n_eval)
    kw = dict(world=req.world, tokens=req.microbatch_tokens, fp32_head=req.fp32_head)
    tr = trainer_bytes(shape, checkpointing=req.checkpointing, **kw)
    other_ac = trainer_bytes(shape, checkpointing=not req.checkpointing, **kw)
    remote_nodes = _remote_nodes(req, errors)
    dp = max(1, len(gen.gpus) // req.tp) + req.remote_engines
    ev_dp = max(1, n_eval // req.tp)
    rows = _rows(req, physical, trainer, tr, gen, ev, ev_dp)
    rows += _remote_rows(req, gen, remote_nodes, first_rank=dp - req.remote_engines)
    _check_sizes(req, rows, tr, other_ac, gen, ev, n_eval, notes, errors)
    ev_seqs = max(1, min(-(-req.eval_seqs // ev_dp), KV_OVERCOMMIT * max(ev.kv_seqs, 1)))
    ev_gpus = [physical[g] for g in ev.gpus]
    evp = EvalPlacement(ev_gpus, req.tp, ev_dp, ev.utilization, not n_eval, ev_seqs, ev.kv_seqs)
    n = max_num_seqs(**req.seqs(), dp=dp, kv_seqs=max(gen.kv_seqs, 1))
    dedicated = bool(gen.gpus) and not [g for g in gen.gpus if g in trainer]
    # distinct GPUs for gpu_hours: shared ones once
    devices = req.world + len({g for g in gen.gpus + ev.gpus if g not in trainer})
    devices += req.remote_engines * req.tp
    generator = [physical[g] for g in gen.gpus]
    out = Plan(rows, generator, req.tp, dp, gen.utilization, dedicated, devices, n, gen.kv_seqs)
    out.eval = evp
    out.remote = req.remote_engines
    out.remote_nodes = remote_nodes
    out.notes = notes
    out.errors = errors
    return out


def _remote_nodes(req, errors) -> list[int]:
    """Training engines on each other node: as many tp groups as rank 0's node has GPUs, the last
    node the rest; appends to `errors` remote engines with no GPU of their own to join."""
    per_node = req.n_gpus // req.tp
    if req.remote_engines and not per_node:
        errors.append(
            f"--remote-engines {req.remote_engines}: a node of {req.n_gpus} GPU(s) "
            f"holds no engine of tp {req.tp}"
        )
        return []
    out = []
    left = req.remote_engines
    while left > 0:
        out.append(min(per_node, left))
        left -= out[-1]
    return out


def _remote_rows(req, gen, remote_nodes, first_rank: int) -> list[Row]:
    """One Row per GPU of the other nodes' engines (headless: vLLM alone, its whole share, as on
    rank 0's node), DP ranks from `first_rank` on, after rank 0's node's."""
    rows = []
    rank = first_rank
    share = int(gen.utilization * req.gpu_bytes)
    for node, engines in enumerate(remote_nodes, start=1):
        for g in range(engines * req.tp):
            role = f"vLLM headless dp {rank + g // req.tp}"
            if req.tp > 1:
                role += f" tp {g % req.tp}"
            rows.append(Row(g, str(g), role, {"vllm": share}, share, node))
        rank += engines
    return rows


def _split_gpus(req, trainer, errors, notes) -> tuple[list[int], list[int], int]:
    """(training engine's GPUs, eval engine's GPUs, GPUs the eval engine has to itself), visible
    indices; appends what is wrong to `errors` and idle GPUs to `notes`."""
    n_gpus = req.n_gpus
    tp = req.tp
    if req.local_world > n_gpus:
        errors.append(f"{req.local_world} trainer ranks on rank 0's node but {n_gpus} visible GPUs")
    if req.generator_gpus is None:
        if req.share_gpu:
            pool = list(range(tp))
        else:
            pool = [g for g in range(n_gpus) if g not in trainer]
        gen = pool[: len(pool) // tp * tp]
        if len(gen) < len(pool):
            notes.append(f"visible GPU(s) {pool[len(gen) :]} idle: not a multiple of tp {tp}")
        if not gen:
            errors.append(
                f"no GPU left for the generator: {req.local_world} trainer rank(s) use all "
                f"{n_gpus} visible GPU(s) of rank 0's node (tp {tp})"
            )
    else:
        gen = list(dict.fromkeys(g for g in req.generator_gpus if 0 <= g < n_gpus))
        if len(gen) < len(req.generator_gpus):
            errors.append(
                f"--generator-gpus {req.generator_gpus}: indices must be distinct and among the "
                f"{n_gpus} visible GPUs 0-{n_gpus - 1} (CUDA_VISIBLE_DEVICES order)"
            )
        if len(gen) % tp:
            errors.append(f"--generator-gpus {gen}: not a multiple of --tensor-parallel-size {tp}")
    n_eval = req.eval_gpus
    if n_eval is None:
        # GPUs of its own only where training generation keeps at least one tp group
        n_eval = tp if len(gen) >= 2 * tp else 0
    if n_eval % tp or (gen and n_eval > len(gen) - tp):
        errors.append(
            f"--eval-gpus {n_eval}: must be a multiple of --tensor-parallel-size {tp} and leave "
            f"at least {tp} of the {len(gen)} generator GPU(s) to training generation"
        )
        n_eval = 0
    # the eval engine: the last n_eval generator GPUs, or (0) the training engine's first tp
    eval_gpus = gen[len(gen) - n_eval :] if n_eval else gen[:tp]
    gen = gen[: len(gen) - n_eval]
    shared = [g for g in gen + eval_gpus if g in trainer]
    if shared and not req.share_gpu:
        errors.append(
            f"--generator-gpus {gen + eval_gpus} overlaps the GPU(s) {shared} of trainer rank(s) "
            f"{shared}; --share-gpu shares them on purpose (small models only)"
        )
    return gen, eval_gpus, n_eval


def _vllm_shares(shape, req, gen_gpus, eval_gpus, trainer, n_eval) -> tuple[_Share, _Share]:
    """The training engine's and the eval engine's vLLM share of each of their GPUs
    (vllm_utilization); an eval engine without GPUs of its own (n_eval 0) takes its part
    out of the training engine's share (eval_utilization)."""
    kw = dict(gpu_bytes=req.gpu_bytes, tp=req.tp, dtype_bytes=req.dtype_bytes)
    kw["fp32_head"] = req.fp32_head
    per_seq = kv_bytes_per_token(shape, req.dtype_bytes, req.tp) * req.max_model_len
    util = vllm_utilization(req.utilization, beside_trainer=bool(set(gen_gpus) & set(trainer)))
    ev_util = vllm_utilization(req.utilization, beside_trainer=bool(set(eval_gpus) & set(trainer)))
    if not n_eval:  # one vLLM share per GPU, split between the two engines
        ev_util = eval_utilization(shape, utilization=util, per_seq=per_seq, **kw)
        util -= ev_util
    shares = []
    for gpus, u in ((gen_gpus, util), (eval_gpus, ev_util)):
        parts = generator_bytes(shape, utilization=u, **kw)
        shares.append(_Share(gpus, u, parts, max(0, parts["kv"]) // per_seq))
    return shares[0], shares[1]


def _engine_role(name: str, i: int, tp: int, show_dp: bool) -> str:
    """`name dp D tp T` for the i-th GPU of an engine (tp only when it is above 1)."""
    role = name
    if show_dp:
        role += f" dp {i // tp}"
    if tp > 1:
        role += f" tp {i % tp}"
    return role


def _rows(req, physical, trainer, trainer_parts, gen, ev, ev_dp) -> list[Row]:
    """One Row per visible GPU: its roles and their bytes (a vLLM engine: its whole share)."""
    rows = []
    for g in range(req.n_gpus):
        parts = dict(trainer_parts) if g in trainer else {}
        roles = [f"trainer rank {g}"] if g in trainer else []
        if g in gen.gpus:
            roles.append(_engine_role("vLLM", gen.gpus.index(g), req.tp, show_dp=True))
            parts["vllm"] = int(gen.utilization * req.gpu_bytes)
        if g in ev.gpus:
            roles.append(_engine_role("vLLM eval", ev.gpus.index(g), req.tp, show_dp=ev_dp > 1))
            parts["eval"] = int(ev.utilization * req.gpu_bytes)
        rows.append(Row(g, physical[g], " + ".join(roles) or "idle", parts, sum(parts.values())))
    return rows


def _check_sizes(req, rows, trainer_parts, other_ac, gen, ev, n_eval, notes, errors) -> None:
    """Appends to `notes` the trainer's activations with the run's activation checkpointing and
    with the other setting (`other_ac`: trainer_bytes with it), each engine's share and whether
    they share GPUs; to `errors` GPUs whose estimate exceeds their memory and engines with no room
    for one sequence's KV cache."""
    on = "with" if req.checkpointing else "without"
    off = "without" if req.checkpointing else "with"
    notes.append(
        f"trainer activations: {_gib(trainer_parts['activations'])} GiB {on} activation "
        f"checkpointing, {_gib(other_ac['activations'])} GiB {off} (micro-batch of "
        f"{req.microbatch_tokens} tokens)"
    )
    for name, share in (("vLLM", gen), ("eval vLLM", ev)):
        b = share.parts
        if share.gpus:
            notes.append(
                f"{name} {share.utilization:.2f} share of each of its GPUs: weights "
                f"{_gib(b['weights'])} + reserve {_gib(b['reserve'])} + KV cache "
                f"{_gib(max(b['kv'], 0))} GiB"
            )
    if gen.gpus and not n_eval:
        notes.append(
            "the eval engine shares the generator's GPU(s): while an eval runs, training "
            "generation there gets part of the GPU's time; --eval-gpus gives it GPUs of its own"
        )
    gib = _gib(req.gpu_bytes)
    for r in rows:
        if r.total > req.gpu_bytes:
            errors.append(f"GPU {r.gpu} ({r.role}) needs ~{_gib(r.total)} of {gib} GiB")
    for name, share in (("vLLM", gen), ("the eval engine", ev)):
        if share.gpus and share.kv_seqs < 1:
            errors.append(
                f"{name}'s {share.utilization:.2f} share of {gib} GiB holds "
                f"{_gib(share.parts['weights'])} GiB of weights per GPU but no KV cache for one "
                f"{req.max_model_len}-token sequence at tp {req.tp}"
            )


def _suggestion(shape, req, argv) -> str | None:
    """The torchrun command of the first placement on this node that fits: trainer ranks on half
    the GPUs and the generator on the rest, else the fewest trainer ranks that fit beside a
    dedicated generator, else the generator sharing trainer GPUs (--share-gpu); each with the run's
    activation checkpointing, then with it on."""
    n = req.n_gpus
    fits_beside = [t for t in range(1, n) if n - t >= req.tp]
    ranks = sorted(fits_beside, key=lambda t: (t != n // 2, t))  # half the GPUs first
    tries = [(t, False) for t in ranks] + [(req.world, True)]
    for ac in dict.fromkeys([req.checkpointing, True]):
        for t, share in tries:
            # the default placement: the run's --generator-gpus and --eval-gpus are dropped
            alt = replace(req, world=t, local_world=t, share_gpu=share, checkpointing=ac)
            alt = replace(alt, generator_gpus=None, eval_gpus=None)
            if not _gpu_plan(shape, alt).errors:
                extra = ["--share-gpu"] if share else []
                if ac and not req.checkpointing:
                    extra.append("--activation-checkpointing")
                return _command(argv, t, extra)
    return None


def _needs(shape, req) -> str:
    """What a run that fits no placement on this node would need, in one line: the fewest trainer
    ranks whose GPUs (this node's size) hold the trainer with activation checkpointing (FSDP2 shards
    16 B per parameter; this trainer has no CPU offload), and the smallest tp whose GPUs hold one
    engine's weights and one max_model_len sequence's KV cache; the training and the eval engine
    each need that many GPUs of their own (two engines' weights on one GPU fit where one does only
    for small models). Qwen3-30B-A3B on 8 x 80 GB: 8 trainer ranks and 2 x 1 engine GPUs (on 8 x
    H200 it fits: 5 trainer ranks)."""
    kw = dict(tokens=req.microbatch_tokens, checkpointing=True, fp32_head=req.fp32_head)
    gib = _gib(req.gpu_bytes)
    ranks = next(
        (
            w
            for w in range(1, 4097)
            if sum(trainer_bytes(shape, world=w, **kw).values()) <= req.gpu_bytes
        ),
        None,
    )
    trainer = (
        f"the trainer needs >= {ranks} ranks of {gib} GiB"
        if ranks
        else f"the trainer fits no {gib} GiB GPU at any rank count"
    )
    trainer += (
        f" ({shape.params / 1e9:.1f}B parameters, 16 B each sharded by FSDP2, no CPU offload)"
    )
    gen = dict(gpu_bytes=req.gpu_bytes, utilization=DEDICATED_UTILIZATION)
    gen.update(dtype_bytes=req.dtype_bytes, fp32_head=req.fp32_head)
    tp = next(
        (
            t
            for t in (1, 2, 4, 8)
            if generator_bytes(shape, tp=t, **gen)["kv"]
            >= kv_bytes_per_token(shape, req.dtype_bytes, t) * req.max_model_len
        ),
        None,
    )
    if tp is None:
        engines = f"no vLLM engine of up to 8 {gib} GiB GPUs holds the weights"
    else:
        engines = (
            f"vLLM --tensor-parallel-size {tp}: the training and the eval engine {tp} GPU(s) each"
        )
    total = f"{ranks + 2 * tp} GPUs" if ranks and tp else "more GPUs"
    return f"{trainer}; {engines}: {total} against {req.n_gpus} on this node"


def _command(argv: list[str], nproc: int, extra: list[str]) -> str:
    """`torchrun --nproc_per_node nproc train.py ARGV EXTRA`: ARGV without the placement flags (and
    their values) and the flag that turns activation checkpointing off."""
    drop = ("--generator-gpus", "--share-gpu", "--no-activation-checkpointing", "--eval-gpus")
    out = []
    skipping = False
    for a in argv:
        if a.startswith("--"):
            skipping = a.split("=")[0] in drop
        if not skipping:
            out.append(a)
    out += [e for e in extra if e not in out]
    return " ".join(["torchrun", f"--nproc_per_node {nproc}", "train.py", *map(shlex.quote, out)])


def check(p: Plan) -> None:
    """Raise SystemExit naming every problem and the command to run instead, if it cannot run."""
    if p.errors:
        fix = f"run instead: {p.fix}" if p.fix else "no placement on this node fits"
        if p.needs:
            fix += f": {p.needs}"
        raise SystemExit("train.py: placement refused:\n  " + "\n  ".join(p.errors + [fix]))


def describe(p: Plan) -> str:
    """The plan as rank 0 prints it: one line per GPU with its role and estimated memory (GiB)."""
    ev = p.eval
    if p.generator is None:
        return (
            f"placement: CPU, one device; vLLM max_num_seqs {p.max_num_seqs}; the eval engine "
            f"shares the cores at low priority (max_num_seqs {ev.max_num_seqs}); weights via disk"
        )
    where = "sharing the generator's" if ev.shared else "on"
    remote = ""
    if p.remote:
        remote = f" and {p.remote} engine(s) on {len(p.remote_nodes)} other node(s)"
    head = (
        f"placement: {len(p.rows) - p.remote * p.tp} visible GPU(s) on rank 0's node; generator "
        f"tp {p.tp} x dp {p.dp} on physical GPU(s) {','.join(p.generator) or '-'}{remote}; "
        f"eval engine tp {ev.tp} x dp {ev.dp} {where} physical GPU(s) "
        f"{','.join(ev.gpus) or '-'}; gpu_hours counts {p.devices} GPU(s); vLLM max_num_seqs "
        f"{p.max_num_seqs} per engine (KV cache ~{p.kv_seqs} full-length sequences, a rollout "
        f"holds ~1/{KV_OVERCOMMIT} of one on average), eval {ev.max_num_seqs}"
    )
    lines = [head]
    for r in p.rows:
        parts = " + ".join(f"{k} {_gib(v)}" for k, v in r.parts.items())
        where = f"node {r.node} GPU {r.gpu}" if r.node else f"GPU {r.gpu} (physical {r.physical})"
        lines.append(f"  {where}: {r.role}: ~{_gib(r.total)} GiB = {parts}")
    return "\n".join(lines + [f"  note: {n}" for n in p.notes])
