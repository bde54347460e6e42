"""Code reward: a completion's last ```python block, run by sandbox.py against its problem's tests.

Paper §5, A.3 and A.13 (Table 1): the math+code runs train on Polaris and DeepCoder together, each
code completion graded by executing it against the problem's unit tests, reward 1 when all pass.
Exercised by `python -m pytest tests/test_code_reward.py`, `python bench/code_reward.py` and
`python train.py --data humaneval` (also `deepcoder`, `polaris+deepcoder`). `code_problem` turns a
dataset row into a prompt's question and its gold, a JSON tests document of one of three kinds:
- "check" (HumanEval, MBPP): `prelude` (HumanEval's prompt: imports, helpers, the stub) + the code,
  then `test`, then `check(<entry_point>)`; passing means nothing raised.
- "stdio" (DeepCoder / APPS / TACO programs): one run per input on stdin; the outputs come back here
  and are compared with `outputs` (`same_output`).
- "call" (DeepCoder / LiveCodeBench / TACO call-based): `fn_name`, a function or a method of
  `class Solution`, called with each argument list; the results come back as JSON, compared here.
Expected outputs of stdio and call tests never enter the sandbox, so code cannot read them there.

Where this departs from the paper and its sources, and why:
1. The reward is 1.0 / 0.0 with a reason per sample (REASONS), counted in train.py's metrics as
   `reward/code/<reason>`, so a run can tell missing code blocks from wrong logic.
2. A DeepCoder problem keeps its MAX_TESTS longest inputs (the strongest tests; rllm's grader keeps
   15), and `timeout` bounds a sample's whole run, all of its tests together.
3. Model code runs with the standard library only (`python -I -S`): numpy-style imports crash.
"""

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from decimal import Decimal, InvalidOperation

from tasks import sandbox

WORKERS = min(8, os.cpu_count() or 1)  # sandboxes at once; set before the first call
MAX_TESTS = 16  # tests kept per DeepCoder problem
REASONS = ("passed", "no_code", *sandbox.STATUSES[1:])  # passed, no_code, syntax_error, ...
FORMAT = "Give the complete {what} in one ```python code block."
_LOCK = threading.Lock()
_SLOTS: threading.BoundedSemaphore | None = None  # WORKERS, shared by every calling thread


def extract_code(response: str, thinking: bool) -> str | None:
    """The last closed fenced block tagged python / py / python3, or untagged, in `response` (after
    its last `</think>` when `thinking`; no `</think>` means no code), or None. Line-based: linear
    time."""
    if thinking:
        response = response.rsplit("</think>", 1)[1] if "</think>" in response else ""
    code = None
    lines = None  # the open block's lines so far; None outside a block
    lang = None  # the open block's tag
    for line in response.split("\n"):
        fence = line.strip()
        if lines is None and fence.startswith("```"):
            lang = fence[3:].strip().lower()
            lines = []
        elif lines is not None and fence == "```":
            if lang in ("", "python", "py", "python3"):
                code = "\n".join(lines) + "\n"
            lines = None
        elif lines is not None:
            lines.append(line)
    return code


def same_output(got: str, expected: str) -> bool:
    """stdio verdict: the same non-blank lines, each with the same whitespace-separated tokens, a
    token equal as text or as a finite decimal ("1.50" == "1.5"); surrounding whitespace does not
    count."""
    g = [line.split() for line in got.splitlines() if line.strip()]
    e = [line.split() for line in expected.splitlines() if line.strip()]

    def same_token(x: str, y: str) -> bool:
        # equal as text, or both finite decimals of equal value (_decimal gives None otherwise)
        return x == y or (_decimal(x) is not None and _decimal(x) == _decimal(y))

    return len(g) == len(e) and all(
        len(a) == len(b) and all(same_token(x, y) for x, y in zip(a, b, strict=True))
        for a, b in zip(g, e, strict=True)
    )


def _decimal(token: str) -> Decimal | None:
    try:
        value = Decimal(token)
    except (InvalidOperation, ValueError):
        return None
    return value if value.is_finite() else None


def grade(code: str | None, tests: dict, timeout: float = 5.0, sandboxed: bool = True) -> str:
    """The reason (REASONS) for one code block against one problem's tests (a parsed gold): "passed"
    when every test passes. Raises RuntimeError when sandboxed and no sandbox can be made
    (sandbox.check)."""
    if code is None:
        return "no_code"
    job = {k: v for k, v in tests.items() if k not in ("prelude", "outputs", "unwrap")}
    job["code"] = tests["prelude"] + "\n" + code if tests.get("prelude") else code
    status, outputs = sandbox.run(job, timeout, sandboxed)
    if status != "ok" or tests["kind"] == "check":
        return "passed" if status == "ok" else status
    expected = tests["outputs"]
    if not isinstance(outputs, list) or len(outputs) != len(expected):
        return "crash"
    if tests["kind"] == "stdio":
        ok = all(same_output(str(g), e) for g, e in zip(outputs, expected, strict=True))
    else:  # APPS stores a call's result wrapped in a list; its checker accepts the bare value too
        unwrap = tests.get("unwrap", False)
        ok = all(
            g == e or unwrap and isinstance(e, list) and len(e) == 1 and g == e[0]
            for g, e in zip(outputs, expected, strict=True)
        )
    return "passed" if ok else "wrong_answer"


def code_rewards(
    responses: list[str],
    golds: list[str],
    thinking: bool = True,
    timeout: float = 5.0,
    *,
    sandboxed: bool = True,
) -> tuple[list[float], list[str]]:
    """(rewards, reasons), one each per response: 1.0 when its last python block passes every test
    of its gold (a tests document from `code_problem`), else 0.0, and why (REASONS). Distinct (gold,
    code) pairs run once, in parallel, at most WORKERS sandboxes at once in this process. timeout:
    seconds for one sample's whole run. Safe from any thread; never raises on model output. Raises
    ValueError on mismatched lengths or a gold that is not a tests document, RuntimeError when
    sandboxed and no sandbox can be made here (sandbox.check)."""
    global _SLOTS
    if len(responses) != len(golds):
        raise ValueError(f"{len(responses)} responses but {len(golds)} golds")
    sandbox.check(sandboxed)  # raises, or warns once per process when unsafe
    with _LOCK:
        _SLOTS = _SLOTS or threading.BoundedSemaphore(WORKERS)
    tests = {g: _parse_gold(g) for g in set(golds)}
    pairs = [(g, extract_code(r, thinking)) for r, g in zip(responses, golds, strict=True)]
    unique = list(dict.fromkeys(pairs))

    def one(pair):
        with _SLOTS:
            return grade(pair[1], tests[pair[0]], timeout, sandboxed)

    with ThreadPoolExecutor(max(1, min(WORKERS, len(unique)))) as ex:
        verdicts = dict(zip(unique, ex.map(one, unique), strict=True))
    reasons = [verdicts[p] for p in pairs]
    return [float(r == "passed") for r in reasons], reasons


def _parse_gold(gold: str) -> dict:
    try:
        tests = json.loads(gold)
        ok = isinstance(tests, dict) and tests.get("kind") in ("check", "stdio", "call")
    except (ValueError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"code gold is not a tests document (code_problem): {gold[:80]!r}")
    return tests


# ---- problems: dataset rows -> (question, gold) --------------------------------------------------


def is_code_row(row: dict) -> bool:
    """A HumanEval (entry_point), MBPP (test_list) or DeepCoder (tests) row."""
    return any(k in row for k in ("entry_point", "test_list", "tests"))


def code_problem(row: dict) -> tuple[str, str]:
    """(question, gold) for a code row. HumanEval: prompt, test, entry_point. MBPP: text, test_list
    (+ test_setup_code). DeepCoder: problem, tests (JSON text or object: TACO's {"inputs",
    "outputs", "fn_name"}, or LiveCodeBench / PrimeIntellect's [{"input", "output", "testtype" or
    "type", "metadata": {"func_name"}}]), starter_code, metadata ({"func_name"}). question: the
    problem and the instruction to answer in one ```python block; gold: the tests document as JSON.
    Raises ValueError naming what is unusable (data.build_prompts counts it)."""
    try:
        if "entry_point" in row:
            prompt = row["prompt"].rstrip() + "\n"
            question = f"Complete this Python function:\n```python\n{prompt}```\n"
            question += FORMAT.format(what="function, with its imports,")
            tests = dict(
                kind="check", prelude=prompt, test=row["test"], entry_point=row["entry_point"]
            )
        elif "test_list" in row:
            test = "\n".join([row.get("test_setup_code") or "", *row["test_list"]])
            question = f"{row['text']}\nYour code should pass this test:\n{row['test_list'][0]}\n"
            question += FORMAT.format(what="function")
            tests = dict(kind="check", test=test, entry_point=None)
        else:
            question, tests = _deepcoder(row)
    except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
        raise ValueError(f"unusable code row ({type(e).__name__})") from None
    if not isinstance(question, str) or not question.strip():
        raise ValueError("unusable code row (no problem text)")
    return question, json.dumps(tests)


def _deepcoder(row: dict) -> tuple[str, dict]:
    raw = _json(row["tests"])
    meta = _json(row.get("metadata") or {})
    if isinstance(raw, dict):  # TACO / APPS
        cases = list(zip(raw["inputs"], raw["outputs"], strict=True))
        fn = raw.get("fn_name")
    else:  # LiveCodeBench / PrimeIntellect: a list of test objects
        cases = [(t["input"], t["output"]) for t in raw]
        first = raw[0]
        names = [first.get("fn_name"), (first.get("metadata") or {}).get("func_name")]
        call = first.get("testtype") == "functional" or first.get("type") == "function_call"
        fn = next((n for n in [*names, meta.get("func_name")] if n), None) if call else names[0]
    if not cases:
        raise ValueError("no tests")
    cases = sorted(cases, key=lambda c: len(json.dumps(c[0])), reverse=True)[:MAX_TESTS]
    starter = (row.get("starter_code") or "").strip()
    question = row["problem"].strip() + "\n\n"
    if starter:
        question += f"Start from this code:\n```python\n{starter}\n```\n"
    if not fn:
        question += "Read the input from standard input and write the answer to standard output. "
        text = lambda x: "\n".join(map(str, x)) if isinstance(x, list) else str(x)
        tests = dict(kind="stdio", inputs=[text(i) for i, _ in cases])
        tests.update(outputs=[text(o) for _, o in cases])
        return question + FORMAT.format(what="program"), tests
    # LiveCodeBench writes each argument as a JSON line and the result as JSON; TACO stores the
    # objects, each result wrapped in a list. LeetCode starters annotate with List, Optional: import
    # typing first.
    args = [
        i if isinstance(i, list) else [json.loads(a) for a in i.splitlines() if a] for i, _ in cases
    ]
    outs = [json.loads(o) if isinstance(i, str) else o for i, o in cases]
    tests = dict(kind="call", prelude="from typing import *\n", fn_name=fn, inputs=args)
    tests.update(outputs=outs, unwrap=isinstance(cases[0][0], list))
    return question + FORMAT.format(what=f"solution, with the function `{fn}`,"), tests


def _json(value):
    return json.loads(value) if isinstance(value, str) else value
