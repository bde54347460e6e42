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
and EVAL_SHARED_SEQS sequences out of vLLM's memory share there. On CPU it shares the cores (at low
priority: generate.Sampler's `nice`).
Pure: GPU count and memory are arguments; nothing here touches CUDA or imports vLLM.

Memory is estimated per GPU, in bytes (departures from a measurement, and why):
1. Trainer: FSDP2 shards fp32 parameters, fp32 gradients and AdamW's two fp32 moments over all
   trainer ranks (16 B per parameter / world); transient: the largest FSDP unit gathered in bf16
   twice (prefetch) plus its unsharded gradient in bf16 and fp32 (reduce_dtype); activations of one
   micro-batch of max_model_len tokens: with activation checkpointing each layer keeps its bf16
   input and one layer at a time holds everything it saves for backward; without, every layer does.
   Saved per token and layer (bf16, counted from the Qwen3 layer: two RMSNorms in fp32, q/k norms,
   RoPE, SDPA inputs and output, SwiGLU): 2 (6 H + 5 H_q + 5 H_kv + 4 I) bytes, ~194 KiB at
   Qwen3-8B's width (bench/gpu_trainer.py's estimate: ~206 KiB). The fp32 head (loss.token_logprobs)
   adds two (1024, V) fp32 blocks, the hidden gradient and a fp32 copy of the head weight and its
   gradient. Plus CONTEXT_BYTES per process. Not measured on a GPU by this project yet.
2. Generator: vLLM takes `utilization` of the GPU (its own rule): weights / tp (the fp32 LM head in
   fp32), VLLM_RESERVE_BYTES for activations and CUDA graphs, and the rest for the KV cache.
"""

import math
import shlex
from dataclasses import dataclass, field

# vLLM's KV cache on CPU when neither --kv-cache-gib nor a GPU memory share is given (GiB)
CPU_KV_CACHE_GIB = 1.0

GIB = 2**30
CONTEXT_BYTES = 2 * GIB  # CUDA context, NCCL buffers and allocator slack of one process (estimate)
VLLM_RESERVE_BYTES = 4 * GIB  # vLLM's activations, CUDA graphs and sampler buffers (estimate)
DEDICATED_UTILIZATION = 0.9  # vLLM's share of a GPU it has to itself
SHARED_UTILIZATION = 0.5  # ... of a GPU it shares with trainer rank 0 (--share-gpu)
# full-length sequences the eval engine's KV cache holds on a GPU it shares with the training engine
# (--eval-gpus 0): it takes its weights, reserve and so much KV cache (at most half of vLLM's share);
# the training engine the rest. Few: there the eval slows training generation anyway
EVAL_SHARED_SEQS = 4
HEAD_CHUNK = 1024  # loss.token_logprobs' chunk_size: rows of (chunk, V) fp32 logits at a time


@dataclass(frozen=True)
class Shape:
    """What the memory estimate needs of a decoder-only LM (a Hugging Face config's sizes)."""

    params: int
    hidden: int  # H
    intermediate: int  # I, the SwiGLU width
    layers: int
    vocab: int  # V
    q_dim: int  # attention heads x head_dim (H_q)
    kv_dim: int  # key-value heads x head_dim (H_kv)
    tied: bool  # the LM head is the input embedding

    @classmethod
    def from_config(cls, cfg) -> "Shape":
        """From a transformers config (Qwen3, Qwen2, Llama); parameters counted from the sizes."""
        H, I, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size
        head_dim = getattr(cfg, "head_dim", None) or H // cfg.num_attention_heads
        q, kv = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
        qk_norm = 2 * head_dim if cfg.model_type == "qwen3" else 0
        layer = H * q + 2 * H * kv + q * H + qk_norm + 3 * H * I + 2 * H
        tied = bool(cfg.tie_word_embeddings)
        params = V * H * (1 if tied else 2) + L * layer + H
        return cls(params, H, I, L, V, q, kv, tied)


def trainer_bytes(
    shape: Shape, *, world: int, tokens: int, checkpointing: bool, fp32_head: bool = True
) -> dict[str, int]:
    """Estimated peak bytes of one trainer GPU (module docstring, 1): params, grads, adamw (sharded
    over `world` ranks), gathers (FSDP2 transients), activations (one micro-batch of `tokens`, with
    or without activation checkpointing), head (the LM head's transients), context."""
    H, V = shape.hidden, shape.vocab
    per_token_layer = 2 * (6 * H + 5 * shape.q_dim + 5 * shape.kv_dim + 4 * shape.intermediate)
    layer_params = (shape.params - V * H * (1 if shape.tied else 2) - H) // shape.layers
    root_params = V * H * (1 if shape.tied else 2) + H  # embedding, head, final norm: the root unit
    unit = max(layer_params, root_params)
    one_layer = tokens * per_token_layer
    head = 2 * HEAD_CHUNK * V * 4 + tokens * H * 4 + (2 * V * H * 4 if fp32_head else 0)
    return {
        "params": 4 * shape.params // world,
        "grads": 4 * shape.params // world,
        "adamw": 8 * shape.params // world,
        "gathers": 2 * 2 * unit + (2 + 4) * unit,
        "activations": (
            shape.layers * tokens * 2 * H + one_layer if checkpointing else shape.layers * one_layer
        ),
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
    head_extra = (
        0 if shape.tied or not fp32_head else shape.vocab * shape.hidden * (4 - dtype_bytes)
    )
    weights = (shape.params * dtype_bytes + head_extra) // tp
    budget = int(utilization * gpu_bytes)
    return {
        "weights": weights,
        "reserve": VLLM_RESERVE_BYTES,
        "kv": budget - weights - VLLM_RESERVE_BYTES,
    }


def max_num_seqs(
    *, P: int, G: int, k: int, mode: str, max_inflight: int, dp: int, kv_seqs: int
) -> int:
    """vLLM's max_num_seqs per engine: the rollouts the pipeline can have in flight, split over dp
    engines, capped by the KV cache. P prompt groups per batch (after --batch-scale), G rollouts
    each; batches in flight: k + 1 for PipelineRL-k (pipeline.may_start lets groups of the next k
    batches start), k for PPO-off-policy-k (k batches per weight version), either way at most
    max_inflight / P (pipeline.Pipeline's cap on groups at once). kv_seqs: sequences of
    max_model_len tokens the engine's KV cache holds (blocks x block size / max_model_len): vLLM
    allocates blocks as sequences grow, so up to that many never preempt one another. At least 1."""
    batches = min(k + 1 if mode == "pipeline" else k, max_inflight / P)
    demand = -(-round(P * G * batches) // dp)  # ceil over dp engines
    return max(1, min(demand, kv_seqs))


def visible_gpus(cuda_visible_devices: str | None, n: int) -> list[str]:
    """The physical ids (or UUIDs) behind visible GPUs 0..n-1: CUDA numbers visible devices in the
    order CUDA_VISIBLE_DEVICES lists them; unset, visible = physical."""
    if cuda_visible_devices is None:
        return [str(i) for i in range(n)]
    ids = [s.strip() for s in cuda_visible_devices.split(",") if s.strip()]
    if len(ids) < n:
        raise ValueError(f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r} lists fewer than {n} GPUs")
    return ids[:n]


@dataclass
class Row:
    gpu: int  # visible index on rank 0's node
    physical: str  # its id in the parent's CUDA_VISIBLE_DEVICES terms
    role: str
    parts: dict[str, int]  # bytes by item
    total: int


@dataclass
class Engine:
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
    devices: (
        int  # distinct devices for gpu_hours: trainer GPUs + generator GPUs not shared; 1 on CPU
    )
    max_num_seqs: int
    kv_seqs: int  # KV capacity in max_model_len sequences per engine (estimate)
    eval: Engine | None = None
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    fix: str | None = None  # the command to run instead


def _gib(b: float) -> str:
    return f"{b / GIB:.1f}"


def _command(argv: list[str], nproc: int, extra: list[str] = (), drop=()) -> str:
    """`torchrun --nproc_per_node nproc train.py ARGV`: ARGV without the flags in `drop` (and their
    values)."""
    out, skipping = [], False
    for a in argv:
        if a.startswith("--"):
            skipping = a.split("=")[0] in drop
        if not skipping:
            out.append(a)
    out += [e for e in extra if e not in out]
    return " ".join(
        ["torchrun", "--nproc_per_node", str(nproc), "train.py", *map(shlex.quote, out)]
    )


def plan(
    shape: Shape,
    *,
    n_gpus: int,
    gpu_bytes: int,
    cuda_visible_devices: str | None,
    world: int,
    local_world: int,
    generator_gpus: list[int] | None,
    share_gpu: bool,
    tp: int,
    utilization: float | None,
    microbatch_tokens: int,
    max_model_len: int,
    checkpointing: bool,
    fp32_head: bool,
    dtype_bytes: int,
    P: int,
    G: int,
    k: int,
    mode: str,
    max_inflight: int,
    kv_cache_bytes: int | None = None,
    eval_gpus: int | None = None,
    eval_seqs: int = 1,
    argv: list[str] = (),
    suggest: bool = True,
) -> Plan:
    """Place trainer ranks, the generator and the eval engine on rank 0's node and check that they
    fit (module docstring).

    n_gpus: visible GPUs (0 = CPU: one device runs everything, nothing is checked); gpu_bytes: each
    one's memory; world: trainer ranks in all; local_world: those on rank 0's node (visible GPUs
    0..local_world-1); generator_gpus: visible indices, or None for the default placement;
    share_gpu: allow (and by default use) trainer GPUs for the generator; utilization: vLLM's share
    (None: DEDICATED_ or SHARED_UTILIZATION); microbatch_tokens: tokens per trainer forward (the
    micro-batch token budget); dtype_bytes: the sampler's weight dtype; P, G, k, mode, max_inflight: see
    `max_num_seqs`; kv_cache_bytes: the CPU engines' KV cache; eval_gpus: generator GPUs (the last
    ones) given to the eval engine, 0 = it shares the generator's first tp GPUs, None = tp of them
    when the generator has >= 2 tp, else 0; eval_seqs: sequences one eval samples (prompts x
    (samples + 1 greedy)), for its max_num_seqs; argv: train.py's arguments, for the suggested
    command (suggest=False: none). Returns a Plan and never raises on a bad placement (`errors` say
    why, `fix` what to run instead); ValueError for a CUDA_VISIBLE_DEVICES shorter than n_gpus.
    """
    seqs = dict(P=P, G=G, k=k, mode=mode, max_inflight=max_inflight)
    if n_gpus == 0:
        kv = (kv_cache_bytes or GIB) // (kv_bytes_per_token(shape, dtype_bytes) * max_model_len)
        n = max_num_seqs(**seqs, dp=1, kv_seqs=kv)
        ev = Engine(None, 1, 1, None, True, max(1, min(eval_seqs, kv)), kv)
        row = Row(-1, "cpu", f"{world} trainer rank(s) + generator + eval engine", {}, 0)
        return Plan([row], None, 1, 1, None, False, 1, n, kv, ev)
    physical = visible_gpus(cuda_visible_devices, n_gpus)
    trainer = list(range(min(local_world, n_gpus)))
    errors, notes = [], []
    if local_world > n_gpus:
        errors.append(f"{local_world} trainer ranks on rank 0's node but {n_gpus} visible GPUs")
    if generator_gpus is None:
        pool = list(range(tp)) if share_gpu else [g for g in range(n_gpus) if g not in trainer]
        gen = pool[: len(pool) // tp * tp]
        if len(gen) < len(pool):
            notes.append(f"visible GPU(s) {pool[len(gen) :]} idle: not a multiple of tp {tp}")
        if not gen:
            errors.append(
                f"no GPU left for the generator: {local_world} trainer rank(s) use all {n_gpus} "
                f"visible GPU(s) of rank 0's node (tp {tp})"
            )
    else:
        gen = list(dict.fromkeys(g for g in generator_gpus if 0 <= g < n_gpus))
        if len(gen) < len(generator_gpus):
            errors.append(
                f"--generator-gpus {generator_gpus}: indices must be distinct and among the "
                f"{n_gpus} "
                f"visible GPUs 0-{n_gpus - 1} (CUDA_VISIBLE_DEVICES order)"
            )
        if len(gen) % tp:
            errors.append(f"--generator-gpus {gen}: not a multiple of --tensor-parallel-size {tp}")
    n_eval = (tp if len(gen) >= 2 * tp else 0) if eval_gpus is None else eval_gpus
    if n_eval % tp or (gen and n_eval > len(gen) - tp):
        errors.append(
            f"--eval-gpus {n_eval}: must be a multiple of --tensor-parallel-size {tp} and leave "
            f"at least {tp} of the {len(gen)} generator GPU(s) to training generation"
        )
        n_eval = 0
    # the eval engine: the last n_eval generator GPUs, or (0) beside the training engine on its first tp
    ev_gpus = gen[len(gen) - n_eval :] if n_eval else gen[:tp]
    gen = gen[: len(gen) - n_eval]
    shared = [g for g in gen + ev_gpus if g in trainer]
    if shared and not share_gpu:
        errors.append(
            f"--generator-gpus {gen + ev_gpus} overlaps the GPU(s) {shared} of trainer rank(s) "
            f"{shared}; --share-gpu shares them on purpose (small models only)"
        )
    base = lambda gpus: (
        utilization or (SHARED_UTILIZATION if set(gpus) & set(trainer) else DEDICATED_UTILIZATION)
    )
    kw = dict(gpu_bytes=gpu_bytes, tp=tp, dtype_bytes=dtype_bytes, fp32_head=fp32_head)
    per_seq = kv_bytes_per_token(shape, dtype_bytes, tp) * max_model_len
    util, ev_util = base(gen), base(ev_gpus)
    if not n_eval:  # one vLLM share per GPU, split between the two engines
        weights = generator_bytes(shape, utilization=0.0, **kw)["weights"]
        need = weights + VLLM_RESERVE_BYTES + EVAL_SHARED_SEQS * per_seq
        ev_util = min(util / 2, math.ceil(need / gpu_bytes * 1e4) / 1e4)  # up: >= need bytes
        util -= ev_util
    tokens = microbatch_tokens
    tr = trainer_bytes(
        shape, world=world, tokens=tokens, checkpointing=checkpointing, fp32_head=fp32_head
    )
    other = trainer_bytes(
        shape, world=world, tokens=tokens, checkpointing=not checkpointing, fp32_head=fp32_head
    )
    gb = generator_bytes(shape, utilization=util, **kw)
    ev_gb = generator_bytes(shape, utilization=ev_util, **kw)
    kv_seqs = max(0, gb["kv"]) // per_seq
    ev_kv = max(0, ev_gb["kv"]) // per_seq
    dp = max(1, len(gen) // tp)
    ev_dp = max(1, n_eval // tp)
    rows = []
    for g in range(n_gpus):
        parts = dict(tr) if g in trainer else {}
        roles = [f"trainer rank {g}"] if g in trainer else []
        if g in gen:
            i = gen.index(g)
            roles.append(f"vLLM dp {i // tp}" + (f" tp {i % tp}" if tp > 1 else ""))
            parts["vllm"] = int(util * gpu_bytes)
        if g in ev_gpus:
            i = ev_gpus.index(g)
            roles.append(
                "vLLM eval"
                + (f" dp {i // tp}" if ev_dp > 1 else "")
                + (f" tp {i % tp}" if tp > 1 else "")
            )
            parts["eval"] = int(ev_util * gpu_bytes)
        rows.append(Row(g, physical[g], " + ".join(roles) or "idle", parts, sum(parts.values())))
    with_ac = "with" if checkpointing else "without"
    notes.append(
        f"trainer activations: {_gib(tr['activations'])} GiB {with_ac} activation checkpointing, "
        f"{_gib(other['activations'])} GiB {'without' if checkpointing else 'with'} (micro-batch of "
        f"{microbatch_tokens} tokens)"
    )
    for name, u, b, n in (("vLLM", util, gb, gen), ("eval vLLM", ev_util, ev_gb, ev_gpus)):
        if n:
            notes.append(
                f"{name} {u:.2f} share of each of its GPUs: weights {_gib(b['weights'])} + "
                f"reserve {_gib(b['reserve'])} + KV cache {_gib(max(b['kv'], 0))} GiB"
            )
    if gen and not n_eval:
        notes.append(
            "the eval engine shares the generator's GPU(s): while an eval runs, training "
            "generation there gets part of the GPU's time; --eval-gpus gives it GPUs of its own"
        )
    for r in rows:
        if r.total > gpu_bytes:
            errors.append(f"GPU {r.gpu} ({r.role}) needs ~{_gib(r.total)} of {_gib(gpu_bytes)} GiB")
    for name, u, b, n, cap in (
        ("vLLM", util, gb, gen, kv_seqs),
        ("the eval engine", ev_util, ev_gb, ev_gpus, ev_kv),
    ):
        if n and cap < 1:
            errors.append(
                f"{name}'s {u:.2f} share of {_gib(gpu_bytes)} GiB holds {_gib(b['weights'])} "
                f"GiB of weights per GPU but no KV cache for one {max_model_len}-token sequence "
                f"at tp {tp}"
            )
    n = max_num_seqs(**seqs, dp=dp, kv_seqs=max(kv_seqs, 1))
    # distinct GPUs: shared ones once
    devices = world + len({g for g in gen + ev_gpus if g not in trainer})
    dedicated = bool(gen) and not [g for g in gen if g in trainer]
    ev = Engine(
        [physical[g] for g in ev_gpus],
        tp,
        ev_dp,
        ev_util,
        not n_eval,
        max(1, min(-(-eval_seqs // ev_dp), max(ev_kv, 1))),
        ev_kv,
    )
    out = Plan(rows, [physical[g] for g in gen], tp, dp, util, dedicated, devices, n, kv_seqs, ev)
    out.notes, out.errors = notes, errors
    if errors and suggest and world == local_world:
        kw = dict(
            n_gpus=n_gpus,
            gpu_bytes=gpu_bytes,
            cuda_visible_devices=cuda_visible_devices,
            generator_gpus=None,
            tp=tp,
            utilization=utilization,
            microbatch_tokens=microbatch_tokens,
            max_model_len=max_model_len,
            fp32_head=fp32_head,
            dtype_bytes=dtype_bytes,
            eval_seqs=eval_seqs,
            suggest=False,
            **seqs,
        )
        out.fix = _suggestion(shape, kw, world, checkpointing, list(argv))
    return out


def _suggestion(shape: Shape, kw: dict, world: int, checkpointing: bool, argv) -> str | None:
    """The torchrun command of the first placement on this node that fits: trainer ranks on half the
    GPUs and the generator on the rest, else the fewest trainer ranks that fit beside a dedicated
    generator, else the generator sharing trainer GPUs (--share-gpu); each with the run's activation
    checkpointing, then with it on."""
    n = kw["n_gpus"]
    ranks = sorted(
        (t for t in range(1, n) if kw["G"] % t == 0 and n - t >= kw["tp"]),
        key=lambda t: (t != n // 2, t),
    )
    tries = [(t, False) for t in ranks] + [(world, True)]
    drop = ("--generator-gpus", "--share-gpu", "--no-activation-checkpointing", "--eval-gpus")
    for ac in dict.fromkeys([checkpointing, True]):
        for t, share in tries:
            p = plan(shape, world=t, local_world=t, share_gpu=share, checkpointing=ac, **kw)
            if not p.errors:
                extra = ["--share-gpu"] if share else []
                extra += ["--activation-checkpointing"] if ac and not checkpointing else []
                return _command(argv, t, extra, drop)
    return None


def check(p: Plan) -> None:
    """Raise SystemExit naming every problem and the command to run instead, if it cannot run."""
    if p.errors:
        fix = f"run instead: {p.fix}" if p.fix else "no placement on this node fits (more nodes?)"
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
    head = (
        f"placement: {len(p.rows)} visible GPU(s) on rank 0's node; "
        f"generator tp {p.tp} x dp {p.dp} "
        f"on physical GPU(s) {','.join(p.generator) or '-'}; eval engine tp {ev.tp} x dp "
        f"{ev.dp} {where} physical GPU(s) {','.join(ev.gpus) or '-'}; gpu_hours counts "
        f"{p.devices} GPU(s); vLLM max_num_seqs {p.max_num_seqs} per engine "
        f"(KV cache ~{p.kv_seqs} full-length sequences), eval {ev.max_num_seqs}"
    )
    lines = [head]
    for r in p.rows:
        parts = " + ".join(f"{k} {_gib(v)}" for k, v in r.parts.items())
        lines.append(
            f"  GPU {r.gpu} (physical {r.physical}): {r.role}: ~{_gib(r.total)} GiB = {parts}"
        )
    return "\n".join(lines + [f"  note: {n}" for n in p.notes])
