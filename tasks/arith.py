"""`arith`, the synthetic task the embedded tiny model learns: "Add 7 to 18, 3 times.", worked in
one line of thinking per addition.

Paper: it stands in for Polaris-53K (A.3) on a CPU; forced interruptions (A.10) cut the rollouts
that think past the longest item's countdown. Exercised by
`python -m pytest tests/test_data.py -k arith` and by the default `python train.py`
(`--data arith`); tiny.py's warm start trains on its SFT pool.

Where this departs from the paper, and why:
1. A CPU cannot learn Polaris. Each line of thinking is opened by a countdown ("3:18+7=25"), so
   every step, the stop included, is a local decision a 0.4M-parameter model learns in a two-minute
   warm start; thinking length grows with the number of additions.
2. The interruption budget of RL (ARITH_THINK_BUDGET) lies past the longest item's thinking, so it
   cuts only rollouts that ramble (11% at R0, 1-2% once RL has taught the model to stop; issue 12;
   a budget that bound on correct countdowns broke the arithmetic: docs/history-presets.md). The
   warm start still cuts a tenth of its long traces at ARITH_SFT_CUT, so the model knows the format
   an interruption leaves.
3. Items are split by a hash of the question into an SFT pool (tiny.py's warm start) and an RL pool
   (train and held-out), so no held-out item is ever trained on.
4. `arith-hard`, every RL-pool item with 7-9 additions, is a second task for a CPU run:
   `--data arith-hard+arith` is two difficulty bands (7-9 additions, and the rest of arith's items).
"""

import random
import zlib
from collections.abc import Iterator
from dataclasses import dataclass

# Short: the tiny model pays for every prompt byte in each forward.
ARITH_INSTRUCTION = "Answer in \\boxed{}."
# The hardest arith item needs this many additions (lines of thinking).
ARITH_MAX_ADDS = 9
# Thinking tokens with </think>: 9 additions take 84-93, 8 take 78-83, 7 at most 73.
# RL's interruption budget (config.Args.think_budget): past every item, it cuts only rambling.
ARITH_THINK_BUDGET = (100, 110)
# The warm start's interruption cuts (tiny.warm_start_example): inside the 8-9-addition items.
ARITH_SFT_CUT = (80, 94)
# RL-pool items that data.load_prompts("arith") returns (train + held-out), of ~2,570 distinct.
ARITH_SIZE = 2000
# "arith-hard": the RL-pool items with at least this many additions (662).
ARITH_HARD_ADDS = 7


@dataclass(frozen=True)
class ArithItem:
    """Add `add` to `start`, `times` times; the answer is start + times * add."""

    start: int
    add: int
    times: int

    @property
    def question(self) -> str:
        return f"Add {self.add} to {self.start}, {self.times} times."

    @property
    def gold(self) -> str:
        return str(self.start + self.times * self.add)


def in_rl_pool(item: ArithItem) -> bool:
    """Is `item` in the RL pool (train.py's prompts and held-out) rather than the SFT pool
    (tiny.py's warm start)? Fixed by the lowest bit of the CRC32 of its question."""
    return (zlib.crc32(item.question.encode()) & 1) == 1


def arith_items(seed: int, pool: str = "rl", max_adds: int = ARITH_MAX_ADDS) -> Iterator[ArithItem]:
    """Infinite seeded stream of arith items with 1..max_adds additions (uniform), addends 2..9,
    totals <= 99.

    pool: "rl" (train.py's prompts and held-out) or "sft" (tiny.py's warm start); an item's pool is
    fixed by the CRC32 of its question (in_rl_pool), so the two never share an item. Items repeat
    (the RL pool has ~2,570 distinct items); data.load_prompts drops repeats. Raises ValueError for
    an unknown pool."""
    if pool not in ("rl", "sft"):
        raise ValueError(f"arith pool must be 'rl' or 'sft', got {pool!r}")
    rng = random.Random(seed)
    while True:
        # draw order (n, add, start) fixes the stream of every seed: keep it
        n = rng.randint(1, max_adds)
        add = rng.randint(2, 9)
        if n * add > 98:
            continue  # rejection sampling keeps the total <= 99 with a start >= 1
        item = ArithItem(rng.randint(1, 99 - n * add), add, n)
        if in_rl_pool(item) == (pool == "rl"):
            yield item


def arith_solution(item: ArithItem, *, slip: float = 0.0, rng: random.Random | None = None) -> str:
    """The worked solution, from `<think>` to the box:
    "<think>\\n2:18+7=25\\n1:25+7=32\\n</think>\\n\\n\\boxed{32}". Each line opens with how many
    additions are left, so the stop after line "1:" is a local decision.

    slip > 0 writes a sloppy teacher's trace (tiny.py's warm start only): at each addition that
    carries into the tens, the carry is forgotten with probability `slip` (18+7=15) and the chain
    goes on from the wrong total, so the boxed answer is wrong. The student then learns to be unsure
    exactly at the carries, which RL can fix."""
    x = item.start
    lines = []
    for left in range(item.times, 0, -1):
        y = x + item.add
        # rng is drawn only at a carry, so a slip-free trace consumes no randomness
        if slip and y // 10 != x // 10 and rng.random() < slip:
            y -= 10
        lines.append(f"{left}:{x}+{item.add}={y}\n")
        x = y
    return "<think>\n" + "".join(lines) + f"</think>\n\n\\boxed{{{x}}}"


def arith_rows(size: int = ARITH_SIZE, seed: int = 0) -> list[dict]:
    """The "arith" source: the first `size` distinct items of arith_items(seed, "rl") as
    {"question", "answer"} rows. Distinct, so data.load_prompts drops no repeat and returns exactly
    `size` prompts. Raises ValueError when the RL pool has fewer than `size` distinct items."""
    rows = []
    seen = set()
    # the item space is finite: stop looking after 200 draws per wanted item
    for item, _ in zip(arith_items(seed, "rl"), range(200 * size), strict=False):
        if item in seen:
            continue
        seen.add(item)
        rows.append({"question": item.question, "answer": item.gold})
        if len(rows) == size:
            return rows
    raise ValueError(
        f"arith: asked for {size} distinct items, found only {len(rows)} in the rl pool"
    )


def arith_hard_rows(size: int = ARITH_SIZE, seed: int = 0) -> list[dict]:
    """The "arith-hard" source: every RL-pool item with ARITH_HARD_ADDS..ARITH_MAX_ADDS additions
    (the space is small enough to list), shuffled by `seed`, the first `size` as rows."""
    items = [
        ArithItem(start, add, n)
        for n in range(ARITH_HARD_ADDS, ARITH_MAX_ADDS + 1)
        for add in range(2, 10)
        for start in range(1, 99 - n * add + 1)  # arith_items' ranges
    ]
    items = [item for item in items if in_rl_pool(item)]
    random.Random(seed).shuffle(items)
    return [{"question": item.question, "answer": item.gold} for item in items[:size]]
