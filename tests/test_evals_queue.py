"""The eval and the sampler in vLLM's queue (issue 25), on bench/vllm_sim.py's simulated engine (the
real generate.Sampler and infra/evals.EvalEngine; Qwen3-8B on H100 by the simulator's roofline).

Pins: (1) a two-phase eval on an fcfs engine with gen_timeout 1 s of wall time (1,000 simulated s)
finishes. A thinking phase writes ~8,700 tokens (the simulator's LengthModel: its budget L ~
U{10240..12288} with probability 0.4, else U[0.25 L, L): 0.4 x 11,264 + 0.6 x 7,040), ~63
simulated s at ~7 ms per step (4.9 ms of weights at 3.35 TB/s, 1.5 ms overhead, KV); 320 rollouts
on 8 slots, so submitted all at once the first group's answers queue behind ~320 x 63 / 8 = 2,500 s
of thinking (2.5 times the timeout), while in bounded flight 8 phases of ~63 s run at once, so one
finishes every ~8 simulated s on average, far under 1,000; it never holds more than
EVAL_SLOTS_FACTOR x max_num_seqs x dp = 2 x 4 x 2 = 16 requests. (2) Both phases of a rollout run
on one data-parallel engine, the rollouts spread over the engines by the sampler's own count
(fewest first, the lower rank on a tie), and the answer phase has the higher priority (vLLM serves
the lower number first: thinking 0, answer -1).
"""

import asyncio
import collections
import threading

import generate
from bench import vllm_sim
from infra import engine, evals
from tasks import data

SEQS = 4  # max_num_seqs of each simulated engine
DP = 2
N = 8  # samples per prompt
PROMPTS = 40


def make_prompts(k: int) -> list[data.Prompt]:
    """k thinking prompts of the simulator's byte tokenizer, each ~20 tokens."""
    out = []
    for i in range(k):
        question = f"What is {i} + {i}?"
        ids = (vllm_sim.IM_START, *question.encode())
        out.append(data.Prompt(i, question, str(2 * i), ids, thinking=True))
    return out


def zero_rewards(texts, golds, thinking, timeout):
    return [0.0] * len(texts)


async def sim_sampler(**sim_kwargs) -> generate.Sampler:
    """The real Sampler on a SimEngine built in this loop, with the qwen3-8b preset's budgets."""
    sim = vllm_sim.SimEngine(**sim_kwargs)
    return await generate.Sampler.create(
        "sim", engine=vllm_sim.SimHost(sim), think_budget=(10240, 12288), answer_budget=2048
    )


def most_at_once(records) -> int:
    """The most requests in flight (arrived, not finished) at one simulated time."""
    events = sorted([(r.arrival, 1) for r in records] + [(r.finished, -1) for r in records])
    now = most = 0
    for _, step in events:  # at equal times a finish (-1) sorts before an arrival
        now += step
        most = max(most, now)
    return most


def test_a_two_phase_fcfs_eval_with_a_1_s_timeout_finishes(tmp_path):
    weights = tmp_path / "weights"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"")  # what update_weights looks for
    # a loop on the idle clock (vllm_sim.IdleLoop), as bench/scale.py's: the simulator and the
    # eval's 1 s timer count only the time that loop waits, so a busy machine cannot fail the test
    selector = vllm_sim.IdleSelector()
    loop = vllm_sim.IdleLoop(selector)
    runner = threading.Thread(target=loop.run_forever, name="sim-eval", daemon=True)
    runner.start()
    thread = engine.SamplerThread("sim-eval", None, loop)
    sampler = None
    try:
        sim_kwargs = dict(
            dp=DP, max_num_seqs=SEQS, policy=vllm_sim.FCFS, time_scale=1000.0, clock=selector.idle
        )
        sampler = thread.run(sim_sampler(**sim_kwargs), 60)
        with evals.EvalEngine(
            sampler, loop=thread.loop, reward_fn=zero_rewards, gen_timeout=1.0
        ) as eval_engine:
            eval_engine.submit(make_prompts(PROMPTS), N, version=1, weights=str(weights))
            assert eval_engine.wait(0, timeout=120)
            [result] = eval_engine.results()  # raises the eval's TimeoutError, if any
        assert len(result.records) == PROMPTS * N
        assert result.metrics["eval/version"] == 1
        records = sampler.engine.client.records
        assert sampler.finished_requests == len(records)  # nothing aborted
        assert most_at_once(records) <= evals.EVAL_SLOTS_FACTOR * SEQS * DP
    finally:

        async def shutdown():  # in the loop: the simulator's driver ends there
            if sampler is not None:
                sampler.engine.shutdown()
            for _ in range(3):
                await asyncio.sleep(0)

        thread.run(shutdown(), 30.0)
        loop.call_soon_threadsafe(loop.stop)
        runner.join(30.0)
        loop.close()


def test_both_phases_of_a_rollout_share_an_engine_and_the_answer_goes_first():
    n = 8

    async def run():
        sampler = await sim_sampler(dp=DP, max_num_seqs=SEQS, time_scale=None)
        prompt = make_prompts(1)[0].prompt_ids
        group = await sampler.generate(list(prompt), n=n)
        sampler.engine.shutdown()
        return sampler, group

    sampler, group = asyncio.run(run())
    records = sampler.engine.client.records
    phrase = len(sampler.phrase_ids)
    prompt = len(make_prompts(1)[0].prompt_ids)
    thinks = [r for r in records if r.prompt_tokens == prompt]
    answers = [r for r in records if r.prompt_tokens > prompt]
    # the simulated model ends every thinking phase with `</think>` or at its budget: two phases
    assert len(thinks) == len(answers) == n == len(group)
    pairs = []
    for a in answers:
        # the answer's prompt is the thinking's prompt and output, + the phrase if it hit its budget
        [t] = [t for t in thinks if a.prompt_tokens - prompt - t.output_tokens in (0, phrase)]
        pairs.append((t, a))
    assert [a.engine for t, a in pairs] == [t.engine for t, a in pairs]
    assert {(t.priority, a.priority) for t, a in pairs} == {(0, -1)}
    assert (generate.THINK_PRIORITY, generate.ANSWER_PRIORITY) == (0, -1)
    # each rollout starts before any ends: fewest rollouts first, ties to the lower rank (0, 1, 0..)
    assert collections.Counter(t.engine for t in thinks) == {0: n // 2, 1: n // 2}
    assert sampler._rollouts == [0, 0]  # every rollout counted out
