"""Every batch filter of ScaleRL: rollouts with a non-finite behaviour log-prob dropped,
zero-variance filtering, DAPO's length penalty, and the No-Positive-Resampling prompt pool (per task
for a mixture).

Paper: §3.2 (Fig 6a zero-variance filtering, Fig 6b adaptive prompt filtering =
No-Positive-Resampling from Polaris), A.10 Eq. 9 (length penalty, the `loo-lp` ablation). Pure
functions and the pools' state, no flags: train.get_batch calls the batch filters in turn and
infra/loading.py builds the pool. Exercised by `python -m pytest tests/test_filters.py` and by every
`python train.py`.

Where this departs from the paper, and why:
1. The paper does not say how a prompt's pass rate is aggregated. Here a prompt retires when the
   group just scored reaches the threshold (the latest observation): "once easy, stays easy" is
   Polaris's premise, and a cumulative mean would keep a prompt that was hard early on.
2. Retirement takes effect immediately for later `next()` calls, not at the epoch boundary. Each
   prompt is drawn once per epoch, so the two only differ for groups still in flight across a
   boundary (PipelineRL).
3. The length penalty shapes the reward only after the pass rates are recorded (train.get_batch),
   so that the recorded reward stays a pure verdict for pass-rate logging and
   No-Positive-Resampling.
4. A prompt drawn but never trained on comes back: one in flight at a checkpoint is served first
   after the resume, one whose group went stale (PipelineRL) is handed back (`release`) and served
   next. Long prompts are the ones in flight or late, so skipping them would bias training towards
   short ones.
5. Several tasks (the paper's math+code runs, which do not say how they mix): each group's task is
   drawn by a task weight, and each task keeps its own pool (`TaskPools`), so retirement and epochs
   are per task and a task that is fully retired stops being drawn. A prompt handed back, or in
   flight at a checkpoint, is served first the next time its task is drawn.
6. A rollout whose behaviour log-prob is NaN or +-inf on a policy token (a sampler fault the paper
   does not discuss) leaves its group before advantages are computed (drop_nonfinite_logp).
7. A pool whose every prompt is retired (the paper's runs never empty theirs) raises AllRetired:
   the pipeline stops drawing, the groups in flight finish and train in whole batches, and
   train.py ends the run there as a finished one (its last weights exported and evaluated, a
   checkpoint, the fit).
"""

import collections
import dataclasses
import operator
import threading
from fractions import Fraction

import numpy as np
import torch

from loss import STD_FLOOR  # one zero-variance guard for the filter and the advantages


def zero_variance_mask(rewards: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """(S,) bool: True where the sample's group has non-zero reward variance, so it enters the loss
    (§3.2, Fig 6a).

    rewards: (S,) float; group_ids: (S,) int, any values, groups need not be contiguous. A group's
    population std (computed in float64) below loss.STD_FLOOR counts as zero. Raises ValueError on
    mismatched or non-1-D shapes."""
    rewards = torch.as_tensor(rewards)
    group_ids = torch.as_tensor(group_ids)
    if rewards.dim() != 1 or rewards.shape != group_ids.shape:
        shapes = f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)}"
        raise ValueError(f"{shapes} must both be (S,)")
    uniq, inv = torch.unique(group_ids, return_inverse=True)  # inv: (S,) group index in 0..P-1
    r = rewards.to(torch.float64)
    zeros = torch.zeros(len(uniq), dtype=torch.float64)  # (P,)
    count = zeros.index_add(0, inv, torch.ones_like(r))  # (P,) samples per group
    mean = zeros.index_add(0, inv, r) / count  # (P,)
    var = zeros.index_add(0, inv, (r - mean[inv]) ** 2) / count  # (P,) population variance
    return (var.sqrt() >= STD_FLOOR)[inv]


def length_penalty(lengths: torch.Tensor, max_len: int, cache_len: int) -> torch.Tensor:
    """(S,) float32 DAPO overlong penalty, A.10 Eq. 9: clip((L_max - |y|) / L_cache - 1, -1, 0).

    lengths: (S,) response lengths |y| in tokens. 0 up to max_len - cache_len tokens, then a linear
    ramp to -1 at max_len, -1 beyond (paper: L_max 14k, L_cache 2k); 0 < cache_len <= max_len
    (config.validate: --answer-budget >= 1, 0 < think_budget[0] <= think_budget[1]).
    dapo_length_penalty adds it to the reward of correct traces only (A.10)."""
    lengths = torch.as_tensor(lengths, dtype=torch.float64)
    return ((max_len - lengths) / cache_len - 1).clamp(-1.0, 0.0).to(torch.float32)  # A.10 Eq. 9


def drop_nonfinite_logp(groups) -> tuple[list, int]:
    """(groups, n): the groups without their rollouts whose behaviour log-prob (Completion.logp) is
    NaN or +-inf on a policy token (mask True), and n, how many rollouts were dropped (logged as
    gen/nonfinite_logp). That is a sampler fault: rho against such a log-prob is NaN or silently
    capped, and train.check_batch raises on it. Runs on rank 0 before collate, so advantages and
    aggregation weights are computed without the dropped rollouts; a group left with no rollout is
    dropped whole. Prints one warning line per dropped rollout naming its prompt (the data index,
    as in samples.jsonl) and the token's position in the completion. The input is not modified."""
    kept, dropped = [], 0
    for g in groups:
        keep = []
        for j, c in enumerate(g.completions):
            bad = (c.mask & ~torch.isfinite(c.logp)).nonzero()  # (n, 1) positions in the completion
            if len(bad):
                t = int(bad[0, 0])
                print(
                    f"warning: dropped rollout {j} of prompt {g.prompt.index}: behaviour log-prob "
                    f"{c.logp[t].item()} at completion token {t} (a sampler fault)",
                    flush=True,
                )
            else:
                keep.append(j)
        # a group keeps its place with fewer rollouts; its advantages use only those left
        dropped += len(g.completions) - len(keep)
        if len(keep) == len(g.completions):
            kept.append(g)
        elif keep:
            comps = [g.completions[j] for j in keep]
            rewards = [g.rewards[j] for j in keep]
            kept.append(dataclasses.replace(g, completions=comps, rewards=rewards))
    return kept, dropped


def has_variance(g) -> bool:
    """Whether a group's rewards differ (True: it is kept). A zero-variance group has zero advantage
    everywhere, so it adds nothing to the gradient (§3.2, Fig 6a; DAPO's dynamic sampling without
    the resampling)."""
    rewards = torch.tensor(g.rewards)
    # one group: every rollout gets group id 0; the mask (True: kept) is True on all or on none
    return bool(zero_variance_mask(rewards, torch.zeros(len(g.rewards))).any())


def dapo_length_penalty(groups, *, max_len: int, cache_len: int) -> list:
    """The groups with DAPO's overlong penalty (A.10 Eq. 9, length_penalty: 0, then a ramp to -1
    over the last cache_len tokens before max_len, the longest completion the sampler allows) added
    to the reward of each correct rollout (reward > 0: "added only to correct traces", A.10). The
    input is not modified."""
    out = []
    for g in groups:
        lengths = torch.tensor([len(c.completion_ids) for c in g.completions])
        pen = length_penalty(lengths, max_len, cache_len)  # (G,) float32
        rewards = torch.tensor(g.rewards, dtype=torch.float64)  # (G,)
        # in float64, as collate keeps rewards (the penalty itself is float32)
        shaped = torch.where(rewards > 0, rewards + pen.double(), rewards)
        out.append(dataclasses.replace(g, rewards=shaped.tolist()))
    return out


def task_weights(tasks: list[str], weights: dict[str, float] | None = None) -> dict[str, float]:
    """{task: weight} for prompts whose tasks are `tasks` ((N,) one name per prompt), in order of
    first appearance: `weights` as given (finite, >= 0, one > 0: config.parse_task_weights), or each
    task's number of prompts when None (as if the sources were one concatenated set). Raises
    ValueError naming a task of the data without a weight, or a weight for a task the data lacks."""
    names = list(dict.fromkeys(tasks))
    if weights is None:
        return {t: float(n) for t, n in collections.Counter(tasks).items()}
    missing = [t for t in names if t not in weights]
    if missing:
        raise ValueError(f"no weight for task {missing[0]} (its tasks: {', '.join(names)})")
    unknown = [t for t in weights if t not in names]
    if unknown:
        raise ValueError(f"no task {unknown[0]} in the data (its tasks: {', '.join(names)})")
    return {t: float(weights[t]) for t in names}


class AllRetired(RuntimeError):
    """No-Positive-Resampling retired every training prompt: nothing is left to sample. The
    pipeline ends its draws on it and train.py ends the run there, as a finished one."""


class PromptPool:
    """Which prompt to sample next: No-Positive-Resampling (§3.2, Fig 6b; Polaris) or uniform
    epochs.

    Each epoch visits every active prompt once in a fresh order, a permutation seeded by (seed,
    epoch), so a pool restored from `state_dict()` continues the same sequence.
    `policy="no_positive"`: `record` retires a prompt for good when its group's pass rate
    n_correct / n_total >= threshold, compared exactly (9 of 10 retires at 0.9, 15 of 16 retires,
    0 of 16 stays); `threshold` may be a float (read as its shortest decimal, so 0.9 is 9/10), a
    str ("9/10") or a Fraction. `policy="uniform"` never retires (the LOO baseline). Thread-safe:
    PipelineRL's producer calls `next()` while the trainer calls `record()`.

    Prompts drawn by `next()` and not yet `record`ed (in flight in the pipeline, or queued) are
    kept in draw order, and so are prompts handed back by `release()`; `state_dict()` saves them
    and a restored pool serves them before anything else. Long prompts are the ones in flight at a
    checkpoint, so losing them on a resume would bias training towards short ones."""

    def __init__(
        self, n_prompts: int, threshold: float = 0.9, policy: str = "no_positive", seed: int = 0
    ):
        if n_prompts < 1 or seed < 0:
            raise ValueError(f"need n_prompts >= 1 and seed >= 0, got {n_prompts}, {seed}")
        if policy not in ("no_positive", "uniform"):
            raise ValueError(f"policy must be 'no_positive' or 'uniform', got {policy!r}")
        # Fraction(0.9) is 0.9000000000000000222..., which 9/10 would not reach; the decimal
        # string is exact. In (0, 1]: config.validate's --npr-threshold rule.
        self.threshold = Fraction(str(threshold))
        self.n_prompts = n_prompts
        self.policy = policy
        self.seed = seed
        self._lock = threading.Lock()
        self._epoch = 0
        self._pos = 0  # next position in the epoch's order
        self._order = self._permutation(0)
        self._retired: set[int] = set()
        # drawn by next(), not yet recorded nor released (a multiset, in draw order)
        self._drawn: list[int] = []
        # to serve again before the epoch's order goes on (released, or unfinished in a restored
        # state)
        self._again: collections.deque[int] = collections.deque()

    def _permutation(self, epoch: int) -> list[int]:
        return np.random.default_rng([self.seed, epoch]).permutation(self.n_prompts).tolist()

    @property
    def num_active(self) -> int:
        """Prompts not retired."""
        return self.n_prompts - len(self._retired)

    def next(self) -> int:
        """Index of the next prompt to sample; retired prompts are skipped. Prompts handed back by
        `release()`, or unfinished when a restored state was saved, come first. Raises AllRetired
        when every prompt is retired (the policy solves the whole training set at the threshold:
        nothing left to learn from)."""
        with self._lock:
            if not self.num_active:
                raise AllRetired(
                    f"all {self.n_prompts} training prompts are retired (No-Positive-Resampling: "
                    f"a group's pass rate >= {float(self.threshold)}); a new run gets more steps "
                    "from more prompts (--data, --train-size), a higher --npr-threshold or "
                    "--prompt-sampling uniform"
                )
            while self._again:
                idx = self._again.popleft()
                if idx not in self._retired:
                    self._drawn.append(idx)
                    return idx
            while True:
                if self._pos == self.n_prompts:  # epoch boundary: reshuffle
                    self._epoch += 1
                    self._pos = 0
                    self._order = self._permutation(self._epoch)
                idx = self._order[self._pos]
                self._pos += 1
                if idx not in self._retired:
                    self._drawn.append(idx)
                    return idx

    def release(self, idx: int) -> None:
        """Hand back prompt `idx`, drawn by `next()`, whose group will never be recorded (the
        pipeline dropped it as stale): `next()` serves it again before the epoch's order goes on,
        so a slow prompt is not skipped for the epoch. A prompt that keeps going stale keeps coming
        back, at the cost of one group slot at a time. Raises ValueError when `idx` is not drawn
        and unrecorded."""
        idx = operator.index(idx)
        with self._lock:
            if idx not in self._drawn:
                raise ValueError(f"release({idx}): prompt {idx} is not drawn and unrecorded")
            self._drawn.remove(idx)
            self._again.append(idx)

    def record(self, idx: int, n_correct: int, n_total: int) -> None:
        """Record a scored group of prompt `idx`: n_correct of n_total rollouts correct. With
        "no_positive", retire the prompt when n_correct / n_total >= threshold (exact integers). The
        group itself still trains this step: the caller already holds it. One draw of `idx`, if any
        is unfinished, is finished (a prompt may also be recorded without a draw). Integer-like
        arguments (numpy, 0-d torch) are taken as ints; a float raises TypeError. Raises ValueError
        on an unknown index or impossible counts."""
        # ints, or TypeError: a float count would defeat the exact comparison
        idx = operator.index(idx)
        n_correct = operator.index(n_correct)
        n_total = operator.index(n_total)
        if not (0 <= idx < self.n_prompts and 0 <= n_correct <= n_total and n_total > 0):
            raise ValueError(
                f"bad record: idx={idx} (n_prompts={self.n_prompts}), {n_correct}/{n_total} correct"
            )
        with self._lock:
            if idx in self._drawn:
                self._drawn.remove(idx)  # its first draw: equal indices are interchangeable
            # n_correct / n_total >= threshold, in integers (§3.2)
            t = self.threshold
            easy = n_correct * t.denominator >= t.numerator * n_total
            if self.policy == "no_positive" and easy:
                self._retired.add(idx)

    def state_dict(self) -> dict:
        """JSON-serialisable state: position in the epoch's order, retired prompts, and the
        unfinished prompts (handed back, then drawn and not yet recorded), which a restored pool
        serves first."""
        with self._lock:
            return {
                "n_prompts": self.n_prompts,
                "seed": self.seed,
                "epoch": self._epoch,
                "pos": self._pos,
                "retired": sorted(self._retired),
                "unfinished": [*self._again, *self._drawn],
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output; threshold and policy stay as constructed. The saved
        unfinished prompts are served first, in their order (a state saved before they were kept
        has none; the per-prompt "correct" and "total" counts of older states are ignored). Raises
        ValueError when the state belongs to a different pool (n_prompts or seed differ), since the
        sequence could not continue."""
        if (state["n_prompts"], state["seed"]) != (self.n_prompts, self.seed):
            raise ValueError(
                f"state is for n_prompts={state['n_prompts']}, seed={state['seed']}; this pool has "
                f"n_prompts={self.n_prompts}, seed={self.seed}"
            )
        with self._lock:
            self._epoch = state["epoch"]
            self._pos = state["pos"]
            self._order = self._permutation(self._epoch)
            self._retired = set(state["retired"])
            self._again = collections.deque(state.get("unfinished", []))
            self._drawn = []


class TaskPools:
    """Sampling by task (note 5): one PromptPool per task, with `threshold`, `policy` and `seed`;
    `next()` draws task t with probability w_t / sum(w) over the tasks with weight > 0 and a
    prompt not retired, then that task's pool draws the prompt. tasks: (N,) the task of each
    prompt; indices in and out are positions in it. weights: see task_weights. Draw k uses the
    k-th double of numpy's generator seeded by `seed`, so a pool restored from `state_dict()`
    continues the same task sequence. The same interface as PromptPool where the pipeline and
    train.py use it (next, release, record, num_active, n_prompts, state_dict, load_state_dict);
    thread-safe."""

    def __init__(self, tasks, weights=None, threshold=0.9, policy="no_positive", seed: int = 0):
        self.weights = task_weights(list(tasks), weights)
        self.members = {t: [i for i, x in enumerate(tasks) if x == t] for t in self.weights}
        # global index i -> (its task, its position j in that task's pool)
        self._where = {i: (t, j) for t, ids in self.members.items() for j, i in enumerate(ids)}
        self.pools = {
            t: PromptPool(len(ids), threshold, policy, seed) for t, ids in self.members.items()
        }
        self.n_prompts = len(tasks)
        self.seed = seed
        self._lock = threading.Lock()  # one draw (task, then prompt) is atomic against record()
        self._draws = 0  # doubles taken from the task stream, for state_dict
        self._rng = np.random.default_rng(seed)

    @property
    def num_active(self) -> int:
        """Prompts not retired, over every task."""
        return sum(pool.num_active for pool in self.pools.values())

    def next(self) -> int:
        """Index of the next prompt: a task drawn by weight among the live ones, then its pool's
        next prompt. Raises AllRetired when every task with weight > 0 is fully retired."""
        with self._lock:
            live = [t for t, w in self.weights.items() if w > 0 and self.pools[t].num_active]
            u = self._rng.random()  # taken even when it raises below, as state_dict counts it
            self._draws += 1
            if not live:
                drawn = ", ".join(t for t, w in self.weights.items() if w > 0)
                raise AllRetired(
                    f"every training prompt of every task with a weight > 0 ({drawn}) is retired "
                    "(No-Positive-Resampling); a new run gets more steps from more prompts "
                    "(--data, --train-size), --task-weights, a higher --npr-threshold or "
                    "--prompt-sampling uniform"
                )
            cum = np.cumsum([self.weights[t] for t in live])
            # u < 1, but u * total may round up to total: clamp to the last task
            k = min(int(np.searchsorted(cum, u * cum[-1], side="right")), len(live) - 1)
            task = live[k]
            return self.members[task][self.pools[task].next()]

    def _local(self, idx) -> tuple[str, int]:
        idx = operator.index(idx)
        if idx not in self._where:
            raise ValueError(f"bad record: idx={idx} (n_prompts={self.n_prompts})")
        return self._where[idx]

    def release(self, idx: int) -> None:
        """PromptPool.release for prompt `idx`: its task's pool serves it first when next drawn."""
        task, j = self._local(idx)
        with self._lock:
            self.pools[task].release(j)

    def record(self, idx: int, n_correct: int, n_total: int) -> None:
        """PromptPool.record for prompt `idx`, in its task's pool. Raises as PromptPool.record."""
        task, j = self._local(idx)
        with self._lock:
            self.pools[task].record(j, n_correct, n_total)

    def state_dict(self) -> dict:
        """JSON-serialisable: the number of task draws so far and each task's PromptPool state."""
        with self._lock:
            tasks = {t: pool.state_dict() for t, pool in self.pools.items()}
            return {
                "n_prompts": self.n_prompts,
                "seed": self.seed,
                "draws": self._draws,
                "tasks": tasks,
            }

    def load_state_dict(self, state: dict) -> None:
        """Restore `state_dict()` output. Raises ValueError when it belongs to other tasks, another
        seed or other task sizes (PromptPool.load_state_dict's check, per task)."""
        saved = (state.get("n_prompts"), state.get("seed"), list(state.get("tasks", [])))
        if saved != (self.n_prompts, self.seed, list(self.pools)):
            raise ValueError(
                f"state is for {state.get('n_prompts')} prompts of tasks "
                f"{list(state.get('tasks', []))}, seed {state.get('seed')}; these pools have "
                f"{self.n_prompts} of {list(self.pools)}, seed {self.seed}"
            )
        with self._lock:
            for t, pool in self.pools.items():
                pool.load_state_dict(state["tasks"][t])
            self._rng = np.random.default_rng(self.seed)
            self._rng.random(state["draws"])  # the same stream, advanced past the draws made
            self._draws = state["draws"]


def prompt_pool(tasks, weights=None, *, threshold=0.9, policy="no_positive", seed: int = 0):
    """The pool for prompts of `tasks` ((N,) one task name each): a PromptPool when there is one
    task (a single-task run draws exactly as before tasks existed), else TaskPools. Raises
    ValueError as task_weights, and as PromptPool."""
    weights = task_weights(list(tasks), weights)
    if len(weights) == 1:
        return PromptPool(len(tasks), threshold=threshold, policy=policy, seed=seed)
    return TaskPools(tasks, weights, threshold=threshold, policy=policy, seed=seed)
