"""placement.py and placement.py: where trainer ranks and vLLM go, and whether they fit (no GPU
needed: sizes are arguments).

Pins: (1) parameter counts of the qwen3-0.6b and qwen3-8b presets' shapes equal transformers' own
count on the meta device; (2) on 8 x H100-80GB and 8 x H200 (141 GB) with both presets: `torchrun
--nproc_per_node 4` trains on GPUs 0-3, generates on 4-6 (tp 1 x dp 3, NCCL-eligible) and evaluates
on 7; 8 trainer ranks leave no generator GPU and are refused with the 4 + 4 command; --share-gpu
fits where trainer rank 0 plus both vLLM engines fit the GPU (not 8B on an H100); one rank cannot
hold 8B's fp32 weights, gradients and AdamW states; (3) overlap with trainer GPUs is refused unless
--share-gpu, and shared GPUs count once in gpu_hours; (4) --generator-gpus and the default placement
read through CUDA_VISIBLE_DEVICES; (5) max_num_seqs = P x G x batches in flight over dp engines,
capped at 3 x the full-length sequences the KV cache holds (a rollout holds ~1/3 of max_model_len
over its life): 66 per H100 engine and 138 per H200 engine for qwen3-8b, the eval engine alike;
(6) the eval engine: its own GPU(s) (--eval-gpus, tp of them by default from 2 x tp generator GPUs
on), else beside the training engine with the memory for its weights and EVAL_SHARED_SEQS
sequences; bad --eval-gpus refused; on CPU it shares the device; (7) the suggested split tries
every trainer rank count, whatever G (3 ranks on a 6-GPU node with G = 16); (8) an MoE's
parameters: Qwen3-30B-A3B's 30.5B (3.35B per token) by hand and against transformers on the meta
device, dense layers among sparse ones; the qwen3-30b-a3b preset fits no 8 x 80 GB node and the
refusal names what would (8 trainer ranks, 2 engine GPUs: a second node). Expected values are
worked out by hand in each test from the formulas in placement.py's docstring; (9) on CPU a
trainer rank takes half the cores as torch threads, OMP_NUM_THREADS winning.
"""

import math

import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from config import BadInput
from infra import placement as pl

GIB = 2**30
# torch.cuda.get_device_properties(0).total_memory of an H100 80GB HBM3 (79.2 GiB)
H100 = 85_045_510_144
H200 = 150_754_820_096  # ... of an H200 (140.4 GiB)
QWEN3 = dict(vocab_size=151936, head_dim=128, num_key_value_heads=8)
CONFIGS = {  # the public Qwen/Qwen3-0.6B and Qwen/Qwen3-8B config.json sizes
    "qwen3-0.6b": Qwen3Config(
        hidden_size=1024,
        intermediate_size=3072,
        num_hidden_layers=28,
        num_attention_heads=16,
        tie_word_embeddings=True,
        **QWEN3,
    ),
    "qwen3-8b": Qwen3Config(
        hidden_size=4096,
        intermediate_size=12288,
        num_hidden_layers=36,
        num_attention_heads=32,
        tie_word_embeddings=False,
        **QWEN3,
    ),
}
# the qwen3 presets (config.PAPER_GEN): 48 x 16, k = 8, micro-batch 1 of 16,512 tokens, AC on
PAPER = dict(
    cuda_visible_devices=None,
    generator_gpus=None,
    share_gpu=False,
    tp=1,
    utilization=None,
    microbatch_tokens=16512,
    max_model_len=16512,
    checkpointing=True,
    fp32_head=True,
    dtype_bytes=2,
    P=48,
    G=16,
    max_lag=8,
    mode="pipeline",
    max_inflight=96,
    eval_seqs=1000 * 17,  # 1,000 held-out prompts x (16 samples + 1 greedy)
)


def plan(model, gpu_bytes, nproc, n_gpus=8, **kw):
    shape = pl.Shape.from_config(CONFIGS[model])
    argv = ["--model", model] + kw.pop("argv", [])
    kw = {**PAPER, **kw}
    return pl.plan(
        shape, n_gpus=n_gpus, gpu_bytes=gpu_bytes, world=nproc, local_world=nproc, argv=argv, **kw
    )


@pytest.mark.parametrize("model", CONFIGS)
def test_parameter_count_matches_transformers(model):
    with torch.device("meta"):
        lm = Qwen3ForCausalLM(CONFIGS[model])
    assert pl.Shape.from_config(CONFIGS[model]).params == sum(p.numel() for p in lm.parameters())


def test_trainer_memory_by_hand_8b_on_4_ranks():
    N = 8_190_735_360  # Qwen3-8B (test above)
    m = pl.trainer_bytes(
        pl.Shape.from_config(CONFIGS["qwen3-8b"]), world=4, tokens=16512, checkpointing=True
    )
    assert (m["params"], m["grads"], m["adamw"]) == (N, N, 2 * N)  # 4 + 4 + 8 bytes / 4 ranks
    per_layer_token = 2 * (6 * 4096 + 5 * 4096 + 5 * 1024 + 4 * 12288)  # 198,656 bytes
    assert m["activations"] == 36 * 16512 * 2 * 4096 + 16512 * per_layer_token
    no_ac = pl.trainer_bytes(
        pl.Shape.from_config(CONFIGS["qwen3-8b"]), world=4, tokens=16512, checkpointing=False
    )
    assert no_ac["activations"] == 36 * 16512 * per_layer_token  # 110 GiB: checkpointing is needed
    root = 2 * 151936 * 4096 + 4096  # embedding + untied head + final norm: the largest FSDP unit
    assert m["gathers"] == 2 * 2 * root + 6 * root
    assert m["head"] == 2 * 1024 * 151936 * 4 + 16512 * 4096 * 4 + 2 * 151936 * 4096 * 4


@pytest.mark.parametrize("gpu_bytes", [H100, H200])
@pytest.mark.parametrize("model", CONFIGS)
def test_four_trainer_ranks_three_generator_gpus_one_eval_gpu(model, gpu_bytes):
    p = plan(model, gpu_bytes, nproc=4)
    assert p.errors == [] and p.fix is None
    assert [r.role for r in p.rows] == [f"trainer rank {g}" for g in range(4)] + [
        f"vLLM dp {i}" for i in range(3)
    ] + ["vLLM eval"]
    assert p.generator == ["4", "5", "6"] and (p.tp, p.dp) == (1, 3)
    assert p.dedicated and p.devices == 8 and p.utilization == 0.9
    ev = p.eval
    assert (ev.gpus, ev.tp, ev.dp, ev.utilization, ev.shared) == (["7"], 1, 1, 0.9, False)
    # 17,000 sequences: KV-bound, 3 rollouts per full-length sequence
    assert ev.kv_seqs == p.kv_seqs and ev.max_num_seqs == 3 * p.kv_seqs
    N = pl.Shape.from_config(CONFIGS[model]).params
    assert p.rows[0].parts["params"] + p.rows[0].parts["adamw"] == 12 * N // 4
    assert p.rows[0].total < gpu_bytes and p.rows[4].parts == {"vllm": int(0.9 * gpu_bytes)}
    assert p.rows[7].parts == {"eval": int(0.9 * gpu_bytes)}
    text = pl.describe(p)
    assert "eval engine tp 1 x dp 1 on physical GPU(s) 7;" in text
    assert "  GPU 7 (physical 7): vLLM eval: ~" in text
    pl.check(p)  # does not raise


@pytest.mark.parametrize("gpu_bytes", [H100, H200])
@pytest.mark.parametrize("model", CONFIGS)
def test_eight_trainer_ranks_leave_no_generator_gpu(model, gpu_bytes):
    p = plan(model, gpu_bytes, nproc=8)
    assert any("no GPU left for the generator" in e for e in p.errors)
    assert p.fix == f"torchrun --nproc_per_node 4 train.py --model {model}"
    with pytest.raises(SystemExit, match=f"run instead: torchrun --nproc_per_node 4 .*{model}"):
        pl.check(p)


@pytest.mark.parametrize(
    "model, gpu_bytes, fits",
    [("qwen3-0.6b", H100, True), ("qwen3-0.6b", H200, True), ("qwen3-8b", H200, True)]
    + [("qwen3-8b", H100, False)],  # 8 ranks: ~42.5 GiB on rank 0 + 0.5 x 79.2 GiB > 79.2 GiB
)
def test_share_gpu_fits_small_models_only(model, gpu_bytes, fits):
    p = plan(model, gpu_bytes, nproc=8, share_gpu=True, argv=["--share-gpu"])
    r0 = p.rows[0]
    assert r0.role == "trainer rank 0 + vLLM dp 0 + vLLM eval"
    # the two engines split vLLM's 0.5 share of the GPU (rounding: a byte each at most)
    assert abs(r0.parts["vllm"] + r0.parts["eval"] - int(0.5 * gpu_bytes)) <= 2
    # rank 1: trainer only
    assert abs(r0.total - sum(p.rows[1].parts.values()) - int(0.5 * gpu_bytes)) <= 2
    assert (r0.total <= gpu_bytes) == fits
    assert (not p.errors) == fits
    assert p.generator == ["0"] and not p.dedicated and p.devices == 8  # GPU 0 counted once
    assert p.eval.gpus == ["0"] and p.eval.shared
    if not fits:
        assert (
            p.fix == f"torchrun --nproc_per_node 4 train.py --model {model}"
        )  # --share-gpu dropped


@pytest.mark.parametrize("gpu_bytes", [H100, H200])
def test_one_rank_cannot_hold_8b(gpu_bytes):
    p = plan("qwen3-8b", gpu_bytes, nproc=1)
    assert 16 * 8_190_735_360 > gpu_bytes * 0.8  # fp32 weights + grads + AdamW alone: 122 GiB
    assert p.errors == [f"GPU 0 (trainer rank 0) needs ~{p.rows[0].total / GIB:.1f} of "
                        f"{gpu_bytes / GIB:.1f} GiB"]  # fmt: skip
    assert p.fix == "torchrun --nproc_per_node 4 train.py --model qwen3-8b"
    small = plan("qwen3-0.6b", gpu_bytes, nproc=1)  # fits: 1 trainer, 6 generator, 1 eval GPU
    assert not small.errors and (small.dp, small.eval.gpus, small.devices) == (6, ["7"], 8)


def test_suggested_split_takes_a_rank_count_that_does_not_divide_g():
    # a 6-GPU node, G = 16: half the GPUs (3 trainer ranks, 16 % 3 = 1) come first, and 8B fits on
    # 3 ranks of an H100: 12 B x 8.19e9 / 3 sharded + ~28 GiB of transients (~68 GiB of 79.2)
    p = plan("qwen3-8b", H100, nproc=6, n_gpus=6)
    assert any("no GPU left for the generator" in e for e in p.errors)
    assert p.fix == "torchrun --nproc_per_node 3 train.py --model qwen3-8b"
    three = plan("qwen3-8b", H100, nproc=3, n_gpus=6)  # generator GPUs 3-4, eval GPU 5
    assert not three.errors and (three.generator, three.eval.gpus) == (["3", "4"], ["5"])


def test_activation_checkpointing_suggested_when_activations_do_not_fit():
    p = plan("qwen3-8b", H100, nproc=4, checkpointing=False, argv=["--no-activation-checkpointing"])
    assert p.errors and "110.0 GiB without" in " ".join(p.notes)
    assert (
        p.fix == "torchrun --nproc_per_node 4 train.py --model qwen3-8b --activation-checkpointing"
    )


def test_single_gpu_small_model_suggests_sharing():
    p = plan("qwen3-0.6b", H100, nproc=1, n_gpus=1)
    assert any("no GPU left" in e for e in p.errors)
    assert p.fix == "torchrun --nproc_per_node 1 train.py --model qwen3-0.6b --share-gpu"


def test_overlap_refused_unless_shared_and_counted_once():
    p = plan("qwen3-0.6b", H200, nproc=4, generator_gpus=[3, 4, 5, 6], argv=["--generator-gpus"])
    assert p.errors == [
        "--generator-gpus [3, 4, 5, 6] overlaps the GPU(s) [3] of trainer rank(s) [3]; "
        "--share-gpu shares them on purpose (small models only)"
    ]
    assert p.fix == "torchrun --nproc_per_node 4 train.py --model qwen3-0.6b"
    shared = plan("qwen3-0.6b", H200, nproc=4, generator_gpus=[3, 4, 5, 6], share_gpu=True)
    assert not shared.errors and shared.devices == 7  # 4 trainer GPUs + 4 generator GPUs - 1 shared
    assert shared.rows[3].role == "trainer rank 3 + vLLM dp 0" and shared.rows[7].role == "idle"
    assert shared.rows[6].role == "vLLM eval" and shared.eval.utilization == 0.9
    assert shared.utilization == 0.5 and not shared.dedicated
    bad = plan("qwen3-0.6b", H200, nproc=4, generator_gpus=[7, 8, 7])
    assert "indices must be distinct and among the 8 visible GPUs 0-7" in bad.errors[0]


def test_cuda_visible_devices_mapping():
    assert pl.visible_gpus(None, 3) == ["0", "1", "2"]
    assert pl.visible_gpus("GPU-aa, GPU-bb,GPU-cc", 2) == ["GPU-aa", "GPU-bb"]
    with pytest.raises(ValueError, match="lists fewer than 4 GPUs"):
        pl.visible_gpus("3,5", 4)
    env = "2,3,6,7,0,1,4,5"  # visible GPU i is physical env[i]
    p = plan("qwen3-8b", H200, nproc=4, cuda_visible_devices=env)
    assert p.generator == ["0", "1", "4"] and [r.physical for r in p.rows[:4]] == list("2367")
    assert p.eval.gpus == ["5"]
    q = plan("qwen3-8b", H200, nproc=4, cuda_visible_devices=env, generator_gpus=[5, 6])
    assert q.generator == ["1"] and q.eval.gpus == ["4"] and (q.dp, q.devices) == (1, 6)


def test_tensor_parallel_groups_and_idle_gpus():
    p = plan("qwen3-8b", H200, nproc=4, tp=3)  # one tp group: the eval engine shares it
    assert (p.tp, p.dp, p.generator) == (3, 1, ["4", "5", "6"]) and p.rows[7].role == "idle"
    roles = [f"vLLM dp 0 tp {i} + vLLM eval tp {i}" for i in range(3)]
    assert [r.role for r in p.rows[4:7]] == roles and p.eval.shared
    assert "[7] idle" in p.notes[0] and p.devices == 7
    assert (
        "not a multiple" in plan("qwen3-8b", H200, nproc=4, tp=3, generator_gpus=[4, 5]).errors[0]
    )
    q = plan("qwen3-8b", H200, nproc=2, tp=2)  # 6 generator GPUs: 2 tp groups, the last evaluates
    assert (q.generator, q.eval.gpus, q.eval.tp, q.dp) == (["2", "3", "4", "5"], ["6", "7"], 2, 2)
    assert [r.role for r in q.rows[6:]] == ["vLLM eval tp 0", "vLLM eval tp 1"]


@pytest.mark.parametrize("gpu_bytes, kv_seqs", [(H100, 22), (H200, 46)])
def test_kv_cache_capacity_by_hand(gpu_bytes, kv_seqs):
    p = plan("qwen3-8b", gpu_bytes, nproc=4)
    kv_token = 2 * 36 * 8 * 128 * 2  # K and V, 36 layers, 8 KV heads of 128, bf16: 147,456 bytes
    weights = 8_190_735_360 * 2 + 151936 * 4096 * 2  # bf16, plus the fp32 head's other 2 bytes
    kv = int(0.9 * gpu_bytes) - weights - 4 * GIB  # H100: 50.9 GiB, H200: 105.9 GiB
    assert p.kv_seqs == kv // (kv_token * 16512) == kv_seqs
    # demand 48 x 16 x 2 / 3 = 512 per engine, capped at 3 rollouts per full-length sequence
    assert p.max_num_seqs == 3 * kv_seqs
    assert f"vLLM max_num_seqs {3 * kv_seqs} per engine (KV cache ~{kv_seqs} full-length" in (
        pl.describe(p)
    )


def test_max_num_seqs_formula():
    f = pl.max_num_seqs
    kw = dict(P=48, G=16, max_inflight=96, dp=4, kv_seqs=10_000)
    # k + 1 = 9 batches may start, max_inflight lets 2 run
    assert f(max_lag=8, mode="pipeline", **kw) == 48 * 16 * 2 // 4
    assert f(max_lag=0, mode="pipeline", **kw) == 48 * 16 // 4  # synchronous: one batch
    assert f(max_lag=1, mode="ppo", **kw) == 48 * 16 // 4  # one batch per weight version
    assert f(max_lag=8, mode="pipeline", **{**kw, "kv_seqs": 46}) == 3 * 46  # 384 > 138
    batch_scale = {**kw, "P": 80, "max_inflight": 160}
    assert f(max_lag=8, mode="pipeline", **batch_scale) == 80 * 16 * 2 // 4
    small = dict(P=2, G=4, max_lag=8, mode="pipeline")
    assert f(**small, max_inflight=4, dp=3, kv_seqs=99) == 6  # ceil(16 / 3)
    assert f(**small, max_inflight=8, dp=1, kv_seqs=99) == 32  # 4 batches
    assert f(**small, max_inflight=8, dp=1, kv_seqs=10) == 30  # 32 > 3 x 10
    assert f(**small, max_inflight=8, dp=1, kv_seqs=0) == 1


def test_cpu_plan():
    tiny = Qwen3Config(
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=320,
        tie_word_embeddings=True,
    )
    kw = {
        **PAPER,
        "max_model_len": 512,
        "dtype_bytes": 4,
        "P": 16,
        "G": 8,
        "max_lag": 2,
        "max_inflight": 32,
    }
    p = pl.plan(pl.Shape.from_config(tiny), n_gpus=0, gpu_bytes=0, world=2, local_world=2, **kw)
    assert (p.generator, p.devices, p.errors, p.dedicated) == (None, 1, [], False)
    assert p.kv_seqs == GIB // (2 * 2 * 64 * 4 * 512)  # 1 GiB / (K+V x 2 layers x 64 x fp32 x 512)
    assert p.max_num_seqs == 16 * 8 * 2  # two batches in flight, far below the KV cap
    # the eval's 17,000 sequences, capped at 3 x 2,048
    assert (p.eval.gpus, p.eval.shared, p.eval.max_num_seqs) == (None, True, 3 * 2048)
    assert pl.describe(p).startswith("placement: CPU")


def test_eval_engine_shares_a_lone_generator_gpu_with_room_for_its_sequences():
    # 7 trainer ranks leave one generator GPU: the eval engine takes its bf16 weights (+ the fp32
    # head's other 2 bytes per weight when untied), vLLM's reserve and 4 full-length sequences
    for model, gpu_bytes in (("qwen3-0.6b", H100), ("qwen3-8b", H200)):
        p = plan(model, gpu_bytes, nproc=7)
        shape = pl.Shape.from_config(CONFIGS[model])
        head = 0 if shape.tied else shape.vocab * shape.hidden * 2
        per_seq = 2 * shape.layers * shape.kv_dim * 2 * 16512  # K and V, bf16, 16,512 tokens
        need = shape.params * 2 + head + 4 * GIB + 4 * per_seq
        share = math.ceil(need / gpu_bytes * 1e4) / 1e4  # vLLM's fraction, rounded up
        assert p.eval.utilization == share and p.utilization == pytest.approx(0.9 - share)
        assert p.eval.kv_seqs == 4 and p.eval.shared and p.eval.gpus == p.generator == ["7"]
        assert p.eval.max_num_seqs == 3 * 4
        assert p.rows[7].role == "vLLM dp 0 + vLLM eval" and p.devices == 8 and not p.errors
        assert "the eval engine shares the generator's GPU(s)" in " ".join(p.notes)


def test_eval_gpus_flag():
    p = plan("qwen3-0.6b", H200, nproc=4, eval_gpus=2)  # 2 of the 4 generator GPUs evaluate
    assert (p.generator, p.eval.gpus, p.eval.dp) == (["4", "5"], ["6", "7"], 2)
    assert [r.role for r in p.rows[6:]] == ["vLLM eval dp 0", "vLLM eval dp 1"]
    assert p.eval.max_num_seqs == min(-(-17000 // 2), 3 * p.eval.kv_seqs)
    q = plan("qwen3-0.6b", H200, nproc=4, eval_gpus=0)  # shares GPU 4; 5-7 generate only
    assert q.generator == ["4", "5", "6", "7"] and q.eval.gpus == ["4"] and q.eval.shared
    for bad in (4, 5):  # none (or fewer than none) left to training generation
        r = plan("qwen3-0.6b", H200, nproc=4, eval_gpus=bad, argv=["--eval-gpus", str(bad)])
        assert r.errors == [
            f"--eval-gpus {bad}: must be a multiple of --tensor-parallel-size 1 and leave at "
            "least 1 of the 4 generator GPU(s) to training generation"
        ]
        assert r.fix == "torchrun --nproc_per_node 4 train.py --model qwen3-0.6b"


def test_kv_warning_compares_vllms_measured_cache_with_the_plans_estimate(capsys):
    """generator.warn_if_kv_short warns when vLLM's KV cache holds fewer full-length sequences than
    the plan's kv_seqs (what max_num_seqs = KV_OVERCOMMIT x kv_seqs was sized for), not when it
    holds fewer than max_num_seqs, which overcommits by design."""
    from types import SimpleNamespace

    from infra import generator

    plan = SimpleNamespace(kv_seqs=22, max_num_seqs=66)
    args = SimpleNamespace(max_model_len=16512)
    for measured, warns in ((22, False), (30, False), (21, True)):
        pipe = SimpleNamespace(
            sampler=SimpleNamespace(engine=SimpleNamespace(kv_capacity=measured))
        )
        generator.warn_if_kv_short(pipe, plan, args)
        out = capsys.readouterr().out
        assert bool(out) == warns, (measured, out)
        if warns:
            assert "holds 21 sequences" in out and "the 22 that max_num_seqs 66" in out


def test_two_nodes_three_trainers_twelve_generator_engines_one_eval():
    # 16 H200s: node 0 trains on 3, generates on 4 (dp 0-3, the head) and evaluates on 1; node 1
    # runs 8 headless engines (dp 4-11): 12 generator GPUs for 3 trainer GPUs, the paper's 4:1
    p = plan("qwen3-8b", H200, nproc=3, remote_engines=8)
    assert p.errors == []
    roles = [(r.node, r.gpu, r.role) for r in p.rows]
    assert roles[:8] == [(0, g, f"trainer rank {g}") for g in range(3)] + [
        (0, 3 + i, f"vLLM dp {i}") for i in range(4)
    ] + [(0, 7, "vLLM eval")]
    assert roles[8:] == [(1, g, f"vLLM headless dp {4 + g}") for g in range(8)]
    share = int(0.9 * H200)  # a GPU vLLM has to itself
    assert all(r.parts == {"vllm": share} and r.total == share for r in p.rows[8:])
    assert (p.tp, p.dp, p.remote, p.remote_nodes) == (1, 12, 8, [8])
    assert p.generator == ["3", "4", "5", "6"] and p.dedicated
    assert p.devices == 16  # 3 trainers + 4 generator + 1 eval here, 8 there
    # 48 x 16 rollouts x 2 batches in flight over 12 engines: 128 each, below 3 x 46 (KV cap)
    assert p.max_num_seqs == 128 and 3 * p.kv_seqs > 128
    text = pl.describe(p)
    assert "and 8 engine(s) on 1 other node(s)" in text
    assert "  node 1 GPU 7: vLLM headless dp 11: ~" in text


def test_remote_engines_fill_nodes_of_rank0s_size_and_tp():
    # tp 2 on 8-GPU nodes: 4 engines per other node; 6 engines: one full node and one of 2
    p = plan("qwen3-8b", H200, nproc=4, tp=2, remote_engines=6, eval_gpus=0)
    assert p.errors == [] and p.remote_nodes == [4, 2]
    assert p.dp == 2 + 6
    node2 = [(r.gpu, r.role) for r in p.rows if r.node == 2]
    assert node2 == [
        (0, "vLLM headless dp 6 tp 0"),
        (1, "vLLM headless dp 6 tp 1"),
        (2, "vLLM headless dp 7 tp 0"),
        (3, "vLLM headless dp 7 tp 1"),
    ]


def test_remote_engines_refused_on_cpu():
    shape = pl.Shape.from_config(CONFIGS["qwen3-0.6b"])
    kw = {**PAPER, "n_gpus": 0, "gpu_bytes": 0, "world": 1, "local_world": 1}
    assert pl.plan(shape, **kw).errors == []
    p = pl.plan(shape, **kw, remote_engines=2)
    assert p.errors == ["--remote-engines 2: needs GPUs (NCCL weights)"]


# Qwen/Qwen3-30B-A3B's config.json sizes: 48 layers, each 128 experts of width 768, 8 per token
QWEN3_30B_A3B = dict(
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    vocab_size=151936,
    intermediate_size=6144,
    moe_intermediate_size=768,
    num_experts=128,
    num_experts_per_tok=8,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
)


def test_moe_parameters_counted_by_hand_and_by_transformers():
    """Qwen3-30B-A3B: 30.5B parameters (3.34B before MoE layers were counted), 3.35B per token.
    By hand: embedding and untied head 2 x 151,936 x 2,048 + final norm 2,048 = 622,331,904; per
    layer attention 2,048 x 4,096 x 2 + 2 x 2,048 x 512 + q/k norms 256 + 2 RMSNorms 4,096 =
    18,878,720, experts 128 x 3 x 2,048 x 768 = 603,979,776, router 128 x 2,048 = 262,144."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(**QWEN3_30B_A3B)
    shape = pl.Shape.from_config(cfg)
    layer = 18_878_720 + 603_979_776 + 262_144
    assert shape.params == 622_331_904 + 48 * layer == 30_532_122_624
    active = 18_878_720 + 8 * 3 * 2048 * 768 + 262_144  # 8 of 128 experts per token
    assert shape.active == 622_331_904 + 48 * active == 3_353_032_704
    assert pl.inactive_params(cfg) == shape.params - shape.active
    assert shape.intermediate == 8 * 768 and shape.top_k == 8
    with torch.device("meta"):
        lm = Qwen3MoeForCausalLM(cfg)
    assert shape.params == sum(p.numel() for p in lm.parameters())
    # dense layers among sparse ones: every 2nd layer sparse, layer 1 kept dense (mlp_only_layers)
    small = dict(QWEN3_30B_A3B, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[1])
    small.update(hidden_size=64, vocab_size=256, intermediate_size=96, moe_intermediate_size=32)
    small.update(num_attention_heads=2, num_key_value_heads=1, head_dim=32, num_experts=4)
    small.update(num_experts_per_tok=2)
    cfg = Qwen3MoeConfig(**small)
    assert pl.sparse_layers(cfg) == [3, 5]
    with torch.device("meta"):
        lm = Qwen3MoeForCausalLM(cfg)
    shape = pl.Shape.from_config(cfg)
    assert shape.params == sum(p.numel() for p in lm.parameters())
    assert shape.params - shape.active == 2 * (4 - 2) * 3 * 64 * 32  # 2 sparse layers, 2 idle
    assert shape.intermediate == 96  # the dense layers' MLP, wider than 2 x 32
    assert (
        pl.sparse_layers(CONFIGS["qwen3-8b"]) == [] and pl.inactive_params(CONFIGS["qwen3-8b"]) == 0
    )


def test_an_moe_the_plan_cannot_count_is_refused_on_gpus():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    for cfg, field in ((MixtralConfig(), "num_local_experts"), (Qwen2MoeConfig(), "shared_expert")):
        with pytest.raises(BadInput, match=f"--model: {cfg.model_type} .*cannot count .*{field}"):
            pl.check_counted(cfg)
    pl.check_counted(Qwen3MoeConfig(**QWEN3_30B_A3B))  # counted: no error
    pl.check_counted(CONFIGS["qwen3-8b"])
    # on CPU Mixtral trains, its FLOPs per token counted as if dense (its experts alias num_experts)
    assert pl.sparse_layers(MixtralConfig()) == [] and pl.inactive_params(MixtralConfig()) == 0


def test_qwen3_30b_a3b_fits_no_8_x_80gb_node_and_the_plan_says_what_would():
    """The preset (PAPER: micro-batch 16,512 tokens, activation checkpointing) on 8 x H100: its
    trainer shards 16 B x 30,532,122,624 parameters = 488.5 GB; beside that each rank holds the
    largest FSDP unit gathered (a layer, 623,120,640 parameters: 2 x 2 + 2 + 4 = 10 B each =
    6.23 GB), activations (48 layers x 16,512 tokens x 2 x 2,048 bytes = 3.25 GB, plus one
    layer's 16,512 x 2 (6 x 2,048 + 5 x 4,096 + 5 x 512 + 4 x 6,144 + 2 x 8 x 2,048) = 3.06 GB),
    the head (2 x 1,024 x 151,936 x 4 + 16,512 x 2,048 x 4 + 2 x 151,936 x 2,048 x 4 = 3.87 GB)
    and 2 GiB of context: 18.56 GB. 7 ranks: 69.8 + 18.6 = 88.3 GB > 85.0 GB (79.2 GiB): no.
    8 ranks: 61.1 + 18.6 = 79.6 GB: fits, but leaves no GPU for vLLM, which at tp 1 holds its
    bf16 weights (61.06 GB + the fp32 head's extra 0.62 GB = 57.4 GiB) and 4 GiB in 0.9 x 79.2 =
    71.3 GiB, 9.9 GiB of KV cache (16,512 tokens x 2 x 48 x 512 x 2 B = 1.51 GiB a sequence)."""
    from transformers import Qwen3MoeConfig

    shape = pl.Shape.from_config(Qwen3MoeConfig(**QWEN3_30B_A3B))
    kw = dict(world=7, tokens=16512, checkpointing=True)
    fixed = 10 * 623_120_640 + 48 * 16512 * 2 * 2048 + 16512 * 2 * (12288 + 20480 + 2560 + 24576)
    fixed += 16512 * 2 * 2 * 8 * 2048
    fixed += 2 * 1024 * 151936 * 4 + 16512 * 2048 * 4 + 2 * 151936 * 2048 * 4 + 2 * GIB
    tr = pl.trainer_bytes(shape, **kw)
    assert sum(tr.values()) == pytest.approx(16 * 30_532_122_624 / 7 + fixed, abs=8)
    assert sum(tr.values()) > H100
    assert sum(pl.trainer_bytes(shape, **{**kw, "world": 8}).values()) <= H100
    gen = pl.generator_bytes(
        shape, gpu_bytes=H100, utilization=0.9, tp=1, dtype_bytes=2, fp32_head=True
    )
    assert gen["weights"] == 30_532_122_624 * 2 + 151936 * 2048 * 2
    assert gen["kv"] // (16512 * 2 * 48 * 512 * 2) == 6
    for nproc in (4, 7):
        p = pl.plan(
            shape,
            n_gpus=8,
            gpu_bytes=H100,
            world=nproc,
            local_world=nproc,
            argv=["--model", "qwen3-30b-a3b"],
            **PAPER,
        )
        assert p.errors and p.fix is None
        assert p.needs == (
            "the trainer needs >= 8 ranks of 79.2 GiB (30.5B parameters, 16 B each sharded by "
            "FSDP2, no CPU offload); vLLM --tensor-parallel-size 1: the training and the eval "
            "engine 1 GPU(s) each: 10 GPUs against 8 on this node"
        )
        with pytest.raises(SystemExit, match="no placement on this node fits: the trainer needs"):
            pl.check(p)
    # 8 x H200: 5 ranks hold 16 B x 30.5B / 5 = 97.7 GB + 18.6 GB each; vLLM at tp 1 on the rest
    p = pl.plan(
        shape, n_gpus=8, gpu_bytes=H200, world=5, local_world=5, argv=["--model", "x"], **PAPER
    )
    assert p.errors == [] and (p.dp, p.eval.dp) == (2, 1)
    assert sum(pl.trainer_bytes(shape, **{**kw, "world": 5}).values()) == pytest.approx(
        16 * 30_532_122_624 / 5 + fixed, abs=8
    )


def test_cpu_trainer_threads_leave_the_engines_half_the_cores():
    """On CPU a trainer rank takes half the cores it may use (the engines run on the rest), at
    least 1; an OMP_NUM_THREADS (the user's, or torchrun's 1 for several ranks) wins, unless it is
    not a positive integer."""
    assert pl.cpu_trainer_threads({}, 2) == 1
    assert pl.cpu_trainer_threads({}, 1) == 1
    assert pl.cpu_trainer_threads({}, 9) == 4
    assert pl.cpu_trainer_threads({"OMP_NUM_THREADS": "3"}, 2) == 3
    assert pl.cpu_trainer_threads({"OMP_NUM_THREADS": "0"}, 8) == 4
    assert pl.cpu_trainer_threads({"OMP_NUM_THREADS": "x"}, 8) == 4
    assert pl.cpu_trainer_threads({"OMP_NUM_THREADS": "3,2"}, 8) == 3  # OpenMP's nested list
