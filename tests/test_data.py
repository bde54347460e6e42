"""data.py, sources.py, arith.py and heldout.py: column mapping in each file format (GSM8K "####"
answers, \\boxed{} solutions, key overrides), every kind of bad row skipped and counted, the all-bad
error, the held-out split (deterministic, disjoint, restored on resume), the arith task (solutions
graded right by math_reward.math_reward, wrong answers graded wrong, thinking lengths spanning the
warm start's interruption cuts and all below RL's budget, SFT and RL pools disjoint), the 100 real
GSM8K questions with their golds; thinking decided from the chat template (Qwen3 hybrid, no think
block, opened think block, DeepSeek-R1, a closed empty block, no template, a multi-token </think>)
and the eval warning; number golds written exactly and bad answers (bool, NaN, inf, lists) counted
in JSON, JSONL and parquet; files with a UTF-8 byte-order mark loading every row; a local path told
from a hub id (is_local_path, hand-picked names). Multi-task (issue 16): a mixture's prompts named
by source, questions of an earlier source dropped, its errors; the held-out split per task
(eval_size of each, by the documented draws, restored on resume) and --eval-size's rule
(loading.load_prompts: the error naming the short task); and arith-hard: every RL-pool item with
7-9 additions, graded right by its gold."""

import json
import os
import random
import re
from dataclasses import replace

import pytest

import config
from infra import loading
from tasks import arith, data, heldout, math_reward, tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# 100 GSM8K test questions with their answers (MIT, github.com/openai/grade-school-math)
GSM8K_100 = os.path.join(ROOT, "tests", "data", "gsm8k_100.jsonl")
ROWS = [  # (row, expected gold), written out by hand
    ({"question": "Q1", "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips.\n#### 72"}, "72"),
    ({"question": "Q2", "answer": "so\n#### 1,234"}, "1234"),
    ({"problem": "Q3", "solution": "Thus $x=\\boxed{\\frac{1}{2}}$."}, "\\frac{1}{2}"),
    ({"question": "Q4", "final_answer": " 7 ", "solution": "wrong \\boxed{8}"}, "7"),
    ({"question": "Q5", "answer": 12}, "12"),
]


@pytest.fixture(scope="module")
def tok():
    return tiny.build_tokenizer()


def write(path, rows, fmt):
    if fmt == "jsonl":
        with open(path, "w") as f:
            f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    elif fmt == "json":
        with open(path, "w") as f:
            json.dump(rows, f)
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


@pytest.mark.parametrize("fmt", ["jsonl", "json", "parquet"])
def test_column_mapping_and_golds_in_each_format(tmp_path, tok, fmt):
    # one mapping per file, chosen from the keys: split the fixtures by their question/answer
    # column pairs
    groups = [[ROWS[0], ROWS[1]], [ROWS[2]], [ROWS[3]]] + ([[ROWS[4]]] if fmt != "parquet" else [])
    for i, group in enumerate(groups):
        path = write(tmp_path / f"d{i}.{fmt}", [r for r, _ in group], fmt)
        prompts = data.load_prompts(path, tok, thinking=True, max_prompt_len=512)
        assert [p.gold for p in prompts] == [g for _, g in group]
        q = next(v for k, v in group[0][0].items() if k in ("question", "problem"))
        assert tok.decode(prompts[0].prompt_ids) == (
            f"<|im_start|>user\n{q}\n{data.INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
        )
        assert [p.index for p in prompts] == list(range(len(group)))


def test_key_override_and_thinking_off(tmp_path, tok):
    path = write(tmp_path / "d.jsonl", [{"q": "What?", "a": "5", "answer": "6"}], "jsonl")
    (p,) = data.load_prompts(
        path, tok, thinking=False, max_prompt_len=512, question_key="q", answer_key="a"
    )
    assert (p.question, p.gold, p.thinking) == ("What?", "5", False)
    assert tok.decode(p.prompt_ids).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )  # template's no-think


def test_bad_rows_skipped_and_counted(tmp_path, tok, capsys):
    rows = [
        {"question": "ok", "answer": "1"},
        "{not json",
        [1, 2],
        {"answer": "2"},
        {"question": "q", "answer": None},
        {"question": ["q"], "answer": "3"},
        {"question": "q2", "answer": {"v": 1}},
        {"question": "  ", "answer": "4"},
        {"question": "q3", "answer": "#### "},
        {"question": "q4", "answer": "\\boxed{5"},
        {"question": "ok", "answer": "9"},
        {"question": "x" * 600, "answer": "6"},
    ]
    path = write(tmp_path / "bad.jsonl", rows, "jsonl")
    prompts = data.load_prompts(path, tok, thinking=True, max_prompt_len=512)
    assert [(p.question, p.gold) for p in prompts] == [("ok", "1")]
    _, skipped = data.build_prompts(data.read_rows(path), tok, thinking=True, max_prompt_len=512)
    assert skipped == {
        "not a JSON object": 2,
        "missing question": 1,
        "missing answer": 1,
        "question not a string": 1,
        "answer not a string or number": 1,
        "empty question": 1,
        "empty answer": 2,
        "duplicate question": 1,
        "prompt too long": 1,
    }
    out = capsys.readouterr().out
    assert (
        out.count("data: 1 prompts") == 1 and "2 empty answer" in out and "1 prompt too long" in out
    )


def test_all_bad_file_fails_with_clear_error(tmp_path, tok):
    path = write(
        tmp_path / "allbad.jsonl", [{"text": "a"}, {"question": "", "answer": "1"}], "jsonl"
    )
    with pytest.raises(
        ValueError, match=r"allbad\.jsonl: no valid rows out of 2 .*1 missing question.*1 empty"
    ):
        data.load_prompts(path, tok, thinking=True, max_prompt_len=512)
    with pytest.raises(FileNotFoundError, match=r"nope\.jsonl: no such file"):
        data.load_prompts(str(tmp_path / "nope.jsonl"), tok, thinking=True, max_prompt_len=512)
    noanswer = write(tmp_path / "noanswer.jsonl", [{"question": "a", "result": "1"}] * 3, "jsonl")
    looked = "looked for final_answer, answer, solution; the rows have question, result"
    with pytest.raises(ValueError, match=rf"noanswer\.jsonl: no answer column: {looked}"):
        data.load_prompts(noanswer, tok, thinking=True, max_prompt_len=512)
    with pytest.raises(ValueError, match=r"the rows have question, result \(name it with --answer"):
        data.load_prompts(noanswer, tok, thinking=True, max_prompt_len=512, answer_key="gold")
    (tmp_path / "empty.jsonl").write_text("")
    with pytest.raises(ValueError, match=r"empty\.jsonl: no rows"):
        data.load_prompts(str(tmp_path / "empty.jsonl"), tok, thinking=True, max_prompt_len=512)
    with pytest.raises(ValueError, match="unknown data format '.csv'"):
        data.load_prompts(
            write(tmp_path / "d.csv", [], "json"), tok, thinking=True, max_prompt_len=512
        )


def test_is_local_path_a_path_or_an_existing_name_else_a_hub_id(tmp_path, monkeypatch):
    """Local: whatever exists (relative to the working directory) and whatever starts with ".",
    "/" or "~", found or not; anything else is a hub id. --data adds its extension rule on top,
    --model its presets and the org/name shape."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "org" / "model").mkdir(parents=True)
    (tmp_path / "x.jsonl").write_text('{"question": "q", "answer": "1"}\n')
    local = ["./missing", "../missing", ".hidden", "/no/such/dir", "~/missing", "~"]
    local += ["org", "org/model", "x.jsonl"]  # these exist here
    for name in local:
        assert data.is_local_path(name), name
    for name in ["org/name", "Qwen/Qwen3-8B", "gsm8k", "y.jsonl"]:
        assert not data.is_local_path(name), name
    # --data: a missing file name is still a file (its extension), never asked of the hub
    with pytest.raises(FileNotFoundError, match=r"^y\.jsonl: no such file"):
        data.read_rows("y.jsonl")
    assert data.read_rows("x.jsonl") == [{"question": "q", "answer": "1"}]
    # --model: a local directory, a hub id, or neither
    kinds = {m: config.model_kind(m) for m in ["org/model", "org/name", "./m", "gsm8k", "tiny"]}
    assert kinds == {
        "org/model": "dir",
        "org/name": "hub",
        "./m": "dir",
        "gsm8k": "unknown",
        "tiny": "preset",
    }


def test_heldout_split_deterministic_disjoint_and_restored(tmp_path, tok):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(50)]
    prompts, _ = data.build_prompts(rows, tok, thinking=True, max_prompt_len=512)
    train, held = heldout.split_heldout(prompts, 10, seed=3, run_dir=str(tmp_path))
    expected = set(random.Random(3).sample(range(50), 10))  # the documented rule, independently
    assert {p.index for p in held} == expected and len(train) == 40
    assert {p.question for p in train}.isdisjoint(p.question for p in held)
    assert heldout.split_heldout(prompts, 10, seed=3)[1] == held  # same seed, same split
    assert heldout.split_heldout(prompts, 10, seed=4)[1] != held
    # resume: the saved split wins even if the seed (or eval size) passed now differs
    train2, held2 = heldout.split_heldout(prompts, 5, seed=99, run_dir=str(tmp_path))
    assert held2 == held and train2 == train
    other, _ = data.build_prompts(
        rows[:49] + [{"question": "new", "answer": "1"}], tok, thinking=True, max_prompt_len=512
    )
    with pytest.raises(ValueError, match="different dataset"):
        heldout.split_heldout(other, 10, seed=3, run_dir=str(tmp_path))


def test_arith_solutions_graded_right_and_wrong_answers_wrong():
    items = [item for item, _ in zip(arith.arith_items(0), range(60), strict=False)]
    for item in items:  # gold by brute force, independent of the closed form in ArithItem
        x = item.start
        for _ in range(item.times):
            x += item.add
        assert item.gold == str(x) and 1 <= item.times <= arith.ARITH_MAX_ADDS and x <= 99
    sols = [arith.arith_solution(item) for item in items]
    assert math_reward.math_rewards(sols, [item.gold for item in items], timeout=30.0) == [
        1.0
    ] * len(items)
    wrong = [
        s.replace(f"\\boxed{{{i.gold}}}", f"\\boxed{{{int(i.gold) + 1}}}")
        for s, i in zip(sols, items, strict=True)
    ]
    assert math_reward.math_rewards(wrong, [item.gold for item in items], timeout=30.0) == [
        0.0
    ] * len(items)
    item = arith.ArithItem(start=18, add=7, times=2)
    assert item.question == "Add 7 to 18, 2 times." and item.gold == "32"
    assert arith.arith_solution(item) == "<think>\n2:18+7=25\n1:25+7=32\n</think>\n\n\\boxed{32}"
    sloppy = arith.arith_solution(
        item, slip=1.0, rng=random.Random(0)
    )  # every carry forgotten: 15, then 12
    assert sloppy == "<think>\n2:18+7=15\n1:15+7=12\n</think>\n\n\\boxed{12}"
    assert math_reward.math_reward(sloppy, item.gold, timeout=30.0) == 0.0


def test_arith_thinking_lengths_fit_the_budget_and_pools_are_disjoint(tok):
    lo, hi = arith.ARITH_SFT_CUT
    items = [item for item, _ in zip(arith.arith_items(1), range(2000), strict=False)]
    think = {}  # additions -> thinking tokens up to and including </think>
    for item in items:
        ids = tok(arith.arith_solution(item), add_special_tokens=False)["input_ids"]
        think.setdefault(item.times, []).append(
            ids.index(tok.convert_tokens_to_ids("</think>")) + 1
        )
    assert sorted(think) == list(range(1, arith.ARITH_MAX_ADDS + 1))
    assert (
        max(think[arith.ARITH_MAX_ADDS - 2]) < lo < max(think[arith.ARITH_MAX_ADDS - 1]) < hi
    )  # binds on the 2 hardest
    assert lo < max(think[arith.ARITH_MAX_ADDS]) <= hi
    # RL's interruption budget cuts no item's worked countdown, only rambling
    assert max(max(t) for t in think.values()) < arith.ARITH_THINK_BUDGET[0]
    assert max(think[1]) < min(think[arith.ARITH_MAX_ADDS])  # longer with difficulty
    sft = {i.question for i, _ in zip(arith.arith_items(1, "sft"), range(5000), strict=False)}
    assert sft.isdisjoint(i.question for i in items)
    with pytest.raises(ValueError, match="pool"):
        next(arith.arith_items(0, "test"))


def test_arith_preset_unique_and_seeded(tok):
    a = data.load_prompts("arith", tok, thinking=True, max_prompt_len=128, size=300, seed=5)
    assert len(a) == 300 == len({p.question for p in a})
    assert [p.question for p in a] == [
        p.question
        for p in data.load_prompts(
            "arith", tok, thinking=True, max_prompt_len=128, size=300, seed=5
        )
    ]
    assert tok.decode(a[0].prompt_ids).endswith(
        f"\n{arith.ARITH_INSTRUCTION}<|im_end|>\n<|im_start|>assistant\n"
    )
    with pytest.raises(
        ValueError, match="distinct items"
    ):  # the space is finite: a clear error, not a hang
        data.read_rows("arith", size=10_000)


def test_real_gsm8k_100(tok):
    prompts = data.load_prompts(GSM8K_100, tok, thinking=True, max_prompt_len=2048)
    with open(GSM8K_100) as f:
        rows = [json.loads(line) for line in f]
    assert len(prompts) == 100
    # golds, worked out independently: the text after "####" in each GSM8K solution, commas dropped
    assert [p.gold for p in prompts] == [
        r["solution"].split("####")[-1].strip().replace(",", "") for r in rows
    ]
    assert [p.question for p in prompts] == [r["question"] for r in rows]


# ---- thinking from the chat template (issue 14) ----

CHATML = (  # a chat template with no think block (Qwen3-Instruct-2507, SmolLM2, most chat models)
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TEMPLATES = {  # name -> (chat template, thinks?), each written here in the style of a real family
    "qwen3 hybrid (tiny's own)": (tiny.CHAT_TEMPLATE, True),
    "chatml, no think block (Qwen3-Instruct-2507)": (CHATML, False),
    "opens <think> (Qwen3-Thinking-2507, QwQ)": (
        CHATML.replace("assistant\n{%", "assistant\n<think>\n{%"),
        True,
    ),
    "deepseek-r1": (
        "{% for m in messages %}{% if m['role'] == 'user' %}<|User|>{{ m['content'] }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|Assistant|><think>\n{% endif %}",
        True,
    ),
    "hybrid with enable_thinking=True opening <think>": (
        CHATML.replace(
            "assistant\n{%",
            "assistant\n{% if enable_thinking is not defined or enable_thinking %}<think>\n"
            "{% endif %}{%",
        ),
        True,
    ),
    "always an empty, closed think block (thinking off for good)": (
        CHATML.replace("assistant\n{%", "assistant\n<think>\n\n</think>\n\n{%"),
        False,
    ),
    "smollm2 style: default system turn, no think block": (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nYou are a helpful AI assistant"
        "<|im_end|>\n{% endif %}" + CHATML,
        False,
    ),
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_thinking_mode_from_the_chat_template(name):
    template, thinks = TEMPLATES[name]
    tok = tiny.build_tokenizer()  # </think> is one token (id 260)
    tok.chat_template = template
    assert data.thinking_mode(tok) is thinks
    assert data.thinking_mode(tok, "on") is True and data.thinking_mode(tok, "off") is False


def test_thinking_needs_a_single_token_think_end_and_a_template(monkeypatch):
    tok = tiny.build_tokenizer()
    tok.chat_template = None  # a base model without a chat template
    assert data.thinking_mode(tok) is False
    monkeypatch.setattr(
        tiny, "THINK_TOKENS", []
    )  # the same byte tokenizer without <think> / </think>
    bytes_only = tiny.build_tokenizer()
    assert len(bytes_only.encode("</think>", add_special_tokens=False)) == 8
    assert data.thinking_mode(bytes_only) is False  # Qwen3's hybrid template, but </think> is 8 ids
    assert data.thinking_mode(bytes_only, "off") is False
    with pytest.raises(ValueError, match="not a single token"):
        data.thinking_mode(bytes_only, "on")
    with pytest.raises(ValueError, match="'auto', 'on' or 'off'"):
        data.thinking_mode(tok, "yes")


def test_thinking_warning_when_no_response_closed_its_thinking():
    def rec(text, interrupted=False):
        return {"text": text, "interrupted": interrupted}

    phrase = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
    never = [rec("2 + 2 = 4.\n\n\\boxed{4}"), rec("it is " + phrase + "\\boxed{4}", True)]
    msg = data.thinking_warning(never)
    assert msg.startswith("warning: thinking is on") and "none of the 2 eval" in msg
    assert "--thinking off" in msg
    assert data.thinking_warning([]) is not None
    assert data.thinking_warning(never + [rec("<think>2+2</think>\\boxed{4}")]) is None
    assert data.thinking_warning([rec("2+2</think>\\boxed{4}")]) is None  # the template opened it


# ---- golds written exactly, bad answers counted, byte-order marks (issue 14) ----

NUMERIC = [  # (answer cell, gold text), by hand
    (12, "12"),
    (-7, "-7"),
    (3.0, "3"),
    (0.00001, "0.00001"),  # str() gives "1e-05", which math-verify reads as e - 5
    (2.5e-7, "0.00000025"),
    (1e20, "100000000000000000000"),
    (0.1, "0.1"),
    (-2.5, "-2.5"),
    (123456789.125, "123456789.125"),
]
BAD_ANSWERS = [  # (answer cell, skip reason)
    (True, "answer is a bool"),
    (float("nan"), "answer not finite"),
    (float("inf"), "answer not finite"),
    (float("-inf"), "answer not finite"),
    ([4], "answer not a string or number"),
    ({"value": 4}, "answer not a string or number"),
    ("", "empty answer"),
    ("  ", "empty answer"),
]


@pytest.mark.parametrize("fmt", ["jsonl", "json"])
def test_numeric_golds_and_bad_answers_in_json(tmp_path, tok, fmt):
    rows = [{"question": f"n{i}", "answer": a} for i, (a, _) in enumerate(NUMERIC)]
    rows += [{"question": f"b{i}", "answer": a} for i, (a, _) in enumerate(BAD_ANSWERS)]
    rows += [{"question": "missing"}, {"question": "null", "answer": None}]
    path = write(
        tmp_path / f"d.{fmt}", rows, fmt
    )  # json.dump writes NaN / Infinity, as pandas does
    prompts, skipped = data.build_prompts(
        data.read_rows(path), tok, thinking=True, max_prompt_len=512
    )
    assert [p.gold for p in prompts] == [g for _, g in NUMERIC]
    expected = {"missing answer": 2}
    for _, why in BAD_ANSWERS:
        expected[why] = expected.get(why, 0) + 1
    assert skipped == expected
    # the digits as written in the file, not a double's: 0.1000000000000000055511 stays as written
    row = '{"question": "q", "answer": 0.1000000000000000055511}'
    with open(path, "w") as f:
        f.write(row if fmt == "jsonl" else f"[{row}]")
    (p,) = data.build_prompts(data.read_rows(path), tok, thinking=True, max_prompt_len=512)[0]
    assert p.gold == "0.1000000000000000055511"


def test_numeric_golds_from_parquet_columns_and_python_rows(tmp_path, tok):
    import decimal
    import fractions

    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {  # one answer column per arrow type, with a null in each: (values, type, golds)
        "int64": ([1234, None, -5], pa.int64(), ["1234", "-5"]),
        "float64": (
            [0.00001, 3.0, None, float("nan"), 1e20],
            pa.float64(),
            ["0.00001", "3", "100000000000000000000"],
        ),
        "float32": (
            [0.1, 2.5, None],
            pa.float32(),
            ["0.1", "2.5"],
        ),  # to_pylist: 0.10000000149011612
        "decimal": (
            [decimal.Decimal("1.50"), decimal.Decimal("-0.25")],
            pa.decimal128(6, 2),
            ["1.50", "-0.25"],
        ),
        "bool": ([True, False], pa.bool_(), []),
    }
    for name, (values, typ, golds) in columns.items():
        path = str(tmp_path / f"{name}.parquet")
        questions = [f"q{i}" for i in range(len(values))]
        pq.write_table(
            pa.table({"question": questions, "answer": pa.array(values, type=typ)}), path
        )
        prompts, skipped = data.build_prompts(
            data.read_rows(path), tok, thinking=True, max_prompt_len=512
        )
        assert [p.gold for p in prompts] == golds, name
        assert sum(skipped.values()) == len(values) - len(golds), name
    # rows built in Python (a fork's loader): numpy scalars, Fraction, Decimal
    rows = [
        {"question": "a", "answer": np.int64(42)},
        {"question": "b", "answer": np.float32(0.1)},
        {"question": "c", "answer": fractions.Fraction(3, 4)},
        {"question": "d", "answer": fractions.Fraction(-6, 3)},
        {"question": "e", "answer": decimal.Decimal("1E-5")},
        {"question": "f", "answer": np.bool_(True)},
        {"question": "g", "answer": decimal.Decimal("NaN")},
    ]
    prompts, skipped = data.build_prompts(rows, tok, thinking=True, max_prompt_len=512)
    assert [p.gold for p in prompts] == ["42", "0.1", "3/4", "-2", "0.00001"]
    assert skipped == {"answer is a bool": 1, "answer not finite": 1}


@pytest.mark.parametrize("newline", ["\n", "\r\n"])
def test_byte_order_mark_jsonl_and_json_load_every_row(tmp_path, tok, newline):
    rows = [
        {"question": "Combien font 2 + 2 ?", "answer": "4"},
        {"question": "√9 = ?", "answer": 3},
    ]
    lines = newline.join(json.dumps(r, ensure_ascii=False) for r in rows) + newline
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + lines.encode())
    (tmp_path / "bom.json").write_bytes(
        b"\xef\xbb\xbf" + json.dumps(rows, ensure_ascii=False).encode()
    )
    for name in ("bom.jsonl", "bom.json"):
        prompts = data.load_prompts(str(tmp_path / name), tok, thinking=True, max_prompt_len=512)
        assert [(p.question, p.gold) for p in prompts] == [
            ("Combien font 2 + 2 ?", "4"),
            ("√9 = ?", "3"),
        ]


# ---- several tasks (issue 16) ----


def test_mixture_tasks_are_sources_and_repeated_questions_dropped(tmp_path, tok, capsys):
    rows = lambda qs: [{"question": q, "answer": "1"} for q in qs]
    x = write(tmp_path / "x.jsonl", rows(["q0", "q1", "q2", "q3"]), "jsonl")
    y = write(tmp_path / "y.json", rows(["q2", "q4", "q3", "q5"]), "json")
    mixed = data.load_prompts(f"{x}+{y}", tok, thinking=False, max_prompt_len=512)
    # q2 and q3 are x's: y keeps q4 and q5; indices run over the mixture
    assert [(p.index, p.question, p.task, p.kind) for p in mixed] == [
        (0, "q0", "x", "math"),
        (1, "q1", "x", "math"),
        (2, "q2", "x", "math"),
        (3, "q3", "x", "math"),
        (4, "q4", "y", "math"),
        (5, "q5", "y", "math"),
    ]
    assert (
        f"data: {x}+{y}: tasks x 4, y 2 (2 repeats of a question dropped)"
        in capsys.readouterr().out
    )
    single = data.load_prompts(x, tok, thinking=False, max_prompt_len=512)
    assert {p.task for p in single} == {"math"}  # one source: the task is the kind
    with pytest.raises(ValueError, match="two sources give one task name"):
        data.load_prompts(f"{x}+{tmp_path / 'sub'}/x.jsonl", tok, thinking=False, max_prompt_len=9)
    z = write(tmp_path / "z.jsonl", rows(["q1", "q0"]), "jsonl")
    with pytest.raises(ValueError, match=f"{z}: every question is in an earlier source"):
        data.load_prompts(f"{x}+{z}", tok, thinking=False, max_prompt_len=512)
    assert data.task_name("org/name") == "name" and data.task_name("~/d/x.parquet") == "x"


def test_heldout_split_per_task_by_the_documented_draws_and_restored(tmp_path, tok):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(30)]
    prompts, _ = data.build_prompts(rows, tok, thinking=True, max_prompt_len=512)
    # tasks interleaved: a at positions 0, 3, 6, ... (10), b elsewhere (20)
    prompts = [replace(p, task="a" if p.index % 3 == 0 else "b") for p in prompts]
    train, held = heldout.split_heldout(prompts, 4, seed=2, run_dir=str(tmp_path))
    rng = random.Random(2)  # the documented rule: one generator, each task's positions in turn
    a, b = list(range(0, 30, 3)), [i for i in range(30) if i % 3]
    expected = {a[j] for j in rng.sample(range(10), 4)} | {b[j] for j in rng.sample(range(20), 4)}
    assert {p.index for p in held} == expected and len(train) == 22
    assert sorted(p.task for p in held) == ["a"] * 4 + ["b"] * 4
    assert heldout.split_heldout(prompts, 9, seed=0, run_dir=str(tmp_path))[1] == held  # restored


def test_heldout_split_with_train_size_samples_each_tasks_training_prompts_by_the_seed(tok):
    rows = [{"question": f"q{i}", "answer": str(i)} for i in range(30)]
    prompts, _ = data.build_prompts(rows, tok, thinking=True, max_prompt_len=512)
    prompts = [replace(p, task="a" if p.index % 3 == 0 else "b") for p in prompts]
    rng = random.Random(2)
    a, b = list(range(0, 30, 3)), [i for i in range(30) if i % 3]
    held = {a[j] for j in rng.sample(range(10), 2)} | {b[j] for j in rng.sample(range(20), 2)}
    capped, held3 = heldout.split_heldout(prompts, 2, seed=2, train_size=3)
    assert {p.index for p in held3} == held  # the held-out split does not depend on train_size
    # the documented rule, independently: one generator samples a's 8 then b's 18 training indices
    rng = random.Random("train-size 2")
    kept = set(rng.sample([i for i in a if i not in held], 3))
    kept |= set(rng.sample([i for i in b if i not in held], 3))
    assert [p.index for p in capped] == sorted(kept) and len(capped) == 6
    assert [p.task for p in capped].count("a") == 3
    # a cap above a task's count keeps all of it; another seed, other prompts
    train, _ = heldout.split_heldout(prompts, 2, seed=2)
    assert heldout.split_heldout(prompts, 2, seed=2, train_size=100)[0] == train
    assert heldout.split_heldout(prompts, 2, seed=5, train_size=3)[0] != capped


def test_eval_size_must_leave_every_task_a_training_prompt(tmp_path, tok):
    # loading.load_prompts' --eval-size rule (held out per task), before the run directory exists:
    # the smallest task is named
    rows = lambda qs: [{"question": q, "answer": "1"} for q in qs]
    x = write(tmp_path / "x.jsonl", rows(["q0", "q1", "q2"]), "jsonl")
    y = write(tmp_path / "y.jsonl", rows(["q3", "q4"]), "jsonl")
    args = config.Args(data=f"{x}+{y}", eval_size=2, max_prompt_len=512)
    with pytest.raises(config.BadInput) as info:
        loading.load_prompts(args, tok, False)
    assert info.value.code == 1
    assert (
        str(info.value)
        == f"--eval-size 2: must be less than the 2 prompts of task y of --data {x}+{y}"
    )
    assert len(loading.load_prompts(replace(args, eval_size=1), tok, False)) == 5
    one = replace(args, data=x, eval_size=3)
    with pytest.raises(
        config.BadInput, match=f"^--eval-size 3: must be less than the 3 prompts of --data {x}$"
    ):
        loading.load_prompts(one, tok, False)


def test_arith_hard_is_every_rl_item_with_7_to_9_additions(tok):
    hard = data.read_rows("arith-hard", seed=3)
    # independently: the RL stream of arith_items, read until it has shown every such item
    seen = {
        i.question
        for i, _ in zip(arith.arith_items(0, "rl"), range(300_000), strict=False)
        if i.times >= 7
    }
    assert sorted(r["question"] for r in hard) == sorted(seen) and len(hard) == 662
    assert [r["question"] for r in hard] != [r["question"] for r in data.read_rows("arith-hard")]
    prompts = data.load_prompts("arith-hard", tok, thinking=True, max_prompt_len=128, size=50)
    assert len(prompts) == 50 and {p.task for p in prompts} == {"math"}
    for p in prompts:  # gold = start + times * add, read back from the question
        add, start, times = map(
            int, re.fullmatch(r"Add (\d+) to (\d+), (\d+) times\.", p.question).groups()
        )
        assert times >= 7 and p.gold == str(start + times * add)
        item = arith.ArithItem(start, add, times)
        assert math_reward.math_reward(arith.arith_solution(item), p.gold, thinking=True) == 1.0
