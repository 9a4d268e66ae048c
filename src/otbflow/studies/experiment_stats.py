"""The statistics of an experiment's report (``otbflow.stages.experiment``), over the members'
eval curves and train steps: one row per (run, seed) (``per_seed_table``), one per run with
t-intervals over the seeds (``summary_table``), one per analysis pair seed by seed
(``paired_table``), and their parts: the tokens to the target accuracy (``tokens_to_target``), its
median with censored seeds (``censored_median``), which member of a seed got there first
(``first_to_target``) and the largest equal budget of rollout responses (``matched_budget``).
The interval arithmetic: ``otbflow.studies.stats``; the choices: docs/experiments.md."""

from __future__ import annotations

import math

import numpy as np
import polars as pl

from otbflow import schemas
from otbflow.studies.stats import late_trend, t_interval


def tokens_to_target(tokens: np.ndarray, accuracy: np.ndarray, target: float) -> float | None:
    """Rollout tokens at which an accuracy curve (one point per evaluated policy, in order) first
    reaches ``target``, linear between evaluations; 0 if the first (initial) policy is already
    there; None if it never does (censored: the run ended before)."""
    for i, acc in enumerate(accuracy):
        if acc >= target:
            if i == 0:
                return float(tokens[0])
            frac = (target - accuracy[i - 1]) / (acc - accuracy[i - 1])
            return float(tokens[i - 1] + frac * (tokens[i] - tokens[i - 1]))
    return None


def censored_median(reached: np.ndarray, n: int) -> float:
    """Median over ``n`` seeds of the tokens to the target, the ``n - len(reached)`` seeds that
    never reached it counted as +inf (they needed more than their run's tokens): finite only when
    more than half of the seeds reached the target, else NaN. Never a mean over the seeds that
    reached it (which would drop the slow seeds)."""
    if n == 0:
        return float("nan")
    median = float(np.median(np.concatenate([np.asarray(reached, dtype=float), np.full(n - len(reached), np.inf)])))
    return median if math.isfinite(median) else float("nan")


def per_seed_table(exp: dict, curves: pl.DataFrame, metrics: pl.DataFrame) -> pl.DataFrame:
    """One row per (run, seed): initial and final avg@k and greedy accuracy, tokens generated and
    trained, whether and at how many tokens avg@k reached the fixed ``analysis.target`` (NaN when
    it did not: censored at the member's tokens_generated), the avg@k gain over the last
    ``plateau_window`` iterations (from the last evaluation at least that many iterations before
    the final one, see evaluate.every; nan if there is none), the longest mean response length
    relative to the initial one, the largest finite grad norm and, beside it, the steps whose loss
    or gradient was not finite (skipped: no update; the instability signal a max over the
    finite norms would hide), and the lowest avg@k on the way."""
    a = exp["analysis"]
    target = float(a["target"])
    finite = pl.col("grad_norm").is_finite()
    trained = metrics.group_by("run", "seed").agg(
        pl.col("tokens").sum().cast(pl.Float64).alias("tokens_trained"),
        pl.col("grad_norm").filter(finite).max().fill_null(float("nan")).alias("max_grad_norm"),
        (~finite).sum().cast(pl.Int64).alias("nonfinite_steps"),  # a skipped step's norm is NaN
    )
    window = int(a["plateau_window"])
    rows = []
    for (run, seed), part in curves.sort("iteration").group_by(["run", "seed"], maintain_order=True):
        acc = part["sampled_accuracy"].to_numpy()
        length = part["mean_response_length"].to_numpy()
        its = part["iteration"].to_numpy()
        before = np.flatnonzero(its <= its[-1] - window)  # evaluations >= window iterations before the last
        late_gain = float(acc[-1] - acc[before[-1]]) if len(before) else float("nan")
        ttt = tokens_to_target(part["tokens_generated"].to_numpy(), acc, target)
        rows.append(
            {
                "run": run,
                "seed": seed,
                "initial_accuracy": acc[0],
                "final_accuracy": acc[-1],
                "late_gain": late_gain,
                "final_greedy_accuracy": part["greedy_accuracy"][-1],
                "min_accuracy": float(acc.min()),
                "tokens_generated": float(part["tokens_generated"][-1]),
                "responses_generated": float(part["responses_generated"][-1]),
                "target_accuracy": target,
                "reached_target": ttt is not None,
                "tokens_to_target": float("nan") if ttt is None else ttt,
                "final_response_length": float(length[-1]),
                "max_length_ratio": float(length.max() / max(length[0], 1e-9)),
            }
        )
    out = pl.DataFrame(rows).join(trained, on=["run", "seed"], how="left")
    order = {r: i for i, r in enumerate(exp["runs"])}
    return out.sort(pl.col("run").replace_strict(order), "seed").select(list(schemas.EXPERIMENT_SEEDS.columns))


def summary_table(exp: dict, per_seed: pl.DataFrame) -> pl.DataFrame:
    """One row per run: means over seeds with t-intervals (``otbflow.studies.stats.t_interval``: the seeds'
    values assumed normal), the late gain read as plateau / rising / falling / unresolved against
    ``analysis.plateau_margin``, and the tokens to the target as how many seeds reached it, their
    median with the others censored, and the fastest and slowest seed that reached it."""
    a = exp["analysis"]
    rows = []
    for run in exp["runs"]:
        part = per_seed.filter(pl.col("run") == run)
        final = part["final_accuracy"].to_numpy()
        reached = part.filter(pl.col("reached_target"))["tokens_to_target"].to_numpy()
        ci = t_interval(final, a["confidence"])
        late = part["late_gain"].to_numpy()
        late = late[np.isfinite(late)]  # members with fewer evaluations than the window have none
        lci = t_interval(late, a["confidence"])
        rows.append(
            {
                "run": run,
                "seeds": part.height,
                "initial_accuracy": float(part["initial_accuracy"].mean()),
                "final_accuracy": float(final.mean()),
                "final_accuracy_lo": ci[0],
                "final_accuracy_hi": ci[1],
                "final_accuracy_std": float(final.std(ddof=1)) if len(final) > 1 else 0.0,
                "final_greedy_accuracy": float(part["final_greedy_accuracy"].mean()),
                "accuracy_gain": float(final.mean() - part["initial_accuracy"].mean()),
                "late_gain": float(late.mean()) if len(late) else float("nan"),
                "late_gain_lo": lci[0],
                "late_gain_hi": lci[1],
                "late_trend": late_trend(lci[0], lci[1], float(a["plateau_margin"])),
                "target_accuracy": float(a["target"]),
                "reached_seeds": int(len(reached)),
                "tokens_to_target": censored_median(reached, part.height),
                "tokens_to_target_min": float(reached.min()) if len(reached) else float("nan"),
                "tokens_to_target_max": float(reached.max()) if len(reached) else float("nan"),
                "tokens_generated": float(part["tokens_generated"].mean()),
                "responses_generated": float(part["responses_generated"].mean()),
                "tokens_trained": float(part["tokens_trained"].mean()),
                "final_response_length": float(part["final_response_length"].mean()),
                "max_length_ratio": float(part["max_length_ratio"].max()),
                "min_accuracy": float(part["min_accuracy"].min()),
                "max_grad_norm": float(part["max_grad_norm"].max()),
                "nonfinite_steps": int(part["nonfinite_steps"].sum()),
            }
        )
    return pl.DataFrame(rows, schema=schemas.EXPERIMENT_SUMMARY.columns)


def first_to_target(ta: float | None, tb: float | None, end_a: float, end_b: float) -> str:
    """Which of two members of one seed reached the target first: 'a', 'b', 'neither' (both
    censored), or 'undecided' (the same tokens, e.g. both already there at 0, or one censored
    before the tokens at which the other reached it: it might have reached it sooner). A crossing
    at 0 tokens (the initial policy already at the target) counts like any other."""
    if ta is None and tb is None:
        return "neither"
    if ta is not None and tb is not None:
        return "a" if ta < tb else "b" if tb < ta else "undecided"
    if ta is not None:  # b censored at end_b
        return "a" if ta <= end_b else "undecided"
    return "b" if tb <= end_a else "undecided"


def matched_budget(curves: pl.DataFrame, a: str, b: str) -> int:
    """The largest number of rollout responses generated (dropped groups' included: the members'
    reports count them from the rollouts' metadata) after which both runs were evaluated on every
    seed (the initial policy aside): the point where they compare at an equal rollout budget
    without interpolating either curve. 0 if there is none: make evaluate.every put evaluations
    there (e.g. N = 4 every 4th iteration against N = 16 every iteration); a run with dynamic
    sampling generates a budget of its own per seed and iteration, so it rarely has one."""
    common = None
    for run in (a, b):
        for _, part in curves.filter(pl.col("run") == run).group_by("seed"):
            points = set(part.filter(pl.col("responses_generated") > 0)["responses_generated"].to_list())
            common = points if common is None else common & points
    return max(common) if common else 0


def paired_table(exp: dict, per_seed: pl.DataFrame, curves: pl.DataFrame) -> pl.DataFrame:
    """For each analysis pair [a, b], seed by seed: the final avg@k difference a - b with the
    t-interval of the per-seed differences (assumed normal); which run reached the target first
    (counts of seeds); and the avg@k difference at the largest equal budget of rollout responses
    where both were evaluated (``matched_budget``; the ``matched_responses*`` columns), with its
    t-interval and both runs' tokens there."""
    an = exp["analysis"]
    rows = []
    for a, b in an["pairs"]:
        joined = per_seed.filter(pl.col("run") == a).join(per_seed.filter(pl.col("run") == b), on="seed", suffix="_b")
        diff = (joined["final_accuracy"] - joined["final_accuracy_b"]).to_numpy()
        dci = t_interval(diff, an["confidence"])
        first = [
            first_to_target(
                r["tokens_to_target"] if r["reached_target"] else None,
                r["tokens_to_target_b"] if r["reached_target_b"] else None,
                r["tokens_generated"],
                r["tokens_generated_b"],
            )
            for r in joined.iter_rows(named=True)
        ]
        budget = matched_budget(curves, a, b)
        row = {
            "a": a,
            "b": b,
            "seeds": joined.height,
            "accuracy_diff": float(diff.mean()) if len(diff) else float("nan"),
            "accuracy_diff_lo": dci[0],
            "accuracy_diff_hi": dci[1],
            "a_better_seeds": int((diff > 0).sum()),
            "a_first_seeds": first.count("a"),
            "b_first_seeds": first.count("b"),
            "neither_seeds": first.count("neither"),
            "undecided_seeds": first.count("undecided"),
            "matched_responses": budget,
            "matched_responses_tokens_a": float("nan"),
            "matched_responses_tokens_b": float("nan"),
            "matched_responses_diff": float("nan"),
            "matched_responses_diff_lo": float("nan"),
            "matched_responses_diff_hi": float("nan"),
            "matched_responses_a_better_seeds": 0,
        }
        if budget:
            at = curves.filter(pl.col("responses_generated") == budget)
            m = at.filter(pl.col("run") == a).join(at.filter(pl.col("run") == b), on="seed", suffix="_b")
            mdiff = (m["sampled_accuracy"] - m["sampled_accuracy_b"]).to_numpy()
            mci = t_interval(mdiff, an["confidence"])
            row |= {
                "matched_responses_tokens_a": float(m["tokens_generated"].mean()),
                "matched_responses_tokens_b": float(m["tokens_generated_b"].mean()),
                "matched_responses_diff": float(mdiff.mean()),
                "matched_responses_diff_lo": mci[0],
                "matched_responses_diff_hi": mci[1],
                "matched_responses_a_better_seeds": int((mdiff > 0).sum()),
            }
        rows.append(row)
    return pl.DataFrame(rows, schema=schemas.EXPERIMENT_PAIRS.columns)
