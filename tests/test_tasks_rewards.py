import json

import polars as pl
import pytest
from conftest import tiny_config

from otbflow import schemas
from otbflow.algorithms.rewards import (
    REWARDS,
    arithmetic_reward,
    extract_math_answer,
    fallback_math_reward,
    get_reward,
    marked_answer,
    math_reward,
)
from otbflow.io import SchemaError, read_table
from otbflow.models.tasks import (
    apply_prompt_template,
    arithmetic_prompts,
    arithmetic_solution,
    arithmetic_terms,
    load_dataset_file,
)
from otbflow.stages import shard


def test_arithmetic_solution_is_correct_and_lengths_vary():
    probs = arithmetic_prompts(200, seed=1, min_terms=2, max_terms=5, max_operand=9)
    for p in probs:
        assert int(p["answer"]) == eval(p["prompt"].rstrip("="))
        assert p["target"].endswith("#" + p["answer"])
        assert p["target"].count(";") == p["prompt"].count("+") + p["prompt"].count("-")
    lengths = {len(p["target"]) for p in probs}
    assert max(lengths) - min(lengths) >= 15  # variable-length responses
    assert arithmetic_solution("7+3-5=") == ("7+3=10;10-5=5;#5", "5")


def test_slipped_demonstrations_are_consistent_and_wrong_by_one_or_two():
    import random
    import re

    rng = random.Random(0)
    assert arithmetic_solution("7+3-5=", rng, 0.0) == ("7+3=10;10-5=5;#5", "5")
    for prompt in ("7+3-5=", "0-9+4-1+8=", "5+5="):
        scratch, answer = arithmetic_solution(prompt, rng, 1.0)  # every step slips
        steps = re.findall(r"(-?\d+)([+-])(\d+)=(-?\d+);", scratch)
        assert len(steps) == len(re.findall(r"[+-]\d", prompt.lstrip("-")))
        for i, (a, op, b, c) in enumerate(steps):
            exact = int(a) + int(b) if op == "+" else int(a) - int(b)
            assert abs(int(c) - exact) in (1, 2)
            if i:  # the scratchpad goes on from the slipped value
                assert int(a) == int(steps[i - 1][3])
        assert scratch.endswith(f"#{steps[-1][3]}") and answer == steps[-1][3]


def test_arithmetic_is_deterministic_and_distinct():
    a = arithmetic_prompts(50, 3, 2, 4, 9)
    assert a == arithmetic_prompts(50, 3, 2, 4, 9)
    assert a != arithmetic_prompts(50, 4, 2, 4, 9)
    assert len({p["prompt"] for p in a}) == 50
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic_prompts(1000, 0, 1, 1, 3)  # only 4 distinct problems exist


def test_a_tailed_task_draws_its_operands_from_the_capped_geometric():
    """task.terms_tail = p: operands min_terms + G, G ~ Geometric(p) on 0, 1, ..., capped at
    max_terms. The frequencies of 40,000 draws against the exact probabilities, P(G = k) =
    (1 - p)^k p and the cap taking the rest, each within 5 standard errors; the problems drawn have
    that many operands; null keeps the uniform draw (rng.randint), so the default task's problems
    are the ones drawn before the option existed."""
    import random
    from collections import Counter

    p, lo, hi, n = 0.35, 2, 9, 40_000
    rng = random.Random(0)
    counts = Counter(arithmetic_terms(rng, lo, hi, p) for _ in range(n))
    assert set(counts) <= set(range(lo, hi + 1))
    for k in range(lo, hi + 1):
        q = (1 - p) ** (k - lo) * p if k < hi else (1 - p) ** (hi - lo)
        assert abs(counts[k] / n - q) < 5 * (q * (1 - q) / n) ** 0.5, (k, counts[k] / n, q)
    assert Counter(arithmetic_terms(rng, lo, hi, 1.0) for _ in range(100)) == {lo: 100}
    a, b = random.Random(5), random.Random(5)
    assert [arithmetic_terms(a, 2, 4) for _ in range(100)] == [b.randint(2, 4) for _ in range(100)]
    operands = Counter(
        1 + sum(c in "+-" for c in row["prompt"]) for row in arithmetic_prompts(2000, 1, 2, 24, 99, tail=p)
    )
    assert operands[2] > operands[3] > operands[4] and max(operands) > 10


def test_rewards_registry():
    assert {"arithmetic", "math"} <= set(REWARDS)
    assert arithmetic_reward("7+3=10;10-5=5;#5", "5") == 1.0
    assert arithmetic_reward("7+3=10;10-5=5;#6", "5") == 0.0
    assert arithmetic_reward("no answer", "5") == 0.0
    with pytest.raises(ValueError, match="registered: arithmetic, digit_share, math"):
        get_reward("nope")


def test_the_digit_share_reward_counts_digits_whatever_the_answer():
    share = get_reward("digit_share")
    assert share("a1b2", "7") == 0.5 and share("12#3", "nope") == 0.75
    assert share("", "1") == 0.0 and share("no digits", "1") == 0.0


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so the answer is \\boxed{42}.", "42", 1.0),
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("Total: 1,234 apples\n#### 1234", "1234", 1.0),
        ("it is 7, no wait, 8", "8", 1.0),
        ("it is 7, no wait, 8", "7", 0.0),
        ("\\boxed{x+1}", "x+1", 1.0),
        ("nothing", "3", 0.0),
        ("#### 18", "Janet sells 16-3-4=9 eggs... #### 18", 1.0),  # GSM8K-style reference
    ],
)
def test_math_reward(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_extract_nested_boxed():
    assert extract_math_answer("\\boxed{\\frac{3}{4}} and later \\boxed{\\sqrt{2}}") == "\\sqrt{2}"


def test_shard_synthetic(data_dir, cfg):
    shards = [read_table(data_dir / "train" / f"shard_{s}.parquet", schemas.PROMPTS) for s in range(2)]
    ev = read_table(data_dir / "eval.parquet", schemas.PROMPTS)
    assert sum(s.height for s in shards) == cfg.task.n_train and ev.height == cfg.task.n_eval
    train_prompts = set(pl.concat(shards)["prompt"])
    assert not train_prompts & set(ev["prompt"])
    assert all((s["shard"] == i).all() for i, s in enumerate(shards))


def test_dataset_loader_and_split(tmp_path):
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i), "extra": i} for i in range(20)]
    pl.DataFrame(rows).write_ndjson(tmp_path / "d.jsonl")
    pl.DataFrame(rows).write_parquet(tmp_path / "d.parquet")
    assert load_dataset_file(tmp_path / "d.jsonl").columns == ["prompt", "messages", "answer", "data_source"]
    assert load_dataset_file(tmp_path / "d.parquet").height == 20
    pl.DataFrame({"question": ["x"]}).write_ndjson(tmp_path / "bad.jsonl")
    with pytest.raises(SchemaError, match="bad.jsonl: missing column 'prompt'"):
        load_dataset_file(tmp_path / "bad.jsonl", "prompt_answer")
    with pytest.raises(SchemaError, match="bad.jsonl: missing column 'answer' \\(the gsm8k layout needs question"):
        load_dataset_file(tmp_path / "bad.jsonl")
    pl.DataFrame({"text": ["x"], "answer": ["1"]}).write_ndjson(tmp_path / "other.jsonl")
    with pytest.raises(
        SchemaError, match="other.jsonl: cannot tell the dataset layout from its columns \\(text, answer\\)"
    ):
        load_dataset_file(tmp_path / "other.jsonl")
    cfg = tiny_config(
        "task.name=dataset",
        f"task.path={tmp_path / 'd.jsonl'}",
        "task.n_eval=5",
        "task.prompt_template='Q: {prompt} A:'",
    )
    shard.run(cfg, shard.Args(out_dir=str(tmp_path / "out")))
    ev = read_table(tmp_path / "out" / "eval.parquet", schemas.PROMPTS)
    tr = [read_table(tmp_path / "out" / "train" / f"shard_{s}.parquet", schemas.PROMPTS) for s in range(2)]
    assert ev.height == 5 and sum(t.height for t in tr) == 15
    assert ev["prompt"][0].startswith("Q: What is") and ev["prompt"][0].endswith(" A:")


# ------------------------------------------------------------------------------------------
# math: math-verify, and the fallback extractor where it parses nothing
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("so x = \\boxed{\\frac{3}{4}}", "0.75", 1.0),  # LaTeX fraction vs decimal
        ("\\boxed{\\dfrac{6}{8}}", "\\frac{3}{4}", 1.0),  # unsimplified fraction
        ("The answer is 3/4.", "\\frac{3}{4}", 1.0),  # plain fraction, no box
        ("\\boxed{\\frac{3}{5}}", "\\frac{3}{4}", 0.0),
        ("\\boxed{\\{3, 1, 2\\}}", "\\{1,2,3\\}", 1.0),  # sets, any order
        ("\\boxed{1, 2}", "\\{1,2,3\\}", 0.0),
        ("\\boxed{25\\%}", "0.25", 1.0),  # percentage
        ("\\boxed{5\\text{ cm}}", "5", 1.0),  # units in \text{}
        ("\\boxed{\\$1,200}", "1200", 1.0),  # currency and thousands separator
        ("\\boxed{\\sqrt{8}}", "2\\sqrt{2}", 1.0),  # symbolic equality
        ("\\boxed{x=3}", "3", 1.0),
        ("\\boxed{(1,2)}", "(1,2)", 1.0),
        ("The last step gives 17\n#### 17", "Janet sells 16-3-4=9... #### 17", 1.0),  # GSM8K reference
        ("\\boxed{7}", "We get $\\boxed{7}$.", 1.0),  # MATH solution reference
    ],
)
def test_math_reward_uses_math_verify(response, answer, expected):
    assert math_reward(response, answer) == expected


def test_math_verify_compares_what_the_fallback_cannot():
    assert math_reward("\\boxed{12}", "1, 2") == 0.0
    # the fallback reads 1/3 and 0.33 by value at 6 digits: unequal, and math-verify agrees; but it takes
    # "\\frac{1}{3}x" for a string and "1/3" for a number, where math-verify compares symbolically
    assert math_reward("\\boxed{\\frac{x}{3}}", "\\frac{1}{3}x") == 1.0
    assert fallback_math_reward("\\boxed{\\frac{x}{3}}", "\\frac{1}{3}x") == 0.0


def test_math_reward_falls_back_where_math_verify_parses_nothing():
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    unclosed = "so it is \\boxed{7"
    assert parse(unclosed, extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()]) == []
    assert math_reward(unclosed, "7") == 1.0 and math_reward(unclosed, "8") == 0.0  # last number, by value
    assert math_reward("no number at all", "7") == 0.0


def test_math_reward_works_off_the_main_thread():
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(math_reward, "\\boxed{\\frac{1}{2}}", "0.5").result() == 1.0


# GSM8K-format solutions, with <<a+b=c>> calculator notes and several numbers, that math-verify's
# free extraction misreads (the first: 18, from "answered" + a number; the second: 1800, from
# "answer"): the '#### x' marker decides instead, as verl's gsm8k reward reads it
GSM8K_SOLUTIONS = [
    (
        "Of the 45 students, 45 * 0.6 = <<45*0.6=27>>27 answered green, so 45 - 27 = <<45-27=18>>18 did not.\n"
        "Half of those, 18 / 2 = <<18/2=9>>9, answered red, and 18 - 9 = <<18-9=9>>9 answered yellow.\n#### 9",
        "9",
    ),
    ("To answer this, add the two rents: 1800+1400= <<1800+1400=3200>>3200\n#### 3200", "3200"),
    ("30 - 21 = <<30-21=9>>9 answered yellow.\n#### 9", "9"),  # the two excerpts
    ("1800+1400= <<1800+1400=3200>>3200\n#### 3200", "3200"),
    ("He pays 1,200 + 1,350 = <<1200+1350=2550>>2,550 dollars in all.\n#### 2,550", "2550"),  # thousands
    ("She has 12 - 4.5 = <<12-4.5=7.5>>7.5 cups left.\n#### $7.5", "7.5"),  # a $ before the number
]


@pytest.mark.parametrize("solution, answer", GSM8K_SOLUTIONS)
def test_the_gsm8k_marker_decides_the_answer(solution, answer):
    assert marked_answer(solution) == answer
    assert math_reward(solution, answer) == 1.0
    # a wrong final line scores 0 though the reference appears in the working
    wrong = solution.rsplit("####", 1)[0] + "#### 1"
    assert math_reward(wrong, answer) == 0.0
    # and a GSM8K solution as the reference (its '#### x' line) scores the same way
    assert math_reward(solution, solution) == 1.0


@pytest.mark.parametrize(
    "response, marked",
    [
        ("First \\boxed{3}, no wait: the answer is \\boxed{4}.", "4"),  # the last \boxed{}
        ("It is \\boxed{5}.\n#### 6", "6"),  # '#### x' before \boxed{}
        ("#### 2. Add the costs\n3 + 4 = 7, so the total is \\boxed{7}", "7"),  # a markdown heading: no marker
        ("#### Step 1\nThe total is 7.", None),
        ("The answer is 7.", None),  # no marker: math-verify's own extraction
        ("The answer is \\boxed{}", ""),  # an empty answer: marked, and scores 0
    ],
)
def test_the_marked_answer(response, marked):
    assert marked_answer(response) == marked


def test_the_marked_answer_is_the_one_compared():
    assert math_reward("First \\boxed{3}, no wait: the answer is \\boxed{4}.", "4") == 1.0
    assert math_reward("First \\boxed{3}, no wait: the answer is \\boxed{4}.", "3") == 0.0
    assert math_reward("It is \\boxed{5}.\n#### 6", "6") == 1.0
    assert math_reward("#### 2. Add the costs\n3 + 4 = 7, so the total is \\boxed{7}", "7") == 1.0
    assert math_reward("The answer is \\boxed{}", "7") == 0.0
    assert math_reward("The total is 7 apples.", "7") == 1.0  # no marker: as before


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("\\boxed{\\text{Bob}}", "\\text{Evelyn}", 0.0),  # a \text{} answer is its text, never ''
        ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),
        ("\\boxed{\\text{Evelyn}}", "Evelyn", 1.0),
        ("\\boxed{.5}", "5", 0.0),  # a leading point is a decimal point
        ("\\boxed{.5}", "0.5", 1.0),  # by value
        ("\\boxed{5.}", "5", 1.0),  # a closing full stop
        ("\\boxed{12}", "1,2", 0.0),  # only thousands separators are dropped
        ("\\boxed{1 2}", "12", 0.0),
        ("\\boxed{1,2}", "1,2", 1.0),
        ("\\boxed{1,234}", "1234", 1.0),
        ("\\boxed{1{,}234}", "1234", 1.0),
        ("\\boxed{5\\text{ cm}}", "5", 1.0),  # a unit after a value is dropped
        ("\\boxed{}", "", 0.0),  # empty answers equal nothing
        ("\\boxed{$.$}", ".", 0.0),  # nor mere punctuation
        ("The total is 3, 4 or 5", "5", 1.0),  # the last number
    ],
)
def test_the_fallback_never_matches_empty_or_mangled_answers(response, answer, expected):
    assert fallback_math_reward(response, answer) == expected


def test_the_math_reward_refuses_what_the_fallback_once_accepted():
    for response, answer in [("\\boxed{\\text{Bob}}", "\\text{Evelyn}"), ("\\boxed{.5}", "5"), ("\\boxed{12}", "1,2")]:
        assert math_reward(response, answer) == 0.0
    assert math_reward("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}") == 1.0
    assert math_reward("\\boxed{.5}", "0.5") == 1.0


# a power tower: verify's comparison runs sympy's big-integer arithmetic inside C, holding the GIL.
# math-verify's own limit (signal.alarm) stops it in the main thread only; from a thread the old
# reward never returned (killed after 40 s), and held up every other thread of the process meanwhile
PATHOLOGICAL = "\\boxed{9^{9^{9^{9}}}}"


def test_math_reward_has_a_hard_deadline_in_any_thread(monkeypatch):
    import time
    from concurrent.futures import ThreadPoolExecutor

    from otbflow.algorithms import rewards

    assert math_reward("\\boxed{2}", "2") == 1.0  # the worker is up
    first, timeouts = rewards._WORKER.proc.pid, rewards.reward_timeouts()
    monkeypatch.setattr(rewards, "MATH_VERIFY_TIMEOUT_S", 1.0)
    with ThreadPoolExecutor(1) as pool:
        start = time.monotonic()
        assert pool.submit(math_reward, PATHOLOGICAL, "1").result() == 0.0
        took = time.monotonic() - start
    assert 1.0 <= took < 10.0  # the deadline, plus the kill on a loaded machine; unbounded it does not end
    assert rewards.reward_timeouts() == timeouts + 1  # counted (issue 35: no silent zero)
    assert rewards._WORKER.proc is None  # killed; the next call starts another
    assert math_reward("\\boxed{\\frac{1}{2}}", "0.5") == 1.0
    assert rewards._WORKER.proc.pid != first


def test_the_fallback_runs_under_the_deadline_too(monkeypatch):
    """Issue 35: the fallback extractor ran in the calling process, after the worker's deadline, with
    none of its own. It runs in the worker now: the caller's copy is never called."""
    from otbflow.algorithms import rewards

    def in_the_caller(*args):
        raise AssertionError("the fallback ran in the calling process, outside the deadline")

    monkeypatch.setattr(rewards, "fallback_math_reward", in_the_caller)
    unclosed = "so it is \\boxed{7"  # math-verify parses nothing: the fallback decides
    assert math_reward(unclosed, "7") == 1.0 and math_reward(unclosed, "8") == 0.0
    assert math_reward("#### " + "." * 80_000 + "x", "1") == 0.0  # the payload, under the deadline


def test_a_forked_process_scores_with_its_own_worker():
    import os

    from otbflow.algorithms import rewards

    assert math_reward("\\boxed{2}", "2") == 1.0
    parent = rewards._WORKER.proc.pid
    pid = os.fork()
    if pid == 0:  # the child: a fresh worker, the parent's left alone
        ok = rewards._WORKER.proc is None and math_reward("\\boxed{3}", "3") == 1.0
        os._exit(0 if ok and rewards._WORKER.proc.pid != parent else 1)
    assert os.waitpid(pid, 0)[1] == 0
    assert rewards._WORKER.proc.pid == parent and math_reward("\\boxed{4}", "4") == 1.0


def test_prompt_template_braces_are_literal(tmp_path):
    assert apply_prompt_template("Answer in \\boxed{}. {prompt}", "What is {x}?") == "Answer in \\boxed{}. What is {x}?"
    pl.DataFrame({"prompt": ["1+1=", "2+2="], "answer": ["2", "4"]}).write_ndjson(tmp_path / "d.jsonl")
    df = load_dataset_file(tmp_path / "d.jsonl", "prompt_answer", "Put the answer in \\boxed{}.\n{prompt}")
    assert df["prompt"].to_list() == ["Put the answer in \\boxed{}.\n1+1=", "Put the answer in \\boxed{}.\n2+2="]
    cfg = tiny_config(
        "task.name=dataset", f"task.path={tmp_path / 'd.jsonl'}", "task.prompt_template='\\boxed{}: {prompt}'"
    )
    assert cfg.task.prompt_template == "\\boxed{}: {prompt}"


# ------------------------------------------------------------------------------------------
# Dataset layouts: a few-row fixture of each, through the shard stage
# ------------------------------------------------------------------------------------------


def write_layouts(d):
    """Fixtures in the layouts users have, as the public datasets spell them."""
    gsm8k = [
        {
            "question": f"Tom has {i} apples and buys {i + 1}. How many?",
            "answer": f"He has {i}+{i + 1}=<<{i}+{i + 1}={2 * i + 1}>>{2 * i + 1} apples.\n#### {2 * i + 1:,}",
        }
        for i in range(498, 508)
    ]
    pl.DataFrame(gsm8k).write_ndjson(d / "gsm8k.jsonl")
    math = [
        {
            "problem": f"Simplify $\\frac{{{i}}}{{{2 * i}}}$.",
            "level": "Level 1",
            "type": "Algebra",
            "solution": f"Divide: $\\frac{{{i}}}{{{2 * i}}} = \\boxed{{\\frac{{1}}{{2}}}}$ for {i}.",
        }
        for i in range(1, 11)
    ]
    pl.DataFrame(math).write_ndjson(d / "math.jsonl")
    verl = pl.DataFrame(
        {
            "data_source": ["openai/gsm8k"] * 10,
            "prompt": [
                [
                    {"role": "system", "content": "You are a calculator."},
                    {
                        "role": "user",
                        "content": f"What is {i}+1? Let's think step by step and output the final "
                        'answer after "####".',
                    },
                ]
                for i in range(10)
            ],
            "ability": ["math"] * 10,
            "reward_model": [{"style": "rule", "ground_truth": str(i + 1)} for i in range(10)],
            "extra_info": [{"split": "train", "index": i} for i in range(10)],
        }
    )
    verl.write_parquet(d / "verl.parquet")
    pl.DataFrame({"prompt": [f"{i}+{i}=" for i in range(10)], "answer": [str(2 * i) for i in range(10)]}).write_parquet(
        d / "plain.parquet"
    )


def shard_dataset(tmp_path, path, *overrides):
    cfg = tiny_config("task.name=dataset", f"task.path={path}", "task.n_eval=2", *overrides)
    out = tmp_path / "out" / path.stem
    shard.run(cfg, shard.Args(out_dir=str(out)))
    parts = [read_table(out / "train" / f"shard_{s}.parquet", schemas.PROMPTS) for s in range(2)]
    return pl.concat([*parts, read_table(out / "eval.parquet", schemas.PROMPTS)]).sort("prompt")


@pytest.mark.parametrize("fmt", ["auto", "explicit"])
def test_every_layout_through_the_shard_stage(tmp_path, fmt):
    write_layouts(tmp_path)
    fmts = {"gsm8k.jsonl": "gsm8k", "math.jsonl": "math", "verl.parquet": "verl", "plain.parquet": "prompt_answer"}
    tables = {
        name: shard_dataset(tmp_path, tmp_path / name, f"task.format={fmts[name] if fmt == 'explicit' else 'auto'}")
        for name in fmts
    }
    g = tables["gsm8k.jsonl"]
    assert g.height == 10 and set(g["answer"]) == {str(2 * i + 1) for i in range(498, 508)}  # "1,001" -> "1001"
    assert g["prompt"][0].startswith("Tom has") and set(g["data_source"]) == {"gsm8k"}
    m = tables["math.jsonl"]
    assert set(m["answer"]) == {"\\frac{1}{2}"} and m["prompt"][0].startswith("Simplify $\\frac")
    v = tables["verl.parquet"]
    assert set(v["data_source"]) == {"openai/gsm8k"} and sorted(v["answer"].to_list()) == sorted(
        str(i + 1) for i in range(10)
    )
    msgs = json.loads(v["messages"][0])
    assert [x["role"] for x in msgs] == ["system", "user"] and msgs[0]["content"] == "You are a calculator."
    assert v["prompt"][0] == msgs[1]["content"]  # the raw prompt: the user message
    p = tables["plain.parquet"]
    assert json.loads(p["messages"][0]) == [{"role": "user", "content": p["prompt"][0]}]
    # the rewards score the extracted references
    assert math_reward("so \\boxed{999}", g.filter(pl.col("prompt").str.contains("Tom has 499 "))["answer"][0]) == 1.0
    assert math_reward("$\\boxed{0.5}$", m["answer"][0]) == 1.0


@pytest.mark.parametrize(
    "name, fmt, error",
    [
        ("gsm8k.jsonl", "math", "gsm8k.jsonl: missing column 'problem' \\(the math layout needs problem, solution\\)"),
        ("math.jsonl", "gsm8k", "math.jsonl: missing column 'question'"),
        ("plain.parquet", "verl", "plain.parquet: missing column 'reward_model'"),
        ("verl.parquet", "prompt_answer", "verl.parquet: missing column 'answer'"),
        ("nohash.jsonl", "auto", "nohash.jsonl: column 'answer' row 0: no '#### <answer>' line"),
        ("nobox.jsonl", "math", "nobox.jsonl: column 'solution' row 1: no \\\\boxed\\{\\} answer"),
        ("nogt.parquet", "auto", "nogt.parquet: missing column 'reward_model.ground_truth'"),
    ],
)
def test_a_wrong_layout_names_the_file_and_the_column(tmp_path, name, fmt, error):
    write_layouts(tmp_path)
    pl.DataFrame({"question": ["q"] * 4, "answer": ["no marker"] * 4}).write_ndjson(tmp_path / "nohash.jsonl")
    pl.DataFrame({"problem": ["p"] * 4, "solution": ["\\boxed{1}", "none", "x", "y"]}).write_ndjson(
        tmp_path / "nobox.jsonl"
    )
    pl.DataFrame(
        {"prompt": [[{"role": "user", "content": "q"}]] * 4, "reward_model": [{"style": "rule"}] * 4}
    ).write_parquet(tmp_path / "nogt.parquet")
    with pytest.raises(SchemaError, match=error):
        shard_dataset(tmp_path, tmp_path / name, f"task.format={fmt}")


def test_verl_prompts_keep_their_system_message_through_the_chat_template(tmp_path, qwen2_bpe_policy):
    from transformers import AutoTokenizer

    from otbflow.io import read_metadata
    from otbflow.stages import rollout

    write_layouts(tmp_path)
    cfg = tiny_config(
        "task.name=dataset",
        f"task.path={tmp_path / 'verl.parquet'}",
        "task.n_eval=2",
        "task.system_prompt='Ignored: the data has its own.'",
        "rollout.max_new_tokens=4",
    )
    shard.run(cfg, shard.Args(out_dir=str(tmp_path / "out")))
    out = tmp_path / "rollout.parquet"
    rollout.run(
        cfg,
        rollout.Args(
            prompts=str(tmp_path / "out" / "train" / "shard_0.parquet"), policy=str(qwen2_bpe_policy), out=str(out)
        ),
    )
    df = read_table(out, schemas.ROLLOUTS)
    tok = AutoTokenizer.from_pretrained(qwen2_bpe_policy)
    rendered = tok.decode(df["prompt_ids"][0].to_list())
    assert rendered == (
        f"<|im_start|>system\nYou are a calculator.<|im_end|>\n<|im_start|>user\n{df['prompt'][0]}"
        "<|im_end|>\n<|im_start|>assistant\n"
    )
    meta = read_metadata(out)
    assert meta["chat"] is True and meta["stop_tokens"] == ["<|im_end|>", "<|endoftext|>"]
    with pytest.raises(ValueError, match="need the chat template"):
        rollout.run(
            tiny_config(
                *[
                    f"task.{k}={v}"
                    for k, v in (
                        ("name", "dataset"),
                        ("path", tmp_path / "verl.parquet"),
                        ("n_eval", 2),
                        ("chat", "false"),
                    )
                ]
            ),
            rollout.Args(
                prompts=str(tmp_path / "out" / "train" / "shard_0.parquet"),
                policy=str(qwen2_bpe_policy),
                out=str(tmp_path / "no.parquet"),
            ),
        )


# ------------------------------------------------------------------------------------------
# The fallback extractor reads any response in linear time (issue 35, item 4). The references are
# the regexes it had before, copied here: slow (quadratic on the strings below) and obviously what
# the fallback meant. Speed is measured in benchmarks/bench_reward_adversarial.py, not here.
# ------------------------------------------------------------------------------------------

OLD_NUM = r"-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"
OLD_GSM8K_MARKER = r"####[ \t]*\\?\$?[ \t]*(" + OLD_NUM + r")[ \t]*\.?[ \t]*$"


def old_marked_answer(text):
    import re

    from otbflow.algorithms.rewards import _drop_thousands, last_boxed

    found = re.findall(OLD_GSM8K_MARKER, text, re.MULTILINE)
    if found:
        return _drop_thousands(found[-1])
    boxed = last_boxed(text)
    return None if boxed is None else boxed.strip()


def old_normalise_text(s):
    """The old _normalise's three regex steps (a closing full stop, spaces, \\text{} macros)."""
    import re

    s = re.sub(r"\.+$", "", s).strip()
    s = re.sub(r"(?<!\d) | (?!\d)", "", s)
    without_text = re.sub(r"\\(?:text|mbox|mathrm)\{[^}]*\}", "", s)
    return without_text if without_text else re.sub(r"\\(?:text|mbox|mathrm)\{([^}]*)\}", r"\1", s)


def old_fallback(response, answer):
    import re

    def extract(text):
        marked = old_marked_answer(text)
        if marked is not None:
            return marked
        if "####" in text:
            return text.rsplit("####", 1)[1].strip().split("\n")[0].strip()
        nums = re.findall(OLD_NUM + r"(?:/\d+)?", text)
        return nums[-1] if nums else None

    def normalise(ans):
        from otbflow.algorithms.rewards import _drop_thousands

        s = ans.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("{,}", ",").strip()
        s = old_normalise_text(s)
        s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
        m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
        if m:
            s = f"{m.group(1)}/{m.group(2)}"
        s = _drop_thousands(s)
        try:
            if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", s):
                num, _, den = s.partition("/")
                return repr(round(float(num) / float(den or 1), 6))
        except ZeroDivisionError:
            pass
        return s

    pred = extract(response)
    if pred is None:
        return 0.0
    ref = extract(answer) if ("####" in answer or "\\boxed" in answer) else answer
    if ref is None:
        return 0.0
    pred, ref = normalise(pred), normalise(ref)
    return float(bool(pred) and pred == ref)


PIECES = [
    "#", "####", "#####", " ", "  ", "\t", "\n", "\r", "\\", "$", "\\$", "-", ",", ".", "..", "0", "1", "7", "12",
    "345", "1,234", ",567", "/", "x", "a b", "{", "}", "{,}", "\\!", "\\text{", "\\mbox{", "\\mathrm{", "\\boxed{",
    "\\frac{", "\\dfrac{", " cm}", "Evelyn",
]  # fmt: skip


def random_texts(n, seed, most=30):
    import random

    rng = random.Random(seed)
    return ["".join(rng.choice(PIECES) for _ in range(rng.randint(0, most))) for _ in range(n)]


# the shapes that made the old regexes quadratic (a failing match retried from every position),
# at sizes the quadratic references still read in well under a second
ADVERSARIAL = [
    "#### " + "." * 3000 + "x",  # the payload, shorter: _normalise's '\.+$'
    "#### " + " " * 3000 + "x",  # the marker's two blank runs around an optional '\' and '$'
    "#### 5" + " " * 3000 + "x",  # and the blank runs around the optional closing full stop
    "#### " + "\\text{" * 600,  # '\text{[^}]*' with no closing brace, retried at every macro
    "#### " + "\\text{" * 300 + "}" + "\\mbox{a}" * 300,
    "####" * 1000 + " 5",
    "#### 5.\n" * 500 + "#### 7 .",
    "1," * 2000 + "1",
    "." * 3000 + "5",
    "\\boxed{" * 1000,
    "\\boxed{" + "{" * 1000 + "}" * 999,
]


def test_the_fallback_reads_the_marker_as_the_old_regex_did():
    texts = random_texts(20_000, seed=1) + ADVERSARIAL + [s for s, _ in GSM8K_SOLUTIONS]
    for text in texts:
        assert marked_answer(text) == old_marked_answer(text), repr(text)


def test_the_fallback_normalises_as_the_old_regexes_did():
    from otbflow.algorithms.rewards import _normalise

    for text in random_texts(20_000, seed=2) + ADVERSARIAL:
        assert fallback_math_reward(text, "7") == old_fallback(text, "7"), repr(text)
        assert _normalise(text) == _normalise_with_old_steps(text), repr(text)


def _normalise_with_old_steps(ans):
    import re

    from otbflow.algorithms.rewards import _drop_thousands

    s = ans.strip().replace("\\$", "").replace("$", "").replace("\\!", "").replace("{,}", ",").strip()
    s = old_normalise_text(s)
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
    m = re.fullmatch(r"\\frac\{(-?\d+)\}\{(\d+)\}", s)
    if m:
        s = f"{m.group(1)}/{m.group(2)}"
    s = _drop_thousands(s)
    try:
        if re.fullmatch(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?", s):
            num, _, den = s.partition("/")
            return repr(round(float(num) / float(den or 1), 6))
    except ZeroDivisionError:
        pass
    return s


def test_random_responses_score_as_before_against_random_references():
    responses, references = random_texts(5_000, seed=3), random_texts(5_000, seed=4, most=6)
    for response, reference in zip(responses, references):
        assert fallback_math_reward(response, reference) == old_fallback(response, reference), (response, reference)


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("#### " + "." * 80_000 + "x", "1", 0.0),  # the 35 s payload: no number after the marker
        ("#### " + "." * 80_000 + "5", ".5", 0.0),  # '.....5': no number, so no marker; the text after it
        ("#### " + " " * 80_000 + "5", "5", 1.0),  # the marker, however many blanks
        ("#### 5" + " " * 80_000 + ".", "5", 1.0),
        ("#### 5" + " " * 80_000 + "x", "5", 0.0),  # no marker: '5   ...x', no number by value
        ("#### " + "\\text{" * 20_000, "1", 0.0),
        ("#### \\text{12}" + "\\text{" * 20_000, "12", 0.0),  # the macros without a '}' are kept
        ("The answer is 7" + "." * 80_000, "7", 1.0),  # the last number
    ],
)
def test_the_adversarial_payloads_score_by_hand(response, answer, expected):
    assert fallback_math_reward(response, answer) == expected


def test_a_prompt_far_too_long_for_the_model_is_refused_at_shard_time(tmp_path, tiny_policy):
    """Issue 35: a 10 MB prompt was sharded, then the rollout ran 130 s to 15 GB and died allocating
    184 GB. The shard stage refuses a prompt of more characters than 64 per position of model.path's
    model, or of the built-in one (128 positions: 8,192 characters), naming the file, the column and
    the row; at the bound it passes (the rollout's token check decides whether it fits)."""
    rows = [{"prompt": f"What is {i}+{i}?", "answer": str(2 * i)} for i in range(12)]
    rows[3]["prompt"] = "1" * 10_000_000
    pl.DataFrame(rows).write_ndjson(tmp_path / "big.jsonl")
    with pytest.raises(
        SchemaError, match=r"big.jsonl: column 'prompt' row 3: 10,000,000 characters, more than 8,192 \(64 per position"
    ):
        shard_dataset(tmp_path, tmp_path / "big.jsonl", f"model.path={tiny_policy}")
    rows[3]["prompt"] = "1" * 8_192
    pl.DataFrame(rows).write_ndjson(tmp_path / "edge.jsonl")
    assert shard_dataset(tmp_path, tmp_path / "edge.jsonl", f"model.path={tiny_policy}").height == 12
    # verl messages count every message's content, the system message's too
    verl = pl.DataFrame(
        {
            "prompt": [[{"role": "system", "content": "s" * 8_000}, {"role": "user", "content": "q" * 193}]] * 4,
            "reward_model": [{"ground_truth": "1"}] * 4,
        }
    )
    verl.write_parquet(tmp_path / "verl_big.parquet")
    with pytest.raises(SchemaError, match=r"verl_big.parquet: column 'prompt' row 0: 8,193 characters"):
        shard_dataset(tmp_path, tmp_path / "verl_big.parquet", f"model.path={tiny_policy}")
    # issue 53: without model.path, the built-in model's positions (model.n_positions) bound it:
    # 64 x 128 = 8,192 characters, and 64 x 256 = 16,384 with model.n_positions=256
    for limit, overrides in ((8_192, ()), (16_384, ("model.n_positions=256",))):
        with pytest.raises(
            SchemaError, match=rf"big.jsonl: column 'prompt' row 3: 10,000,000 characters, more than {limit:,} "
        ):
            shard_dataset(tmp_path, tmp_path / "big.jsonl", *overrides)
    assert shard_dataset(tmp_path, tmp_path / "edge.jsonl").height == 12


# ------------------------------------------------------------------------------------------
# Unreadable, empty and non-text rows refused naming the file and the line or row (issue 35, item 7)
# ------------------------------------------------------------------------------------------


def jsonl(path, *lines: bytes):
    path.write_bytes(b"".join(line + b"\n" for line in lines))
    return path


GOOD = b'{"prompt": "1+1=", "answer": "2"}'


@pytest.mark.parametrize(
    "lines, error",
    [
        # was: polars' "stream did not contain valid UTF-8 at line 0", naming no file
        (
            (GOOD, GOOD, b'{"prompt": "caf\xe9", "answer": "4"}'),
            r"d.jsonl: line 3: not UTF-8 \(byte 0xe9 at character 16\)",
        ),
        (
            (GOOD, b"", GOOD, b'{"prompt": "2+2=", "answer": "4"'),
            r"d.jsonl: line 4: not JSON \(Expecting ',' delimiter",
        ),
        ((GOOD, b"[1, 2]"), r"d.jsonl: line 2: a JSON list, not an object"),
    ],
)
def test_an_unreadable_jsonl_line_is_named(tmp_path, lines, error):
    with pytest.raises(SchemaError, match=error):
        load_dataset_file(jsonl(tmp_path / "d.jsonl", *lines))


def test_a_broken_parquet_dataset_names_the_file(tmp_path):
    (tmp_path / "d.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(SchemaError, match=r"d.parquet: not a readable Parquet file"):
        load_dataset_file(tmp_path / "d.parquet")


@pytest.mark.parametrize(
    "name, error",
    [
        ("empty_prompt.jsonl", r"column 'prompt' row 2: empty prompt \(1 rows\)"),
        ("blank_prompt.jsonl", r"column 'prompt' row 1: empty prompt"),
        ("number_prompt.jsonl", r"column 'prompt' row 1: 5 is not a string"),  # polars reads it as '5'
        ("number_prompts.parquet", r"column 'prompt' row 0: 0 is not a string"),
        ("empty_answer.jsonl", r"column 'answer' row 1: empty answer \(an empty reference scores 0"),
        ("gsm8k_empty.jsonl", r"column 'answer' row 1: empty answer .* after '####'"),
        ("math_empty.jsonl", r"column 'solution' row 0: empty answer .* in its last \\boxed\{\}"),
        ("question_empty.jsonl", r"column 'question' row 0: empty prompt"),
        ("verl_empty.parquet", r"column 'prompt' row 1: empty prompt \(the last user message\)"),
        ("verl_null.parquet", r"column 'prompt' row 0: a message whose content is not a string"),
        ("verl_no_truth.parquet", r"column 'reward_model.ground_truth' row 2: empty answer"),
    ],
)
def test_empty_and_non_text_rows_are_refused_naming_the_row(tmp_path, name, error):
    """Was: accepted (an empty answer scores 0 against every response; an empty prompt samples from nothing)."""
    rows = [{"prompt": f"{i}+{i}=", "answer": str(2 * i)} for i in range(4)]
    path = tmp_path / name
    if name == "empty_prompt.jsonl":
        rows[2]["prompt"] = ""
    elif name == "blank_prompt.jsonl":
        rows[1]["prompt"] = " \n\t"
    elif name == "number_prompt.jsonl":
        rows[1]["prompt"] = 5
    elif name == "empty_answer.jsonl":
        rows[1]["answer"] = "  "
    if name.endswith(".jsonl") and not name.startswith(("gsm8k", "math", "question")):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name == "number_prompts.parquet":
        pl.DataFrame({"prompt": [0, 1, 2], "answer": ["0", "2", "4"]}).write_parquet(path)
    elif name == "gsm8k_empty.jsonl":
        pl.DataFrame({"question": ["q1", "q2"], "answer": ["1+1=2\n#### 2", "so\n####  "]}).write_ndjson(path)
    elif name == "math_empty.jsonl":
        pl.DataFrame({"problem": ["p1", "p2"], "solution": ["\\boxed{ }", "\\boxed{1}"]}).write_ndjson(path)
    elif name == "question_empty.jsonl":
        pl.DataFrame({"question": ["", "q2"], "answer": ["#### 1", "#### 2"]}).write_ndjson(path)
    else:
        contents = ["q0", "q1", "q2"]
        truth = ["1", "2", "3"]
        if name == "verl_empty.parquet":
            contents[1] = ""
        elif name == "verl_null.parquet":
            contents[0] = None
        else:
            truth[2] = ""
        pl.DataFrame(
            {
                "prompt": [[{"role": "user", "content": c}] for c in contents],
                "reward_model": [{"ground_truth": t} for t in truth],
            }
        ).write_parquet(path)
    with pytest.raises(SchemaError, match=rf"{name}: {error}"):
        load_dataset_file(path)
