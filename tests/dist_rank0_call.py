"""Rank 0 busy for longer than the collective timeout while the other ranks wait
(tests/test_train.py; issue 10: ranks waiting in a collective while rank 0 evaluates).

    torchrun --nproc_per_node 2 tests/dist_rank0_call.py MODE TIMEOUT_S BUSY_S OUT

MODE "rank0_call": rank 0's work (a sleep of BUSY_S) runs through launch.rank0_call, whose result
every rank gets; "plain": rank 0 sleeps, then joins a barrier the others wait in (what train.py did
before: the other ranks' wait is one collective, which the TIMEOUT_S process-group timeout ends);
"error": rank 0's work raises ValueError after BUSY_S (rank 0 gets it, the others a RuntimeError
naming it). Each rank writes what it got or raised, and
the seconds it took, to OUT.<rank> as JSON.
"""

import json
import os
import sys
import time

import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from infra import launch  # noqa: E402


def work(mode: str, busy: float):
    time.sleep(busy)
    if mode == "error":
        raise ValueError("rank 0's work failed")
    return "done"


if __name__ == "__main__":
    mode, timeout_s, busy, out = sys.argv[1], float(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
    rank, world, _ = launch.setup_distributed(timeout_s)
    t0, got = time.perf_counter(), {}
    try:
        if mode == "plain":
            if rank == 0:
                work(mode, busy)
            dist.barrier()
            got["value"] = "done"
        else:
            got["value"] = launch.rank0_call(lambda: work(mode, busy), share=True)
    except Exception as e:  # recorded for the test, then the rank fails as it would in a run
        got["error"] = f"{type(e).__name__}: {e}"
    got["seconds"] = time.perf_counter() - t0
    with open(f"{out}.{rank}", "w") as f:
        json.dump(got, f)
    if "error" in got:
        os._exit(1)  # no destroy_process_group: the other rank may be gone
    dist.destroy_process_group()
