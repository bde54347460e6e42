"""Math answer reward: the last \\boxed{} answer after </think>, checked against the gold answer
by math-verify.

Paper A.3 (the reward: Math-Verify on the final answer after stripping <think>...</think>).
Exercised by `python -m pytest tests/test_math_reward.py` and every `python train.py`. math-verify's
timeouts use signal.alarm, which works only in a main thread, and inputs like 9^{9^{9^{9}}} keep
sympy busy for minutes; so grading runs in worker processes owned by this module, each running
math-verify in its main thread with its own timeouts, and a worker that overruns its deadline is
killed and replaced. No call hangs, whatever the model wrote. `pop_stats()` gives the counts of
timeouts, dead workers and unanswered responses for the log.

Where this departs from the paper, and why:
1. Reward 1.0 / 0.0, not ±1: centred, std-normalised advantages are unchanged, and a group's mean
   is its pass rate.
2. Only the content of the last \\boxed{...} reaches math-verify (given a whole response it merges
   nearby boxes into a set). `\\boxed 5` (no braces) is no answer; answers over MAX_ANSWER_CHARS
   score 0 unparsed.
3. Workers are `subprocess` children, not multiprocessing spawn, which re-imports the parent's
   __main__ (train.py, torch, vLLM) in every worker.
4. `timeout` counts from when a started, free worker takes the item: the first call also waits
   ~1-2 s for a worker to start, and concurrent callers beyond WORKERS wait for a free one.
5. LaTeX spacing inside a number ("10\\,000", "1\\;234\\;567") is removed from both answers before
   math-verify, which reads "10\\,000" as 10 * 0; only digit grouping is undone, never two numbers
   merged (ungroup_digits).
"""

import atexit
import collections
import json
import logging
import os
import queue
import re
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait

WORKERS = min(8, os.cpu_count() or 1)  # pool size; set before the first call to change it
MAX_ANSWER_CHARS = 1000
# seconds for a worker to import math-verify; beyond it the machine is broken, so raise
STARTUP_TIMEOUT = 120.0
# bytes of address space per worker: a runaway sympy expression gets MemoryError, not the host
WORKER_MEMORY = 4 << 30
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository: tasks/..
_WORKER_CMD = (
    f"import sys; sys.path.insert(0, {ROOT!r}); "
    "from tasks import math_reward; math_reward._worker_loop()"
)
# graded / timeout / worker_died / no_answer / too_long since the last pop_stats()
_counts = collections.Counter()
_LOCK = threading.Lock()  # guards _counts and the module's pool
_BOX = re.compile(r"\\boxed\s*\{")
# LaTeX spacing written between digit groups: thin, negative thin, medium, normal, thick space, ~
_GROUP_SEP = r"(?:\\[,!: ;]|~)"
# A grouped number: a 1-3 digit lead, then groups of exactly 3 digits, each after one spacing
# command; not inside a longer number (no digit or decimal point before it, no digit after its
# last group).
_GROUPED = re.compile(rf"(?<![\d.])\d{{1,3}}(?:{_GROUP_SEP}\d{{3}})+(?!\d)")
_BRACE = re.compile(r"\\.|[{}]", re.DOTALL)
_DEPTH_STEP = {"{": 1, "}": -1}  # an escape pair (\\{, \\}, \\\\) is a character: step 0


def _count(key: str) -> None:
    with _LOCK:
        _counts[key] += 1


def pop_stats() -> dict[str, int]:
    """The grading counts since the last call, then reset to 0 (any thread), for the step's log.
    They cover every math_rewards call of this process, training and eval rollouts alike:
    reward/math_graded: distinct (gold, answer) pairs math-verify judged in time;
    reward/math_timeouts: distinct pairs that overran `timeout` (scored 0, worker killed);
    reward/math_worker_deaths: distinct pairs on which a worker died twice (scored 0);
    reward/math_no_answer: responses without a \\boxed answer (after </think>), scored 0 ungraded;
    reward/math_too_long: responses whose answer is over MAX_ANSWER_CHARS, scored 0 ungraded."""
    global _counts
    with _LOCK:
        counts = _counts
        _counts = collections.Counter()
    return {
        "reward/math_graded": counts["graded"],
        "reward/math_timeouts": counts["timeout"],
        "reward/math_worker_deaths": counts["worker_died"],
        "reward/math_no_answer": counts["no_answer"],
        "reward/math_too_long": counts["too_long"],
    }


def extract_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`, braces balanced (`\\boxed{\\frac{1}{2}}` ->
    `\\frac{1}{2}`).

    Escaped braces (`\\{`, `\\}`) do not count; whitespace may sit between `\\boxed` and `{`;
    `\\boxed 5` is not a box. None when there is no box or the last one is unclosed (a truncated
    answer). Linear time, no recursion, so hostile text (10k nested braces, 100k characters) is
    safe."""
    i = max((m.end() for m in _BOX.finditer(text)), default=0) - 1  # index of the last box's "{"
    if i < 0:
        return None
    depth = 0
    for m in _BRACE.finditer(text, i):
        depth += _DEPTH_STEP.get(m[0], 0)
        if depth == 0:
            return text[i + 1 : m.start()]
    return None


def ungroup_digits(text: str) -> str:
    """`text` with the LaTeX spacing that groups digits removed from each number: "10\\,000" ->
    "10000", "1\\,234\\,567.5" -> "1234567.5"; the commands are \\, \\! \\: \\; "\\ " and ~
    (math-verify reads "10\\,000" as 10 * 0). Only digit grouping is undone: a 1-3 digit group
    followed by groups of exactly 3 digits, so separate numbers are never merged ("1\\, 2",
    "12\\,34", "(1,\\ 2)" stay as they are). Decimal places grouped after the point are left
    alone."""
    return _GROUPED.sub(lambda m: re.sub(_GROUP_SEP, "", m[0]), text)


def _prepare(response: str, gold: str, thinking: bool) -> tuple[str, str] | None:
    """(gold answer, predicted answer) to grade, or None when the response scores 0 without
    grading."""
    gold_ans = extract_boxed(gold) if "\\boxed" in gold else gold
    if gold_ans is None or not gold_ans.strip():
        raise ValueError(
            f"gold answer has no usable content (empty, or an unclosed \\boxed): {gold[:80]!r}"
        )
    if thinking:  # never closing the thinking means no final answer
        response = response.rsplit("</think>", 1)[1] if "</think>" in response else ""
    pred = extract_boxed(response)
    if pred is None or not pred.strip():
        _count("no_answer")
        return None
    if len(pred) > MAX_ANSWER_CHARS:
        _count("too_long")
        return None
    return ungroup_digits(gold_ans), ungroup_digits(pred)


def _worker_loop() -> None:
    """Worker process: read one JSON [gold, pred, op_timeout] line per item from stdin, write b"1"
    or b"0"."""
    import resource

    out = os.dup(1)
    os.dup2(2, 1)  # stray prints from sympy go to stderr; fd `out` carries verdicts only
    logging.disable(logging.CRITICAL)  # math-verify logs every timeout, with the whole input
    hard = resource.getrlimit(resource.RLIMIT_AS)[1]
    # a negative hard limit is RLIM_INFINITY: ours applies alone; a soft limit may not exceed it
    soft = WORKER_MEMORY if hard < 0 else min(WORKER_MEMORY, hard)
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    from math_verify import parse, verify

    parse("\\boxed{1}")  # compile math-verify's regexes before reporting ready
    os.write(out, b"R")
    for line in sys.stdin:  # EOF (the parent closed us or died) ends the worker
        ok = False
        try:
            gold, pred, t = json.loads(line)
            # Main thread of this process, so math-verify's signal.alarm timeouts work; gold
            # first (math-verify's verify is asymmetric).
            ok = verify(
                parse(f"\\boxed{{{gold}}}", parsing_timeout=t),
                parse(f"\\boxed{{{pred}}}", parsing_timeout=t),
                timeout_seconds=t,
            )
        # timeout, MemoryError, RecursionError: hostile output is simply wrong
        except BaseException:
            pass
        os.write(out, b"1" if ok else b"0")


class _Worker:
    """One grading process, used by one thread at a time (it travels through the slot queue)."""

    def __init__(self):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _WORKER_CMD],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            start_new_session=True,  # no Ctrl-C tracebacks
        )
        self.ready = False

    def _read(self, timeout: float) -> bytes | None:
        """One byte; None on timeout, b"" at EOF. Poll-based, so any fd number works."""
        fd = self.proc.stdout.fileno()
        return os.read(fd, 1) if wait([fd], max(timeout, 0.0)) else None

    def grade(self, gold: str, pred: str, timeout: float) -> bool | None:
        """Verdict, or None when the worker overran `timeout` (then it must be killed). Raises
        BrokenPipeError when the worker is dead (killed while idle, or crashed on this input)."""
        if not self.ready and self._read(STARTUP_TIMEOUT) != b"R":
            raise RuntimeError(
                f"reward worker failed to start within {STARTUP_TIMEOUT:.0f} s (see its stderr)"
            )
        self.ready = True
        # math-verify's per-operation alarm sits well inside our deadline, so most overruns end
        # in the worker
        self.proc.stdin.write(json.dumps([gold, pred, max(1, int(timeout / 4))]).encode() + b"\n")
        self.proc.stdin.flush()  # OSError (BrokenPipeError) when the worker is dead
        verdict = self._read(timeout)
        if verdict == b"":
            raise BrokenPipeError("reward worker died")
        if verdict not in (b"0", b"1"):  # None: no verdict in time
            return None
        return verdict == b"1"

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()  # reaped: no zombie, no orphan


# WORKERS tokens: a running _Worker, or None (start on demand). LIFO reuses started workers first,
# so a light load keeps the pool small.
_SLOTS: queue.LifoQueue | None = None


def close() -> None:
    """Kill and reap the idle worker processes (all of them when no call is in flight); run at
    interpreter exit. Later calls start workers again. A worker busy in another thread at the time
    stays in the pool."""
    idle = []
    try:
        while _SLOTS is not None:
            idle.append(_SLOTS.get_nowait())
    except queue.Empty:
        pass
    for worker in idle:
        if worker is not None:
            worker.kill()
        _SLOTS.put(None)


atexit.register(close)


def _grade(pair: tuple[str, str], timeout: float) -> float:
    global _SLOTS
    with _LOCK:
        if _SLOTS is None:
            _SLOTS = queue.LifoQueue()
            for _ in range(WORKERS):
                _SLOTS.put(None)
        slots = _SLOTS
    worker = slots.get()  # blocks while all WORKERS are busy
    ok = None
    outcome = "timeout"
    try:
        # two tries: a worker can die idle (OOM killer) and still look alive until its exit
        # finishes
        for _ in range(2):
            if worker is None or worker.proc.poll() is not None:  # not started yet, or known dead
                worker = _Worker()
            try:
                ok = worker.grade(*pair, timeout)
                outcome = "graded" if ok is not None else "timeout"
                break
            # dead: retry once on a fresh worker; dying twice on one input scores it 0
            except OSError:
                worker.kill()
                worker = None
                outcome = "worker_died"
    finally:
        if ok is None and worker is not None:
            worker.kill()  # overran: a fresh one starts when the slot is next used
        slots.put(worker if ok is not None else None)
    _count(outcome)
    return 1.0 if ok else 0.0


def math_reward(response: str, gold: str, thinking: bool = True, timeout: float = 5.0) -> float:
    """1.0 if the last \\boxed{} answer of `response` equals `gold` under math-verify, else 0.0
    (paper A.3).

    thinking: only text after the last `</think>` counts, and a response without `</think>`
    scores 0. gold: a bare answer ("42", "\\frac{1}{2}") or text containing \\boxed{}; it is
    math-verify's first (gold) argument. timeout: seconds of grading (see departure 4). Safe from
    any thread; never raises or hangs on model output. Raises ValueError for an unusable gold,
    RuntimeError if a worker cannot start."""
    return math_rewards([response], [gold], thinking, timeout)[0]


def math_rewards(
    responses: list[str], golds: list[str], thinking: bool = True, timeout: float = 5.0
) -> list[float]:
    """`math_reward` over a batch -> len(responses) floats, graded in parallel on the pool, each
    distinct (gold, answer) pair once. Raises as `math_reward`, and ValueError on mismatched
    lengths. Returns within about `timeout` + honest grading work / WORKERS while at most WORKERS
    distinct answers overrun (each holds a worker)."""
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} gold answers")
    if not timeout > 0:
        raise ValueError(f"timeout must be > 0, got {timeout}")
    pairs = [_prepare(r, g, thinking) for r, g in zip(responses, golds, strict=True)]
    unique = list(dict.fromkeys(p for p in pairs if p))  # each distinct pair graded once
    with ThreadPoolExecutor(max(1, min(WORKERS, len(unique)))) as ex:
        verdicts = dict(zip(unique, ex.map(lambda p: _grade(p, timeout), unique), strict=True))
    return [verdicts[p] if p else 0.0 for p in pairs]
