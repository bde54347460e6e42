"""One NCCL-style weight push on 2 gloo ranks, with fakes for vLLM's side (tests/test_stop_push.py;
issue 25: a stop during the update phase, an engine dying in the weight broadcast).

    torchrun --standalone --nproc_per_node 2 tests/dist_stop_push.py MODE OUT

The push is infra/generator.nccl_pusher's, over a real Pipeline (rank 0) and a real
engine.SyncClient; the sampler's engine and the sender are fakes. The fake sender does what vLLM's
NCCL trainer engine does on each rank (vllm/distributed/weight_transfer/nccl_engine.py, 0.32): every
rank all-gathers each parameter (FSDP2's full_tensor), and rank 0 starts the engine's
update_weights RPC in a thread, "broadcasts" each gathered parameter and waits for the RPC.
MODE "send": nothing goes wrong. "stop": rank 0's stop flag is set before the push (a Ctrl-C during
the update phase). "dead": the engine dies as the broadcast starts; the broadcast then blocks until
the sender is shut down (as NCCL's does until ncclCommAbort) and the RPC never answers. After the
push every rank runs launch.stop_agreed. Each rank writes what it saw (or raised) and the push's
seconds to OUT.<rank> as JSON. The process group's timeout is 20 s, so a rank left in a collective
fails within it.
"""

import asyncio
import json
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import filters  # noqa: E402
import generate  # noqa: E402
import pipeline  # noqa: E402
from infra import engine, generator, launch  # noqa: E402
from tasks.data import Prompt  # noqa: E402

PARAMS = 4  # parameters the fake sender gathers
TIMEOUT_S = 20.0  # the process group's


class FakeClient:
    """vLLM's AsyncLLM, the calls a weight update makes; in "dead" mode update_weights never
    answers (its workers are gone)."""

    def __init__(self, dead: bool):
        self.dead = dead

    async def update_weights(self, request):
        if self.dead:
            await asyncio.sleep(3600)

    async def start_weight_update(self):
        pass

    async def finish_weight_update(self):
        pass

    async def pause_generation(self, **kw):
        pass

    async def update_weight_version(self, version):
        pass

    async def resume_generation(self):
        pass


class FakeEngine:
    """infra.engine.Engine's client and health check: dead() answers once `died` is set."""

    def __init__(self, dead: bool):
        self.client = FakeClient(dead)
        self.died = threading.Event()

    def dead(self):
        if self.died.is_set():
            return "the vLLM engine died"
        return None


class FakeSampler(generate.Sampler):
    """A real Sampler's weight swap over a fake engine; every completion is two tokens."""

    def __init__(self, dead: bool):  # no vLLM engine: only what the pipeline touches
        self.engine = FakeEngine(dead)
        self.version = 0
        self.next_version = None
        self.loads = 0
        self._update_lock = asyncio.Lock()

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        await asyncio.sleep(0.01)
        comp = lambda: generate.Completion(
            list(prompt_ids), [1, 2], torch.zeros(2), torch.ones(2, dtype=torch.bool),
            torch.full((2,), self.version), "stop", False, False, "ab",
        )  # fmt: skip
        return [comp() for _ in range(n)]


class FakeSender:
    """vLLM's NCCLTrainerWeightTransferEngine, send_weights and shutdown, over gloo all-gathers."""

    def __init__(self, client, engine=None):
        self.client = client  # rank 0's SyncClient, None elsewhere
        self.engine = engine  # rank 0's FakeEngine in "dead" mode: it dies as the broadcast starts
        self.down = threading.Event()  # shutdown(): the communicator aborted
        self.sends = 0

    def send_weights(self):
        world = dist.get_world_size()
        rpc = None
        if self.client is not None:
            self.client.start_weight_update()
            rpc = ThreadResult(lambda: self.client.update_weights({"names": []}))
        for i in range(PARAMS):
            shard = torch.full((2,), float(dist.get_rank() + i))
            full = [torch.empty(2) for _ in range(world)]
            dist.all_gather(full, shard)  # the parameter's gather: every rank
            if self.client is not None and not self.down.is_set():  # the broadcast
                if self.engine is not None:
                    self.engine.died.set()
                    self.down.wait()  # a dead receiver: until the communicator is aborted
        if rpc is not None:
            rpc.result()
            self.client.finish_weight_update()
        self.sends += 1

    def shutdown(self):
        self.down.set()


class ThreadResult:
    """fn() in a thread; result() waits for it and returns or raises what it did."""

    def __init__(self, fn):
        self.out = {}
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn):
        try:
            self.out["value"] = fn()
        except BaseException as e:
            self.out["error"] = e

    def result(self):
        self.thread.join()
        if "error" in self.out:
            raise self.out["error"]
        return self.out.get("value")


def rank0_pipeline(sampler, loop, stop: dict):
    tokens = (1, 2, 3)
    prompts = [Prompt(i, f"q{i}", str(i), tokens, False) for i in range(8)]
    return pipeline.Pipeline(
        sampler,
        prompts,
        filters.PromptPool(8),
        loop=loop,
        group_size=2,
        prompts_per_step=2,
        max_lag=1,
        reward_fn=lambda texts, golds, thinking, timeout: [0.0] * len(texts),
        stop=lambda: stop["requested"],
    )


def main(mode: str, out: str) -> None:
    rank, world, _ = launch.setup_distributed(TIMEOUT_S)
    stop = {"requested": False}
    got = {}
    pipe = client = sampler = None
    if rank == 0:
        loop = asyncio.new_event_loop()
        threading.Thread(target=loop.run_forever, daemon=True).start()
        sampler = FakeSampler(dead=mode == "dead")
        pipe = rank0_pipeline(sampler, loop, stop)
        client = engine.SyncClient(sampler, loop)
    dying = sampler.engine if mode == "dead" and rank == 0 else None
    sender = FakeSender(client, dying)
    push = generator.nccl_pusher(None, pipe, sender, client, None, stop, timeout=5.0)
    dist.barrier()
    if mode == "stop" and rank == 0:
        stop["requested"] = True  # a Ctrl-C reached rank 0 during the update phase
    t0 = time.perf_counter()
    try:
        push(1)
        got["push_s"] = time.perf_counter() - t0
        got["sends"] = sender.sends
        got["stop_agreed"] = launch.stop_agreed(stop)
        got["failed"] = stop.get("failed")
        if sampler is not None:
            got["version"] = sampler.version
    except Exception as e:  # recorded for the test, then the rank fails as it would in a run
        got["error"] = f"{type(e).__name__}: {e}"
        got["push_s"] = time.perf_counter() - t0
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)
    if pipe is not None:
        pipe.close()
    if "error" in got:
        os._exit(1)  # no destroy_process_group: the other rank may be gone
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
