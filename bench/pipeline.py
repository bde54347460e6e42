"""Benchmark pipeline.Pipeline: trainer steps/s of PipelineRL-8 against synchronous RL (k = 0),
same run (arXiv 2510.13786 §3.1: PipelineRL-k's throughput over synchronous off-policy RL).

    python bench/pipeline.py                # ~3.5 min on a 2-core CPU

One vLLM engine (the tiny random Qwen3) serves both modes in turn, reset to the same start weights
before each run; the trainer is a real step on a transformers copy of the model: forward,
`loss.token_logprobs` (fp32 head) of the completion tokens, batch-normalised group advantages,
prompt-level aggregation, CISPO `loss.policy_loss`, backward, AdamW, then `save_pretrained` into
`Pipeline.weights_dir` and `publish` (the sampler loads it in flight). Rewards are the parity of
each completion's length (random weights solve nothing), so advantages and gradients are not zero.
Runs alternate sync / PipelineRL-8 `--reps` times so machine load hits both alike; the first
`--warmup` steps of each run are not timed. Prints steps/s of each, their ratio (target >= 1.2),
the trainer's wait fraction, and the phases measured alone: generating one batch (the sync run's
wait) and one trainer step (its compute).

Where it departs from the paper, and why:
1. A tiny random model on a shared CPU with parity rewards, not an 8B model on GPUs: it measures
   the overlap of sampling and training that PipelineRL buys, not the paper's wall-clock numbers.
2. Trainer and sampler share the cores, so the overlapped trainer step is slower than alone (the
   report says by how much); on separate devices they would not compete.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch
import transformers
from transformers import Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import filters  # noqa: E402
import generate  # noqa: E402
import loss  # noqa: E402
import pipeline  # noqa: E402
from infra import engine  # noqa: E402
from tasks import tiny  # noqa: E402


class Prompt:
    def __init__(self, index, prompt_ids):
        self.index = index
        self.prompt_ids = prompt_ids
        self.gold = "0"
        self.thinking = True


def parity_reward(responses, golds, thinking, timeout):
    return [float(len(r) % 2) for r in responses]


def completion_logprobs(hidden, weight, ids, mask):
    """(S, T) log-probs of the completion tokens (mask (S, T)), 0 elsewhere, from hidden (S, T, H):
    token t is predicted from position t - 1."""
    sel = mask[:, 1:]  # (S, T-1)
    logp = loss.token_logprobs(hidden[:, :-1][sel], weight, ids[:, 1:][sel])  # (N,)
    shifted = logp.new_zeros(sel.shape).masked_scatter(sel, logp)  # (S, T-1)
    return torch.cat([logp.new_zeros(sel.shape[0], 1), shifted], 1)  # (S, T)


def train_step(model, opt, batch):
    """One CISPO step on a Batch; returns the loss."""
    comps = [c for g in batch.groups for c in g.completions]
    group_ids = torch.tensor([i for i, g in enumerate(batch.groups) for _ in g.completions])  # (S,)
    rewards = torch.tensor([r for g in batch.groups for r in g.rewards])  # (S,)
    T = max(len(c.prompt_ids) + len(c.completion_ids) for c in comps)
    ids = torch.zeros(len(comps), T, dtype=torch.long)  # (S, T) right-padded
    mask = torch.zeros(len(comps), T, dtype=torch.bool)  # (S, T) sampled completion tokens
    old_logp = torch.zeros(len(comps), T)  # (S, T)
    for s, c in enumerate(comps):
        n, m = len(c.prompt_ids), len(c.completion_ids)
        ids[s, : n + m] = torch.tensor(c.prompt_ids + c.completion_ids)
        mask[s, n : n + m] = c.mask
        old_logp[s, n : n + m] = c.logp
    hidden = model.model(input_ids=ids).last_hidden_state  # (S, T, H)
    logp = completion_logprobs(hidden, model.lm_head.weight, ids, mask)  # (S, T)
    adv = loss.group_advantages(rewards, group_ids)  # (S,)
    weights = loss.aggregation_weights(mask, group_ids)  # (S, T)
    value, _ = loss.policy_loss(logp, old_logp, adv, weights)
    opt.zero_grad()
    value.backward()
    opt.step()
    return value.item()


def run(mode_k, thread, model_dir, prompts, args):
    """(seconds per timed step, trainer wait seconds per timed step, trainer compute seconds per
    step) of a run on the sampler of `thread` (an engine.SamplerThread)."""
    # the same start weights for every run
    thread.run(thread.sampler.update_weights(model_dir))
    torch.manual_seed(0)
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    pool = filters.PromptPool(len(prompts), policy="uniform", seed=0)
    waits = []
    computes = []
    with pipeline.Pipeline(
        thread.sampler,
        prompts,
        pool,
        loop=thread.loop,
        group_size=args.group,
        prompts_per_step=args.batch,
        max_lag=mode_k,
        reward_fn=parity_reward,
    ) as pipe:
        for v in range(args.warmup + args.steps):
            if v == args.warmup:
                t0 = time.perf_counter()
            batch = pipe.get_batch(v, timeout=600)
            t = time.perf_counter()
            train_step(model, opt, batch)
            path = pipe.weights_dir(v + 1)
            model.save_pretrained(path)
            pipe.publish(path, v + 1)
            if v >= args.warmup:
                waits.append(batch.metrics["time/trainer_wait_s"])
                computes.append(time.perf_counter() - t)
        elapsed = time.perf_counter() - t0
    return elapsed / args.steps, sum(waits) / args.steps, statistics.median(computes)


def chat_prompts(n: int) -> list[Prompt]:
    """n short chat prompts in the tiny tokenizer's template."""
    tok = tiny.build_tokenizer()
    prompts = []
    for i in range(n):
        chat = [{"role": "user", "content": f"Question {i}: what is {i} + {i}?"}]
        text = tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        prompts.append(Prompt(i, tok.encode(text, add_special_tokens=False)))
    return prompts


def start_sampler(model_dir, args) -> engine.SamplerThread:
    """A generate.Sampler on an asyncio loop in a thread of its own."""
    thread = engine.SamplerThread("bench-sampler")
    make = generate.Sampler.create(
        model_dir,
        dtype="float32",
        max_model_len=1024,
        kv_cache_gib=0.5,
        max_num_seqs=256,
        think_budget=(args.think // 2, args.think),
        answer_budget=args.answer,
        seed=0,
    )
    thread.start(make).result()
    return thread


def report(results, args):
    """Prints the medians over reps of each mode's (step, wait, compute) seconds and their ratio."""
    med = {k: [statistics.median(x[i] for x in v) for i in range(3)] for k, v in results.items()}
    s0, w0, c0 = med[0]  # synchronous: step, trainer wait, trainer compute (seconds)
    s8, w8, c8 = med[8]  # PipelineRL-8
    print(
        f"\nP={args.batch} prompts x G={args.group}, thinking budget [{args.think // 2}, "
        f"{args.think}] + answer {args.answer}, tiny Qwen3 (hidden {args.hidden}, {args.layers} "
        f"layers), trainer on {args.trainer_threads} torch thread(s); medians over {args.reps} "
        f"reps of {args.steps} steps"
    )
    print(
        f"  phases alone: generate one batch {w0:.2f} s (the sync trainer's wait), trainer step + "
        f"save {c0:.2f} s"
    )
    print(f"  synchronous (k=0): {1 / s0:.3f} steps/s, trainer wait fraction {w0 / s0:.0%}")
    print(
        f"  PipelineRL-8:      {1 / s8:.3f} steps/s, trainer wait fraction {w8 / s8:.0%}, "
        f"step {c8:.2f} s"
    )
    print(
        f"  ratio PipelineRL-8 / sync: {s0 / s8:.2f}  (target >= 1.2); overlapped, the trainer "
        f"step takes {c8 / c0:.1f}x its time alone (the two share the cores)"
    )


def main(args, work):
    torch.set_num_threads(args.trainer_threads)
    transformers.utils.logging.disable_progress_bar()  # one save per step
    prompts = chat_prompts(64)
    start = os.path.join(work, "start")
    model_dir = tiny.random_model(start, hidden_size=args.hidden, num_layers=args.layers)
    thread = start_sampler(model_dir, args)
    results = {0: [], 8: []}
    try:
        for rep in range(args.reps):
            for k in (0, 8):
                results[k].append(run(k, thread, model_dir, prompts, args))
                step, wait, compute = results[k][-1]
                print(
                    f"rep {rep} k={k}: {1 / step:.3f} steps/s, trainer wait {wait / step:.0%}, "
                    f"train step {compute:.2f} s",
                    flush=True,
                )
    finally:
        thread.close(pipeline.CLOSE_TIMEOUT)
    report(results, args)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8, help="P prompts per batch")
    parser.add_argument("--group", type=int, default=8, help="G completions per prompt")
    parser.add_argument(
        "--think", type=int, default=128, help="thinking budget high end (low end: half)"
    )
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--trainer-threads", type=int, default=1)
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as work:
        main(parser.parse_args(), work)
