"""checkpoint.py's weight export for the sampler: gathered one parameter at a time and cast to the
sampler dtype before leaving its device, it writes exactly what the old export (the whole fp32 state
dict gathered to the CPU, then cast) wrote: bit for bit in float32 and in bfloat16 (a cast is
elementwise, so cast-then-gather equals gather-then-cast), on 1 and 2 gloo ranks, for a tied head
(saved once) and an untied one, with a layer that 2 ranks shard unevenly. vLLM's own check of the
NCCL weight source (metadata against iteration) passes too. With dtype=None it writes the final
Hugging Face export: the tensors `lm.save_pretrained` of the full state dict writes, and
export_pretrained's directory loads back in transformers, weights and tokenizer. truncate_log on
--resume keeps the lines of steps up to the checkpoint, and of the evals only those it is given
(issue 10: evals finish after their step, so one logged after the checkpoint can carry an earlier
step; train.py's resume tests pin which: those in the history or still running at the checkpoint,
issue 25), and returns them parsed."""

import json
import os
import subprocess
import sys

import pytest
import safetensors.torch
import torch
from safetensors import safe_open
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer

from infra import checkpoint
from tasks import tiny

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


@pytest.mark.parametrize("tied", [True, False])
def test_final_export_equals_save_pretrained(tmp_path, tied):
    """One process, no FSDP: export_weights(dtype=None) into a directory it creates writes what
    the full state dict through lm.save_pretrained (the final export before export_pretrained)
    writes."""
    model_dir = tiny.random_model(str(tmp_path / "model"), seed=3, tie_word_embeddings=tied)
    lm = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    policy = torch.nn.Module()
    policy.lm = lm  # train.Policy's parameter names: the LM under `lm.`
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    sd = get_model_state_dict(policy, options=options)
    old_dir = tmp_path / "old"
    lm.save_pretrained(old_dir, state_dict={k.removeprefix("lm."): v for k, v in sd.items()})
    new_dir = tmp_path / "final" / "new"  # missing: export_weights creates it
    checkpoint.export_weights(policy, str(new_dir))
    old = safetensors.torch.load_file(old_dir / "model.safetensors")
    new = safetensors.torch.load_file(new_dir / "model.safetensors")
    assert sorted(new) == sorted(old) and ("lm_head.weight" in new) is not tied
    for name, t in new.items():
        assert t.dtype == torch.float32 and torch.equal(t, old[name]), name
    with safe_open(new_dir / "model.safetensors", "pt") as f:
        assert f.metadata() == {"format": "pt"}
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    pretrained = str(tmp_path / "pretrained")
    checkpoint.export_pretrained(policy, tokenizer, pretrained, None)
    back = AutoModelForCausalLM.from_pretrained(pretrained)
    assert back.dtype == torch.float32
    for (name, a), (_, b) in zip(lm.named_parameters(), back.named_parameters(), strict=True):
        assert torch.equal(a, b), name
    text = "1 + 2 = 3"
    assert AutoTokenizer.from_pretrained(pretrained)(text) == tokenizer(text)


def test_truncate_log_keeps_the_steps_and_the_evals_of_the_checkpoint(tmp_path):
    """A run checkpointed at step 3 with the evals of steps 0 and 2 in its history; the eval of
    step 3 was logged after the checkpoint, then the run went on to step 4 and was killed
    mid-line."""
    metrics = [
        {"step": 0, "eval/version": 0, "eval/pass_rate": 0.1},
        {"step": 1, "train/reward": 0.2},
        {"step": 2, "train/reward": 0.3},
        {"step": 2, "eval/version": 2, "eval/pass_rate": 0.4},
        {"step": 3, "train/reward": 0.5},
        {"step": 3, "eval/version": 3, "eval/pass_rate": 0.6},
        {"step": 4, "train/reward": 0.7},
    ]
    samples = [
        {"step": 2, "split": "train"},
        {"step": 2, "split": "eval"},
        {"step": 3, "split": "eval"},
        {"step": 4, "split": "train"},
    ]
    for name, lines in (("metrics.jsonl", metrics), ("samples.jsonl", samples)):
        path = tmp_path / name
        path.write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"step": 5, "tra')
        returned = checkpoint.truncate_log(str(path), 3, evals={0, 2})
        assert returned == [json.loads(x) for x in path.read_text().splitlines()]
    kept = lambda name: [json.loads(x) for x in (tmp_path / name).read_text().splitlines()]
    assert kept("metrics.jsonl") == metrics[:5]  # step 3's eval (not in evals) goes
    assert kept("samples.jsonl") == samples[:2]
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(x) + "\n" for x in metrics))
    checkpoint.truncate_log(str(tmp_path / "old.jsonl"), 3)  # evals=None: by step only
    assert kept("old.jsonl") == metrics[:6]
