"""The held-out split: `eval_size` prompts of each task kept out of training, whose pass rate is the
validation curve the sigmoid is fitted to.

Paper: §2.1 and A.5 (a fixed set of 1,000 held-out prompts). Exercised by
`python -m pytest tests/test_data.py -k heldout` and by every `python train.py` (`--eval-size`).

Where this departs from the paper, and why:
1. A mixture holds out `eval_size` prompts of each task, not of the whole, so every task's curve is
   measured on as many prompts as a run of that task alone would be.
2. The split is saved in the run directory (json) and restored on resume, with a
   fingerprint of the questions, so a resumed run never trains on its held-out prompts.
"""

import json
import os
import random
import zlib

from tasks.data import Prompt

SPLIT_FILE = "heldout.json"


def split_heldout(
    prompts: list[Prompt],
    eval_size: int,
    *,
    seed: int,
    run_dir: str | None = None,
    train_size: int = 0,
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout): `eval_size` prompts of each task chosen at random by `seed` and removed
    from training (paper A.5: 1,000), so every task's curve is measured on as many prompts as a run
    of that task alone would be. One task: `random.Random(seed).sample` of the positions; several:
    the same generator samples each task's positions in turn, tasks in order of appearance.
    `train_size` > 0 keeps `train_size` training prompts of each task (all when it has fewer), in
    their order: one generator, `random.Random(f"train-size {seed}")`, samples each task's training
    indices in turn, tasks in order of appearance. The held-out split does not depend on it, and a
    resumed run (same seed) gets the same prompts.

    With `run_dir`, the split is saved there (json: indices and a fingerprint of the
    questions) and, when that file already exists (a resumed run), restored from it instead of
    drawn. eval_size leaves every task a training prompt: loading.load_prompts' --eval-size rule,
    checked before the run directory exists. Raises ValueError when the saved split belongs to a
    different dataset."""
    tasks: dict[str, list[int]] = {}  # task -> its prompts' positions
    for i, p in enumerate(prompts):
        tasks.setdefault(p.task, []).append(i)
    fingerprint = zlib.crc32("\0".join(p.question for p in prompts).encode())
    path = os.path.join(run_dir, SPLIT_FILE) if run_dir else None
    if path and os.path.exists(path):
        held = load_split(path, fingerprint, len(prompts))
    else:
        rng = random.Random(seed)
        # one generator for every task, in order of appearance: the documented draws
        held = {ids[j] for ids in tasks.values() for j in rng.sample(range(len(ids)), eval_size)}
        if path:
            saved = dict(
                seed=seed, n_prompts=len(prompts), fingerprint=fingerprint, heldout=sorted(held)
            )
            save_split(path, saved)
    # a prompt's index is its position (data.load_prompts numbers them so)
    train = [p for p in prompts if p.index not in held]
    if train_size:  # a random subset: a dataset's first rows may not be a fair sample
        rng = random.Random(f"train-size {seed}")
        kept = set()
        for ids in tasks.values():  # tasks in order of appearance, as held out
            ids = [i for i in ids if i not in held]
            kept.update(rng.sample(ids, min(train_size, len(ids))))
        train = [p for p in train if p.index in kept]
    heldout = [p for p in prompts if p.index in held]
    return train, heldout


def load_split(path: str, fingerprint: int, n_prompts: int) -> set[int]:
    """The held-out indices saved at `path`. Raises ValueError when they were saved for other
    prompts (another fingerprint or number of prompts)."""
    with open(path) as f:
        saved = json.load(f)
    if saved["fingerprint"] != fingerprint or saved["n_prompts"] != n_prompts:
        raise ValueError(
            f"{path} was saved for a different dataset ({saved['n_prompts']} prompts); resume with "
            f"the same --data, or start a new run directory"
        )
    return set(saved["heldout"])


def save_split(path: str, saved: dict) -> None:
    """Write `saved` to `path` as JSON, creating its directory; through a temporary file, so a
    crash never leaves a half-written split."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(saved, f)
    os.replace(path + ".tmp", path)
