"""Learned reward models (otbflow.models.reward_model): tiny random reward models of two real
architectures built offline (a GPT-2 with the char tokenizer, no chat template; a Qwen2 with a
byte-level BPE and the ChatML template). The scores are pinned against HF's own forward of the
unpadded sequence, batched against one by one, and the folder checks run before anything loads."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import REPO, save_reward_model

from otbflow.models.policy import build_bpe_tokenizer, build_char_tokenizer
from otbflow.models.reward_model import RewardModel, check_reward_model, max_length_of

PROMPTS = ["1+2=", "12+30-7=", "7=", "", "5*5=", "100-1=", "3+3+3="]
RESPONSES = ["3", "35;#35", "7" * 20, "#0", "25;#25<eos>", "", "9;#9"]
TOL = 1e-5


def bpe_tokenizer():
    texts = ["1+2=3;#3", "12+30-7=35;#35", "5*5=25;#25", "user\n", "assistant\n"] * 4
    return build_bpe_tokenizer(texts, vocab_size=300)


@pytest.fixture(scope="module")
def gpt2_rm(tmp_path_factory):
    """GPT-2, char tokenizer (pad and eos, no chat template), 32 positions."""
    return save_reward_model(tmp_path_factory.mktemp("rm") / "gpt2", "gpt2", build_char_tokenizer(), 32)


@pytest.fixture(scope="module")
def qwen2_rm(tmp_path_factory):
    """Qwen2 (grouped-query attention), byte-level BPE with the ChatML chat template, 48 positions."""
    return save_reward_model(tmp_path_factory.mktemp("rm") / "qwen2", "qwen2", bpe_tokenizer(), 48, seed=1)


@pytest.fixture(scope="module")
def nopad_rm(tmp_path_factory):
    """GPT-2 whose char tokenizer has an eos token but no pad token."""
    tok = build_char_tokenizer()
    tok.pad_token = None
    assert tok.pad_token_id is None
    return save_reward_model(tmp_path_factory.mktemp("rm") / "nopad", "gpt2", tok, 32, seed=2)


def reference(path: Path, ids: list[int]) -> float:
    """HF's own score of one unpadded sequence, loaded independently: with no pad token id and a
    batch of one, *ForSequenceClassification pools at the last position."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path, local_files_only=True).eval()
    model.config.pad_token_id = None
    with torch.no_grad():
        return float(model(torch.tensor([ids])).logits[0, 0])


def token_ids(path: Path, text: str, special: bool) -> list[int]:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True)(text, add_special_tokens=special)["input_ids"]


@pytest.mark.parametrize("name", ["gpt2_rm", "qwen2_rm", "nopad_rm"])
def test_batched_scores_equal_one_by_one(name, request):
    """Mixed lengths in batches of 3 (sorted by length inside, so each batch is padded) give the
    scores of each pair alone, in the input order, as Python floats; and the padding side changes
    nothing (position ids and the last real token come from the attention mask)."""
    rm = RewardModel(request.getfixturevalue(name))
    batched = rm.score(PROMPTS, RESPONSES, batch_size=3)
    alone = [rm.score([p], [r], batch_size=1)[0] for p, r in zip(PROMPTS, RESPONSES)]
    assert all(type(s) is float for s in batched)
    assert batched == pytest.approx(alone, abs=TOL)
    assert len(set(round(s, 4) for s in batched)) > 3, "the scores differ from pair to pair"
    rm.tokenizer.padding_side = "left"
    assert rm.score(PROMPTS, RESPONSES, batch_size=4) == pytest.approx(alone, abs=TOL)


@pytest.mark.parametrize("name", ["gpt2_rm", "nopad_rm"])
def test_score_is_the_unpadded_forward_plain_text(name, request):
    """Without a chat template the model reads prompt + response (the char tokenizer adds no
    special tokens); the score is HF's forward of that sequence alone. For nopad_rm, pad = eos and
    the response ending in <eos> still scores at that last eos (HF's batched pooling would skip it)."""
    path = request.getfixturevalue(name)
    rm = RewardModel(path)
    assert not rm.chat
    assert rm.render("1+2=", "3") == "1+2=3"
    scores = rm.score(PROMPTS, RESPONSES, batch_size=4)
    for p, r, s in zip(PROMPTS, RESPONSES, scores):
        assert s == pytest.approx(reference(path, token_ids(path, p + r, True)), abs=TOL), (p, r)


def test_score_is_the_unpadded_forward_chat_template(qwen2_rm):
    """With a chat template the model reads the ChatML rendering of a user and an assistant
    message, encoded without added special tokens; the score is HF's forward of it alone."""
    rm = RewardModel(qwen2_rm)
    assert rm.chat
    rendered = rm.render("1+2=", "3")
    assert rendered == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    scores = rm.score(PROMPTS[:4], RESPONSES[:4], batch_size=4)
    for p, r, s in zip(PROMPTS, RESPONSES, scores):
        ids = token_ids(qwen2_rm, rm.render(p, r), False)
        assert len(ids) <= rm.max_length
        assert s == pytest.approx(reference(qwen2_rm, ids), abs=TOL), (p, r)


def test_empty_text_is_refused(gpt2_rm, qwen2_rm):
    """Without a chat template an empty prompt and response have no last token to score; the
    chat template always writes some."""
    with pytest.raises(ValueError, match=r"pairs \[1\] render to no tokens"):
        RewardModel(gpt2_rm).score(["1=", ""], ["1", ""])
    assert len(RewardModel(qwen2_rm).score([""], [""])) == 1


def test_tokenizer_without_pad_pads_with_eos(nopad_rm, caplog):
    with caplog.at_level(logging.WARNING, logger="otbflow.models.reward_model"):
        rm = RewardModel(nopad_rm)
    assert rm.tokenizer.pad_token == rm.tokenizer.eos_token == "<eos>"
    assert rm.model.config.pad_token_id == rm.tokenizer.eos_token_id
    assert any("no pad token" in m and "'<eos>'" in m for m in caplog.messages), caplog.messages


def test_tokenizer_without_pad_or_eos_is_refused(tmp_path):
    tok = build_char_tokenizer()
    tok.pad_token = None
    tok.eos_token = None
    path = save_reward_model(tmp_path / "rm", "gpt2", tok, 32)
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        RewardModel(path)


def test_truncation_keeps_the_end(gpt2_rm, qwen2_rm, caplog):
    """A text longer than the maximum length is scored on its last max_length tokens (the end,
    where the response is): the same as scoring that kept part, and HF's forward of it."""
    rm = RewardModel(gpt2_rm)
    assert rm.max_length == 32  # n_positions: the char tokenizer sets no model_max_length
    prompt, response = "12+30-7=", "35;" * 12 + "#35"
    text = prompt + response
    assert len(text) > 32
    with caplog.at_level(logging.WARNING, logger="otbflow.models.reward_model"):
        (cut,) = rm.score([prompt], [response])
    assert any("1 of 1 inputs are longer than its 32 tokens" in m for m in caplog.messages), caplog.messages
    assert cut == pytest.approx(rm.score([""], [text[-32:]])[0], abs=TOL)
    assert cut == pytest.approx(reference(gpt2_rm, token_ids(gpt2_rm, text, True)[-32:]), abs=TOL)
    # in a batch with short texts too
    assert rm.score(["1=", prompt], ["1", response], batch_size=2)[1] == pytest.approx(cut, abs=TOL)

    rm = RewardModel(qwen2_rm)
    long_response = "1+2=3;" * 30
    ids = token_ids(qwen2_rm, rm.render("1+2=", long_response), False)
    assert len(ids) > rm.max_length == 48
    (cut,) = rm.score(["1+2="], [long_response])
    assert cut == pytest.approx(reference(qwen2_rm, ids[-48:]), abs=TOL)


def test_max_length_is_the_smaller_limit():
    from types import SimpleNamespace

    unset = SimpleNamespace(model_max_length=int(1e30))
    assert max_length_of(unset, SimpleNamespace(n_positions=32)) == 32
    assert max_length_of(unset, SimpleNamespace(max_position_embeddings=4096)) == 4096
    assert max_length_of(SimpleNamespace(model_max_length=512), SimpleNamespace(max_position_embeddings=4096)) == 512
    with pytest.raises(ValueError, match="maximum length is unknown"):
        max_length_of(unset, SimpleNamespace())


def config_only(path: Path, config: dict, tokenizer: bool = True) -> Path:
    """A folder with a config.json (and a tokenizer's files) and no weights."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if tokenizer:
        build_char_tokenizer().save_pretrained(path)
    return path


def tokenizer_only(path: Path) -> Path:
    build_char_tokenizer().save_pretrained(path)
    return path


def bad_folders(root: Path) -> dict[str, tuple[Path, str]]:
    """Each kind of bad folder, with the words its error must say."""
    gpt2 = {"model_type": "gpt2", "n_positions": 32}
    return {
        "missing": (root / "nowhere", "no such folder"),
        "no config.json": (tokenizer_only(root / "noconfig"), "no config.json, not an HF model folder"),
        "causal LM": (
            config_only(root / "causal", {**gpt2, "architectures": ["GPT2LMHeadModel"]}),
            r"architectures \(GPT2LMHeadModel\) name no \*ForSequenceClassification",
        ),
        "no architectures": (config_only(root / "noarch", gpt2), r"architectures \(none\)"),
        "two labels": (
            config_only(
                root / "two",
                {**gpt2, "architectures": ["GPT2ForSequenceClassification"], "id2label": {"0": "a", "1": "b"}},
            ),
            "has 2 labels; a reward model gives one scalar score",
        ),
        "num_labels 2": (
            config_only(root / "nl2", {**gpt2, "architectures": ["GPT2ForSequenceClassification"], "num_labels": 2}),
            "has 2 labels",
        ),
        "labels unset": (
            config_only(root / "unset", {**gpt2, "architectures": ["GPT2ForSequenceClassification"]}),
            "has 2 labels",  # HF's default
        ),
        "no tokenizer": (
            config_only(
                root / "notok",
                {**gpt2, "architectures": ["GPT2ForSequenceClassification"], "num_labels": 1},
                tokenizer=False,
            ),
            "no tokenizer files",
        ),
    }


def test_check_names_each_problem(tmp_path):
    for kind, (path, words) in bad_folders(tmp_path).items():
        with pytest.raises(ValueError, match=words) as err:
            check_reward_model(path)
        assert str(path) in str(err.value), kind
        with pytest.raises(ValueError, match=words):
            RewardModel(path)  # the same error before anything loads (these folders have no weights)


def test_check_reads_no_weights_and_imports_no_torch(tmp_path, gpt2_rm):
    """The check a config can run before any generation: config.json and file names only, in a
    process that never imports torch."""
    folders = {k: str(p) for k, (p, _) in bad_folders(tmp_path).items()}
    code = (
        "import json, sys\n"
        "from otbflow.models.reward_model import check_reward_model\n"
        f"check_reward_model({str(gpt2_rm)!r})\n"
        "errors = {}\n"
        f"for kind, path in json.loads({json.dumps(json.dumps(folders))}).items():\n"
        "    try:\n"
        "        check_reward_model(path)\n"
        "    except ValueError as e:\n"
        "        errors[kind] = str(e)\n"
        "assert len(errors) == len(json.loads(sys.argv[1])), errors\n"
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules\n"
    )
    res = subprocess.run(
        [sys.executable, "-c", code, json.dumps(folders)],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(REPO / "src"), "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr


def test_missing_score_head_weights_are_refused(tmp_path):
    """A causal LM's folder whose config.json claims a sequence-classification architecture passes
    the cheap check, but loading finds the score head absent from the weights (HF would initialise
    it at random): refused."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tok = build_char_tokenizer()
    path = tmp_path / "relabelled"
    rm = save_reward_model(tmp_path / "rm", "gpt2", tok, 32)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(rm)).save_pretrained(path)
    tok.save_pretrained(path)
    data = json.loads((path / "config.json").read_text())
    data.update(architectures=["GPT2ForSequenceClassification"], num_labels=1)
    (path / "config.json").write_text(json.dumps(data))
    check_reward_model(path)
    with pytest.raises(ValueError, match=r"weights missing from the checkpoint \(score\.weight"):
        RewardModel(path)


def test_the_config_checks_the_folder_before_anything_runs(gpt2_rm, tmp_path):
    """task.reward_model.path is checked when the config loads: a missing folder and a two-label
    model are refused naming the key."""
    from conftest import tiny_config

    from otbflow.config import ConfigError

    assert tiny_config(f"task.reward_model.path={gpt2_rm}").task.reward_model.weight == 1.0
    with pytest.raises(ConfigError, match="config key .task.reward_model.path.*no such folder"):
        tiny_config(f"task.reward_model.path={tmp_path / 'nowhere'}")
    two = save_reward_model(tmp_path / "two", "gpt2", build_char_tokenizer(), 32, num_labels=2)
    with pytest.raises(ConfigError, match="config key 'task.reward_model.path'.*label"):
        tiny_config(f"task.reward_model.path={two}")


def test_the_score_stage_adds_the_weighted_score_to_the_reward(gpt2_rm, rollouts_path, tmp_path):
    """The score stage's table: the rollout's columns unchanged but the reward, rm_score equal to
    each pair scored alone, and reward = the rollout's reward + weight * rm_score. It reads the
    config keys its stage table entry declares, no other."""
    from conftest import tiny_config
    from keyreads import check, run_recorded

    from otbflow import schemas
    from otbflow.io import read_table
    from otbflow.stages import score

    out = tmp_path / "scored.parquet"
    cfg = tiny_config(f"task.reward_model.path={gpt2_rm}", "task.reward_model.weight=0.5")
    reads = run_recorded("score", cfg, rollouts=str(rollouts_path), out=str(out))
    assert not check("score", "weight 0.5", cfg, reads)
    before, after = read_table(rollouts_path, schemas.ROLLOUTS), read_table(out, schemas.ROLLOUTS)
    assert after.drop("reward", "rm_score").equals(before.drop("reward"))
    rm = RewardModel(gpt2_rm)
    for i in (0, 3, after.height - 1):
        alone = rm.score([after["prompt"][i]], [after["response_text"][i]])[0]
        assert after["rm_score"][i] == pytest.approx(alone, abs=TOL)
    assert (after["reward"] - before["reward"] - 0.5 * after["rm_score"]).abs().max() < 1e-12
    assert after["rm_score"].std() > 0
    # alone: the score is the whole training reward; the verifier's column stays
    alone = tmp_path / "alone.parquet"
    cfg = tiny_config(
        f"task.reward_model.path={gpt2_rm}", "task.reward_model.weight=0.5", "task.reward_model.alone=true"
    )
    score.run(cfg, score.Args(str(rollouts_path), str(alone)))
    only = read_table(alone, schemas.ROLLOUTS)
    assert (only["reward"] - 0.5 * only["rm_score"]).abs().max() < 1e-12
    assert only["verifiable_reward"].equals(before["verifiable_reward"])


def test_the_score_stage_writes_an_empty_table_for_an_empty_shard(gpt2_rm, rollouts_path, tmp_path):
    """A shard that dynamic sampling left empty is legal (features and advantages read it): the
    score stage writes an empty table with the scored columns and the rollout's metadata, where it
    crashed in the tokenizer (IndexError) before."""
    from conftest import tiny_config

    from otbflow import schemas
    from otbflow.io import read_metadata, read_table, write_parquet
    from otbflow.stages import score

    empty = tmp_path / "empty.parquet"
    write_parquet(read_table(rollouts_path, schemas.ROLLOUTS).head(0), empty, metadata={"iteration": 3})
    out = tmp_path / "scored.parquet"
    score.run(tiny_config(f"task.reward_model.path={gpt2_rm}"), score.Args(str(empty), str(out)))
    scored = read_table(out, schemas.ROLLOUTS)
    assert scored.height == 0 and "rm_score" in scored.columns
    assert read_metadata(out)["iteration"] == 3
    assert RewardModel(gpt2_rm).score([], []) == []
