"""checkpoint.py's weight export for the sampler: gathered one parameter at a time and cast to the
sampler dtype before leaving its device, it writes exactly what the old export (the whole fp32 state
dict gathered to the CPU, then cast) wrote: bit for bit in float32 and in bfloat16 (a cast is
elementwise, so cast-then-gather equals gather-then-cast), on 1 and 2 gloo ranks, for a tied head
(saved once) and an untied one, with a layer that 2 ranks shard unevenly. vLLM's own check of the
NCCL weight source (metadata against iteration) passes too."""

import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch

import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_export_equals_the_old_full_gather_then_cast(tmp_path, nproc):
    models = [
        tiny.random_model(
            str(tmp_path / f"model{tied}"), seed=5, tie_word_embeddings=tied, intermediate_size=75
        )
        for tied in (True, False)
    ]
    subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc)]
        + [os.path.join(ROOT, "tests", "dist_export.py"), str(tmp_path / "out"), *models],
        check=True,
        capture_output=True,
        timeout=300,
    )
    for i, (tied, model_dir) in enumerate(zip((True, False), models, strict=True)):
        out = tmp_path / "out" / str(i)
        old = torch.load(out / "old.pt")
        start = safetensors.torch.load_file(os.path.join(model_dir, "model.safetensors"))
        for dtype in ("float32", "bfloat16"):
            new = safetensors.torch.load_file(out / dtype / "model.safetensors")
            assert ("lm_head.weight" in new) is not tied  # a tied head once, as the embedding
            assert sorted(new) == sorted(old[f"torch.{dtype}"])
            for name, t in new.items():
                assert t.dtype == getattr(torch, dtype)
                assert torch.equal(t, old[f"torch.{dtype}"][name]), name
                assert torch.equal(t, start[name].to(t.dtype)), name  # the saved model, cast
        assert new["model.layers.0.mlp.up_proj.weight"].shape[0] == 75  # odd: uneven over 2 ranks
