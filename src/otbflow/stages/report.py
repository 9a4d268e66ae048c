"""Report: collect the outputs of every iteration into tables and plots.

Writes ``progress.parquet`` (accuracy of each policy with the tokens generated so far),
``metrics.parquet`` (all train steps), ``comparison.parquet`` (estimator diagnostics of every
iteration), ``mismatch.parquet`` (trainer vs rollout engine per iteration) and PNG plots of
accuracy and reward against iteration and tokens generated, grad norm, response length and the
mismatch dashboard (log-ratio and k3 distributions, log-PPL gap, TRM acceptance), and the HTML
report's front page: ``front.rst`` (what the run did: accuracy of the initial and the final
policy, tokens, seconds per iteration, disk, the learning curve; the Snakefile's ``report:``
description) and ``metadata.yaml`` (the run's settings, ``--report-metadata``, which makes the
report open on that page). ``snakemake --report report.html --report-metadata
results/report/metadata.yaml`` embeds the plots with captions.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import polars as pl
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import pyplot, read_metadata, read_table, save_figure, write_json, write_parquet, write_text
from otbflow.runtime import usage

log = logging.getLogger("otbflow.report")
PLOTS = ("accuracy", "reward", "grad_norm", "response_length", "mismatch")


@dataclass
class Args:
    summaries: list[str]
    """Eval summary Parquets: the initial policy, then the evaluated iterations (evaluate.every)."""
    metrics: list[str]
    """Train metrics Parquets of iterations 0, 1, ..."""
    rollouts: list[str]
    """Rollout Parquets of every iteration and shard (for token accounting)."""
    comparisons: list[str]
    """Estimator comparison Parquets of iterations 0, 1, ..."""
    features: list[str]
    """Features Parquets of every iteration and shard (for the mismatch dashboard)."""
    out_dir: str
    """Output folder for the tables, {accuracy,reward,grad_norm,response_length}.png and the front page."""


def rollout_table(rollouts: list[str]) -> pl.DataFrame:
    """Per iteration (schemas.ROLLOUT_SUMMARY): mean rollout rewards and length of the kept rows,
    the responses and tokens generated (dropped groups' included) in it and up to it, dynamic
    sampling's groups, rounds and short shards, and the reward calls past their deadline. What a
    job generated beyond the rows it kept is in its Parquet metadata (dynamic_sampling, with
    rollout.filter_groups; reward_timeouts, over every round); a shard it left empty still counts."""
    cols = ["iteration", "group_id", "response_length", "reward", "verifiable_reward", "rm_score"]
    rows, lags, shards = [], [], []
    for path in rollouts:
        table, meta = read_table(path, schemas.ROLLOUTS), read_metadata(path)
        if "rm_score" not in table.columns:  # no reward model
            table = table.with_columns(rm_score=pl.lit(None, pl.Float64))
        rows.append(table.select(cols))
        lags.append(token_lags(table))
        # the sampling job's record of its iteration (an empty shard has no rows to tell it)
        iteration = meta.get("iteration", table["iteration"][0] if table.height else None)
        if iteration is None:
            continue
        gen = meta.get("dynamic_sampling") or {}
        stream = meta.get("stream") or {}  # rollout.stream's counts (take_newer alone has none of these)
        stale = stream.get("groups_dropped_stale", 0) + stream.get("groups_regenerated", 0)
        shards.append(
            {
                "iteration": iteration,
                "responses": (gen["responses_generated"] if gen else table.height)
                + stream.get("groups_dropped_stale", 0) * meta.get("sampling", {}).get("n", 0),
                "tokens": (gen["tokens_generated"] if gen else int(table["response_length"].sum()))
                + stream.get("stale_tokens", 0),
                "groups_dropped": gen.get("groups_dropped", 0),
                "groups_stale": stale,
                "groups_carried": stream.get("groups_from_carry", 0),
                "rounds": gen.get("rounds", 1),
                "shards_short": int(not gen.get("reached", True)),
                "reward_timeouts": meta.get("reward_timeouts", 0),  # absent: written before it was counted
            }
        )
    per_shard = (
        pl.DataFrame(shards, schema_overrides=dict.fromkeys(shards[0], pl.Int64))
        .group_by("iteration")
        .agg(
            pl.col(
                "responses",
                "tokens",
                "groups_dropped",
                "groups_stale",
                "groups_carried",
                "shards_short",
                "reward_timeouts",
            ).sum(),
            pl.col("rounds").max(),
        )
    )
    per_row = (
        pl.concat(rows)
        .group_by("iteration")
        .agg(
            pl.col("reward").mean().alias("mean_reward"),
            pl.col("verifiable_reward").mean().alias("mean_verifiable_reward"),
            pl.col("response_length").mean().cast(pl.Float64).alias("mean_rollout_length"),
            pl.col("rm_score").mean().alias("mean_rm_score"),
            pl.col("group_id").n_unique().cast(pl.Int64).alias("groups_kept"),
        )
    )
    return (
        per_row.join(per_shard, on="iteration")
        .join(lag_histogram(pl.concat(lags)), on="iteration", how="left")
        .sort("iteration")
        .with_columns(
            pl.col("tokens").cum_sum().alias("tokens_generated"),
            pl.col("responses").cum_sum().alias("responses_generated"),
            pl.col("tokens_by_lag").fill_null([]),
        )
        .select(list(schemas.ROLLOUT_SUMMARY.columns))
    )


def token_lags(table: pl.DataFrame) -> pl.DataFrame:
    """Each kept token's lag: its iteration minus the iteration whose policy sampled it (its
    token_versions entry where the table has them, else its row's behaviour_iteration)."""
    if "token_versions" in table.columns:
        versions = table.select("iteration", pl.col("token_versions").alias("v")).explode("v")
    else:
        versions = table.select("iteration", pl.col("behaviour_iteration").repeat_by("response_length").alias("v"))
        versions = versions.explode("v")
    return versions.drop_nulls().select("iteration", (pl.col("iteration") - pl.col("v")).alias("lag"))


def lag_histogram(lags: pl.DataFrame) -> pl.DataFrame:
    """Per iteration, ``tokens_by_lag``: entry j counts the kept tokens sampled j iterations behind."""
    counts = lags.group_by("iteration", "lag").len()
    out = []
    for (k,), g in counts.group_by("iteration"):
        hist = [0] * (int(g["lag"].max()) + 1)
        for lag, n in g.select("lag", "len").iter_rows():
            hist[lag] = n
        out.append({"iteration": k, "tokens_by_lag": hist})
    return pl.DataFrame(out, schema={"iteration": pl.Int64, "tokens_by_lag": pl.List(pl.Int64)})


def progress_table(summaries: list[str], per_iteration: pl.DataFrame) -> pl.DataFrame:
    """One row per evaluated policy (the initial one has iteration -1 and 0 tokens), with the
    rollout statistics of the iteration that trained it."""
    evals = pl.concat([read_table(p, schemas.EVAL_SUMMARY) for p in summaries]).sort("iteration")
    rolled = per_iteration.select(
        "iteration", "tokens_generated", "responses_generated", "mean_reward", "mean_rollout_length"
    )
    out = evals.join(rolled, on="iteration", how="left").with_columns(
        pl.col("tokens_generated", "responses_generated").fill_null(0),
        pl.col("mean_reward").fill_null(float("nan")),
        pl.col("mean_rollout_length").fill_null(float("nan")),
    )
    return out.select(list(schemas.PROGRESS.columns))


def mismatch_table(
    features: pl.DataFrame, max_k2: float, mean_k3: float, is_threshold: float | None = None
) -> pl.DataFrame:
    """Per iteration: the lag (to the oldest policy that sampled a token: the rows'
    behaviour_iteration, or their token_versions where present), the trainer-vs-rollout
    log-ratio statistics, TRM's acceptance at ``max_k2``, ``mean_k3``, and the share of tokens
    whose stored IS weight (the features stage's ``is_weights``, train.rollout_is) sits at its
    truncation ``is_threshold`` (None: no weights, NaN)."""
    cols = ["iteration", "log_ratio", "k3"] + (["is_weights"] if is_threshold is not None else [])
    tokens = features.select(cols).explode(cols[1:]).drop_nulls()
    # a weight min(rho, C) stored in float32 equals float32(C) exactly where rho reached C
    c = float(np.float32(is_threshold)) if is_threshold is not None else None
    truncated = (pl.col("is_weights").cast(pl.Float64) >= c).mean() if c is not None else pl.lit(float("nan"))
    per_token = tokens.group_by("iteration").agg(
        pl.len().cast(pl.Int64).alias("tokens"),
        pl.col("log_ratio").cast(pl.Float64).mean().alias("log_ratio_mean"),
        pl.col("log_ratio").cast(pl.Float64).abs().max().alias("log_ratio_abs_max"),
        pl.col("k3").cast(pl.Float64).mean().alias("k3_mean"),
        truncated.cast(pl.Float64).alias("truncated_fraction"),
    )
    oldest = pl.col("behaviour_iteration")  # with rollout.take_newer, the oldest policy that sampled a token
    if "token_versions" in features.columns:
        oldest = pl.col("token_versions").list.min().fill_null(oldest)
    lag = (pl.col("iteration") - oldest).max().cast(pl.Int64)
    per_seq = features.group_by("iteration").agg(
        lag.alias("lag"),
        pl.col("log_ppl_abs_diff").mean().alias("log_ppl_abs_diff_mean"),
        ((pl.col("seq_max_k2") <= max_k2) & (pl.col("seq_mean_k3") <= mean_k3))
        .mean()
        .cast(pl.Float64)
        .alias("trm_acceptance"),
    )
    return (
        per_token.join(per_seq, on="iteration")
        .sort("iteration")
        .with_columns(
            pl.when(pl.col("lag") == 0)
            .then(pl.lit("engine"))
            .otherwise(pl.lit("behaviour->proximal"))
            .alias("measures")
        )
        .select(list(schemas.MISMATCH.columns))
    )


def _plot_mismatch(path: Path, features: pl.DataFrame, table: pl.DataFrame) -> None:
    plt = pyplot()
    fig, axes = plt.subplots(1, 4, figsize=(20, 3.6))
    for k, lag in table.select("iteration", "lag").iter_rows():
        part = features.filter(pl.col("iteration") == k)
        lr = part["log_ratio"].explode().drop_nulls().to_numpy()
        k3 = part["k3"].explode().drop_nulls().to_numpy()
        label = f"iteration {k}" + (f" (lag {lag}: behaviour vs proximal)" if lag else "")
        axes[0].hist(lr, bins=60, histtype="step", log=True, label=label)
        axes[1].hist(np.log10(np.maximum(k3, 1e-20)), bins=60, histtype="step", log=True, label=label)
    axes[0].set_xlabel("per-token log r = log pi_trainer - log pi_rollout")
    axes[1].set_xlabel("log10 per-token k3")
    for ax in axes[:2]:
        ax.set_ylabel("tokens")
        ax.legend()
    it = table["iteration"].to_numpy()
    axes[2].plot(it, table["log_ppl_abs_diff_mean"].to_numpy(), marker="o")
    axes[2].set_xlabel("iteration")
    axes[2].set_ylabel("mean |log-PPL gap|")
    axes[3].plot(it, table["trm_acceptance"].to_numpy(), marker="o")
    axes[3].axhline(0.7, color="grey", linestyle="--", label="0.7 (TRM paper's floor)")
    axes[3].set_ylim(0, 1.05)
    axes[3].set_xlabel("iteration")
    axes[3].set_ylabel("TRM acceptance rate")
    axes[3].legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    save_figure(fig, path)


TOKENS = "rollout tokens generated"  # the x label of a panel against tokens: its ticks read 40k, 1.2M
PANEL_INCHES = (5.0, 3.2)  # one panel; 550 px wide at save_figure's 110 dpi, about the front page's 512 px column


def _figure(panels: list[tuple[str, str, list[tuple[str, np.ndarray, np.ndarray]]]], stacked: bool = False):
    """The panels side by side, or one above the other (``stacked``: each as wide as the figure,
    for a page that shows it in a narrow column); an axis of tokens (x label ``TOKENS``) ticked
    with an SI suffix (40k, 1.2M) at most 6 times, an axis of iterations at integers."""
    from matplotlib.ticker import EngFormatter, MaxNLocator

    plt = pyplot()
    rows, cols = (len(panels), 1) if stacked else (1, len(panels))
    fig, axes = plt.subplots(rows, cols, figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), squeeze=False)
    for ax, (xlabel, ylabel, series) in zip(axes.flat, panels):
        for label, x, y in series:
            ax.plot(x, y, marker="o", markersize=3, label=label)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if xlabel == TOKENS:
            ax.xaxis.set_major_locator(MaxNLocator(nbins=6, steps=[1, 2, 2.5, 5, 10], min_n_ticks=3))
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        if len(series) > 1:
            ax.legend()
    return fig


def _plot(
    path: Path, panels: list[tuple[str, str, list[tuple[str, np.ndarray, np.ndarray]]]], stacked: bool = False
) -> None:
    save_figure(_figure(panels, stacked), path)


def accuracy_panels(progress: pl.DataFrame) -> list[tuple[str, str, list[tuple[str, np.ndarray, np.ndarray]]]]:
    """The learning curve's panels: held-out accuracy (greedy, avg@k) against the policy (0 the
    initial one, k + 1 after iteration k) and against the rollout tokens generated."""
    it = progress["iteration"].to_numpy() + 1  # policy index: 0 = initial, k+1 = after iteration k
    tok = progress["tokens_generated"].to_numpy()
    acc = [
        ("greedy", progress["greedy_accuracy"].to_numpy()),
        (f"avg@{int(progress['k'][0])}", progress["sampled_accuracy"].to_numpy()),
    ]
    return [
        ("policy (iterations trained)", "held-out accuracy", [(n, it, y) for n, y in acc]),
        (TOKENS, "held-out accuracy", [(n, tok, y) for n, y in acc]),
    ]


# The jobs of iteration k, by their Snakemake benchmark files under results/benchmarks/
ITERATION_JOBS = ("rollout/iter_{k}_shard_*", "score/iter_{k}_shard_*", "features/iter_{k}_shard_*")
ITERATION_JOBS += ("advantages/iter_{k}", "train/iter_{k}", "evaluate/iter_{k}")


def job_seconds(results: Path, iterations: int) -> list[float]:
    """Each iteration's job seconds: the sum of the wall times of its jobs (rollout, score,
    features, advantages, train, evaluate), from Snakemake's benchmark files; jobs that run at
    once count each. An iteration without its train job's file (outputs made by hand, or
    --touch) or with a file that does not read as a benchmark table is left out, with a warning
    for the latter: these files are logs, not inputs."""
    out = []
    for k in range(iterations):
        files = [f for pattern in ITERATION_JOBS for f in (results / "benchmarks").glob(pattern.format(k=k) + ".tsv")]
        if not any("train" in f.parts for f in files):
            continue
        try:
            out.append(sum(float(pl.read_csv(f, separator="\t")["s"].sum()) for f in files))
        except (pl.exceptions.PolarsError, OSError, ValueError) as e:
            log.warning("iteration %d left out of the seconds per iteration: a benchmark file does not read (%s)", k, e)
    return out


def _inline(text: str) -> str:
    """A config string as inline text of the front page: on one line (no reStructuredText directive
    can start in it) and with no Jinja tag (the raw block around the page stays closed)."""
    return " ".join(text.split()).replace("{%", "{ %").replace("{{", "{ {").replace("{#", "{ #")


def front_page(cfg: DictConfig, progress: pl.DataFrame, per_iteration: pl.DataFrame, use: dict, seconds, curve) -> str:
    """The report's landing text (reStructuredText, rendered by Snakemake through Jinja, hence the
    raw block): the accuracy of the initial and the final policy, the tokens generated, the job
    seconds per iteration, the disk, and the learning curve (``curve``: the accuracy plot's PNG
    bytes, embedded)."""
    import base64
    import textwrap

    first, last = progress.row(0, named=True), progress.row(-1, named=True)
    k = int(progress["k"][0])
    final = f"after iteration {last['iteration']}" if last["iteration"] >= 0 else "initial"
    spread = f" (range {min(seconds):.1f}-{max(seconds):.1f} s)" if len(seconds) > 1 else ""
    pace = f"{float(np.median(seconds)):.1f} s{spread}" if seconds else "not recorded (no benchmark files)"
    m = cfg.model
    task = _inline(cfg.task.name + (f" ({cfg.task.path})" if cfg.task.get("path") else ""))
    policy = _inline(str(m.path)) if m.path else f"a built {m.arch} ({m.n_layer} layers, width {m.n_embd})"
    results = _inline(str(cfg.results_dir))
    lines = [
        "{% raw %}",
        "What this run did",
        "=================",
        "",
        f"{cfg.advantages.estimator} advantages, {cfg.train.loss_type} loss ({cfg.train.loss_agg_mode}), "
        f"{per_iteration.height} iterations of {cfg.rollout.prompts_per_iteration} prompts x "
        f"{cfg.rollout.group_size} responses, on {task} with {policy} ({cfg.rollout.backend} backend); "
        f"results in {results}/. Held-out accuracy of each policy on {progress['n_prompts'][0]} prompts:",
        "",
        ".. list-table::",
        "   :header-rows: 1",
        "",
        "   * - held-out accuracy",
        "     - initial policy",
        f"     - {final}",
        "   * - greedy",
        f"     - {first['greedy_accuracy']:.3f}",
        f"     - {last['greedy_accuracy']:.3f}",
        f"   * - avg@{k}",
        f"     - {first['sampled_accuracy']:.3f}",
        f"     - {last['sampled_accuracy']:.3f}",
        "",
        f"- Rollout tokens generated: {int(per_iteration['tokens'].sum()):,} "
        f"({int(per_iteration['responses'].sum()):,} responses).",
        f"- Seconds per iteration: {pace}, the sum of each iteration's job wall times.",
        f"- Disk: {usage.gib(use['total'])} under the results folder, {usage.gib(use['train_outputs'])} of it "
        f"policies and optimizer states; {usage.gib(use['pruned'])} deleted by the retention policy.",
        "",
        "Learning curve (held-out accuracy against the policy and against the tokens generated):",
        "",
        ".. image::",  # docutils joins the argument's lines (one line would pass its line-length limit)
        *textwrap.wrap(
            f"data:image/png;base64,{base64.b64encode(curve).decode()}",
            76,
            initial_indent="   ",
            subsequent_indent="   ",
            break_on_hyphens=False,
        ),
        "   :width: 100%",
        "",
        "The plots with their captions are under the categories of the menu; the tables are the Parquet "
        "files beside this page's source (results/report/); the workflow's graph is the menu's Workflow entry.",
        "{% endraw %}",
        "",
    ]
    return "\n".join(lines)


def metadata(cfg: DictConfig) -> str:
    """The report's landing-page metadata (Snakemake's ``--report-metadata``, a flat YAML mapping;
    its presence is what makes the report open on the front page): the run's sizes, as numbers,
    because Snakemake 9 renders a string value there as docutils' parts, not as its text."""
    import yaml

    r = cfg.rollout
    facts = {"Iterations": cfg.iterations, "Prompts per iteration": r.prompts_per_iteration}
    facts |= {"Responses per prompt": r.group_size, "Seed": cfg.seed}
    return yaml.safe_dump({k: int(v) for k, v in facts.items()}, sort_keys=False)


def read_metrics(paths: list[str]) -> pl.DataFrame:
    """The train steps of every iteration, in order, numbered by ``global_step``."""
    return (
        pl.concat([read_table(p, schemas.TRAIN_METRICS) for p in paths])
        .sort("iteration", "step")
        .with_columns(pl.int_range(pl.len(), dtype=pl.Int64).alias("global_step"))
    )


def log_rollouts(per_iteration: pl.DataFrame) -> None:
    """What dynamic sampling dropped, and the reward calls that ran past their deadline."""
    if dropped := int(per_iteration["groups_dropped"].sum()):
        log.info(
            "dynamic sampling: %d groups dropped, %d kept over %d iterations; %d shard jobs fell short",
            dropped,
            per_iteration["groups_kept"].sum(),
            per_iteration.height,
            per_iteration["shards_short"].sum(),
        )
    if timeouts := int(per_iteration["reward_timeouts"].sum()):
        log.warning(
            "%d rollout reward calls ran past the reward's deadline and scored 0 (rollouts.parquet: reward_timeouts)",
            timeouts,
        )


def write_mismatch(cfg: DictConfig, feature_files: list[str], out: Path) -> None:
    """mismatch.parquet and mismatch.png from the features' per-token mismatch columns."""
    tc = cfg.train
    threshold = tc.rollout_is_threshold if tc.rollout_is != "none" else None  # read only where it is used
    cols = ["iteration", "behaviour_iteration", "log_ratio", "k3", "seq_max_k2", "seq_mean_k3", "log_ppl_abs_diff"]
    cols += ["is_weights"] if threshold is not None else []  # written by features with train.rollout_is
    tables = [read_table(p, schemas.FEATURES) for p in feature_files]
    features = pl.concat(
        [t.select(cols + (["token_versions"] if "token_versions" in t.columns else [])) for t in tables],
        how="diagonal",
    )
    mismatch = mismatch_table(features, cfg.mismatch.max_k2, cfg.mismatch.mean_k3, threshold)
    write_parquet(mismatch, out / "mismatch.parquet")
    for row in mismatch.filter(pl.col("lag") > 0).iter_rows(named=True):
        log.info(
            "iteration %d: lag %d, behaviour->proximal k3 %.2e, truncated fraction %s (engine mismatch not measured)",
            row["iteration"],
            row["lag"],
            row["k3_mean"],
            "n/a (train.rollout_is none)"
            if math.isnan(row["truncated_fraction"])
            else f"{row['truncated_fraction']:.3f}",
        )
    _plot_mismatch(out / "mismatch.png", features, mismatch)


def plot_curves(out: Path, progress: pl.DataFrame, per_iteration: pl.DataFrame, metrics: pl.DataFrame) -> None:
    """accuracy.png, reward.png, grad_norm.png and response_length.png."""
    # stacked: the front page shows it in its text column (512 px wide in a 1400 px window)
    _plot(out / "accuracy.png", accuracy_panels(progress), stacked=True)
    rolled, generated = per_iteration["iteration"].to_numpy(), per_iteration["tokens_generated"].to_numpy()
    rewards = [("reward", per_iteration["mean_reward"].to_numpy())]
    if not per_iteration["mean_reward"].equals(per_iteration["mean_verifiable_reward"]):  # shaped: both
        rewards.append(("verifiable reward", per_iteration["mean_verifiable_reward"].to_numpy()))
    _plot(
        out / "reward.png",
        [
            ("iteration", "mean rollout reward", [(n, rolled, y) for n, y in rewards]),
            (TOKENS, "mean rollout reward", [(n, generated, y) for n, y in rewards]),
        ],
    )
    _plot(
        out / "grad_norm.png",
        [
            (
                "optimizer step",
                "grad norm (before clipping)",
                [("grad norm", metrics["global_step"].to_numpy(), metrics["grad_norm"].to_numpy())],
            ),
        ],
    )
    _plot(
        out / "response_length.png",
        [
            (
                "iteration",
                "mean response length (tokens)",
                [
                    ("rollout", rolled, per_iteration["mean_rollout_length"].to_numpy()),
                    ("eval (sampled)", progress["iteration"].to_numpy(), progress["mean_response_length"].to_numpy()),
                ],
            ),
        ],
    )


def write_disk(out: Path) -> dict:
    """disk.json: the disk the run takes now, after the retention policy (report/ is in the results
    folder: what the report wrote before counts)."""
    use = usage.used(out.parent)
    write_json(use, out / "disk.json")
    log.info(
        "disk: %s under %s, of which %s policies and optimizer states; %s deleted by the retention policy",
        usage.gib(use["total"]),
        out.parent,
        usage.gib(use["train_outputs"]),
        usage.gib(use["pruned"]),
    )
    return use


def log_accuracy(progress: pl.DataFrame) -> None:
    first, last = progress.row(0, named=True), progress.row(-1, named=True)
    log.info(
        "accuracy (avg@k) %.3f -> %.3f, greedy %.3f -> %.3f over %d iterations, %d tokens generated",
        first["sampled_accuracy"],
        last["sampled_accuracy"],
        first["greedy_accuracy"],
        last["greedy_accuracy"],
        last["iteration"] + 1,
        last["tokens_generated"],
    )


def run(cfg: DictConfig, args: Args) -> None:
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    per_iteration = rollout_table(args.rollouts)
    progress = progress_table(args.summaries, per_iteration)
    metrics = read_metrics(args.metrics)
    comparison = pl.concat([read_table(p, schemas.COMPARISON) for p in args.comparisons])
    write_parquet(progress, out / "progress.parquet")
    write_parquet(per_iteration, out / "rollouts.parquet")
    log_rollouts(per_iteration)
    write_parquet(metrics.select(list(schemas.METRICS.columns)), out / "metrics.parquet")
    write_parquet(comparison, out / "comparison.parquet")
    write_mismatch(cfg, args.features, out)
    plot_curves(out, progress, per_iteration, metrics)
    use = write_disk(out)  # after every other output but the front page's: they count in the disk
    seconds = job_seconds(out.parent, per_iteration.height)
    front = front_page(cfg, progress, per_iteration, use, seconds, (out / "accuracy.png").read_bytes())
    write_text(front, out / "front.rst")
    write_text(metadata(cfg), out / "metadata.yaml")
    log_accuracy(progress)
