"""bench/vllm_sim.py: the stand-in for vLLM's AsyncLLM that models vLLM 0.32's scheduler.

Pins, with values worked out by hand from the roofline on a toy GPU and model (1 GB of weights, 1 MB
of KV per token, 1 TB/s, 1 PFLOP/s, no step overhead: a decode step at context N takes 1 + N/1000
ms): fcfs order and queue waits with one slot; priority order; the max_num_seqs cap; a KV budget
forcing one preemption (which request, under fcfs and under priority, back to the queue's front,
and the recomputation it costs); no admission in a step that preempted; prefix-cache reuse on the
request's own engine only, at most (tokens - 1) // 16 blocks, with freed uncached blocks reused
before cached ones; the DP balancer's score, spread, rotating tie-break and `data_parallel_rank`;
the roofline's step time for Qwen3-8B on H100 and H200 and the KV blocks an H100 holds; the
closed-form runs against one-step-at-a-time scheduling; pause (no tokens), weight versions and the
output format generate.py reads; abort freeing a slot; a weight reload's simulated time; the wall
clock's scale; the tokenizer; the prefix-key shortcut against plain hashing; and an eval-sized
two-phase workload (17,000 requests on 3 engines) keeping the fcfs ordering that makes answer phases
queue behind every thinking phase.
"""

import asyncio
import dataclasses
import math
import random
import time
from types import SimpleNamespace

import pytest

from bench import vllm_sim as vs

# toy hardware: weights 1e9 B, KV 1e6 B per token, attention 1e6 FLOPs per query-key pair
TOY_GPU = vs.GPU("toy", 1e12, 1e15, 0.0)
TOY_MODEL = vs.Model("toy", 5e8, 2, 1, 1, 1, 250_000)
MS = 1e-3


def toy(**kw) -> vs.EngineConfig:
    kw.setdefault("num_blocks", 2000)  # holds max_model_len (16,512 tokens)
    return vs.EngineConfig(gpu=TOY_GPU, model=TOY_MODEL, step_overhead_s=0.0, **kw)


def prompt(i: int, n: int = 16) -> list[int]:
    """n tokens no other prompt here starts with."""
    return [i % 256] + [(i * 7 + j) % 256 for j in range(1, n)]


def params(max_tokens: int, think: bool = False):
    stop = [vs.THINK_CLOSE] if think else []
    return SimpleNamespace(max_tokens=max_tokens, stop_token_ids=stop, logprobs=0)


# a 16-token prompt then 4 tokens, alone: prefill (context 16) and decodes at contexts 17, 18, 19
ONE = (1.016 + 1.017 + 1.018 + 1.019) * MS  # 4.070 ms


def test_fcfs_one_slot_serves_in_arrival_order_with_hand_waits():
    e = vs.EngineCore(toy(max_num_seqs=1))
    rs = [vs.Request(f"r{i}", prompt(i), 4) for i in range(3)]
    for r in rs:
        e.add(r, 0.0)
    done = e.run()
    assert [r.request_id for r in done] == ["r0", "r1", "r2"]
    assert [r.first_scheduled for r in rs] == pytest.approx([0.0, ONE, 2 * ONE])
    assert [r.finished_at for r in rs] == pytest.approx([ONE, 2 * ONE, 3 * ONE])
    assert e.stats.busy_s == pytest.approx(3 * ONE)


@pytest.mark.parametrize("policy,order", [("fcfs", "abc"), ("priority", "acb")])
def test_priority_serves_a_later_higher_priority_request_first(policy, order):
    e = vs.EngineCore(toy(max_num_seqs=1, policy=policy))
    a, b = vs.Request("a", prompt(1), 4), vs.Request("b", prompt(2), 4)
    c = vs.Request("c", prompt(3), 4, priority=-1)
    e.add(a, 0.0)
    e.add(b, 0.0)
    e.add(c, 1 * MS)  # while a runs
    assert "".join(r.request_id for r in e.run()) == order
    starts = {"a": 0.0, order[1]: ONE, order[2]: 2 * ONE}
    for r in (a, b, c):
        assert r.first_scheduled == pytest.approx(starts[r.request_id])
    assert c.first_scheduled - c.arrival == pytest.approx(starts["c"] - 1 * MS)


def test_max_num_seqs_caps_the_running_requests():
    e = vs.EngineCore(toy(max_num_seqs=2))
    rs = [vs.Request(f"r{i}", prompt(i), 4) for i in range(5)]
    for r in rs:
        e.add(r, 0.0)
    most = 0
    while (t := e.next_time()) < math.inf:
        e.advance_to(t, inclusive=True)
        most = max(most, len(e.running))
    assert most == 2
    # two at a time: one prefill step of 32 tokens (1.032 ms), decodes at contexts 34, 36, 38
    pair = (1.032 + 1.034 + 1.036 + 1.038) * MS
    assert [r.first_scheduled for r in rs] == pytest.approx([0, 0, pair, pair, 2 * pair])
    assert rs[4].finished_at == pytest.approx(2 * pair + ONE)


def kv_bound(policy: str, b_priority: int = 0):
    """Two requests of 16 + 40 tokens in 4 blocks (64 tokens): each needs 4 blocks alone; c (1 +
    2 tokens, 1 block) waits for a slot."""
    e = vs.EngineCore(toy(max_num_seqs=2, num_blocks=4, policy=policy))
    a = vs.Request("a", prompt(1), 40)
    b = vs.Request("b", prompt(2), 40, priority=b_priority)
    c = vs.Request("c", prompt(3, 1), 2)
    for r in (a, b, c):
        e.add(r, 0.0)
    done = e.run()
    return e, a, b, c, [r.request_id for r in done]


def test_a_full_kv_cache_preempts_the_last_admitted_under_fcfs():
    e, a, b, c, done = kv_bound("fcfs")
    # step 1 prefills a and b (1 block each), step 2 gives each a 2nd block; at step 18 a needs a
    # 3rd (33 tokens) and none is free: b (admitted after a) is preempted, having computed 32
    # tokens and sampled 17, and goes back to the front of the queue, ahead of c; it fits again
    # when a's 40 tokens are out, recomputes all 33 tokens (its cached blocks were evicted by a's
    # 3rd and 4th) and decodes its other 23; c comes in beside it, in its last free block
    assert e.stats.preemptions == 1
    assert (a.preemptions, b.preemptions, c.preemptions) == (0, 1, 0)
    assert done == ["a", "c", "b"]
    assert (a.num_out, b.num_out, c.num_out) == (40, 40, 2)
    assert len(b.output_ids()) == 40
    assert (a.prefilled, b.prefilled, c.prefilled) == (16, 16 + 33, 1)
    assert b.first_scheduled == 0.0
    assert c.first_scheduled == a.finished_at  # b at the head held c back
    assert e.cache.free == 4  # everything freed (cached blocks count as free)


def test_under_priority_the_lower_priority_request_is_preempted():
    e, a, b, c, done = kv_bound("priority", b_priority=-1)
    # the victim is the running request with the largest (priority, arrival): a (0 > -1)
    assert (a.preemptions, b.preemptions) == (1, 0)
    assert done[-1] == "a" and done.index("b") < done.index("a")
    assert (a.num_out, b.num_out) == (40, 40)
    assert a.prefilled == 16 + 33


def test_freed_uncached_blocks_are_reused_before_cached_ones():
    """vLLM puts a freed request's uncached blocks at the front of the free queue, its cached ones
    at the back, so a later prompt still finds them."""
    e = vs.EngineCore(toy(num_blocks=3))
    x = vs.Request("x", prompt(4), 18)  # 33 computed tokens: 2 cached blocks + 1 partial
    e.add(x, 0.0)
    e.run()
    y = vs.Request("y", prompt(5, 1), 1)  # one block, the partial one x freed
    z = vs.Request("z", x.tokens(0, 32) + [7], 1)  # 33 tokens: x's 2 cached blocks, then 1
    e.add(y, e.t)
    e.add(z, e.t)
    e.run()
    assert z.first_scheduled > y.first_scheduled  # 3 blocks: not beside y
    assert (z.first_hit, z.prefilled) == (32, 1)


def test_a_step_that_preempts_admits_nothing():
    """vLLM schedules waiting requests only in a step that preempted none (`if not
    preempted_reqs`): c, waiting for a slot, gets the one the preemption frees a step later."""
    e = vs.EngineCore(toy(max_num_seqs=2, num_blocks=4, policy="priority"))
    a = vs.Request("a", prompt(1), 40)
    b = vs.Request("b", prompt(2), 40, priority=-1)
    c = vs.Request("c", prompt(3, 1), 2, priority=-1)
    e.add(a, 0.0)
    e.add(b, 0.0)
    e.add(c, 1e-6)  # both slots taken
    e.run()
    # step 1 prefills b and a (32 tokens, 1.032 ms); step s = 2..17 decodes both at context
    # 15 + s each (1 + 0.002 (15 + s) ms); in step 18 b needs a 3rd block, a (priority 0) is
    # preempted and b decodes alone at context 33 (1.033 ms); c is admitted in step 19
    step_17_end = 1.032 + 16 + 0.002 * sum(15 + s for s in range(2, 18))
    assert c.first_scheduled == pytest.approx((step_17_end + 1.033) * MS)
    assert (a.preemptions, b.preemptions, c.preemptions) == (1, 0, 0)


def test_closed_form_runs_match_one_step_at_a_time():
    """The decode (and chunked-prefill) runs advanced in closed form give the same times, tokens,
    preemptions and prefix hits as vLLM's scheduler run one step at a time (EngineConfig.bulk)."""

    def world(bulk, policy, blocks, budget, prompt_len):
        config = vs.EngineConfig(
            max_num_seqs=6, num_blocks=blocks, policy=policy, max_num_batched_tokens=budget
        )
        e = vs.EngineCore(dataclasses.replace(config, bulk=bulk))
        rng = random.Random(1)
        shared = [rng.randrange(256) for _ in range(prompt_len)]
        rs, t = [], 0.0
        for i in range(40):
            t += rng.random() * 0.05
            p = shared[: rng.randint(20, prompt_len)] + [rng.randrange(256) for _ in range(30)]
            r = vs.Request(f"r{i}", p, rng.randint(1, 300), priority=rng.choice([0, -1]))
            e.add(r, t)
            rs.append(r)
        e.run()
        return e, rs

    # 40 and 60 blocks: preemption-heavy; budget 32 with long prompts: long chunked prefills
    for world_args in ((300, 64, 100), (40, 64, 100), (60, 32, 400)):
        for policy in ("fcfs", "priority"):
            fast, fr = world(True, policy, *world_args)
            ref, rr = world(False, policy, *world_args)
            assert fast.stats.steps == ref.stats.steps
            assert fast.stats.preemptions == ref.stats.preemptions
            assert fast.stats.prefix_hit_tokens == ref.stats.prefix_hit_tokens
            assert [r.finished_at for r in fr] == pytest.approx([r.finished_at for r in rr])
            assert [r.spans for r in fr] == [r.spans for r in rr]
    assert ref.stats.preemptions > 0 and ref.stats.prefix_hit_tokens > 0  # both paths exercised


def test_the_answer_phase_reuses_the_thinking_kv_on_its_own_engine_only():
    async def main():
        lengths = vs.LengthModel(p_interrupt=1.0, answer_lo=5, answer_hi=5)
        eng = vs.SimEngine(dp=2, config=toy(), lengths=lengths, time_scale=None)
        p = prompt(9, 40)
        outs = eng.generate(
            {"prompt_token_ids": p}, params(30, think=True), "think", data_parallel_rank=0
        )
        thinking = [o async for o in outs][-1].outputs[0].token_ids
        assert len(thinking) == 30
        answer = p + thinking + list(range(40, 50))  # 80 tokens: prompt, thinking, 10 more
        for rid, rank in (("same", 0), ("other", 1)):
            outs = eng.generate(
                {"prompt_token_ids": answer}, params(5), rid, data_parallel_rank=rank
            )
            assert len([o async for o in outs][-1].outputs[0].token_ids) == 5
        eng.shutdown()
        return {r.request_id: r for r in eng.records}

    rec = asyncio.run(main())
    # the thinking request cached its computed 69 tokens' 4 full blocks (64 tokens); 80 tokens look
    # up at most (80 - 1) // 16 = 4 blocks: 64 hit, the partial block's 16 tokens are prefilled
    assert (rec["same"].first_hit_tokens, rec["same"].prefill_tokens) == (64, 16)
    assert (rec["other"].first_hit_tokens, rec["other"].prefill_tokens) == (0, 80)
    assert (rec["same"].engine, rec["other"].engine) == (0, 1)


def test_a_fully_cached_prompt_still_recomputes_its_last_block():
    """vLLM looks up at most (tokens - 1) // 16 blocks: the last token needs its logits."""
    e = vs.EngineCore(toy())
    first = vs.Request("first", prompt(5, 48), 17)
    e.add(first, 0.0)
    e.run()  # 64 computed tokens: 4 full blocks cached
    again = vs.Request("again", first.tokens(0, 64), 3)  # exactly those 64 tokens
    e.add(again, e.t)
    e.run()
    assert (again.first_hit, again.prefilled) == (48, 16)


def test_prefix_keys_of_an_extension_equal_plain_hashing():
    hasher = vs.PromptHasher()
    p = [vs.IM_START] + list(range(97, 120)) * 10
    r = vs.Request("x", p, 1000, stop=vs.THINK_CLOSE, salt="0")
    r.keys((r.lp + r.n_out) // vs.BLOCK)
    hasher.remember(r)
    ext = p + r.output_ids() + list(range(40, 80))
    kept, keys = hasher.prompt(ext, "0")
    assert isinstance(kept, vs.Extension) and kept[0 : len(ext)] == ext
    assert keys.tolist() == vs.prompt_keys(ext, "0").tolist()
    other_salt = hasher.prompt(ext, "1")[1]
    assert other_salt.tolist() == vs.prompt_keys(ext, "1").tolist()
    assert not set(other_salt.tolist()) & set(keys.tolist())
    changed = list(ext)
    changed[r.lp + 500] = ord("x")  # one thinking token differs: not the remembered output
    kept, keys = hasher.prompt(changed, "0")
    assert kept is changed and keys.tolist() == vs.prompt_keys(changed, "0").tolist()


def test_dp_score_and_pick_follow_vllm_032():
    # max(in flight, waiting + running) + waiting x 6 x (KV use - 0.5)
    assert vs.dp_score(3, 2, 1, 0.9) == pytest.approx(3 + 2 * 6 * 0.4)
    assert vs.dp_score(3, 2, 1, 0.4) == 3
    counts = [(4, 2, 1.0), (0, 5, 0.2), (0, 6, 0.9)]  # scores 6 + 12, 5, 6
    assert vs.pick_engine(counts, [6, 5, 6], start=0) == 1
    assert vs.pick_engine([(0, 0, 0.0)] * 3, [1, 1, 1], start=2) == 2  # ties: the scan start


def test_the_balancer_spreads_a_burst_and_data_parallel_rank_pins():
    async def main():
        eng = vs.SimEngine(dp=3, config=toy(), time_scale=None)
        jobs = [
            eng.generate({"prompt_token_ids": prompt(i)}, params(50), f"r{i}") for i in range(7)
        ]
        jobs.append(
            eng.generate({"prompt_token_ids": prompt(7)}, params(50), "pin", data_parallel_rank=1)
        )

        async def drain(gen):
            return [o async for o in gen]

        await asyncio.gather(*map(drain, jobs))
        eng.shutdown()
        return {r.request_id: r.engine for r in eng.records}

    engine = asyncio.run(main())
    # all arrive at once: in-flight counts 0,0,0 -> 0; 1,0,0 -> 1; ...: round robin
    assert [engine[f"r{i}"] for i in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    assert engine["pin"] == 1


def test_the_balancer_breaks_ties_from_a_rotating_start():
    async def main():
        eng = vs.SimEngine(dp=2, config=toy(), time_scale=None)
        for i in range(4):  # one at a time: every engine idle, every score 0
            [o async for o in eng.generate({"prompt_token_ids": prompt(i)}, params(5), f"r{i}")]
        eng.shutdown()
        return [r.engine for r in eng.records]

    assert asyncio.run(main()) == [0, 1, 0, 1]


def test_roofline_step_time_for_qwen3_8b_on_h100_and_h200():
    m = vs.QWEN3_8B
    assert m.kv_bytes_per_token == 36 * 8 * 128 * 2 * 2 == 147_456
    # decode of 3 sequences with 1000, 2000, 3000 tokens in cache: 6003 context tokens
    # bytes 16.4e9 + 147,456 x 6003 = 17,285,178,368; FLOPs 2 x 8.2e9 x 3 + 589,824 x 6003 = 5.27e10
    batch = [(1000, 1), (2000, 1), (3000, 1)]
    o = vs.STEP_OVERHEAD_S
    assert vs.step_time(vs.H100, m, batch) == pytest.approx(17_285_178_368 / 3.35e12 + o)
    assert vs.step_time(vs.H200, m, batch) == pytest.approx(17_285_178_368 / 4.8e12 + o)
    # a 2048-token prefill is compute-bound: 2 x 8.2e9 x 2048 + 589,824 x 2048 x 2049 / 2 FLOPs
    flops = 33_587_200_000_000 + 1_237_560_508_416
    assert vs.step_time(vs.H100, m, [(0, 2048)], 0.0) == pytest.approx(flops / 989e12)
    # KV blocks: 0.9 x 80e9 - 16.4e9 - 4 GiB = 51,305,032,704 B over 16 x 147,456 B per block
    assert vs.default_blocks(vs.H100, m) == 21_745
    # sum over j < 5 of max(1 + 2j, 4 + j) = 4 + 5 + 6 + 7 + 9
    assert vs.sum_max_lines(1, 2, 4, 1, 5) == pytest.approx(31)


def test_pause_stops_tokens_and_versions_label_tokens_after_the_update():
    async def main():
        lengths = vs.LengthModel(p_interrupt=1.0)
        eng = vs.SimEngine(config=toy(), lengths=lengths, time_scale=None)
        gen = eng.generate({"prompt_token_ids": prompt(1)}, params(1000, think=True), "r")
        task = asyncio.ensure_future(gen.__anext__())
        await eng.sleep(0.1)  # ~95 decode steps of ~1.02 ms
        await eng.pause_generation(mode="keep", clear_cache=False)
        core = eng.engines[0]
        r = core.running[0]
        made, busy = r.num_out, core.stats.busy_s
        await eng.sleep(10.0)
        core.advance_to(eng.now())
        assert (r.num_out, core.stats.busy_s) == (made, busy)  # nothing while paused
        await eng.update_weight_version(3)
        await eng.resume_generation()
        out = (await task).outputs[0]
        eng.shutdown()
        return made, out

    made, out = asyncio.run(main())
    assert 50 < made < 1000
    spans = [(s.version, s.start, s.end) for s in out.weight_versions]
    assert spans == [("0", 0, made), ("3", made, 1000)]
    assert out.finish_reason == "length" and len(out.token_ids) == 1000
    assert out.logprobs.token_ids == out.token_ids and set(out.logprobs.logprobs) == {-1.0}


def test_cancelling_a_generate_aborts_it_and_frees_its_slot():
    async def main():
        lengths = vs.LengthModel(p_interrupt=1.0)
        eng = vs.SimEngine(config=toy(max_num_seqs=1), lengths=lengths, time_scale=None)

        async def run(rid, n):
            gen = eng.generate({"prompt_token_ids": prompt(len(rid))}, params(n, think=True), rid)
            return [o async for o in gen]

        long = asyncio.ensure_future(run("long", 10_000))
        short = asyncio.ensure_future(run("s", 4))
        await eng.sleep(0.05)
        long.cancel()
        await short
        with pytest.raises(asyncio.CancelledError):
            await long
        eng.shutdown()
        return eng

    eng = asyncio.run(main())
    rec = {r.request_id: r for r in eng.records}
    assert rec["long"].state == vs.ABORTED and 0 < rec["long"].output_tokens < 10_000
    # the queued request starts at the first step boundary after the abort at 50 ms
    assert 0.05 <= rec["s"].first_scheduled < 0.05 + 15 * MS
    assert rec["s"].output_tokens == 4
    core = eng.engines[0]
    assert core.cache.free == core.cache.num_blocks and not core.running


def test_a_weight_reload_takes_weight_bytes_over_the_reload_bandwidth():
    async def main():
        eng = vs.SimEngine(dp=2, time_scale=None)
        t0 = eng.now()
        assert await eng.collective_rpc("reload_weights_retie", args=("/dev/shm/x",)) == [None] * 2
        reload = eng.now() - t0
        await eng.collective_rpc("ignore_sigint")
        eng.shutdown()
        return reload, eng.now() - t0

    reload, total = asyncio.run(main())
    assert reload == pytest.approx(16.4e9 / 5e9)  # Qwen3-8B bf16 at 5 GB/s
    assert total == reload


def test_a_wall_clock_scale_runs_simulated_seconds_faster():
    async def main():
        lengths = vs.LengthModel(p_interrupt=1.0)
        eng = vs.SimEngine(config=toy(), lengths=lengths, time_scale=100.0)
        wall = time.monotonic()
        outs = eng.generate({"prompt_token_ids": prompt(1)}, params(4, think=True), "r")
        [o async for o in outs]
        wall = time.monotonic() - wall
        eng.shutdown()
        return wall, eng.records[0]

    wall, rec = asyncio.run(main())
    assert rec.finished - rec.first_scheduled == pytest.approx(ONE)  # simulated, not measured
    assert wall >= ONE / 100


def test_the_tokenizer_has_a_single_think_close_and_skips_specials():
    tok = vs.Tokenizer()
    assert tok.encode("</think>") == [vs.THINK_CLOSE]
    ids = tok.encode("ok, done.</think>the answer<|im_end|>")
    assert ids.count(vs.THINK_CLOSE) == 1 and ids[-1] == tok.eos_token_id
    assert tok.decode(ids) == "ok, done.</think>the answer<|im_end|>"
    assert tok.decode(ids, skip_special_tokens=True) == "ok, done.</think>the answer"
    assert tok.decode([vs.MARK] + tok.encode("ab"), skip_special_tokens=True) == "ab"


@pytest.mark.slow
def test_outputs_read_as_generate_py_reads_them():
    """generate.Sampler._phase's checks and infra/engine.py's versions_from_spans on a simulated
    output (imports vLLM: slow)."""
    from infra.engine import versions_from_spans

    async def main():
        eng = vs.SimEngine(config=toy(), lengths=vs.LengthModel(p_interrupt=0.0), time_scale=None)
        outs = eng.generate({"prompt_token_ids": prompt(1)}, params(300, think=True), "r")
        final = [o async for o in outs][-1]
        eng.shutdown()
        return final

    done = asyncio.run(main()).outputs[0]
    ids = list(done.token_ids)
    assert done.finish_reason == "stop" and ids[-1] == vs.THINK_CLOSE
    assert done.logprobs.token_ids == ids
    assert versions_from_spans(done.weight_versions, len(ids)) == [0] * len(ids)


@pytest.mark.slow
def test_an_eval_sized_two_phase_workload_queues_answers_behind_every_thinking_phase():
    """8,500 rollouts (17,000 requests: thinking, then answer) submitted at once to 3 x H100
    engines with max_num_seqs 22, fcfs. Every answer phase arrives after t = 0, so on its engine
    it waits behind every thinking phase: none starts before that engine's last thinking phase."""
    wall = time.perf_counter()
    res = asyncio.run(vs.eval_workload("fcfs", prompts=500, n=16, greedy=True))
    print(f"17,000 simulated requests in {time.perf_counter() - wall:.1f} s of wall time")
    recs = res.records
    assert len(recs) == 17_000 and all(r.state == vs.FINISHED for r in recs)
    thinking = [r for r in recs if r.request_id.startswith("t")]
    answers = [r for r in recs if r.request_id.startswith("a")]
    assert len(thinking) == 8_500
    per_engine = [sum(r.engine == e for r in thinking) for e in range(3)]
    assert per_engine == [2834, 2833, 2833]  # a burst at t = 0 goes round robin
    for e in range(3):
        last_thinking = max(r.first_scheduled for r in thinking if r.engine == e)
        assert min(r.first_scheduled for r in answers if r.engine == e) >= last_thinking
    assert res.preemptions == 0  # 22 sequences of at most 14,812 tokens fit 21,745 blocks
    # a bound by hand: before an engine's last thinking phase starts, 2833 - 22 of them finished,
    # each of at least ceil(0.25 x 10240) = 2560 tokens, at most 22 tokens a step, each step at
    # least 16.4e9 / 3.35e12 s + 1.5 ms
    assert res.first_answer_done_s > 2811 * 2560 / 22 * (16.4e9 / 3.35e12 + 1.5e-3)
    print(f"first answer phase done at {res.first_answer_done_s / 3600:.2f} simulated hours")


def test_the_idle_clock_keeps_every_idle_second_a_late_timer_had():
    """The idle clock is bench/scale.py's event-loop clock too, where the project's timeouts run: a
    timer set for t that fires after more idle time keeps it (simulated time = idle x scale, the
    loop's time x scale), and one that fires early moves the clock to t."""
    idle = [10.0]
    clock = vs._IdleClock(100.0, lambda: idle[0])
    idle[0] += 2.0  # 2 idle seconds: 200 simulated
    clock.set(150.0)  # the timer was for t = 150: 50 simulated s late
    assert clock.now() == 200.0
    idle[0] += 0.5
    assert clock.now() == 250.0
    clock.set(260.0)  # early by 10 simulated seconds
    assert clock.now() == 260.0
