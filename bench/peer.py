"""Benchmark: this project against TRL's GRPOTrainer on the job a newcomer runs first (issue 28),
back to back on one machine, one table for both.

    pip install -r requirements-cpu.txt -r requirements-peer.txt   # TRL: a bench dependency only
    python bench/peer.py                       # python train.py, then TRL on the same job (~40 min)
    python bench/peer.py --only trl --out runs/peer --reuse   # rerun one side, keep the other's row
    python bench/peer.py --steps 2 --eval-every 1 --eval-size 8   # smoke (a few minutes)
    python bench/peer.py --trainer             # the trainers alone on one batch (~1 min, no TRL)
    python bench/peer.py --trainer --batch B.pt   # ... on a saved batch (train.collate's dict)

Ours is `python train.py` (the default run: the tiny preset, config.PRESETS["tiny"]), run as
bench/recipes.py runs it. TRL's side is GRPOTrainer (TRL 1.16.0) on the same job: the model of
tasks.tiny.build(seed) loaded as train.py loads it (loading.load_model), the same arith prompts
(the preset's --train-size of them) and held-out split (loading.load_prompts,
heldout.split_heldout), our reward (math_reward.math_rewards against each prompt's gold), P x G =
12 x 16 rollouts a step, the same LR and warmup
(train.set_lr), the same AdamW (train.build's call) and clipping, temperature 1, CISPO with the same
cap, no KL, one update per batch, 156 steps. Its held-out curve is our eval procedure (eval_size
held-out prompts x eval_n samples at the training temperature, pass rate = mean reward), run
between its steps every eval_every steps with transformers' generate, its time in TRL's wall time.
Ours evaluates with vLLM's eval engine beside training (infra/evals.py), with one greedy sample per
prompt more in every 4th eval (--eval-greedy-every). The GRPOConfig of each setting: trl_settings.

Printed for both: seconds per step (median), sampled tokens per second, the trainer's tokens per
second on its batch, the eval's cost, the wall time to held-out pass rates 0.5, 0.7 and 0.8, the
final pass rate and the whole run's wall time; then where the two setups differ. The rows go to
OUT/ours.json and OUT/trl.json (--reuse reads them instead of running that side again).

--trainer times the two trainers alone, in one process, on one batch of the default job: ours
(train.build and train.train_step on a 1-rank gloo group, as `python train.py` runs them: FSDP2,
fp32 head, micro-batches) against a plain transformers forward / backward of all sequences at once
with AdamW (plain_step: TRL's trainer in a few lines), same threads, no sampler beside them. The
batch is P x G rollouts sampled with transformers' generate (sampled_batch) unless --batch gives a
saved one. Printed: each side's median seconds and their ratio.

Where the two setups differ (TRL 1.16.0 has no setting for them; DIFFERENCES, printed):
1. TRL has no forced interruptions: one phase of think_budget max + answer_budget tokens (as
   train.py --no-interruptions, loo-lp), in training and in its evals.
2. TRL has no zero-variance filter (a zero-variance group gets advantage 0 but stays in the loss's
   token count) and no No-Positive-Resampling (its sampler reshuffles every prompt each epoch).
3. TRL's CISPO averages over the batch's tokens (our --agg token), not per prompt (--agg prompt);
   its "batch" advantage divides by the std of the raw rewards + 1e-4, ours by the std of the
   group-centred rewards.
4. Generation: TRL samples with transformers' generate, synchronously, then trains (on-policy,
   lag 0); ours samples with vLLM's CPU engine in a producer thread beside the trainer (PipelineRL,
   k = 2, in-flight weight updates), its eval in a second vLLM engine. So TRL's importance ratio is
   exactly 1 (num_iterations 1 without vLLM: its old log-probs are the trainer's own, detached) and
   the CISPO cap never binds; ours is against the sampler's log-probs, up to 2 versions behind.
5. TRL forwards all P x G sequences in one micro-batch, padded to the longest; ours in
   micro-batches of at most 8,192 padded tokens (the tiny preset), each cut to its longest row.
"""

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[0] = ROOT  # repo root, not bench/ (bench/fit.py would shadow fit.py)
import config  # noqa: E402
from bench import recipes  # noqa: E402

THRESHOLDS = (0.5, 0.7, 0.8)  # held-out pass rates whose wall time the table gives (issue 28)
TRL_VERSION = "1.16.0"  # requirements-peer.txt's pin; the version trl_settings and TimedGRPO read
TRL_MISSING = "bench/peer.py --only trl needs TRL: pip install -r requirements-peer.txt"
DIFFERENCES = (
    "TRL: no forced interruptions (one phase of think max + answer tokens), in training and eval",
    "TRL: no zero-variance filter, no No-Positive-Resampling (uniform epochs over the prompts)",
    "TRL: CISPO averaged over the batch's tokens (ours per prompt); batch advantage std of the raw "
    "rewards + 1e-4 (ours of the group-centred rewards)",
    "generation: TRL transformers' generate, synchronous, on-policy; ours vLLM CPU engine beside "
    "the trainer (PipelineRL k = 2), evals in a second vLLM engine (--eval-greedy-every: a greedy "
    "sample more at R0, the last step, every 4th eval)",
    "micro-batches: TRL all P x G sequences in one forward; ours at most 8,192 padded tokens each",
    "IS ratio: TRL's is exactly 1 (on-policy, old log-probs = its own, detached), so the CISPO cap "
    "never binds; ours is against the sampler's log-probs, up to 2 versions behind",
)


def job_args(steps: int | None, eval_every: int | None, eval_size: int | None, seed: int):
    """train.py's resolved Args of the default run (the tiny preset) with the bench's overrides,
    checked as train.py checks them (config.cli: a bad value exits 2 with one line); the one source
    of every setting both sides use."""
    argv = ["--seed", str(seed)]
    for flag, value in (("--steps", steps), ("--eval-every", eval_every)):
        if value is not None:
            argv += [flag, str(value)]
    if eval_size is not None:
        argv += ["--eval-size", str(eval_size)]
    return config.cli(argv)


def trl_settings(args, out_dir: str) -> dict:
    """GRPOConfig's keyword arguments for our job `args` (TRL 1.16.0, trl/trainer/grpo_config.py).
    The optimizer and the warmup are not here: run_trl passes train.build's AdamW and sets
    train.set_lr's rate before each step."""
    P = config.groups_per_step(args)
    return dict(
        output_dir=out_dir,
        max_steps=args.steps,
        seed=args.seed,
        use_cpu=True,
        bf16=False,  # fp32 weights and head, as train.py on CPU
        # P x G rollouts, all in one optimizer step: one generation batch per step
        per_device_train_batch_size=P * args.group_size,
        gradient_accumulation_steps=1,
        num_generations=args.group_size,
        generation_batch_size=P * args.group_size,
        num_iterations=1,
        # no forced interruptions in TRL: one phase of the thinking budget's max + the answer's
        max_completion_length=args.think_budget[1] + args.answer_budget,
        temperature=args.temperature,
        top_p=1.0,
        top_k=0,
        use_vllm=False,  # transformers' generate, synchronous
        loss_type=args.loss,  # "cispo"
        # CISPO's cap on the IS ratio: grpo_trainer.py clamps coef_1 at epsilon_high (not 1 + eps)
        epsilon_high=args.cispo_cap,
        beta=0.0,  # no KL, no reference model
        scale_rewards=args.adv_norm,  # "batch"
        mask_truncated_completions=False,  # truncated rollouts stay in the loss, as ours
        learning_rate=args.lr,
        lr_scheduler_type="constant",  # the warmup: train.set_lr before each step (run_trl)
        warmup_steps=0,
        weight_decay=args.weight_decay,
        adam_epsilon=args.adam_eps,
        max_grad_norm=args.max_grad_norm,
        disable_dropout=True,  # loading.load_model builds the model without dropout already
        report_to="none",
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def first_reach(points: list[tuple[float, float, float]], threshold: float) -> tuple | None:
    """(seconds the weights were trained at, seconds the result was known) of the first eval, in
    step order, whose pass rate >= `threshold`; `points` are (weights_s, known_s, pass_rate). None
    when no eval reaches it."""
    for weights_s, known_s, rate in points:
        if rate >= threshold:
            return weights_s, known_s
    return None


def ours_row(run_dir: str, wall_s: float | None) -> dict:
    """The table's numbers for a finished `python train.py` run, from its metrics.jsonl. Clock:
    gpu_hours x 3600, the seconds of the step loop (one device on CPU: infra/records.py; with more
    devices gpu_hours are device-hours and the known times below mean nothing); an eval's
    weights are those of its step, its result is known time/eval_queued_s + time/eval_s after
    them (submitted at its step; the evals still queued when the loop ends finish after it, so
    their known time passes the loop's end). The trainer's tokens/s: train/tokens /
    time/update_s per step (the update; it shares the cores with the sampler)."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    steps = [m for m in lines if "time/step_s" in m]
    evals = sorted((m for m in lines if "eval/pass_rate" in m), key=lambda m: m["step"])
    end = max((m["gpu_hours"] * 3600 for m in steps), default=0.0)
    points = []  # (weights_s, known_s, pass rate)
    for m in evals:
        weights_s = m["gpu_hours"] * 3600
        known_s = weights_s + m["time/eval_queued_s"] + m["time/eval_s"]
        points.append((weights_s, known_s, m["eval/pass_rate"]))
    update = [m["train/tokens"] / m["time/update_s"] for m in steps if m["time/update_s"] > 0]
    return dict(
        side="ours",
        steps=len(steps),
        step_s=statistics.median(m["time/step_s"] for m in steps),
        gen_tokens=sum(m["gen/tokens"] for m in steps),
        loop_s=sum(m["time/step_s"] for m in steps),
        generate_s=None,  # the sampler runs beside the trainer: no time of its own
        trainer_tok_s=statistics.median(update) if update else None,
        eval_s=[m["time/eval_s"] for m in evals],
        points=points,
        final=points[-1][2] if points else None,
        loop_total_s=end,  # the step loop; the evals run beside it
        wall_s=wall_s,
    )


def heldout_pass_rate(
    model,
    tokenizer,
    prompts,
    *,
    n: int,
    max_new_tokens: int,
    temperature: float,
    thinking: bool,
    batch: int,
) -> tuple[float, int]:
    """Our eval procedure with transformers' generate: `n` samples of each prompt
    (tasks.data.Prompt) at `temperature` (no top-k, top-p), at most `max_new_tokens` each, `batch`
    prompts per generate call, graded by math_reward.math_rewards against the prompt's gold.
    Returns (pass rate = mean reward, tokens sampled)."""
    import torch

    from generate import completion_text
    from tasks import math_reward

    pad = tokenizer.pad_token_id
    rewards, tokens = [], 0
    was_training = model.training
    model.eval()
    for i in range(0, len(prompts), batch):
        chunk = prompts[i : i + batch]
        width = max(len(p.prompt_ids) for p in chunk)
        # left-padded: generate appends after the last column
        pads = [width - len(p.prompt_ids) for p in chunk]
        rows = [[pad] * k + list(p.prompt_ids) for k, p in zip(pads, chunk, strict=True)]
        ids = torch.tensor(rows)  # (B, W)
        attention = (torch.arange(width)[None, :] >= torch.tensor(pads)[:, None]).long()  # (B, W)
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attention,
                do_sample=True,
                temperature=temperature,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_new_tokens,
                num_return_sequences=n,
                pad_token_id=pad,
                eos_token_id=tokenizer.eos_token_id,
            )
        texts, golds = [], []
        for row, seq in enumerate(out[:, width:].tolist()):
            if tokenizer.eos_token_id in seq:  # keep the EOS, drop what pads after it
                seq = seq[: seq.index(tokenizer.eos_token_id) + 1]
            tokens += len(seq)
            texts.append(completion_text(tokenizer, seq))
            golds.append(chunk[row // n].gold)
        rewards += math_reward.math_rewards(texts, golds, thinking)
    model.train(was_training)
    return sum(rewards) / len(rewards), tokens


def timed_trainer(GRPOTrainer, times: dict):
    """A GRPOTrainer subclass that adds to `times` the seconds of its generate calls ("generate_s"),
    of each batch's sampling and scoring ("sample_s": generate, reward, advantages) and the
    completion tokens it trained on ("tokens"). Overrides two private methods of TRL 1.16.0's
    trl/trainer/grpo_trainer.py (_generate_single_turn, _generate_and_score_completions); raises
    RuntimeError naming the version when they are gone."""
    for name in ("_generate_single_turn", "_generate_and_score_completions"):
        if not hasattr(GRPOTrainer, name):
            raise RuntimeError(f"TRL's GRPOTrainer has no {name} (checked on TRL {TRL_VERSION})")

    class TimedGRPO(GRPOTrainer):
        def _generate_single_turn(self, *a, **kw):
            t0 = time.perf_counter()
            out = super()._generate_single_turn(*a, **kw)
            times["generate_s"] += time.perf_counter() - t0
            return out

        def _generate_and_score_completions(self, inputs):
            t0 = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            times["sample_s"].append(time.perf_counter() - t0)
            times["tokens"].append(int(out["completion_mask"].sum()))
            return out

    return TimedGRPO


def run_trl(args, out_dir: str) -> dict:
    """TRL's GRPOTrainer on our job (`args`: job_args), with our eval between its steps; returns its
    table row. The wall clock starts before the model is loaded (built on first use); the loop's
    clock at train begin, before the step-0 eval."""
    t_start = time.perf_counter()
    try:
        import trl
        from trl import GRPOConfig, GRPOTrainer
    except ImportError:
        raise SystemExit(TRL_MISSING) from None
    import datasets
    import torch
    from transformers import TrainerCallback

    import train
    from generate import completion_text
    from infra import loading
    from tasks import heldout, math_reward, tiny

    if trl.__version__ != TRL_VERSION:
        print(f"warning: TRL {trl.__version__}; this bench was written against {TRL_VERSION}")
    path = tiny.build(seed=args.seed)
    args.path = path
    tokenizer, thinking = loading.load_tokenizer(args, path, True)
    prompts = loading.load_prompts(args, tokenizer, thinking)
    train_prompts, eval_prompts = heldout.split_heldout(
        prompts, args.eval_size, seed=args.seed, train_size=args.train_size
    )
    model = loading.load_model(args, path)
    # TRL tokenizes a plain-text prompt itself: the text must give back our prompt ids exactly
    texts = [tokenizer.decode(p.prompt_ids, skip_special_tokens=False) for p in train_prompts]
    for p, text in zip(train_prompts, texts, strict=True):
        if tokenizer(text)["input_ids"] != list(p.prompt_ids):
            raise RuntimeError(f"prompt {p.index}: its decoded text does not tokenize back to it")
    dataset = datasets.Dataset.from_list(
        [dict(prompt=t, gold=p.gold) for t, p in zip(texts, train_prompts, strict=True)]
    )

    def math(prompts, completions, completion_ids, gold, **_):
        """Our reward: the decoded completion (generate.completion_text) against the gold."""
        responses = [completion_text(tokenizer, ids) for ids in completion_ids]
        return math_reward.math_rewards(responses, gold, thinking)

    max_new = args.think_budget[1] + args.answer_budget
    P = config.groups_per_step(args)
    times = dict(generate_s=0.0, sample_s=[], tokens=[])
    clock = dict(points=[], eval_s=[], step_s=[])

    class Peer(TrainerCallback):
        """train.set_lr's rate before each step; our eval at train begin and every eval_every
        steps (and the last), its time on the loop's clock."""

        def evaluate(self, step: int, model) -> None:
            t0 = time.perf_counter()
            weights_s = t0 - clock["t0"]
            rate, _ = heldout_pass_rate(
                model,
                tokenizer,
                eval_prompts,
                n=args.eval_n,
                max_new_tokens=max_new,
                temperature=args.temperature,
                thinking=thinking,
                batch=max(1, P * args.group_size // args.eval_n),
            )
            t1 = time.perf_counter()
            clock["eval_s"].append(t1 - t0)
            clock["points"].append((weights_s, t1 - clock["t0"], rate))
            print(
                f"trl eval {step:5d}/{args.steps} | pass {rate:.3f} | {t1 - t0:.1f} s", flush=True
            )

        def on_train_begin(self, targs, state, control, model=None, **kw):
            clock["t0"] = time.perf_counter()
            self.evaluate(0, model)
            clock["last"] = time.perf_counter()

        def on_step_begin(self, targs, state, control, optimizer=None, **kw):
            train.set_lr(optimizer, args, state.global_step)

        def on_step_end(self, targs, state, control, model=None, **kw):
            now = time.perf_counter()
            clock["step_s"].append(now - clock["last"])
            step = state.global_step
            sample_s = times["sample_s"][-1] if times["sample_s"] else 0.0
            print(
                f"trl step {step:5d}/{args.steps} | {now - clock['last']:.1f} s "
                f"(sample {sample_s:.1f} s)",
                flush=True,
            )
            if step % args.eval_every == 0 or step == args.steps:
                self.evaluate(step, model)
            clock["last"] = time.perf_counter()

    # train.build's AdamW (torch's betas 0.9, 0.999; every parameter decayed)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay
    )
    trainer = timed_trainer(GRPOTrainer, times)(
        model=model,
        reward_funcs=math,
        args=GRPOConfig(**trl_settings(args, os.path.join(out_dir, "trl-trainer"))),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[Peer()],
        optimizers=(optimizer, None),
    )
    trainer.train()
    points = clock["points"]
    # the trainer's share of a step: the step less its sampling and scoring
    trainer_s = [s - g for s, g in zip(clock["step_s"], times["sample_s"], strict=True)]
    trainer_tok_s = [n / s for n, s in zip(times["tokens"], trainer_s, strict=True) if s > 0]
    return dict(
        side="trl",
        steps=len(clock["step_s"]),
        step_s=statistics.median(clock["step_s"]),
        gen_tokens=sum(times["tokens"]),
        loop_s=sum(clock["step_s"]),
        generate_s=times["generate_s"],
        trainer_tok_s=statistics.median(trainer_tok_s) if trainer_tok_s else None,
        eval_s=clock["eval_s"],
        points=points,
        final=points[-1][2] if points else None,
        loop_total_s=points[-1][1] if points else None,  # train begin to the last eval's end
        wall_s=time.perf_counter() - t_start,
    )


def sampled_batch(args, model, tokenizer, prompts, thinking: bool) -> dict:
    """One step's batch of the default job without vLLM: the first P prompts (tasks.data.Prompt)
    x G samples from `model` with transformers' generate at args.temperature, up to think max +
    answer budget tokens (no forced interruptions: TRL's setting), graded by
    math_reward.math_rewards, in train.collate's layout (right-padded (S, T) input_ids,
    attention_mask, mask on the completion, old_logp = the model's own fp32 log-probs; rewards,
    group_ids (S,))."""
    import torch

    from generate import completion_text
    from tasks import math_reward

    P = config.groups_per_step(args)
    G = args.group_size
    chunk = prompts[:P]
    width = max(len(p.prompt_ids) for p in chunk)
    pad = tokenizer.pad_token_id
    eos = tokenizer.eos_token_id
    pads = [width - len(p.prompt_ids) for p in chunk]
    ids = torch.tensor([[pad] * k + list(p.prompt_ids) for k, p in zip(pads, chunk, strict=True)])
    attention = (torch.arange(width)[None, :] >= torch.tensor(pads)[:, None]).long()  # (P, W)
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=attention,
            do_sample=True,
            temperature=args.temperature,
            top_k=0,
            top_p=1.0,
            max_new_tokens=args.think_budget[1] + args.answer_budget,
            num_return_sequences=G,
            pad_token_id=pad,
            eos_token_id=eos,
        )
    rows, texts, golds = [], [], []
    for s, seq in enumerate(out[:, width:].tolist()):
        if eos in seq:  # keep the EOS, drop what pads after it
            seq = seq[: seq.index(eos) + 1]
        p = chunk[s // G]
        rows.append((list(p.prompt_ids), seq))
        texts.append(completion_text(tokenizer, seq))
        golds.append(p.gold)
    S = len(rows)
    T = max(len(a) + len(b) for a, b in rows)
    input_ids = torch.full((S, T), pad, dtype=torch.long)
    attention_mask = torch.zeros(S, T, dtype=torch.long)
    mask = torch.zeros(S, T, dtype=torch.bool)
    for s, (prompt, completion) in enumerate(rows):
        n = len(prompt) + len(completion)
        input_ids[s, :n] = torch.tensor(prompt + completion)
        attention_mask[s, :n] = 1
        mask[s, len(prompt) : n] = True
    with torch.no_grad():
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits.float()
    lp = torch.log_softmax(logits[:, :-1] / args.temperature, -1)  # (S, T - 1, V)
    old_logp = torch.zeros(S, T)
    old_logp[:, 1:] = lp.gather(-1, input_ids[:, 1:, None])[..., 0]
    return dict(
        input_ids=input_ids,
        attention_mask=attention_mask,
        mask=mask,
        old_logp=torch.where(mask, old_logp, 0.0),
        rewards=torch.tensor(math_reward.math_rewards(texts, golds, thinking), dtype=torch.float64),
        group_ids=torch.arange(S) // G,
    )


def plain_step(model, optimizer, batch: dict, args) -> None:
    """TRL's trainer on our batch in a few lines: one transformers forward of every sequence at
    once (padded to the longest), fp32 log-softmax of the full logits, CISPO averaged over the
    batch's completion tokens (TRL's aggregation), backward, clipping, AdamW."""
    import torch

    import loss

    ids, mask = batch["input_ids"], batch["mask"][:, 1:]  # (S, T), (S, T - 1)
    adv = loss.group_advantages(batch["rewards"], batch["group_ids"], norm=args.adv_norm)  # (S,)
    logits = model(input_ids=ids, attention_mask=batch["attention_mask"], use_cache=False).logits
    lp = torch.log_softmax(logits[:, :-1].float() / args.temperature, -1)  # (S, T - 1, V)
    logp = lp.gather(-1, ids[:, 1:, None])[..., 0]  # (S, T - 1)
    rho = torch.exp(logp - batch["old_logp"][:, 1:]).detach().clamp(max=args.cispo_cap)
    term = rho * adv.float()[:, None] * logp * mask  # (S, T - 1)
    (-term.sum() / mask.sum()).backward()  # all completion tokens of the batch
    torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def trainer_bench(args, batch_path: str | None, reps: int) -> None:
    """--trainer: median seconds of one update on the same batch, ours (train.train_step on a
    1-rank group, FSDP2 and all) against plain_step, `reps` each after one warm-up, alternating,
    and their ratio; the batch from sampled_batch unless `batch_path` (train.collate's dict)."""
    import torch

    import train
    from infra import launch, loading
    from tasks import heldout, tiny

    rank, world, device = launch.setup_distributed()
    path = tiny.build(seed=args.seed)
    args.path = path
    if batch_path:
        batch = torch.load(batch_path)
    else:
        tokenizer, thinking = loading.load_tokenizer(args, path, True)
        prompts = loading.load_prompts(args, tokenizer, thinking)
        train_prompts, _ = heldout.split_heldout(
            prompts, args.eval_size, seed=args.seed, train_size=args.train_size
        )
        batch = sampled_batch(
            args, loading.load_model(args, path), tokenizer, train_prompts, thinking
        )
    policy, optimizer = train.build(loading.load_model(args, path), args, device)
    lengths = batch["attention_mask"].sum(1)
    pack = train.varlen_attention(policy.lm)
    plan = train.plan_microbatches(lengths.tolist(), world, args, pack)[rank]
    padded = sum(len(rows) * int(lengths[rows].max()) for rows in plan)
    print(
        f"batch: {tuple(batch['input_ids'].shape)} (S, T), {int(lengths.sum())} tokens "
        f"({int(lengths.min())}-{int(lengths.max())} a row), "
        f"{int(batch['mask'].sum())} completion tokens; "
        f"ours in {len(plan)} micro-batches of {padded} tokens padded, plain {lengths.numel()} rows"
        f" x {batch['input_ids'].shape[1]}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads",
        flush=True,
    )
    model = loading.load_model(args, path).train()
    # train.build's AdamW, on plain tensors
    plain_opt = torch.optim.AdamW(
        model.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay
    )
    steps = {
        "ours": lambda: train.train_step(policy, optimizer, batch, args, device),
        "plain": lambda: plain_step(model, plain_opt, batch, args),
    }
    times = {k: [] for k in steps}
    for i in range(reps + 1):
        for k, step in steps.items():
            t0 = time.perf_counter()
            step()
            if i:  # the first is a warm-up
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    for k, v in times.items():
        each = ", ".join(f"{t:.3f}" for t in v)
        print(f"{k:6s} {med[k]:.3f} s per update (median of {reps}: {each})")
    print(f"ours / plain: {med['ours'] / med['plain']:.2f}")
    torch.distributed.destroy_process_group()


def fmt(x, spec: str = ".1f") -> str:
    """`x` formatted by `spec`; "-" for None."""
    return "-" if x is None else format(x, spec)


def table(rows: list[dict]) -> str:
    """The side-by-side table of `rows` (ours_row / run_trl), one column per side."""
    head = ["", *(r["side"] for r in rows)]
    body = [
        ["steps", *(str(r["steps"]) for r in rows)],
        ["s per step (median)", *(fmt(r["step_s"], ".2f") for r in rows)],
        ["sampled tok/s of step time", *(fmt(r["gen_tokens"] / r["loop_s"], ".0f") for r in rows)],
        [
            "sampled tok/s in generate",
            *(fmt(r["generate_s"] and r["gen_tokens"] / r["generate_s"], ".0f") for r in rows),
        ],
        ["trainer tok/s on its batch", *(fmt(r["trainer_tok_s"], ".0f") for r in rows)],
        [
            "eval: s each (total), evals",
            *(
                f"{statistics.mean(r['eval_s']):.1f} ({sum(r['eval_s']):.0f}), {len(r['eval_s'])}"
                if r["eval_s"]
                else "-"
                for r in rows
            ),
        ],
    ]
    for t in THRESHOLDS:
        cells = []
        for r in rows:
            hit = first_reach(r["points"], t)
            cells.append("not reached" if hit is None else f"{hit[0]:.0f} / {hit[1]:.0f}")
        body.append([f"s to pass {t} (weights / known)", *cells])
    body.append(["final pass rate", *(fmt(r["final"], ".3f") for r in rows)])
    body.append(["step loop s (evals incl.)", *(fmt(r["loop_total_s"], ".0f") for r in rows)])
    body.append(["whole run wall s", *(fmt(r["wall_s"], ".0f") for r in rows)])
    lines = [head, *body]
    widths = [max(len(row[k]) for row in lines) for k in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in lines
    )


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=None, help="default: the tiny preset's (156)")
    p.add_argument("--eval-every", type=int, default=None, help="default: the preset's (6)")
    p.add_argument("--eval-size", type=int, default=None, help="default: the preset's (200)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--only", choices=["ours", "trl"], default=None, help="run one side")
    p.add_argument("--out", default=os.path.join(ROOT, "runs", "peer"))
    p.add_argument("--reuse", action="store_true", help="read a side's finished row from --out")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds for train.py")
    p.add_argument("--trainer", action="store_true", help="time the two trainers on one batch")
    p.add_argument("--batch", default=None, help="--trainer: a saved batch (train.collate's dict)")
    p.add_argument("--reps", type=int, default=3, help="--trainer: timed updates per side")
    a = p.parse_args(argv)
    args = job_args(a.steps, a.eval_every, a.eval_size, a.seed)
    if a.trainer:
        trainer_bench(args, a.batch, a.reps)
        return 0
    os.makedirs(a.out, exist_ok=True)
    rows = []
    for side in ("ours", "trl"):
        saved = os.path.join(a.out, f"{side}.json")
        if a.reuse and os.path.exists(saved):
            with open(saved) as f:
                rows.append(json.load(f))
            continue
        if a.only not in (None, side):
            continue
        if side == "ours":
            run_dir = os.path.join(a.out, "ours")
            if os.path.exists(run_dir):
                raise SystemExit(f"{run_dir} exists; pass --reuse or remove it")
            extra = ["--steps", str(args.steps), "--eval-every", str(args.eval_every)]
            extra += ["--eval-size", str(args.eval_size)]
            row = ours_row(run_dir, recipes.train(run_dir, "scalerl", a.seed, extra, a.timeout))
        else:
            row = run_trl(args, a.out)
        with open(saved, "w") as f:
            json.dump(row, f, indent=1)
        rows.append(row)
    print(table(rows))
    print(
        "clock: ours gpu_hours x 3600 (the step loop's seconds, 1 device on CPU); TRL seconds since"
    )
    print("its train began, evals included. weights: the step evaluated; known: its eval scored.")
    print("Where the setups differ:")
    for d in DIFFERENCES:
        print(f"- {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
