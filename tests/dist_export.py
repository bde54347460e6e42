"""checkpoint.export_weights on however many ranks torchrun gives it, against the export it replaced
(tests/test_checkpoint.py).

    torchrun --nproc_per_node N tests/dist_export.py OUT_DIR MODEL_DIR...

For each model i, writes OUT_DIR/i/{float32,bfloat16}/model.safetensors with
checkpoint.export_weights, and rank 0 saves the old export (the full fp32 state dict gathered to the
CPU, then cast) to OUT_DIR/i/old.pt. Every rank also runs vLLM's own check of the NCCL weight source
(metadata against iteration, as its NCCL sender does before broadcasting).
"""

import os
import sys

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerWeightTransferEngine

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import train  # noqa: E402
from infra import (
    checkpoint,  # noqa: E402
    launch,  # noqa: E402
)


def export(model_dir, out, rank, device):
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = train.Policy(lm, fp32_head=True)
    train.shard(policy, device)
    old = {}
    for dtype in (torch.float32, torch.bfloat16):
        out_dir = os.path.join(out, str(dtype).removeprefix("torch."))
        if rank == 0:
            os.makedirs(out_dir)
        checkpoint.export_weights(policy, out_dir if rank == 0 else None, dtype)
        # the export before issue 10: everything gathered in fp32 to the CPU, then cast
        sd = get_model_state_dict(
            policy, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        sd = {k.removeprefix("lm."): v.to(dtype).contiguous() for k, v in sd.items()}
        if lm.config.tie_word_embeddings:
            sd.pop("lm_head.weight", None)
        old[str(dtype)] = sd
        source = checkpoint.sampler_source(policy, dtype)
        sent = list(NCCLTrainerWeightTransferEngine._checked_iter(source, source.metadata()))
        assert [n for n, _ in sent] == [m.name for m in source.metadata()]
    if rank == 0:
        torch.save(old, os.path.join(out, "old.pt"))


if __name__ == "__main__":
    rank, world, device = launch.setup_distributed()
    for i, model_dir in enumerate(sys.argv[2:]):
        export(model_dir, os.path.join(sys.argv[1], str(i)), rank, device)
    launch.dist.destroy_process_group()
