"""The stage table (otbflow.pipeline) against what the stages actually read.

Every stage runs on tiny data with a config that records each key read (tests/keyreads.py),
over a matrix of configs (loss types, estimators, schedules, tokenizers; the vLLM backend for the
rollout stage: tests/test_vllm.py, on its vLLM rollout). A key that a stage reads must be declared as
output-changing (its rerun trigger) or execution-only; a key declared output-changing must be
read. Either failure names the stage, the config and the keys. A stage outside the chain may
check its reads beside its own test (the score stage: tests/test_reward_model.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from conftest import REPO, tiny_config
from keyreads import check, run_recorded
from omegaconf import DictConfig

from otbflow.algorithms.rewards import REWARDS, register


@pytest.fixture(autouse=True, scope="module")
def length_verifier():
    """The 'dapo' column's verifier (right where the text's length is a multiple of 3), removed
    afterwards: the config's choices come from the registry."""
    register("length_mod3")(lambda text, answer: float(len(text) % 3 == 0))
    yield
    REWARDS.pop("length_mod3")


pytestmark = pytest.mark.slow

# One config per column of the matrix, layered over config/tiny.yaml. Small enough that the
# whole chain of a column runs in seconds.
SMALL = [
    "iterations=2",
    "bootstrap.sft_max_steps=4",
    "bootstrap.eval_every=2",
    "bootstrap.n_eval_prompts=4",
    "rollout.prompts_per_iteration=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=8",
    "evaluate.n_samples=2",
    "evaluate.max_new_tokens=8",
    "task.n_eval=4",
    "variance.pool_prompts=2",
    "variance.pool_size=4",
    "variance.resamples=5",
    "variance.sketch_dim=64",
    "scaling.max_sequences=6",
    "scaling.ci_resamples=20",
]
MATRIX = {
    "default": [],
    "reinforce": [
        "model.arch=llama",
        "model.tokenizer=bpe",
        "model.n_kv_head=1",
        "train.loss_type=reinforce",
        "train.rollout_is=token",
        "train.loss_agg_mode=seq-mean-token-sum-norm",
        "train.lr_schedule=cosine",
        "train.kl_coef=0.01",
        "train.entropy_coef=0.01",
        "train.trm=true",
        "advantages.estimator=length_power",
        "advantages.baseline_shift=-0.1",
        "advantages.compare=[grpo,rloo]",
        "variance.estimators=[grpo,length_power]",
        "features.exact_grad_norm=true",
        "task.seed=3",
    ],
    "zero1_bf16": [
        "train.zero_stage=1",
        "train.bf16=true",
        "train.reset_optimizer=true",
        "train.ppo_epochs=2",
        "train.lr_schedule=cosine",
        "train.lr_decay_steps=5",
        "train.lr_warmup_steps=1",
        "train.loss_agg_mode=seq-mean-token-sum-norm",
        "train.loss_scale_factor=32",
        "features.vocab_chunk_size=16",
        "advantages.estimator=rloo",
        "advantages.compare=[]",
    ],
    # DAPO's dynamic sampling and overlong shaping with the cosine reward, vocabulary pruning and (added
    # in the test) a learned reward model; the
    # verifier scores by length (registered below) so that groups are mixed and both branches of
    # the cosine reward are reached by the untrained policy
    "dapo": [
        "rollout.filter_groups=true",
        "rollout.max_gen_batches=3",
        "rollout.min_p=0.01",
        "task.reward=cosine",
        "task.cosine.verifier=length_mod3",
        "task.cosine.exceed_margin=2",
        "task.cosine.repetition_max=-0.5",
        "task.overlong_buffer=4",
        "train.clip_ratio_high=0.28",
    ],
    "length_decay": [
        "train.lr_schedule=length_decay",
        "train.rollout_is=sequence",
        "train.loss_agg_mode=seq-mean-token-mean",
        "advantages.estimator=grpo",
        "advantages.compare=[otb,reinforce_pp_baseline]",
    ],
}


def run_chain(tmp: Path, cfg: DictConfig, policy: str | None = None) -> dict[str, set[str]]:
    """Every stage of one iteration (and the report over it), each on the previous one's
    outputs, the train and evaluate stages with their live curves (under cfg.results_dir); the
    reads of each."""
    reads = {}
    if policy is None:
        policy = str(tmp / "policy")
        reads["bootstrap"] = run_recorded("bootstrap", cfg, out=policy, metrics=str(tmp / "curve.parquet"))
    reads["shard"] = run_recorded("shard", cfg, out_dir=str(tmp / "data"))
    prompts = str(tmp / "data" / "train" / "shard_0.parquet")
    rollouts, features, adv = tmp / "rollout.parquet", tmp / "features.parquet", tmp / "advantages.parquet"
    reads["rollout"] = run_recorded("rollout", cfg, prompts=prompts, policy=policy, out=str(rollouts), iteration=1)
    reads["features"] = run_recorded("features", cfg, rollouts=str(rollouts), policy=policy, out=str(features))
    reads["advantages"] = run_recorded(
        "advantages", cfg, features=[str(features)], out=str(adv), comparison=str(tmp / "comparison.parquet")
    )
    reads["train"] = run_recorded(
        "train",
        cfg,
        advantages=str(adv),
        policy=policy,
        out=str(tmp / "next"),
        metrics=str(tmp / "metrics.parquet"),
        state=str(tmp / "schedule.json"),
        reference=policy if cfg.train.kl_coef > 0 else "",
        checkpoint_dir=str(tmp / "checkpoints"),
        optimizer=str(tmp / "optimizer"),
        tracking_name="train/iter_1",
    )
    if (tmp / "optimizer").is_dir():  # the fp32 export of the policy and AdamW state train wrote
        reads["export"] = run_recorded(
            "export", cfg, policy=str(tmp / "next"), optimizer=str(tmp / "optimizer"), out=str(tmp / "fp32")
        )
    reads["evaluate"] = run_recorded(
        "evaluate",
        cfg,
        prompts=str(tmp / "data" / "eval.parquet"),
        policy=str(tmp / "next"),
        name="iter_0",
        samples=str(tmp / "samples.parquet"),
        summary=str(tmp / "summary.parquet"),
        iteration=0,
        train_state=str(tmp / "schedule.json"),
        tracking_name="evaluate/iter_0",
    )
    reads["report"] = run_recorded(
        "report",
        cfg,
        summaries=[str(tmp / "summary.parquet")],
        metrics=[str(tmp / "metrics.parquet")],
        rollouts=[str(rollouts)],
        comparisons=[str(tmp / "comparison.parquet")],
        features=[str(features)],
        out_dir=str(tmp / "report"),
    )
    reads["scaling"] = run_recorded(
        "scaling", cfg, rollouts=[str(rollouts)], policy=policy, out_dir=str(tmp / "scaling")
    )
    pool = tmp / "pool.parquet"
    reads["variance_pool"] = run_recorded("variance_pool", cfg, prompts=prompts, policy=policy, out=str(pool))
    reads["variance"] = run_recorded(
        "variance", cfg, rollouts=[str(pool)], policy=policy, out_dir=str(tmp / "variance")
    )
    # last: it deletes what retention does not keep of the policy the chain trained
    reads["prune"] = run_recorded(
        "prune", cfg, iteration=0, policy=str(tmp / "next"), optimizer=str(tmp / "optimizer"), out=str(tmp / "k.json")
    )  # it reads no key: the workflow passes what to keep
    return reads


@pytest.mark.parametrize("column", sorted(MATRIX))
def test_every_stage_reads_what_the_table_declares(column, tmp_path):
    extra = []
    if column == "dapo":  # with a learned reward model, which no stage of the chain reads (the score
        # stage's reads are checked beside its test, tests/test_reward_model.py)
        from conftest import save_reward_model

        from otbflow.models.policy import build_char_tokenizer

        rm = save_reward_model(tmp_path / "rm", "gpt2", build_char_tokenizer(), 32)
        extra = [f"task.reward_model.path={rm}", "task.reward_model.weight=0.5"]
    cfg = tiny_config(*SMALL, *MATRIX[column], *extra, f"results_dir={tmp_path / 'results'}")
    reads = run_chain(tmp_path, cfg)
    problems = [p for stage, keys in reads.items() for p in check(stage, column, cfg, keys)]
    assert not problems, "\n".join(problems)


def test_the_dataset_prompt_set_is_declared(tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(12)))
    cfg = tiny_config(*SMALL, "task.name=dataset", f"task.path={data}", "task.prompt_template='Q: {prompt}'")
    reads = run_recorded("shard", cfg, out_dir=str(tmp_path / "data"))
    assert not check("shard", "dataset", cfg, reads)


if __name__ == "__main__":  # discovery: print what each stage reads beyond / short of its declaration
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    for column in sys.argv[1:] or sorted(MATRIX):
        with tempfile.TemporaryDirectory() as tmp:
            cfg = tiny_config(*SMALL, *MATRIX[column], f"results_dir={tmp}/results")
            for stage, keys in run_chain(Path(tmp), cfg).items():
                print("\n".join(check(stage, column, cfg, keys)) or f"{stage} [{column}] ok", flush=True)
