"""Answers graded right, end to end: a gold as it appears in a real dataset file (GSM8K's
"#### 1,234", MATH's \\boxed{} solutions, integer and float answer columns in JSON, JSONL and
parquet) goes through data.py's loading (read_rows, build_prompts, thinking_mode) and
math_reward.math_rewards (real math-verify, in its workers) with a model's response; every expected
reward is decided by hand. Also the issue-14 reproductions: a model whose chat template has no
think block is graded without a </think> (through the pipeline, as train.py runs it), a float gold
0.00001 is not Euler's number, LaTeX thin spaces inside a number are digit grouping and never merge
two numbers."""

import asyncio
import json
import threading

import pytest
import torch

import filters
import generate
import pipeline
from tasks import data, math_reward, tiny

# no think block: Qwen3-Instruct-2507's generation prompt, in the tiny tokenizer's tokens
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

GSM8K = [  # (GSM8K "answer" cell, response, reward)
    ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72", "so \\boxed{72}", 1.0),
    ("She pays 1,000 + 234 = <<1000+234=1234>>1,234.\n#### 1,234", "\\boxed{1234}", 1.0),
    ("#### 1,234", "\\boxed{1,234}", 1.0),
    ("#### 1,234", "\\boxed{1{,}234}", 1.0),
    ("#### 1,234", "\\boxed{1\\,234}", 1.0),
    ("#### 1,234", "\\boxed{1234.0}", 1.0),
    ("#### 1,234", "\\boxed{\\$1,234}", 1.0),
    ("#### 1,234", "\\boxed{1.234}", 0.0),  # a European decimal comma read as a point: 1.234
    ("#### 1,234", "\\boxed{1235}", 0.0),
    ("#### 1,234,567", "\\boxed{1\\,234\\,567}", 1.0),
    ("#### 10,000", "\\boxed{10\\,000}", 1.0),  # issue 14: math-verify alone reads 10 * 0
    ("#### 10000", "\\boxed{10\\!000}", 1.0),
    ("#### 10000", "\\boxed{10\\ 000}", 1.0),
    ("#### 10000", "\\boxed{10\\;000}", 1.0),
    ("#### 10000", "\\boxed{10\\:000}", 1.0),
    ("#### 10000", "\\boxed{10~000}", 1.0),
    ("#### 10000", "\\boxed{10,\\!000}", 1.0),
    ("#### 10000", "\\boxed{10\\,000.00}", 1.0),
    ("#### 10000", "\\boxed{10 000}", 0.0),  # a bare space: two numbers, not one
    ("#### 1234.5", "\\boxed{1\\,234.5}", 1.0),
    ("#### 12", "\\boxed{1\\, 2}", 0.0),  # never merged into 12: a spacing command then a space
    ("#### 12", "\\boxed{1\\,2}", 0.0),  # a 1-digit group is no thousands group
    ("#### 1234", "\\boxed{12\\,34}", 0.0),
    ("#### -3", "\\boxed{-3}", 1.0),
    ("#### 18", "\\boxed{\\$18}", 1.0),
    ("#### 0.5", "\\boxed{\\frac{1}{2}}", 1.0),
]
MATH = [  # (MATH "solution" cell, response, reward)
    ("So $x = \\boxed{\\frac{3}{4}}$.", "\\boxed{0.75}", 1.0),
    ("$\\boxed{\\frac{\\sqrt{3}}{2}}$", "\\boxed{\\frac{\\sqrt3}{2}}", 1.0),
    ("$\\boxed{2\\sqrt{5}}$", "\\boxed{\\sqrt{20}}", 1.0),
    ("$\\boxed{2\\sqrt{5}}$", "\\boxed{2\\sqrt{3}}", 0.0),
    ("$\\boxed{(-\\infty, 3]}$", "\\boxed{(-\\infty,3]}", 1.0),
    ("$\\boxed{(-\\infty, 3]}$", "\\boxed{(-\\infty,3)}", 0.0),  # an open end is another set
    ("$\\boxed{[2, 5)}$", "\\boxed{[2,5)}", 1.0),
    ("$\\boxed{30^\\circ}$", "\\boxed{30}", 1.0),
    ("$\\boxed{30^\\circ}$", "\\boxed{30^{\\circ}}", 1.0),
    ("$\\boxed{50\\%}$", "\\boxed{50}", 1.0),
    ("$\\boxed{50\\%}$", "\\boxed{50\\%}", 1.0),
    ("$\\boxed{\\text{Evelyn}}$", "\\boxed{\\text{Evelyn}}", 1.0),
    ("$\\boxed{\\text{Evelyn}}$", "\\boxed{Evelyn}", 1.0),
    ("$\\boxed{\\text{Evelyn}}$", "\\boxed{\\text{Bob}}", 0.0),
    ("$\\boxed{\\text{(C)}}$", "\\boxed{C}", 1.0),
    ("$\\boxed{\\text{(C)}}$", "\\boxed{D}", 0.0),
    ("$\\boxed{10,\\!000}$", "\\boxed{10000}", 1.0),  # MATH's own thousands spelling
    ("$\\boxed{10\\,000}$", "\\boxed{10000}", 1.0),  # a gold with a thin space
    ("$\\boxed{(1,2)}$", "\\boxed{(1,\\ 2)}", 1.0),  # a pair with a LaTeX space stays a pair
    ("$\\boxed{(1,2)}$", "\\boxed{12}", 0.0),
    ("$\\boxed{-\\frac{1}{2}}$", "\\boxed{-0.5}", 1.0),
    ("$\\boxed{\\dfrac{1}{6}}$", "\\boxed{\\frac16}", 1.0),
    ("$\\boxed{x^2+1}$", "\\boxed{1+x^2}", 1.0),
]
NUMBERS = [  # (answer cell as a JSON / parquet number, response, reward)
    (0.00001, "\\boxed{0.00001}", 1.0),  # issue 14: the gold used to be "1e-05", read as e - 5
    (0.00001, "\\boxed{e-5}", 0.0),
    (0.00001, "\\boxed{10^{-5}}", 1.0),
    (0.00001, "\\boxed{1\\times 10^{-5}}", 1.0),
    (1e20, "\\boxed{10^{20}}", 1.0),  # used to be "1e+20", read as 20e + 1
    (1e20, "\\boxed{100000000000000000000}", 1.0),
    (3.0, "\\boxed{3}", 1.0),
    (2.5, "\\boxed{\\frac{5}{2}}", 1.0),
    (2.5, "\\boxed{2}", 0.0),
    (-0.75, "\\boxed{-\\frac34}", 1.0),
    (1234, "\\boxed{1,234}", 1.0),
    (1234, "\\boxed{1\\,234}", 1.0),
    (-7, "\\boxed{-7}", 1.0),
    (-7, "\\boxed{7}", 0.0),
]


def grade(prompts, responses):
    return math_reward.math_rewards(
        responses, [p.gold for p in prompts], thinking=prompts[0].thinking, timeout=20.0
    )


def load(path, tok):
    return data.load_prompts(path, tok, thinking=data.thinking_mode(tok), max_prompt_len=4096)


@pytest.fixture(scope="module")
def chatml_tok():
    tok = tiny.build_tokenizer()  # </think> is one token, as in Qwen3's vocabulary
    tok.chat_template = CHATML
    return tok


@pytest.fixture(scope="module", autouse=True)
def _close_pool():
    yield
    math_reward.close()


def test_gsm8k_and_math_golds_graded(tmp_path, chatml_tok):
    expected, got = [], []
    for name, key, table in (("gsm8k", "answer", GSM8K), ("math", "solution", MATH)):
        path = tmp_path / f"{name}.jsonl"
        rows = [{"question": f"{name} {i}", key: gold} for i, (gold, _, _) in enumerate(table)]
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        prompts = load(str(path), chatml_tok)
        assert len(prompts) == len(table) and not prompts[0].thinking
        got += grade(prompts, [response for _, response, _ in table])
        expected += [e for *_, e in table]
    assert got == expected


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_number_golds_from_files_graded(tmp_path, chatml_tok, fmt):
    rows = [{"question": f"n{i}", "answer": gold} for i, (gold, _, _) in enumerate(NUMBERS)]
    if fmt == "parquet":  # one arrow type per column: the ints and the floats in two files
        import pyarrow as pa
        import pyarrow.parquet as pq

        files = []
        for kind in (int, float):
            part = [r for r in rows if type(r["answer"]) is kind]
            files.append(str(tmp_path / f"{kind.__name__}.parquet"))
            pq.write_table(pa.Table.from_pylist(part), files[-1])
        order = [r for kind in (int, float) for r in rows if type(r["answer"]) is kind]
    else:
        text = json.dumps(rows) if fmt == "json" else "".join(json.dumps(r) + "\n" for r in rows)
        files, order = [str(tmp_path / f"n.{fmt}")], rows
        (tmp_path / f"n.{fmt}").write_text(text)
    prompts = [p for path in files for p in load(path, chatml_tok)]
    table = {f"n{i}": row for i, row in enumerate(NUMBERS)}
    assert [p.question for p in prompts] == [r["question"] for r in order]
    got = grade(prompts, [table[p.question][1] for p in prompts])
    assert got == [table[p.question][2] for p in prompts]


def test_thinking_decided_by_the_template_grades_the_answer():
    # tiny's template (Qwen3 hybrid) thinks: only the text after </think> counts, none means 0
    thinker = tiny.build_tokenizer()
    (p,) = data.build_prompts(
        [{"question": "2 + 2?", "answer": "4"}],
        thinker,
        thinking=data.thinking_mode(thinker),
        max_prompt_len=512,
    )[0]
    assert p.thinking
    responses = ["<think>2 + 2 = 4</think>\n\n\\boxed{4}", "2 + 2 = 4.\n\n\\boxed{4}"]
    assert math_reward.math_rewards(responses, [p.gold] * 2, thinking=p.thinking) == [1.0, 0.0]


class ScriptedSampler:
    """Stands in for generate.Sampler: every rollout is the same scripted text; records
    `thinking`."""

    version = 0

    def __init__(self, tok, text):
        self.tok, self.text, self.thinking = tok, text, []

    async def generate(self, prompt_ids, n=1, *, thinking=True, temperature=None):
        self.thinking.append(thinking)
        ids = self.tok.encode(self.text, add_special_tokens=False) + [self.tok.eos_token_id]
        T = len(ids)
        return [
            generate.Completion(
                list(prompt_ids),
                ids,
                torch.full((T,), -0.5),
                torch.ones(T, dtype=torch.bool),
                torch.zeros(T, dtype=torch.int64),
                "stop",
                False,
                False,
                self.text,
            )
            for _ in range(n)
        ]


def test_issue_reproduction_no_think_block_scores_through_the_pipeline(tmp_path, chatml_tok):
    # `</think>` is one token but the chat template opens no think block; the model answers and
    # stops.
    # Before: train.py set thinking from the vocabulary alone, so this scored 0.0 in every group.
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 2?", "answer": "4"}) + "\n")
    thinking = data.thinking_mode(chatml_tok)  # what train.py calls, with --thinking auto
    prompts = data.load_prompts(str(path), chatml_tok, thinking=thinking, max_prompt_len=512)
    assert not thinking and chatml_tok.decode(prompts[0].prompt_ids).endswith(
        "<|im_start|>assistant\n"
    )
    sampler = ScriptedSampler(chatml_tok, "2 + 2 = 4.\n\n\\boxed{4}")
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        with pipeline.Pipeline(
            sampler,
            prompts,
            filters.PromptPool(1),
            loop=loop,
            group_size=4,
            prompts_per_step=1,
            max_lag=0,
        ) as pipe:
            batch = pipe.get_batch(0, timeout=60)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()
    assert batch.groups[0].rewards == [1.0, 1.0, 1.0, 1.0]
    assert sampler.thinking and not any(sampler.thinking)  # one phase, no thinking budget
