"""bench/seeds.py: the default run's bars per seed (issues 12 and 29), on run directories written
here. Pins the fall bar: the last eval at most 0.05 below the run's best."""

import json

import numpy as np
import pytest

from bench import seeds


@pytest.mark.parametrize("drop", [0.0, 0.03, 0.08])
def test_seeds_bars_flag_a_fall_from_the_best_eval_to_the_last(tmp_path, drop):
    """bench/seeds.check on a run whose evals follow Eq. 1 (R0 0.2, A 0.85, B 2, C_mid 0.06; 26
    evals 0.01 h apart), the last one set `drop` below the one before it, the best of a rising
    curve: the fall is `drop` (0 when the last is left on the curve: it is the best), and the bar
    holds up to 0.05."""
    C = np.arange(27) * 0.01
    R = np.full(27, 0.2)
    R[1:] = 0.2 + (0.85 - 0.2) / (1 + (0.06 / C[1:]) ** 2)
    if drop:
        R[-1] = R[-2] - drop
    lines = [{"step": 6 * k, "gpu_hours": C[k], "eval/pass_rate": R[k]} for k in range(27)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in lines))
    r = seeds.check(str(tmp_path), n_boot=20)
    assert abs(r["fall"] - drop) < 1e-12
    assert r["ok"]["fall"] == (drop <= 0.05)
