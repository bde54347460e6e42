"""Generator engines on other nodes (issue 27): rank 0's engine is vLLM's data-parallel head and
each other node runs headless engines (`python -m infra.engine --headless`, engine.serve_headless).

Pins: (1) the headless command rank 0 prints carries exactly the head's engine arguments (parsed
back, every AsyncEngineArgs field equal but the node's own DP fields); (2) train.py refuses engines
on other nodes without a routable --node-address, with weights via disk or on --resume; (3) the NCCL
weight group's ranks and address, with a stand-in for NCCL's rendezvous: checkpoint.nccl_sender
through vLLM's own trainer_init and worker rank rule (nccl_common.worker_init_process_group) on
every worker of a 2-node plan (tp 2, dp 2 on the head's node + 4 headless): ranks 0..12 once each,
world 13 = 1 + tp x dp, all meeting at --node-address; (4) on CPU, for real: a head engine (DP rank
0) and a headless engine (DP rank 1, another process playing the other node, joined over 127.0.0.1)
serve one Sampler; its rollouts come from both engines, both hold each update's weights (vLLM's
per-worker checksums, dp0 and dp1, equal and changed) and each engine's log-probs equal a float32
transformers forward of the new weights; (5) liveness: the headless engine killed, the head's
Engine.dead() says so in one line within seconds (what pipeline.SharedState raises to end the run).
"""

import contextlib
import dataclasses
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from transformers import Qwen3ForCausalLM

import config
import generate
from config import BadInput
from infra import checkpoint, engine
from infra.launch import free_port
from tasks import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DP_FIELDS = {
    "data_parallel_size_local",
    "data_parallel_start_rank",
}


def test_headless_command_carries_the_heads_engine_arguments():
    kw = dict(
        seed=7,
        dtype="bfloat16",
        max_model_len=16512,
        max_num_seqs=128,
        tensor_parallel_size=2,
        data_parallel_size=12,
        gpu_memory_utilization=0.9,
        weight_transfer="nccl",
        fp32_head=False,
    )
    head = engine.engine_args("/m", cuda=True, nodes=engine.DPNodes("10.0.0.1", 29550, 4), **kw)
    there = engine.DPNodes("10.0.0.1", 29550, 8, start_rank=4)
    command = engine.headless_command("/m", there, **kw)
    assert command.startswith("python -m infra.engine --headless --model /m ")
    parsed = engine.headless_args(command.split()[3:], cuda=True)
    a, b = dataclasses.asdict(head), dataclasses.asdict(parsed)
    assert {k for k in a if a[k] != b[k]} == DP_FIELDS
    assert (b["data_parallel_size_local"], b["data_parallel_start_rank"]) == (8, 4)
    assert (b["data_parallel_address"], b["data_parallel_rpc_port"]) == ("10.0.0.1", 29550)
    assert b["hf_overrides"] == {} and b["weight_transfer_config"] == {"backend": "nccl"}
    with pytest.raises(ValueError, match="gpus"):
        engine.headless_command("/m", there, gpus=[0])


@pytest.mark.parametrize("cuda", [True, False])
def test_routing_replay_asks_vllm_for_routes_on_cuda_on_every_node(cuda):
    # vLLM returns routed experts only with Model Runner V2 (CUDA); on CPU the workers record them
    nodes = engine.DPNodes("10.0.0.1", 29550, 4)
    head = engine.engine_args("/m", cuda=cuda, nodes=nodes, routed_experts=True)
    assert head.enable_return_routed_experts is cuda
    assert engine.engine_args("/m", cuda=cuda).enable_return_routed_experts is False
    there = engine.DPNodes("10.0.0.1", 29550, 8, start_rank=4)
    words = engine.headless_command("/m", there, routed_experts=True, data_parallel_size=12)
    assert " --routed-experts " in words
    parsed = engine.headless_args(words.split()[3:], cuda=cuda)
    assert parsed.enable_return_routed_experts is cuda
    off = engine.headless_command("/m", there, routed_experts=False, data_parallel_size=12)
    assert "--routed-experts" not in off


def test_remote_engines_need_a_routable_address_and_nccl():
    config.check_nodes(0, None, "disk")  # one node: nothing asked
    config.check_nodes(8, "10.0.0.1", "auto")
    for address in (None, "127.0.0.1", "localhost"):
        with pytest.raises(BadInput, match="--node-address"):
            config.check_nodes(8, address, "auto")
    with pytest.raises(BadInput, match="never through a node-local disk"):
        config.check_nodes(8, "10.0.0.1", "disk")
    with pytest.raises(BadInput, match="--resume"):
        config.check_nodes(8, "10.0.0.1", "nccl", resume="runs/x")
    # train.py's flags reach it: one line, exit code 2
    with pytest.raises(BadInput) as info:
        config.validate(config.parse_args(["--remote-engines", "2"]), 1)
    assert info.value.code == 2
    assert str(info.value) == (
        "--remote-engines 2: needs --node-address, rank 0's node address the other nodes reach "
        "(got None)"
    )


def test_nccl_group_ranks_every_worker_of_every_node_once(monkeypatch):
    from test_placement import H200, plan
    from vllm.distributed.weight_transfer import nccl_common

    met = []  # (address, port, rank, world) of each rendezvous: NCCL's stand-in
    monkeypatch.setattr(
        nccl_common,
        "stateless_init_process_group",
        lambda address, port, rank, world, device: met.append((address, port, rank, world)),
    )
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    # 16 H200s, tp 2: node 0 trains on 4 GPUs and runs 2 engines (the head, dp 0-1); node 1
    # runs 4 headless engines (dp 2-5)
    p = plan("qwen3-8b", H200, nproc=4, tp=2, remote_engines=4, eval_gpus=0)
    assert (p.dp, p.remote) == (6, 4)
    world = 1 + p.tp * p.dp  # generator.start: the sender + every worker of every node

    class Engines:  # the head's client: init reaches every worker, vLLM's rank rule on each
        def init_weight_transfer_engine(self, init_info):
            info = nccl_common.NCCLWeightTransferInitInfo(**init_info)
            for d in range(p.dp):  # vLLM's data_parallel_index: the global DP rank, any node
                for w in range(p.tp):
                    cfg = type("P", (), dict(data_parallel_index=d, world_size=p.tp, rank=w))
                    nccl_common.worker_init_process_group(info, cfg)

    address = "10.0.0.1"  # --node-address
    checkpoint.nccl_sender(
        torch.nn.Linear(2, 2),
        torch.bfloat16,
        rank=0,
        client=Engines(),
        address=address,
        port=4242,
        world_size=world,
    )
    assert sorted(r for _, _, r, _ in met) == list(range(world))  # 0: the trainer's sender
    assert {(a, port, n) for a, port, _, n in met} == {(address, 4242, 13)}


def hf_prompt_logp(model_dir, ids):
    """(len(ids) - 1,) log-probs of ids[1:] from a float32 transformers forward."""
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]  # (T - 1, V)
    logp = torch.log_softmax(logits.double(), dim=-1)
    return logp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0]


@pytest.mark.vllm
@pytest.mark.slow
def test_head_and_headless_engine_sample_and_take_weights(tmp_path):
    from vllm import SamplingParams

    start = tiny.random_model(str(tmp_path / "start"), seed=0)
    new = tiny.random_model(str(tmp_path / "new"), seed=1)
    port = free_port()
    kw = dict(
        dtype="float32", max_model_len=256, max_num_seqs=16, kv_cache_gib=0.1, data_parallel_size=2
    )
    there = engine.DPNodes("127.0.0.1", port, 1, start_rank=1)
    command = engine.headless_command(start, there, weight_transfer="disk", seed=0, **kw)
    # the other node: one core of two each (generate.cpu_bind), its own process group
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=generate.cpu_bind(1))
    remote = subprocess.Popen(
        [sys.executable] + command.split()[1:], cwd=ROOT, env=env, start_new_session=True
    )
    thread = engine.SamplerThread("nodes-loop")
    try:
        here = engine.DPNodes("127.0.0.1", port, 1)
        cpu0 = str(sorted(os.sched_getaffinity(0))[0])
        make = generate.Sampler.create(
            start,
            nodes=here,
            env={"VLLM_CPU_OMP_THREADS_BIND": cpu0},
            think_budget=(8, 12),
            answer_budget=4,
            seed=0,
            **kw,
        )
        s = thread.start(make).result(600)
        run = thread.run
        client = s.engine.client
        core = client.engine_core
        chosen = []  # the engines the sampler's requests went to (generate.Sampler picks)
        route = core.get_core_engine_for_request

        def spy(request):
            engine_id = route(request)
            if not request.request_id.startswith("pin-"):  # not one of per_engine's
                chosen.append(engine_id)
            return engine_id

        core.get_core_engine_for_request = spy

        async def per_engine(ids):
            """{DP rank: (len(ids) - 1,) float64 log-probs of ids[1:] from that engine}"""
            logps = {}
            for rank in (0, 1):
                params = SamplingParams(max_tokens=1, prompt_logprobs=0)
                prompt = {"prompt_token_ids": ids}
                request_id = f"pin-{rank}-{time.time()}"
                stream = client.generate(prompt, params, request_id, data_parallel_rank=rank)
                async for out in stream:
                    last = out
                logps[rank] = torch.tensor(
                    [next(iter(d.values())).logprob for d in last.prompt_logprobs[1:]],
                    dtype=torch.float64,
                )
            return logps

        async def checksums():
            merged = {}
            for worker in await client.compute_weight_checksums():
                merged.update(worker)
            return merged

        ids = list(b"What is 2 + 3? Think, then answer.")
        for version, weights in ((0, start), (1, new)):
            if version:
                assert run(s.update_weights(weights)) == 1
            groups = [run(s.generate(list(b"Q%d?" % i), n=4)) for i in range(4)]
            assert all((c.versions == version).all() for g in groups for c in g)
            sums = run(checksums())
            by_dp = {k.split(":")[0] for k in sums}
            assert by_dp == {"dp0", "dp1"}
            # the two engines hold the same tensors: each name's digest equal across dp0 and dp1
            names = {k.split(":", 4)[-1] for k in sums}
            for n in names:
                assert sums[f"dp0:pp0:pcp0:tp0:{n}"] == sums[f"dp1:pp0:pcp0:tp0:{n}"]
            logp = run(per_engine(ids))
            expected = hf_prompt_logp(weights, ids)
            for rank in (0, 1):
                assert torch.allclose(logp[rank], expected, atol=1e-4, rtol=0), rank
            if version == 0:
                before = sums
        assert sums != before
        # the sampler's own rollouts: routed to both engines (identity: the DP rank, little-endian)
        served = {int.from_bytes(e, "little") for e in chosen}
        assert served == {0, 1}
        # every engine's answers (take_routes' need): vLLM's collective_rpc keeps engine 0's only
        assert len(run(client.collective_rpc("ignore_sigint"))) == 1
        assert len(run(engine.every_engine_rpc(client, "ignore_sigint"))) == 2
        # liveness: the other node's engine dies; the head says so in one line within seconds
        assert s.engine.dead() is None
        for p in psutil.Process(remote.pid).children(recursive=True):
            p.kill()
        deadline = time.time() + 30
        while s.engine.dead() is None and time.time() < deadline:
            time.sleep(0.5)
        why = s.engine.dead()
        assert why is not None and "\n" not in why, why
    finally:
        assert thread.close(60.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(remote.pid, signal.SIGKILL)
        remote.wait(30)


def test_rank0_prints_the_readme_command_for_the_other_node():
    from test_placement import H200, plan

    from infra import generator

    argv = ["--model", "qwen3-8b", "--remote-engines", "8", "--node-address", "10.0.0.1"]
    args = config.parse_args(argv)
    p = plan("qwen3-8b", H200, nproc=3, remote_engines=args.remote_engines)
    train_kwargs, eval_kwargs = generator.sampler_kwargs(args, p, torch.bfloat16, "nccl", seed=0)
    assert train_kwargs["nodes"] == engine.DPNodes("10.0.0.1", 29550, local=4)
    assert eval_kwargs["nodes"] is None  # the eval engine: rank 0's node only
    assert eval_kwargs["logprobs"] is False and "logprobs" not in train_kwargs  # evals grade text
    (command,) = generator.headless_commands(args, p, args.path, train_kwargs)
    assert command == (
        "python -m infra.engine --headless --model Qwen/Qwen3-8B --seed 0 --dtype bfloat16 "
        "--max-model-len 16512 --max-num-seqs 128 --tensor-parallel-size 1 "
        "--data-parallel-size 12 --gpu-memory-utilization 0.9 --weight-transfer nccl "
        "--address 10.0.0.1 --port 29550 --local 8 --start-rank 4"
    )
