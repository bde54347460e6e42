"""Per-GPU memory of a run's processes, estimated: an FSDP2 trainer rank, a vLLM engine (issue 10).

Pure arithmetic on a decoder-only LM's sizes (`Shape`, read from a Hugging Face config), in bytes;
placement.py places the processes with them and prints them at start-up. Pinned by
tests/test_placement.py (`python -m pytest tests/test_placement.py`).

Departures from a measurement, and why:
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
from dataclasses import dataclass

GIB = 2**30
CONTEXT_BYTES = 2 * GIB  # CUDA context, NCCL buffers and allocator slack of one process (estimate)
VLLM_RESERVE_BYTES = 4 * GIB  # vLLM's activations, CUDA graphs and sampler buffers (estimate)
HEAD_CHUNK = 1024  # loss.token_logprobs' chunk_size: rows of (chunk, V) fp32 logits at a time
DEDICATED_UTILIZATION = 0.9  # vLLM's share of a GPU it has to itself
SHARED_UTILIZATION = 0.5  # ... of a GPU it shares with trainer rank 0 (--share-gpu)
# full-length sequences the eval engine's KV cache holds on a GPU it shares with the training
# engine (--eval-gpus 0): it takes its weights, reserve and so much KV cache (at most half of vLLM's
# share); the training engine the rest. Few: there the eval slows training generation anyway
EVAL_SHARED_SEQS = 4


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
        q = cfg.num_attention_heads * head_dim
        kv = cfg.num_key_value_heads * head_dim
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
    H = shape.hidden
    V = shape.vocab
    per_token_layer = 2 * (6 * H + 5 * shape.q_dim + 5 * shape.kv_dim + 4 * shape.intermediate)
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
    engines, capped by the KV cache. P prompt groups per batch (after --batch-scale), G rollouts
    each; batches in flight: max_lag + 1 for PipelineRL-k (k = max_lag: the pipeline's may_start
    rule lets groups of the next k batches start), k for PPO-off-policy-k (k batches per weight
    version), either way at most max_inflight / P (pipeline.Pipeline's cap on groups at once).
    kv_seqs: sequences of max_model_len tokens the engine's KV cache holds (blocks x block size /
    max_model_len): vLLM allocates blocks as sequences grow, so up to that many never preempt one
    another. At least 1."""
    if mode == "pipeline":
        batches = min(max_lag + 1, max_inflight / P)
    else:
        batches = min(max_lag, max_inflight / P)
    demand = -(-round(P * G * batches) // dp)  # ceil over dp engines
    return max(1, min(demand, kv_seqs))
