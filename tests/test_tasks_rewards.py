import polars as pl
import pytest

from otbflow import shard
from otbflow.io import SchemaError, read_table
from otbflow import schemas
from otbflow.rewards import REWARDS, arithmetic_reward, extract_math_answer, get_reward, math_reward
from otbflow.tasks import arithmetic_prompts, arithmetic_solution, load_dataset_file

from conftest import tiny_config


def test_arithmetic_solution_is_correct_and_lengths_vary():
    probs = arithmetic_prompts(200, seed=1, min_terms=2, max_terms=5, max_operand=9)
    for p in probs:
        assert int(p["answer"]) == eval(p["prompt"].rstrip("="))
        assert p["target"].endswith("#" + p["answer"])
        assert p["target"].count(";") == p["prompt"].count("+") + p["prompt"].count("-")
    lengths = {len(p["target"]) for p in probs}
    assert max(lengths) - min(lengths) >= 15  # variable-length responses
    assert arithmetic_solution("7+3-5=") == ("7+3=10;10-5=5;#5", "5")


def test_arithmetic_is_deterministic_and_distinct():
    a = arithmetic_prompts(50, 3, 2, 4, 9)
    assert a == arithmetic_prompts(50, 3, 2, 4, 9)
    assert a != arithmetic_prompts(50, 4, 2, 4, 9)
    assert len({p["prompt"] for p in a}) == 50
    with pytest.raises(ValueError, match="max_operand"):
        arithmetic_prompts(1000, 0, 1, 1, 3)  # only 4 distinct problems exist


def test_rewards_registry():
    assert {"arithmetic", "math"} <= set(REWARDS)
    assert arithmetic_reward("7+3=10;10-5=5;#5", "5") == 1.0
    assert arithmetic_reward("7+3=10;10-5=5;#6", "5") == 0.0
    assert arithmetic_reward("no answer", "5") == 0.0
    with pytest.raises(ValueError, match="registered: arithmetic, math"):
        get_reward("nope")


@pytest.mark.parametrize("response, answer, expected", [
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("Total: 1,234 apples\n#### 1234", "1234", 1.0),
    ("it is 7, no wait, 8", "8", 1.0),
    ("it is 7, no wait, 8", "7", 0.0),
    ("\\boxed{x+1}", "x+1", 1.0),
    ("nothing", "3", 0.0),
    ("#### 18", "Janet sells 16-3-4=9 eggs... #### 18", 1.0),  # GSM8K-style reference
])
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
    assert load_dataset_file(tmp_path / "d.jsonl").columns == ["prompt", "answer"]
    assert load_dataset_file(tmp_path / "d.parquet").height == 20
    pl.DataFrame({"question": ["x"]}).write_ndjson(tmp_path / "bad.jsonl")
    with pytest.raises(SchemaError, match="bad.jsonl: missing column 'prompt'"):
        load_dataset_file(tmp_path / "bad.jsonl")
    cfg = tiny_config("task.name=dataset", f"task.path={tmp_path / 'd.jsonl'}", "task.n_eval=5",
                      "task.prompt_template='Q: {prompt} A:'")
    shard.run(cfg, shard.Args(out_dir=str(tmp_path / "out")))
    ev = read_table(tmp_path / "out" / "eval.parquet", schemas.PROMPTS)
    tr = [read_table(tmp_path / "out" / "train" / f"shard_{s}.parquet", schemas.PROMPTS) for s in range(2)]
    assert ev.height == 5 and sum(t.height for t in tr) == 15
    assert ev["prompt"][0].startswith("Q: What is") and ev["prompt"][0].endswith(" A:")
