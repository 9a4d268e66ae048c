"""The TRL peer of one otbflow RL iteration: ``trl.GRPOTrainer`` doing the default chain's work.

otbflow's default chain (config/config.yaml) does, per iteration: 256 prompts x 8 samples = 2,048
responses (transformers generation, 48 new tokens at most, temperature 1, top_p 1), the old
log-probs of every response, group advantages, then one pass of 8 AdamW steps of 256 sequences
(micro-batches of 64): PPO-clip 0.2/0.2 with dual clip 3, token-mean loss, no KL, lr 3e-4
constant, weight decay 0, grad-norm clip 1.0, fp32. This module runs the same work with TRL
(``GRPO_SETTINGS`` and ``grpo_config``):

- one generation of the iteration's 2,048 responses every 8 optimizer steps:
  ``generation_batch_size`` 2,048 = ``per_device_train_batch_size`` 64 x ``steps_per_generation``
  32 micro-steps, ``gradient_accumulation_steps`` 4 (256 sequences per optimizer step),
  ``num_iterations`` 1. As gradient_accumulation_steps (4) is no multiple of the 32 micro-steps
  per generation, TRL computes the old log-probs once per generation (a no-grad forward over the
  2,048 sequences), as otbflow's features stage does: steps 2-8 are off the sampling policy.
- the prompts otbflow's iteration k samples: ``otbflow.engines.sampling.select_prompts``'s window of
  ceil(256 / n_shards) consecutive rows of each shard (``iteration_prompts``), in a dataset TRL
  reads in order (``shuffle_dataset=False``), iteration after iteration;
- the reward is otbflow's own function (``otbflow.algorithms.rewards``, which imports only the standard
  library: ``src/`` goes on ``sys.path``, otbflow is not installed in the TRL venv).

What is not the same work (TRL has no switch for it):

- the loss's token count: ``loss_type="dapo"`` divides each step's token sum by the generation
  batch's token count / 8 (the mean count of a 256-sequence step), otbflow by that step's own count
  (equal in expectation; 'bnpo' divides per micro-batch of 64, 'grpo' is a per-sequence mean);
- the advantages: GRPO's (r - mean) / (std + 1e-4) (otbflow's default estimator is otb; its grpo
  adds 1e-6); TRL also shuffles the 2,048 sequences before cutting them into steps;
- generation: one ``model.generate`` call over all 2,048 sequences (otbflow: 64 prompts x 8 a
  call) with torch's global RNG (otbflow: a hashed key per row), so the samples differ;
- the old log-probs: TRL's no-grad forward computes log-probs only; otbflow's features stage also
  stores entropy, sum pi^2, the gradient-proxy energy and mismatch columns, and the training
  forward here also computes the entropy (TRL logs it);
- no process boundaries: otbflow runs each iteration as separate Snakemake jobs (rollout,
  features, advantages, train) that load the model, read and write Parquet and save the policy and
  AdamW state; TRL keeps everything in one process (its start-up is ``startup_s``, paid once).

Measured (``IterationTimer``): the wall time of each iteration, from the start of its first
optimizer step to the end of its 8th (generation, reward, old log-probs, advantages, 32
forward/backward micro-steps, 8 AdamW steps and TRL's per-step bookkeeping); within it, the time
of TRL's ``_generate_and_score_completions`` (``generate_s``). ``startup_s``: from the start of
``main`` (before ``import trl``) to the first step: imports, model and tokenizer load, dataset and
trainer construction. Run it in its own venv (``ensure_trl_venv``), from the lead's benchmark
through ``run_trl``, or by hand::

    python benchmarks/trl_peer.py --ensure-venv                  # build .venv-trl (main venv)
    .venv-trl/bin/python benchmarks/trl_peer.py --policy results/bootstrap/policy \\
        --prompts results/data/train/shard_0.parquet results/data/train/shard_1.parquet \\
        --iterations 2 --out trl.json
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_VENV = REPO / ".venv-trl"
TRL_VERSION = "1.16.0"
STAMP = ".otbflow-trl-installed"

GRPO_SETTINGS = {
    "prompts_per_iteration": 256,  # rollout.prompts_per_iteration
    "group_size": 8,  # rollout.group_size
    "max_new_tokens": 48,  # rollout.max_new_tokens
    "temperature": 1.0,  # rollout.temperature
    "top_p": 1.0,  # rollout.top_p
    "mini_batch_size": 256,  # train.mini_batch_size: sequences per optimizer step
    "micro_batch_size": 64,  # train.micro_batch_size: sequences per forward/backward
    "lr": 3.0e-4,  # train.lr, train.lr_schedule constant, no warm-up
    "weight_decay": 0.0,  # TrainConfig.weight_decay
    "max_grad_norm": 1.0,  # train.max_grad_norm
    "clip_ratio": 0.2,  # train.clip_ratio_low = train.clip_ratio_high
    "clip_ratio_c": 3.0,  # train.clip_ratio_c: dual clip for A < 0
    "seed": 0,
}
"""otbflow's defaults (config/config.yaml, src/otbflow/config/sections.py) that the TRL run takes over."""


def requirements() -> list[str]:
    """What the TRL venv installs: the CPU torch of constraints.txt, TRL, and the transformers of
    the calling interpreter where it has one (both sides then generate with the same version)."""
    reqs = ["torch==2.13.0", f"trl=={TRL_VERSION}"]
    try:
        from importlib.metadata import version

        reqs.append(f"transformers=={version('transformers')}")
    except Exception:  # no transformers here: TRL's own pick
        pass
    return reqs


def ensure_trl_venv(path: Path = TRL_VENV) -> Path:
    """Create the venv at ``path`` (if its stamp does not name the same requirements) with
    ``pip install -c constraints.txt`` of ``requirements()``; return its python."""
    python = path / "bin" / "python"
    reqs = requirements()
    stamp = path / STAMP
    if stamp.is_file() and stamp.read_text().split() == reqs and python.is_file():
        return python
    if not python.is_file():
        subprocess.run([sys.executable, "-m", "venv", str(path)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    subprocess.run([*pip, "-c", str(REPO / "constraints.txt"), *reqs], check=True)
    check = (
        "import torch, trl; assert torch.__version__.endswith('+cpu') or torch.cuda.is_available(), torch.__version__"
    )
    subprocess.run([str(python), "-c", check], check=True)
    stamp.write_text("\n".join(reqs) + "\n")
    return python


def run_trl(policy: Path, shards: list[Path], iterations: int, threads: int, venv: Path = TRL_VENV, **kw) -> dict:
    """Ensure the TRL venv, run ``main`` in it (a subprocess with ``threads`` torch/OMP threads) and
    return its JSON result. ``kw``: further ``main`` options by name (e.g. prompts_per_iteration=16)."""
    python = ensure_trl_venv(venv)
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    with tempfile.TemporaryDirectory(prefix="trl_peer_") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [str(python), str(Path(__file__).resolve()), "--policy", str(policy), "--prompts", *map(str, shards)]
        cmd += ["--iterations", str(iterations), "--threads", str(threads), "--out", str(out)]
        cmd += ["--workdir", tmp]
        for key, value in kw.items():
            cmd += [f"--{key.replace('_', '-')}", str(value)]
        subprocess.run(cmd, check=True, env=env, cwd=REPO)
        return json.loads(out.read_text())


def iteration_prompts(shards: list[list[dict]], iteration: int, prompts_per_iteration: int) -> list[dict]:
    """The rows otbflow's rollout jobs of ``iteration`` sample, shard after shard: each shard's
    window of ceil(prompts_per_iteration / n_shards) consecutive rows, cycling
    (otbflow.stages.rollout and otbflow.engines.sampling.select_prompts, restated here: that module
    imports torch, polars and omegaconf)."""
    per_shard = math.ceil(prompts_per_iteration / len(shards))
    rows = []
    for df in shards:
        n = len(df)
        rows += [df[(iteration * per_shard + i) % n] for i in range(min(per_shard, n))]
    return rows


def read_shard(path: Path) -> list[dict]:
    """A prompt shard (otbflow.schemas.PROMPTS) as rows of prompt, messages and answer."""
    import pyarrow.parquet as pq

    return pq.read_table(path, columns=["prompt", "messages", "answer"]).to_pylist()


def grpo_config(args: argparse.Namespace, n_prompts: int, out_dir: str):
    """The GRPOConfig of otbflow's per-iteration work: one generation of n_prompts x group_size
    responses per ``steps`` optimizer steps of mini_batch_size sequences (see the module doc)."""
    from trl import GRPOConfig

    s = GRPO_SETTINGS
    responses = n_prompts * args.group_size
    if responses % args.mini_batch_size or args.mini_batch_size % args.micro_batch_size:
        raise ValueError(
            f"{responses} responses per iteration: no whole number of {args.mini_batch_size}-sequence steps"
        )
    accumulation = args.mini_batch_size // args.micro_batch_size
    steps = responses // args.mini_batch_size  # optimizer steps per iteration
    return GRPOConfig(
        output_dir=out_dir,
        # the generation: 2,048 responses once every 8 optimizer steps (32 micro-steps)
        num_generations=args.group_size,
        per_device_train_batch_size=args.micro_batch_size,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=steps * accumulation,
        num_iterations=1,  # one pass over each generation (ppo_epochs 1)
        max_steps=steps * args.iterations,
        shuffle_dataset=False,  # iteration k's prompts are rows [k n_prompts, (k+1) n_prompts)
        max_completion_length=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=0,
        use_vllm=False,  # transformers generate
        # the loss: PPO-clip, dual clip, token mean, no KL, GRPO advantages
        loss_type="dapo",  # sum over tokens / tokens of the step's batch (see the report in the docs)
        epsilon=s["clip_ratio"],
        epsilon_high=s["clip_ratio"],
        delta=s["clip_ratio_c"],  # clamp(r, max=3) in the unclipped term = otbflow's dual clip for A < 0
        beta=0.0,
        scale_rewards="group",  # (r - group mean) / (group std + 1e-4)
        importance_sampling_level="token",
        mask_truncated_completions=False,
        # the optimizer: AdamW, constant lr, fp32
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        optim="adamw_torch",
        weight_decay=s["weight_decay"],
        max_grad_norm=s["max_grad_norm"],
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,  # TRL's default is True; otbflow keeps activations
        use_cpu=not args.cuda,
        seed=args.seed,
        data_seed=args.seed,
        # no side work: one log per iteration, no checkpoints, no reporters
        logging_steps=steps,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_num_workers=0,
        log_completions=False,
    )


def main() -> None:
    t_main, load_start = time.perf_counter(), os.getloadavg()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ensure-venv", action="store_true", help="only build the TRL venv (run from the main venv)")
    p.add_argument("--policy", type=Path, help="initial policy: an HF folder (otbflow's bootstrap policy)")
    p.add_argument("--prompts", type=Path, nargs="+", help="otbflow prompt shards (Parquet), in shard order")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--out", type=Path, help="JSON result")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    p.add_argument("--reward", default="arithmetic", help="otbflow reward name (otbflow.algorithms.rewards)")
    p.add_argument("--prompts-per-iteration", type=int, default=GRPO_SETTINGS["prompts_per_iteration"])
    p.add_argument("--group-size", type=int, default=GRPO_SETTINGS["group_size"])
    p.add_argument("--mini-batch-size", type=int, default=GRPO_SETTINGS["mini_batch_size"])
    p.add_argument("--micro-batch-size", type=int, default=GRPO_SETTINGS["micro_batch_size"])
    p.add_argument("--max-new-tokens", type=int, default=GRPO_SETTINGS["max_new_tokens"])
    p.add_argument("--temperature", type=float, default=GRPO_SETTINGS["temperature"])
    p.add_argument("--top-p", type=float, default=GRPO_SETTINGS["top_p"])
    p.add_argument("--lr", type=float, default=GRPO_SETTINGS["lr"])
    p.add_argument("--seed", type=int, default=GRPO_SETTINGS["seed"])
    p.add_argument("--cuda", action="store_true", help="train on the GPU (default: CPU, as the comparison runs)")
    p.add_argument(
        "--workdir", type=Path, default=None, help="TRL's output_dir (nothing is saved; default: a temp dir)"
    )
    args = p.parse_args()
    if args.ensure_venv:
        print(ensure_trl_venv())
        return
    if not (args.policy and args.prompts and args.out):
        p.error("--policy, --prompts and --out are required")

    import torch

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(REPO / "src"))  # otbflow.algorithms.rewards: standard library only
    import transformers
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

    from otbflow.algorithms.rewards import get_reward

    score = get_reward(args.reward)
    tok = AutoTokenizer.from_pretrained(args.policy, local_files_only=True)
    if tok.pad_token_id is None:  # otbflow.models.policy.load_tokenizer's rule
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    chat = bool(getattr(tok, "chat_template", None))  # task.chat auto: the template where there is one
    model = AutoModelForCausalLM.from_pretrained(args.policy, local_files_only=True, dtype=torch.float32)

    shards = [read_shard(s) for s in args.prompts]
    rows = [r for k in range(args.iterations) for r in iteration_prompts(shards, k, args.prompts_per_iteration)]
    n_prompts = len(rows) // args.iterations
    if not chat:  # TRL tokenizes plain prompts with special tokens; otbflow without: they must agree
        for r in rows[:n_prompts]:
            assert tok(r["prompt"])["input_ids"] == tok(r["prompt"], add_special_tokens=False)["input_ids"], r
    dataset = Dataset.from_dict(
        {
            "prompt": [json.loads(r["messages"]) if chat else r["prompt"] for r in rows],
            "answer": [r["answer"] for r in rows],
        }
    )
    rewards: list[float] = []  # mean reward of each generation batch
    generate_s: list[float] = []  # seconds of each generation batch
    same_prompts: list[bool] = []  # each generation batch: otbflow's iteration's prompts, each group_size times

    def otbflow_reward(prompts, completions, answer, **_) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        out = [score(t, a) for t, a in zip(texts, answer)]
        k = len(rewards)
        expected = dataset["prompt"][k * n_prompts : (k + 1) * n_prompts]
        same_prompts.append(sorted(map(str, prompts)) == sorted(map(str, expected * args.group_size)))
        rewards.append(sum(out) / len(out))
        return out

    otbflow_reward.__name__ = f"otbflow_{args.reward}"

    class TimedGRPOTrainer(trl.GRPOTrainer):
        """GRPOTrainer that times each generation (generate, reward, old log-probs, advantages)."""

        def _generate_and_score_completions(self, inputs):
            t = time.perf_counter()
            out = super()._generate_and_score_completions(inputs)
            generate_s.append(time.perf_counter() - t)
            return out

    class IterationTimer(TrainerCallback):
        """Wall time of each RL iteration: from the first optimizer step's start to the end of the
        ``steps``-th; the previous iteration's end (its last step's on_step_end) starts the next."""

        def __init__(self, steps: int):
            self.steps, self.start, self.first_step, self.per_iteration, self.logs = steps, None, None, [], []
            self.per_step, self.step_start = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.step_start = time.perf_counter()
            if self.start is None:
                self.start = self.first_step = self.step_start

        def on_step_end(self, args, state, control, **kw):
            now = time.perf_counter()
            self.per_step.append(now - self.step_start)
            if state.global_step % self.steps == 0:
                self.per_iteration.append(now - self.start)
                self.start = now

        def on_log(self, args, state, control, logs=None, **kw):
            self.logs.append(dict(logs or {}))

    with tempfile.TemporaryDirectory(prefix="trl_peer_") as tmp:
        config = grpo_config(args, n_prompts, str(args.workdir or tmp))
        steps = config.steps_per_generation // config.gradient_accumulation_steps
        timer = IterationTimer(steps)
        trainer = TimedGRPOTrainer(
            model=model,
            reward_funcs=otbflow_reward,
            args=config,
            train_dataset=dataset,
            processing_class=tok,
            callbacks=[timer],
        )
        trainer.train()
    assert len(timer.per_iteration) == args.iterations, (timer.per_iteration, args.iterations)
    assert len(generate_s) == args.iterations, ("TRL generated more than once per iteration", generate_s)

    result = {
        "trl_version": trl.__version__,
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "threads": torch.get_num_threads(),
        "device": "cuda" if args.cuda else "cpu",
        "iterations": args.iterations,
        "per_iteration_s": timer.per_iteration,
        "generate_s": generate_s,
        "train_s": [t - g for t, g in zip(timer.per_iteration, generate_s)],
        "per_step_s": timer.per_step,  # each optimizer step, on_step_begin to on_step_end (the first: + generation)
        "startup_s": timer.first_step - t_main,
        "load_average_1_5_15min": {"start": load_start, "end": os.getloadavg()},  # other work on the machine
        "mean_reward": rewards,
        "same_prompts_as_otbflow": same_prompts,
        "mean_length": [log["completions/mean_length"] for log in timer.logs if "completions/mean_length" in log],
        "logs": timer.logs,
        "settings": {
            "policy": str(args.policy),
            "prompts": [str(s) for s in args.prompts],
            "reward": args.reward,
            "chat_template": chat,
            "prompts_per_iteration": n_prompts,
            "responses_per_iteration": n_prompts * args.group_size,
            "optimizer_steps_per_iteration": steps,
            "grpo_config": {
                k: getattr(config, k)
                for k in (
                    "num_generations",
                    "per_device_train_batch_size",
                    "gradient_accumulation_steps",
                    "steps_per_generation",
                    "generation_batch_size",
                    "num_iterations",
                    "max_steps",
                    "shuffle_dataset",
                    "max_completion_length",
                    "temperature",
                    "top_p",
                    "top_k",
                    "use_vllm",
                    "loss_type",
                    "epsilon",
                    "epsilon_high",
                    "delta",
                    "beta",
                    "scale_rewards",
                    "learning_rate",
                    "lr_scheduler_type",
                    "warmup_steps",
                    "optim",
                    "weight_decay",
                    "adam_beta1",
                    "adam_beta2",
                    "adam_epsilon",
                    "max_grad_norm",
                    "bf16",
                    "gradient_checkpointing",
                    "seed",
                )
            },
            "old_logprobs_computed": config.gradient_accumulation_steps % config.steps_per_generation != 0,
        },
    }
    args.out.write_text(json.dumps(result, indent=2, default=str) + "\n")
    print(json.dumps({k: result[k] for k in ("per_iteration_s", "generate_s", "startup_s", "mean_reward")}))


if __name__ == "__main__":
    main()
