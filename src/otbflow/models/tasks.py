"""Prompt sources: the built-in synthetic arithmetic task and local datasets in the layouts
users already have (``task.format``: prompt/answer, verl's RL Parquet, HF GSM8K, MATH), the
bound on a prompt's characters by the model's positions (``prompt_char_limit``) and ``task.chat``
(``chat_setting``).

The synthetic task is multi-step addition/subtraction with a scratchpad, so response length
grows with the number of operands::

    prompt   : 7+3-5=
    response : 7+3=10;10-5=5;#5<eos>

Everything is generated deterministically from a seed.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import polars as pl
from omegaconf import DictConfig

from otbflow.algorithms.rewards import last_boxed
from otbflow.io import SchemaError
from otbflow.registry import Entry, Registry, Requirement
from otbflow.runtime.policy_folder import model_config, model_positions
from otbflow.seeds import derive_seed, task_seed


def arithmetic_terms(rng: random.Random, min_terms: int, max_terms: int, tail: float | None = None) -> int:
    """The operands of one problem: uniform in ``min_terms..max_terms``; with ``tail`` (p,
    ``task.terms_tail``) ``min_terms`` + G, G ~ Geometric(p) on 0, 1, ... (P(G >= k) = (1 - p)^k,
    drawn by inverting it), capped at ``max_terms``."""
    if tail is None:
        return rng.randint(min_terms, max_terms)
    g = int(math.log(1.0 - rng.random()) / math.log(1.0 - tail)) if tail < 1 else 0
    return min(min_terms + g, max_terms)


def arithmetic_problem(
    rng: random.Random, min_terms: int, max_terms: int, max_operand: int, tail: float | None = None
) -> str:
    n = arithmetic_terms(rng, min_terms, max_terms, tail)
    parts = [str(rng.randint(0, max_operand))]
    for _ in range(n - 1):
        parts += [rng.choice("+-"), str(rng.randint(0, max_operand))]
    return "".join(parts) + "="


def arithmetic_solution(prompt: str, rng: random.Random | None = None, slip_rate: float = 0.0) -> tuple[str, str]:
    """(scratchpad response, answer) for a prompt like '7+3-5='. With ``slip_rate`` > 0 each step's
    result is, with that probability, off by 1 or 2 (drawn from ``rng``) and the scratchpad goes on
    from the slipped value, as a careless solver's would: a consistent but wrong demonstration."""
    expr = prompt.rstrip("=")
    tokens: list[str] = []
    num = ""
    for ch in expr:
        if ch in "+-" and num:
            tokens += [num, ch]
            num = ""
        else:
            num += ch
    tokens.append(num)
    acc = int(tokens[0])
    steps = []
    for op, b in zip(tokens[1::2], tokens[2::2]):
        new = acc + int(b) if op == "+" else acc - int(b)
        if slip_rate > 0 and rng.random() < slip_rate:
            new += rng.choice((-2, -1, 1, 2))
        steps.append(f"{acc}{op}{b}={new};")
        acc = new
    return "".join(steps) + f"#{acc}", str(acc)


def arithmetic_prompts(
    n: int,
    seed: int,
    min_terms: int,
    max_terms: int,
    max_operand: int,
    exclude: set[str] | None = None,
    tail: float | None = None,
) -> list[dict]:
    """``n`` distinct problems (prompt, answer, target) from ``seed``, none in ``exclude``; their
    operands drawn as ``arithmetic_terms`` draws them."""
    rng = random.Random(seed)
    seen = set(exclude or ())
    out: list[dict] = []
    attempts = 0
    while len(out) < n:
        attempts += 1
        if attempts > 50 * n + 1000:
            raise ValueError(
                f"cannot draw {n} distinct arithmetic problems with max_terms={max_terms}, "
                f"max_operand={max_operand}: raise task.max_terms or task.max_operand"
            )
        p = arithmetic_problem(rng, min_terms, max_terms, max_operand, tail)
        if p in seen:
            continue
        seen.add(p)
        target, answer = arithmetic_solution(p)
        out.append({"prompt": p, "answer": answer, "target": target})
    return out


@dataclass(frozen=True)
class Task(Entry):
    """A prompt source (``task.name``): ``obj`` is ``splits(cfg) -> (train, eval)`` prompt tables
    (``prompt_splits``), its options the task.* keys it reads beside task.seed and task.n_eval, and
    ``bootstrap`` whether the bootstrap stage builds and warm-starts a policy for it (otherwise
    model.path must name one)."""

    bootstrap: bool = False


TASKS = Registry("task", "task", entry=Task)
"""The prompt sources by name (task.name): the config's choices are this registry."""


@dataclass(frozen=True)
class Layout(Entry):
    """A dataset layout (``task.format``): ``obj`` is ``rows(df, path, prompt_template, source)``,
    the file's table as the columns of ``DATASET_COLUMNS``; ``columns`` the columns it needs, the
    prompt's first. 'auto' is ``detect_format``, which names the layout of a file."""

    columns: tuple[str, ...] = ()


DATASET_FORMATS = Registry("dataset format", "task", entry=Layout)
"""The dataset layouts by name (task.format): the config's choices are this registry."""


def read_dataset_file(path: str | Path) -> pl.DataFrame:
    """A local JSONL or Parquet file, as it is; one it cannot read fails naming the file and, for
    JSONL, the first line that is not UTF-8 or not a JSON object (``jsonl_rows``)."""
    path = Path(path)
    if not path.is_file():
        raise SchemaError(f"{path}: dataset file not found")
    if path.suffix in (".jsonl", ".json"):
        try:
            return pl.read_ndjson(path)
        except Exception as e:  # polars names neither the file nor, for bad bytes, the right line
            for _ in jsonl_rows(path):  # raises at the first bad line
                pass
            raise SchemaError(f"{path}: not readable as JSON lines ({e})") from None
    if path.suffix == ".parquet":
        try:
            return pl.read_parquet(path)
        except Exception as e:
            raise SchemaError(f"{path}: not a readable Parquet file ({e})") from None
    raise SchemaError(f"{path}: unsupported dataset format '{path.suffix}' (use .jsonl or .parquet)")


def jsonl_rows(path: Path) -> Iterator[dict]:
    """The JSON objects of a JSONL file, one per non-blank line (polars' rows), read line by line;
    SchemaError naming the file and the line (1-based) that is not UTF-8 or not a JSON object."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise SchemaError(
                    f"{path}: line {number}: not UTF-8 (byte 0x{line[e.start]:02x} at character {e.start + 1})"
                ) from None
            if not text.strip():
                continue
            try:
                row = json.loads(text)
            except json.JSONDecodeError as e:
                raise SchemaError(f"{path}: line {number}: not JSON ({e.msg} at character {e.colno})") from None
            if not isinstance(row, dict):
                raise SchemaError(f"{path}: line {number}: a JSON {type(row).__name__}, not an object")
            yield row


def _as_given(path: Path, df: pl.DataFrame, column: str) -> list:
    """The values of ``column`` as the file holds them: a JSONL file's, from its lines (polars
    reads a column that mixes strings and numbers as strings), a Parquet file's from ``df``."""
    if Path(path).suffix == ".parquet":
        return df[column].to_list()
    return [row.get(column) for row in jsonl_rows(Path(path))]


def _check_texts(path, column: str, values: list, what: str, strings_only: bool = True) -> None:
    """Refuse, naming the first row, values that are no string (``strings_only``) or empty."""
    if strings_only:
        bad = [i for i, v in enumerate(values) if not isinstance(v, str)]
        if bad:
            raise _bad_rows(path, column, bad, f"{values[bad[0]]!r} is not a string ({what} must be text)")
    bad = [i for i, v in enumerate(values) if not str(v).strip()]
    if bad:
        raise _bad_rows(path, column, bad, f"empty {what}")


@DATASET_FORMATS.register("auto", doc="the layout its columns show")
def detect_format(df: pl.DataFrame, path: str | Path) -> str:
    """The layout of a dataset from its columns (task.format: auto)."""
    cols = set(df.columns)
    if "prompt" in cols and isinstance(df.schema["prompt"], pl.List):
        return "verl"
    text_layouts = ("prompt_answer", "gsm8k", "math")  # told apart by their columns (verl by its prompt's type)
    for name in text_layouts:
        if set(DATASET_FORMATS[name].columns) <= cols:
            return name
    partial = [name for name in text_layouts if cols & set(DATASET_FORMATS[name].columns)]
    if len(partial) == 1:  # one layout's columns in part: name what it lacks
        need = DATASET_FORMATS[partial[0]].columns
        missing = next(c for c in need if c not in cols)
        raise SchemaError(f"{path}: missing column '{missing}' (the {partial[0]} layout needs {', '.join(need)})")
    raise SchemaError(
        f"{path}: cannot tell the dataset layout from its columns ({', '.join(df.columns)}): "
        "expected prompt + answer (prompt_answer), prompt as a list of messages + reward_model "
        "(verl), question + answer (gsm8k) or problem + solution (math); set task.format"
    )


ANSWER = "answer (an empty reference scores 0 against any response)"


def _bad_rows(path, column: str, bad: list[int], what: str) -> SchemaError:
    return SchemaError(f"{path}: column '{column}' row {bad[0]}: {what} ({len(bad)} rows)")


def _verl_rows(df: pl.DataFrame, path) -> pl.DataFrame:
    if not isinstance(df.schema["prompt"], pl.List) or not isinstance(df.schema["prompt"].inner, pl.Struct):
        raise SchemaError(
            f"{path}: column 'prompt' has dtype {df.schema['prompt']}; the verl layout needs a "
            "list of {role, content} messages"
        )
    fields = {f.name for f in df.schema["prompt"].inner.fields}
    for f in ("role", "content"):
        if f not in fields:
            raise SchemaError(f"{path}: column 'prompt' messages have no field '{f}' (verl: {{role, content}})")
    rm = df.schema["reward_model"]
    if not isinstance(rm, pl.Struct) or "ground_truth" not in {f.name for f in rm.fields}:
        raise SchemaError(
            f"{path}: missing column 'reward_model.ground_truth' (verl: reward_model is a struct "
            f"with ground_truth; got {rm})"
        )
    given = df["prompt"].to_list()
    bad = [i for i, msgs in enumerate(given) if any(not isinstance(m["content"], str) for m in msgs or [])]
    if bad:
        raise _bad_rows(path, "prompt", bad, "a message whose content is not a string")
    messages = [[{"role": str(m["role"]), "content": m["content"]} for m in msgs or []] for msgs in given]
    bad = [i for i, msgs in enumerate(messages) if not any(m["role"] == "user" for m in msgs)]
    if bad:
        raise _bad_rows(path, "prompt", bad, "no user message")
    prompts = [[m for m in msgs if m["role"] == "user"][-1]["content"] for msgs in messages]
    _check_texts(path, "prompt", prompts, "prompt (the last user message)")
    truth = df["reward_model"].struct.field("ground_truth")
    answers = [json.dumps(v) if isinstance(v, (list, dict)) else str(v) for v in truth.to_list()]
    bad = [i for i, v in enumerate(truth.to_list()) if v is None]
    if bad:
        raise _bad_rows(path, "reward_model.ground_truth", bad, "null")
    _check_texts(path, "reward_model.ground_truth", answers, ANSWER, strings_only=False)
    source = (
        df["data_source"].cast(pl.String).fill_null("verl").to_list()
        if "data_source" in df.columns
        else ["verl"] * df.height
    )
    return pl.DataFrame(
        {
            "prompt": prompts,
            "messages": [json.dumps(msgs, ensure_ascii=False) for msgs in messages],
            "answer": answers,
            "data_source": source,
        },
        schema=DATASET_COLUMNS,
    )


def apply_prompt_template(template: str, prompt: str) -> str:
    """``template`` with '{prompt}' replaced by ``prompt``; every other brace is literal (so
    'Answer in \\boxed{}. {prompt}' works), and so are braces in the prompt."""
    return template.replace("{prompt}", prompt)


def _text_rows(prompts: list, answers: list, source: list[str], template: str) -> pl.DataFrame:
    prompts = [apply_prompt_template(template, str(p)) for p in prompts]
    return pl.DataFrame(
        {
            "prompt": prompts,
            "messages": [user_message(p) for p in prompts],
            "answer": [str(a) for a in answers],
            "data_source": source,
        },
        schema=DATASET_COLUMNS,
    )


def user_message(prompt: str) -> str:
    """The ``messages`` of a plain-text prompt (schemas.PROMPTS): one user message, as JSON."""
    return json.dumps([{"role": "user", "content": prompt}], ensure_ascii=False)


def chat_setting(cfg: DictConfig) -> str:
    """task.chat as 'auto' | 'true' | 'false' (YAML's true/false arrive as 'True'/'False'): whether
    the prompts render through the policy's chat template (``otbflow.engines.prompts.use_chat``)."""
    return str(cfg.task.chat).lower()


PROMPT_CHARS_PER_POSITION = 64
"""The shard stage, and the rollout and evaluate jobs before they render, refuse a prompt of more
characters than this many per position of the model (``prompt_char_limit``): a prompt that fits
the positions averages a few characters a token, and one past this bound could never fit; it is
stopped before any tokenizer or GPU sees it."""


def prompt_char_limit(positions: int) -> int:
    """The most characters a prompt may have for a model of ``positions`` (the shard stage's bound
    and ``otbflow.engines.prompts.check_prompt_chars``')."""
    return PROMPT_CHARS_PER_POSITION * positions


def prompt_chars(messages: str) -> int:
    """A prompt's characters: those of its messages' contents (``messages``: the prompts table's
    JSON list of {role, content}), what the chat template renders."""
    return sum(len(m["content"]) for m in json.loads(messages))


DATASET_COLUMNS = {"prompt": pl.String, "messages": pl.String, "answer": pl.String, "data_source": pl.String}


def load_dataset_file(
    path: str | Path, fmt: str = "auto", prompt_template: str = "{prompt}", max_prompt_chars: int | None = None
) -> pl.DataFrame:
    """A local dataset in any layout of ``task.format`` as the columns prompt (text: the prompt
    after ``prompt_template``, or verl's last user message), messages (JSON list of {role,
    content}: what a chat template renders), answer (the reference the reward checks) and
    data_source. GSM8K answers are the text after '####' (commas removed), MATH answers the
    last \\boxed{} of the solution, verl's reward_model.ground_truth. A missing column or an
    answer that cannot be found fails naming the file and the column; a prompt whose messages
    hold more than ``max_prompt_chars`` characters (None: no limit) fails naming its row."""
    out, fmt = _dataset_rows(path, fmt, prompt_template)
    if max_prompt_chars is not None:
        sizes = [prompt_chars(s) for s in out["messages"].to_list()]
        bad = [i for i, n in enumerate(sizes) if n > max_prompt_chars]
        if bad:
            raise _bad_rows(
                path,
                DATASET_FORMATS[fmt].columns[0],
                bad,
                f"{sizes[bad[0]]:,} characters, more than {max_prompt_chars:,} ({PROMPT_CHARS_PER_POSITION} per "
                "position of the model: model.path's config.json, or model.n_positions): no such prompt fits "
                "its positions",
            )
    return out


def _dataset_rows(path: str | Path, fmt: str, prompt_template: str) -> tuple[pl.DataFrame, str]:
    """``load_dataset_file``'s table and the layout it read."""
    df = read_dataset_file(path)
    fmt = detect_format(df, path) if fmt == "auto" else fmt
    needed = DATASET_FORMATS[fmt].columns
    for col in needed:
        if col not in df.columns:
            raise SchemaError(f"{path}: missing column '{col}' (the {fmt} layout needs {', '.join(needed)})")
    for col in needed:
        nulls = df[col].null_count()
        if nulls:
            raise _bad_rows(path, col, df[col].is_null().arg_true().to_list(), "null")
    source = (
        df["data_source"].cast(pl.String).fill_null(fmt).to_list() if "data_source" in df.columns else [fmt] * df.height
    )
    return DATASET_FORMATS[fmt].obj(df, path, prompt_template, source), fmt


def _prompts(df: pl.DataFrame, path, column: str) -> list:
    """The text prompts of ``column``, refused where one is no string or empty."""
    prompts = _as_given(path, df, column)
    _check_texts(path, column, prompts, "prompt")
    return prompts


@DATASET_FORMATS.register("prompt_answer", columns=("prompt", "answer"))
def prompt_answer_rows(df: pl.DataFrame, path, prompt_template: str, source: list[str]) -> pl.DataFrame:
    """String columns prompt, answer."""
    if isinstance(df.schema["prompt"], pl.List):
        raise SchemaError(f"{path}: column 'prompt' holds lists (messages?): use task.format verl")
    prompts = _prompts(df, path, "prompt")
    answers = [str(a) for a in df["answer"].to_list()]
    _check_texts(path, "answer", answers, ANSWER, strings_only=False)
    return _text_rows(prompts, answers, source, prompt_template)


@DATASET_FORMATS.register("verl", columns=("prompt", "reward_model"))
def verl_rows(df: pl.DataFrame, path, prompt_template: str, source: list[str]) -> pl.DataFrame:
    """verl's RL Parquet: prompt a list of {role, content} messages, reward_model.ground_truth, data_source."""
    if prompt_template != "{prompt}":
        raise SchemaError(
            f"{path}: task.prompt_template applies to text prompts; this verl file's prompts "
            "are chat messages, used as they are (set task.prompt_template to '{prompt}')"
        )
    return _verl_rows(df, path)


@DATASET_FORMATS.register("gsm8k", columns=("question", "answer"))
def gsm8k_rows(df: pl.DataFrame, path, prompt_template: str, source: list[str]) -> pl.DataFrame:
    """HF GSM8K: question, and answer ending in '#### x'."""
    prompts = _prompts(df, path, "question")
    solutions = df["answer"].cast(pl.String).to_list()
    bad = [i for i, a in enumerate(solutions) if "####" not in a]
    if bad:
        raise _bad_rows(path, "answer", bad, "no '#### <answer>' line (GSM8K layout)")
    answers = [a.rsplit("####", 1)[1].strip().replace(",", "") for a in solutions]
    _check_texts(path, "answer", answers, ANSWER + " after '####'", strings_only=False)
    return _text_rows(prompts, answers, source, prompt_template)


@DATASET_FORMATS.register("math", columns=("problem", "solution"))
def math_rows(df: pl.DataFrame, path, prompt_template: str, source: list[str]) -> pl.DataFrame:
    """MATH: problem, and solution with the answer in its last \\boxed{}."""
    prompts = _prompts(df, path, "problem")
    boxed = [last_boxed(str(s)) for s in df["solution"].to_list()]
    bad = [i for i, b in enumerate(boxed) if b is None]
    if bad:
        raise _bad_rows(path, "solution", bad, "no \\boxed{} answer (MATH layout)")
    answers = [b.strip() for b in boxed]
    _check_texts(path, "solution", answers, ANSWER + " in its last \\boxed{}", strings_only=False)
    return _text_rows(prompts, answers, source, prompt_template)


@TASKS.register(
    "arithmetic", options=("n_train", "min_terms", "max_terms", "max_operand", "terms_tail"), bootstrap=True
)
def synthetic_splits(cfg: DictConfig) -> tuple[pl.DataFrame, pl.DataFrame]:
    """The built-in synthetic multi-step arithmetic task with a scratchpad."""
    t = cfg.task
    rows = arithmetic_prompts(
        t.n_train + t.n_eval,
        derive_seed(task_seed(cfg), "task"),
        t.min_terms,
        t.max_terms,
        t.max_operand,
        tail=t.terms_tail,
    )
    df = (
        pl.DataFrame(rows)
        .select("prompt", "answer")
        .with_columns(
            pl.col("prompt").map_elements(user_message, return_dtype=pl.String).alias("messages"),
            pl.lit("arithmetic").alias("data_source"),
        )
    )
    return df[t.n_eval :], df[: t.n_eval]


def max_prompt_chars(cfg: DictConfig) -> int | None:
    """The most characters a dataset prompt may have (``prompt_char_limit`` of model.path's
    positions, or without model.path of the built-in model's model.n_positions); None where
    model.path's config.json names no positions. The rollout and evaluate jobs check the same bound
    against their policy's positions before they render (``otbflow.engines.prompts.check_prompt_chars``)."""
    if cfg.model.path is None:
        return prompt_char_limit(cfg.model.n_positions)
    found = model_positions(model_config(cfg.model.path))
    return None if found is None else prompt_char_limit(found[0])


@TASKS.register(
    "dataset",
    options=("path", "eval_path", "format", "prompt_template"),
    requires=(Requirement("task.path", "a JSONL or Parquet file", lambda path, cfg: path is not None),),
)
def dataset_splits(cfg: DictConfig) -> tuple[pl.DataFrame, pl.DataFrame]:
    """Prompts and answers read from task.path (JSONL or Parquet, in a layout of task.format)."""
    t = cfg.task
    limit = max_prompt_chars(cfg)
    df = load_dataset_file(t.path, t.format, t.prompt_template, limit)
    df = df.sample(fraction=1.0, shuffle=True, seed=derive_seed(task_seed(cfg), "task"))
    if t.eval_path:
        return df, load_dataset_file(t.eval_path, t.format, t.prompt_template, limit)
    if df.height <= t.n_eval:
        raise ValueError(
            f"{t.path}: {df.height} rows cannot give task.n_eval={t.n_eval} eval rows and a training split"
        )
    return df[t.n_eval :], df[: t.n_eval]


def prompt_splits(cfg: DictConfig) -> tuple[pl.DataFrame, pl.DataFrame]:
    """(training prompts, eval prompts) of the task, shuffled and split with the prompt set's seed."""
    return TASKS[cfg.task.name].obj(cfg)
