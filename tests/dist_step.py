"""One train.train_step on a saved batch, on however many ranks torchrun gives it (tests/test_train.py).

    torchrun --nproc_per_node N tests/dist_step.py MODEL_DIR BATCH.pt OUT.pt

Rank 0 saves the loss, gradient norm and the full updated weights to OUT.pt.
"""

import os
import sys

import torch
from transformers import AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import config  # noqa: E402
import train  # noqa: E402

if __name__ == "__main__":
    model_dir, batch_path, out = sys.argv[1:4]
    rank, world, device = train.setup_distributed()
    args = config.Args(
        micro_batch_size=3, lr=1e-3, warmup_steps=1, adam_eps=1e-6
    )  # 3 rows a micro-batch
    policy = train.Policy(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), args.fp32_head
    )
    train.shard(policy, device)
    optimizer = torch.optim.AdamW(
        policy.parameters(), lr=args.lr, eps=args.adam_eps, weight_decay=args.weight_decay
    )
    metrics = train.train_step(policy, optimizer, torch.load(batch_path), args, device)
    sd = train.get_model_state_dict(
        policy, options=train.StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if rank == 0:
        torch.save({"metrics": metrics, "weights": sd}, out)
    train.dist.destroy_process_group()
