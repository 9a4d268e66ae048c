"""``otbflow disk``: the disk a run will take, from the model's HF config, the run's size and the
retention policy (``otbflow.runtime.retention``), before it runs; and what a results folder holds
(``otbflow.runtime.usage``).

Sizes per iteration, by what the stages write:
- policy: every parameter in fp32, or in bf16 where the run publishes bf16
  (``policy_folder.publishes_bf16``), counted exactly on the meta device from the HF config (no
  weights allocated);
- optimizer (DeepSpeed checkpoint): the two AdamW moments in fp32 and, under ZeRO ≥ 1, the
  optimizer's own fp32 weights: 8 or 12 bytes per parameter, as measured
  (``optimizer_bytes_per_parameter``);
- data: rollouts, features and advantages, per response token the widths of their per-token
  columns (otbflow.schemas; Parquet's compression makes the files smaller: an upper bound), the
  prompt's token ids once per response and table; with ``rollout.stream`` each rollout's carry
  besides (at most ``rollout.staleness`` groups left open per group taken).
Peak: while iteration k trains, the policies still read (k - staleness - 1 .. k) and the
optimizer states from the one it reads on (``otbflow.runtime.adamw``: k-1's with
``train.optimizer_every`` 1, else the second-newest checkpoint) to its own exist beside everything
kept so far. The states written in all (``optimizer_written``) are the disk's write traffic.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from omegaconf import DictConfig

from otbflow import schemas
from otbflow.runtime import adamw
from otbflow.runtime.policy_folder import publishes_bf16
from otbflow.runtime.retention import decision
from otbflow.runtime.usage import gib, used

_WIDTH = {"Int64": 8, "Int32": 4, "Float32": 4, "Float64": 8}
DATA_TABLES = (schemas.ROLLOUTS, schemas.FEATURES, schemas.ADVANTAGES)


def count_parameters(model_config) -> int:
    """Parameters of the causal LM an HF config describes (a folder, a config.json, a dict or a config),
    counted on the meta device; tied embeddings count once, as they are saved."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if isinstance(model_config, dict):
        config = AutoConfig.for_model(**model_config)
    elif not isinstance(model_config, (str, Path)):
        config = model_config  # an HF PretrainedConfig
    else:
        path = Path(model_config)
        if path.is_file():  # a config.json of any name
            config = AutoConfig.for_model(**json.loads(path.read_text()))
        else:
            config = AutoConfig.from_pretrained(path, local_files_only=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def bytes_per_token(cfg: DictConfig) -> tuple[int, int]:
    """(bytes per response token, bytes per prompt token per response) of the three data tables,
    their optional columns counted (token_versions only where ``cfg`` writes it: rollout.take_newer)."""
    return _widths(DATA_TABLES, {"token_versions"} if cfg.rollout.take_newer == "none" else set())


def _widths(tables, unwritten: set[str] = frozenset()) -> tuple[int, int]:
    """(bytes per response token, bytes per prompt token) of ``tables``' list columns but ``unwritten``."""
    response = prompt = 0
    for table in tables:
        for name, dtype in table.columns.items():
            inner = getattr(dtype, "inner", None)
            if inner is None or name in unwritten:
                continue
            width = _WIDTH[str(inner)]
            if name == "prompt_ids":
                prompt += width
            else:
                response += width
    return response, prompt


def optimizer_bytes_per_parameter(tc: DictConfig) -> int:
    """A DeepSpeed optimizer folder per parameter, as measured (docs/training.md, 'The optimizer
    across iterations'): 2.0x the fp32 weights at ZeRO-0 (the two moments), 3.0x at ZeRO 1-3
    (and the optimizer's own fp32 copy of the weights); the module's weights are its policy's."""
    return 12 if tc.zero_stage else 8


def estimate(cfg: DictConfig, n_params: int, response_tokens: float | None = None, prompt_tokens: float = 0.0) -> dict:
    """Disk of a run of ``cfg`` for a model of ``n_params`` parameters. ``response_tokens``:
    mean tokens per response (default: rollout.max_new_tokens, the most)."""
    n, s = cfg.iterations, cfg.rollout.staleness
    policy = (2 if publishes_bf16(cfg) else 4) * n_params
    optimizer = 0 if cfg.train.reset_optimizer else optimizer_bytes_per_parameter(cfg.train) * n_params
    per_token, per_prompt_token = bytes_per_token(cfg)
    responses = cfg.rollout.prompts_per_iteration * cfg.rollout.group_size
    tokens = responses * (cfg.rollout.max_new_tokens if response_tokens is None else response_tokens)
    data = tokens * per_token + responses * prompt_tokens * per_prompt_token
    if cfg.rollout.stream:  # each rollout's carry: at most s groups per taken one left open (otbflow.engines.laminar)
        carry_token, carry_prompt = _widths([schemas.STREAM])
        data += s * (tokens * carry_token + responses * prompt_tokens * carry_prompt)
    kept = [decision(cfg, k) for k in range(n)]
    written = adamw.written(cfg)
    peak = 0.0
    for k in range(n):  # as iteration k's train job writes: what is kept so far, and what is still read
        policies = sum(kept[j].policy or j >= k - s - 1 for j in range(k + 1))
        # the states written so far that are kept, the one job k reads, those after it, and k's own
        read = adamw.declared(cfg, k)
        optimizers = sum(kept[j].optimizer or j >= (0 if read is None else read) for j in written if j <= k)
        peak = max(peak, (k + 1) * data + policies * policy + optimizers * optimizer)
    final = n * data + sum(d.policy for d in kept) * policy + sum(d.optimizer for d in kept) * optimizer
    keep_all = n * (data + policy) + len(written) * optimizer
    return {
        "parameters": n_params,
        "iterations": n,
        "responses_per_iteration": responses,
        "response_tokens_per_iteration": tokens,
        "bytes": {
            "policy": policy,
            "optimizer": optimizer,
            "data_per_iteration": data,
            "final": final,
            "peak": peak,
            "keep_everything": keep_all,
            # the AdamW states the run writes, whether kept or not: the disk's write traffic
            "optimizer_written": len(written) * optimizer,
        },
        "optimizer_every": adamw.every(cfg),
        "optimizer_writes": len(written),
        "kept_policies": [k for k, d in enumerate(kept) if d.policy],
        "kept_optimizers": [k for k, d in enumerate(kept) if d.optimizer and optimizer],
        "retention": {"policy_every": cfg.retention.policy_every, "optimizer": cfg.retention.optimizer},
    }


def spans(ks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out: list[list[int]] = []
    for k in ks:
        if out and k == out[-1][1] + 1:
            out[-1][1] = k
        else:
            out.append([k, k])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in out) or "none"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="config YAML (default: config/config.yaml)")
    p.add_argument(
        "--model-config",
        help="an HF model folder or its config.json (default: model.path, else the built model of model.*)",
    )
    p.add_argument("--response-tokens", type=float, help="mean tokens per response (default: rollout.max_new_tokens)")
    p.add_argument("--prompt-tokens", type=float, default=0.0, help="mean tokens per prompt (default: 0)")
    p.add_argument("--results", help="also measure what this results folder holds now")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, e.g. iterations=100")


def built_model_config(cfg: DictConfig):
    """The HF config of the model the bootstrap builds (model.*), without building it."""
    from otbflow.models.policy import tiny_model_config, tiny_vocab_size

    return tiny_model_config(cfg.model, tiny_vocab_size(cfg.model))


def main(ns: argparse.Namespace) -> int:
    from otbflow.config import DEFAULT_CONFIG, load_config

    cfg = load_config(ns.config or DEFAULT_CONFIG, ns.overrides)
    source = ns.model_config or cfg.model.path
    n_params = count_parameters(source if source else built_model_config(cfg))
    est = estimate(cfg, n_params, ns.response_tokens, ns.prompt_tokens)
    est["model"] = str(source) if source else f"built {cfg.model.arch} (model.*)"
    if ns.results:
        est["used"] = used(ns.results)
    if ns.json:
        print(json.dumps(est, indent=2))
        return 0
    b = est["bytes"]
    print(f"model: {est['model']}, {n_params / 1e6:.3g} M parameters; {cfg.iterations} iterations")
    print(
        f"  per iteration: policy {gib(b['policy'])}, optimizer state {gib(b['optimizer'])}, "
        f"data {gib(b['data_per_iteration'])} (upper bound)"
    )
    print(
        f"  retention policy_every={cfg.retention.policy_every} optimizer={cfg.retention.optimizer}: "
        f"kept policies {spans(est['kept_policies'])}, optimizer states {spans(est['kept_optimizers'])}"
    )
    print(
        f"  at the end: {gib(b['final'])}; at the peak: {gib(b['peak'])}; keeping everything: "
        f"{gib(b['keep_everything'])}"
    )
    print(
        f"  AdamW states written (train.optimizer_every {est['optimizer_every']}): {est['optimizer_writes']}, "
        f"{gib(b['optimizer_written'])} in all"
    )
    if ns.results:
        u = est["used"]
        print(
            f"  {ns.results} holds {gib(u['total'])} now ({gib(u['train_outputs'])} of policies and optimizer states)"
        )
    return 0
