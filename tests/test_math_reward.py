"""Pins math_reward.py: `extract_boxed` (balanced and escaped braces, last box wins, unclosed ->
None, 10k nesting); `ungroup_digits` (each LaTeX spacing command between thousands groups removed,
never two numbers merged); a table of response/gold verdicts decided by hand (equivalent forms,
wrong answers, thinking rules, last box wins, and no merging of several boxes into a set); the batch
path gives the same verdicts and grades repeats once; `pop_stats` counts gradings, unanswered
responses and timeouts, and resets; bad gold raises; hostile output (power towers, 100k-character
boxes, 10k nested braces, NUL bytes, lone surrogates, empty strings) scores 0.0 within timeout + a
few seconds; an overrunning worker is killed and replaced; a worker that died while idle costs no
wrong verdict; 8 threads at once; the pool starts one worker, `close()` reaps all, and no worker
outlives its parent (normal exit, SIGKILL while idle, SIGKILL while grading)."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from tasks import math_reward
from tasks.math_reward import extract_boxed, math_rewards

SLACK = 3.0  # seconds allowed on top of a timeout on a loaded 2-core machine
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, parent pid) of a live reward worker, or None when `pid` is gone, a zombie,
    or not a worker."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            is_worker = b"_worker_loop" in f.read()
    except OSError:
        return None
    return (fields[0], int(fields[1])) if is_worker and fields[0] != "Z" else None


def worker_pids(parent: int | None = None) -> set[int]:
    parent = parent or os.getpid()
    pids = {int(d) for d in os.listdir("/proc") if d.isdigit()}
    return {pid for pid in pids if (s := proc_state(pid)) is not None and s[1] == parent}


def wait_gone(pids: set[int], within: float) -> set[int]:
    """The pids still alive after waiting up to `within` seconds for them to exit."""
    deadline = time.monotonic() + within
    while (alive := {p for p in pids if proc_state(p) is not None}) and time.monotonic() < deadline:
        time.sleep(0.05)
    return alive


@pytest.fixture(scope="module", autouse=True)
def _close_pool():
    yield
    math_reward.close()


# ---------------------------------------------------------------- extract_boxed
@pytest.mark.parametrize(
    "text,expected",
    [
        ("so \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("\\boxed{1} then \\boxed{2}", "2"),  # last box wins
        ("\\boxed{1} then \\boxed{2", None),  # the last box is unclosed: a truncated answer
        ("no box here", None),
        ("", None),
        ("\\boxed {x^{2}}", "x^{2}"),  # space before the brace
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not group
        ("\\boxed{a\\\\}", "a\\\\"),  # a LaTeX line break before the closing brace
        ("\\boxed 5", None),  # no braces: not a box
        ("\\boxed{3} and \\boxed 5", "3"),
        ("\\boxed{}", ""),
        ("\\boxed{a}}}", "a"),
        ("\\boxed{\\boxed{7}}", "7"),
        ("\\fbox{1}", None),
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


def test_extract_boxed_hostile_sizes():
    deep = "{" * 10_000 + "1" + "}" * 10_000
    t = time.monotonic()
    assert extract_boxed("\\boxed{" + deep + "}") == deep
    assert extract_boxed("\\boxed{" + "9" * 100_000 + "}") == "9" * 100_000
    assert extract_boxed("\\boxed{" + "{" * 100_000) is None
    assert extract_boxed("\\boxed{1}" * 20_000) == "1"
    # linear scans; seconds would mean something quadratic crept in
    assert time.monotonic() - t < 5.0


# ---------------------------------------------------------------- ungroup_digits
@pytest.mark.parametrize(
    "text,expected",
    [
        ("10\\,000", "10000"),
        ("10\\!000", "10000"),
        ("10\\ 000", "10000"),
        ("10\\;000", "10000"),
        ("10\\:000", "10000"),
        ("10~000", "10000"),
        ("1\\,234\\,567", "1234567"),
        ("1\\,234\\,567.25", "1234567.25"),
        ("-1\\,234", "-1234"),
        ("\\$1\\,000 and 2\\;500\\;000", "\\$1000 and 2500000"),
        ("1\\, 2", "1\\, 2"),  # a space after the command: two numbers, kept apart
        ("1\\,2", "1\\,2"),  # a 1-digit group is no thousands group
        ("12\\,34", "12\\,34"),
        ("1\\,2345", "1\\,2345"),  # a 4-digit group
        ("1234\\,567", "1234\\,567"),  # a 4-digit lead
        ("0.123\\,456", "0.123\\,456"),  # grouped decimal places: left alone
        ("(1,\\ 234)", "(1,\\ 234)"),  # a tuple: the comma, not the space, separates
        ("(1,\\ 2)", "(1,\\ 2)"),
        ("x\\,y", "x\\,y"),
        ("10\\\\,000", "10\\\\,000"),  # a LaTeX line break, then a comma
        ("10,\\!000", "10,\\!000"),  # math-verify's own rule reads this one
    ],
)
def test_ungroup_digits(text, expected):
    assert math_reward.ungroup_digits(text) == expected


# ---------------------------------------------------------------- verdicts (decided by hand)
CASES = [  # (response, gold, thinking, reward)
    ("\\boxed{0.5}", "\\frac{1}{2}", False, 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", False, 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", False, 1.0),
    ("\\boxed{1,000}", "1000", False, 1.0),  # thousands separator
    ("\\boxed{1000}", "1,000", False, 1.0),
    ("\\boxed{42.0}", "42", False, 1.0),
    ("\\boxed{42}", "42.0", False, 1.0),
    ("\\boxed{3/4}", "0.75", False, 1.0),
    ("\\boxed{2\\sqrt{3}}", "\\sqrt{12}", False, 1.0),
    ("\\boxed{1+x}", "x+1", False, 1.0),
    ("\\boxed{\\{2,1\\}}", "\\{1,2\\}", False, 1.0),
    ("\\boxed{10\\%}", "10", False, 1.0),
    ("\\boxed{\\$18}", "18", False, 1.0),
    ("\\boxed{5}", "$5$", False, 1.0),
    ("\\boxed{43}", "42", False, 0.0),
    ("\\boxed{-42}", "42", False, 0.0),
    ("\\boxed{3.14159}", "\\pi", False, 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.3", False, 0.0),
    ("The answer is 42.", "42", False, 0.0),  # no box, no answer
    ("\\boxed{42", "42", False, 0.0),  # unclosed
    ("\\boxed{}", "42", False, 0.0),
    ("\\boxed{7}, no wait: \\boxed{8}", "8", False, 1.0),  # last box wins
    ("\\boxed{8}, no wait: \\boxed{7}", "8", False, 0.0),
    (
        "\\boxed{1} and \\boxed{2}",
        "\\{1,2\\}",
        False,
        0.0,
    ),  # math-verify alone would merge the boxes into {1,2}
    ("so \\boxed{12}", "The answer is \\boxed{12}.", False, 1.0),  # a gold with a box
    ("<think>maybe \\boxed{41}</think>The answer is \\boxed{42}", "42", True, 1.0),
    (
        "<think>it is \\boxed{42}</think>The answer is \\boxed{41}",
        "42",
        True,
        0.0,
    ),  # only after </think> counts
    ("<think>it is \\boxed{42} and still thinking", "42", True, 0.0),  # never closed its thinking
    ("\\boxed{42}", "42", True, 0.0),  # no </think> at all
    ("<think>a</think>b</think>\\boxed{42}", "42", True, 1.0),  # the last </think> splits
    (
        "<think>a</think>\\boxed{42}</think>",
        "42",
        True,
        0.0,
    ),  # the box sits before the last </think>
    (
        "<think>a</think>\\boxed{42}</think>",
        "42",
        False,
        1.0,
    ),  # thinking off: the whole text counts
    ("<think>\\boxed{41}</think>\\boxed{42}", "42", False, 1.0),
]


@pytest.mark.parametrize("response,gold,thinking,expected", CASES)
def test_math_reward_table(response, gold, thinking, expected):
    assert math_reward.math_reward(response, gold, thinking=thinking) == expected


def test_math_rewards_batch_matches_table_and_grades_repeats_once():
    for thinking in (False, True):
        rows = [c for c in CASES if c[2] == thinking]
        assert math_rewards([r for r, *_ in rows], [g for _, g, *_ in rows], thinking=thinking) == [
            e for *_, e in rows
        ]
    math_reward.pop_stats()  # count from here on
    out = math_rewards(
        ["\\boxed{42}"] * 16 + ["\\boxed{41}"] * 15 + ["no box"], ["42"] * 32, thinking=False
    )
    assert out == [1.0] * 16 + [0.0] * 16
    assert math_reward.pop_stats() == {
        "reward/math_graded": 2,  # two distinct answers, two gradings
        "reward/math_timeouts": 0,
        "reward/math_worker_deaths": 0,
        "reward/math_no_answer": 1,  # "no box"
        "reward/math_too_long": 0,
    }
    assert set(math_reward.pop_stats().values()) == {0}  # reset by the call before
    assert math_rewards([], [], thinking=False) == []


def test_bad_gold_and_arguments_raise():
    with pytest.raises(ValueError, match="gold answer"):
        math_reward.math_reward("\\boxed{1}", "", thinking=False)
    with pytest.raises(ValueError, match="gold answer"):
        math_reward.math_reward("\\boxed{1}", "answer \\boxed{1", thinking=False)
    with pytest.raises(ValueError, match="gold answers"):
        math_rewards(["\\boxed{1}"], ["1", "2"])
    with pytest.raises(ValueError, match="timeout"):
        math_reward.math_reward("\\boxed{1}", "1", timeout=0)


# ---------------------------------------------------------------- hostile output
HOSTILE = {
    "power tower": "\\boxed{9^{9^{9^{9}}}}",
    "100k-char box": "\\boxed{" + "9" * 100_000 + "}",
    "10k nested braces": "\\boxed{" + "{" * 10_000 + "1" + "}" * 10_000 + "}",
    # these two are under MAX_ANSWER_CHARS: a worker's problem, not the length cap's
    "300 nested braces": "\\boxed{" + "{" * 300 + "1" + "}" * 300 + "}",
    "400-term sum": "\\boxed{" + "+".join(["1"] * 400) + "}",
    "unclosed 100k": "\\boxed{" + "{" * 100_000,
    "NUL bytes": "\\boxed{4\x002}\x00",
    "only NULs": "\x00" * 1000,
    "lone surrogates": "\\boxed{4\udc802\ud800}",
    "empty": "",
    "1M-char thinking": "<think>" + "a" * 1_000_000 + "</think>\\boxed{" + "\udcff" * 10 + "}",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_hostile_output_scores_zero_in_time(name):
    timeout = 2.0
    t = time.monotonic()
    assert (
        math_reward.math_reward(
            HOSTILE[name], "42", thinking=name.startswith("1M"), timeout=timeout
        )
        == 0.0
    )
    assert time.monotonic() - t < timeout + SLACK


def test_overrunning_worker_is_killed_and_replaced():
    # a started worker on top of the pool
    assert math_reward.math_reward("\\boxed{1}", "1", thinking=False) == 1.0
    before = worker_pids()
    math_reward.pop_stats()  # count from here on
    t = time.monotonic()
    # math-verify's alarm inside the worker is 1 s (its minimum), so our 0.5 s deadline lands
    # first: a kill
    assert math_reward.math_reward(HOSTILE["power tower"], "42", thinking=False, timeout=0.5) == 0.0
    assert time.monotonic() - t < 0.5 + SLACK
    assert math_reward.pop_stats()["reward/math_timeouts"] == 1
    assert len(before - worker_pids()) == 1  # exactly the overrunning worker is gone, and reaped
    assert (
        math_reward.math_reward("\\boxed{1}", "1", thinking=False) == 1.0
    )  # its slot starts a fresh one


def test_worker_that_died_idle_costs_no_wrong_verdict():
    math_rewards([f"\\boxed{{{i}}}" for i in range(8)], [str(i) for i in range(8)], thinking=False)
    pids = worker_pids()
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGKILL)  # as the OOM killer would
    assert wait_gone(pids, within=10) == set()
    math_reward.pop_stats()  # count from here on
    assert math_rewards(["\\boxed{0.5}", "\\boxed{3}"], ["\\frac12", "4"], thinking=False) == [
        1.0,
        0.0,
    ]
    assert math_reward.pop_stats()["reward/math_timeouts"] == 0


def test_eight_threads_at_once():
    rows = [c for c in CASES if not c[2]]
    results, errors = {}, []

    def grade(k):
        try:
            order = rows[k:] + rows[:k]  # each thread in its own order
            if k == 0:  # one thread takes the batch path meanwhile
                got = math_rewards(
                    [r for r, *_ in order], [g for _, g, *_ in order], thinking=False
                )
            else:
                got = [math_reward.math_reward(r, g, thinking=False) for r, g, *_ in order]
            results[k] = (got, [e for *_, e in order])
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=grade, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert errors == [] and len(results) == 8
    for got, expected in results.values():
        assert got == expected


# ---------------------------------------------------------------- pool lifetime
@pytest.mark.slow  # starts workers three times: ~8 s on a loaded 2-core machine
def test_pool_starts_light_and_close_reaps_every_worker():
    math_reward.close()
    assert worker_pids() == set()
    t = time.monotonic()
    assert math_reward.math_reward("\\boxed{1}", "1", thinking=False) == 1.0
    first_call = time.monotonic() - t
    assert math_reward.math_reward("\\boxed{2}", "2", thinking=False) == 1.0
    assert len(worker_pids()) == 1  # sequential calls reuse the started worker
    math_rewards(
        [f"\\boxed{{{i}}}" for i in range(20)], [str(i) for i in range(20)], thinking=False
    )
    assert 1 <= len(worker_pids()) <= math_reward.WORKERS
    pids = worker_pids()
    math_reward.close()
    assert wait_gone(pids, within=0) == set()  # killed and reaped before close() returns
    assert (
        math_reward.math_reward("\\boxed{3}", "3", thinking=False) == 1.0
    )  # a later call starts again
    print(f"first call, worker start included: {first_call:.2f} s")


CHILD = """
import os, signal, sys, threading, time
sys.path.insert(0, {root!r})
from tasks import math_reward
assert math_reward.math_reward("\\\\boxed{{1}}", "1", thinking=False) == 1.0
if sys.argv[1] == "kill-busy":  # a worker grading a power tower when its parent dies
    tower = "\\\\boxed{{9^{{9^{{9^{{9}}}}}}}}"
    threading.Thread(target=math_reward.math_reward, args=(tower, "42", False, 5.0)).start()
    time.sleep(0.5)
print("ready", flush=True)
sys.stdin.readline()
if sys.argv[1].startswith("kill"):
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode,within", [("exit", 2.0), ("kill", 10.0), ("kill-busy", 15.0)])
def test_no_worker_outlives_its_parent(mode, within):
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD.format(root=ROOT), mode],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "ready"
    pids = worker_pids(child.pid)
    assert pids
    child.stdin.write("go\n")
    child.stdin.flush()
    child.wait(timeout=30)
    child.stdin.close()  # an unclosed pipe's garbage collection can fail a later test
    child.stdout.close()
    # normal exit: atexit killed them; SIGKILL: their stdin hits EOF (after the in-flight item, if
    # any)
    assert wait_gone(pids, within=within) == set()
