"""One train.train_step on a saved batch, on however many ranks torchrun gives it
(tests/test_train.py).

    torchrun --nproc_per_node N tests/dist_step.py MODEL_DIR BATCH.pt OUT.pt [LAYOUT ...]

LAYOUT = BUDGET:ROWS:PACK sets --max-tokens-per-microbatch BUDGET, --micro-batch-size ROWS and, with
PACK 1, packs micro-batches into one row as if the attention kernel were varlen (SDPA computes a
packed row exactly, through a block-diagonal mask). Default: one layout, 32768:3:0. Each layout
starts from the same weights. Rank 0 saves {LAYOUT: {"metrics", "weights" (full, after the step),
"grads" (full, clipped, before AdamW)}} to OUT.pt.
"""

import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import train  # noqa: E402
from infra import launch  # noqa: E402

if __name__ == "__main__":
    model_dir, batch_path, out = sys.argv[1:4]
    rank, world, device = launch.setup_distributed()
    batch, results, varlen = torch.load(batch_path), {}, train.varlen_attention
    for layout in sys.argv[4:] or ["32768:3:0"]:
        budget, rows, pack = map(int, layout.split(":"))
        args = config.Args(
            max_tokens_per_microbatch=budget,
            micro_batch_size=rows,
            lr=1e-3,
            warmup_steps=1,
            adam_eps=1e-6,
        )
        train.varlen_attention = (lambda lm: True) if pack else varlen
        policy = train.Policy(
            AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args.fp32_head
        )
        train.shard(policy, device)
        optimizer = torch.optim.AdamW(
            policy.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay
        )
        grads, adam_step = {}, optimizer.step

        def record_then_step(grads=grads, adam_step=adam_step, policy=policy):
            grads.update({k: p.grad.full_tensor() for k, p in policy.named_parameters()})
            return adam_step()

        optimizer.step = record_then_step  # every rank gathers: full_tensor is a collective
        metrics = train.train_step(policy, optimizer, batch, args, device)
        sd = get_model_state_dict(
            policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        results[layout] = {"metrics": metrics, "weights": sd, "grads": grads}
    if rank == 0:
        torch.save(results, out)
    launch.dist.destroy_process_group()
