import polars as pl
import pytest
import torch
from conftest import tiny_config

from otbflow import schemas
from otbflow.io import read_metadata, read_table, write_parquet
from otbflow.stages import bootstrap, evaluate, report


def test_bootstrap_builds_an_offline_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = tiny_config("bootstrap.sft_max_steps=20", "bootstrap.eval_every=10", "bootstrap.target_accuracy=1.0")
    bootstrap.run(cfg, bootstrap.Args(out=str(tmp_path / "policy"), metrics=str(tmp_path / "curve.parquet")))
    tok = AutoTokenizer.from_pretrained(tmp_path / "policy", local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy", local_files_only=True)
    ids = tok("12+3=", add_special_tokens=False)["input_ids"]
    assert len(ids) == 5 and tok.decode(ids) == "12+3="
    assert model.config.n_layer == cfg.model.n_layer
    curve = pl.read_parquet(tmp_path / "curve.parquet")
    assert curve["step"].to_list() == [0, 10, 20]  # target 1.0 not reached: ran to sft_max_steps
    assert curve["loss"][1] > curve["loss"][2]
    assert read_metadata(tmp_path / "curve.parquet")["steps"] == 20


def test_bootstrap_stops_at_target(tmp_path):
    cfg = tiny_config("bootstrap.target_accuracy=0.0")
    bootstrap.run(cfg, bootstrap.Args(out=str(tmp_path / "p"), metrics=str(tmp_path / "c.parquet")))
    assert pl.read_parquet(tmp_path / "c.parquet")["step"].to_list() == [0]


def test_bootstrap_is_reproducible(tmp_path):
    cfg = tiny_config("bootstrap.sft_max_steps=5", "bootstrap.target_accuracy=1.0")
    for name in ("a", "b"):
        bootstrap.run(cfg, bootstrap.Args(out=str(tmp_path / name), metrics=str(tmp_path / f"{name}.parquet")))
    from safetensors.torch import load_file

    a, b = load_file(tmp_path / "a/model.safetensors"), load_file(tmp_path / "b/model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_evaluate(tmp_path, cfg, tiny_policy, data_dir):
    args = evaluate.Args(
        prompts=str(data_dir / "eval.parquet"),
        policy=str(tiny_policy),
        name="iter_3",
        samples=str(tmp_path / "s.parquet"),
        summary=str(tmp_path / "m.parquet"),
        iteration=3,
    )
    evaluate.run(cfg, args)
    samples = read_table(tmp_path / "s.parquet", schemas.EVAL_SAMPLES)
    n = cfg.task.n_eval
    assert samples.filter(pl.col("mode") == "greedy").height == n
    assert samples.filter(pl.col("mode") == "sampled").height == n * cfg.evaluate.n_samples
    summary = read_table(tmp_path / "m.parquet", schemas.EVAL_SUMMARY).row(0, named=True)
    assert summary["iteration"] == 3 and summary["k"] == cfg.evaluate.n_samples
    assert summary["sampled_accuracy"] == pytest.approx(samples.filter(pl.col("mode") == "sampled")["reward"].mean())
    first = samples
    evaluate.run(cfg, args)
    assert read_table(tmp_path / "s.parquet", schemas.EVAL_SAMPLES).equals(first)  # fixed seed per policy


def test_evaluate_counts_the_reward_timeouts(tmp_path, cfg, tiny_policy, data_dir, monkeypatch, caplog):
    """Issue 35: evaluation scores under the reward's deadline as the rollout does, and says how many
    calls ran past it (here a stand-in verifier whose calls on responses of even length time out,
    counted as the math reward's worker counts them) in the samples' metadata and its log."""
    import logging

    from otbflow.algorithms import rewards
    from otbflow.io import read_metadata
    from otbflow.registry import Entry

    timed_out = []

    def verifier(text, answer):
        if len(text) % 2:
            return 1.0
        timed_out.append(text)
        rewards._WORKER.timeouts += 1
        return 0.0

    monkeypatch.setitem(rewards.REWARDS, "arithmetic", Entry("arithmetic", verifier))
    args = evaluate.Args(
        prompts=str(data_dir / "eval.parquet"),
        policy=str(tiny_policy),
        name="initial",
        samples=str(tmp_path / "s.parquet"),
        summary=str(tmp_path / "m.parquet"),
    )
    with caplog.at_level(logging.WARNING, logger="otbflow.evaluate"):
        evaluate.run(cfg, args)
    samples = read_table(tmp_path / "s.parquet", schemas.EVAL_SAMPLES)
    assert 0 < len(timed_out) == int((samples["response_text"].str.len_chars() % 2 == 0).sum())
    assert read_metadata(tmp_path / "s.parquet")["reward_timeouts"] == len(timed_out)
    assert f"initial: {len(timed_out)} of {samples.height} reward calls ran past" in caplog.text


def test_report_tables_and_token_accounting(tmp_path, rollouts_path, features_path, cfg):
    roll = pl.read_parquet(rollouts_path)
    feats = pl.read_parquet(features_path)
    paths = {}
    for k in (0, 1):
        paths[f"r{k}"] = write_parquet(
            roll.with_columns(pl.lit(k, pl.Int64).alias("iteration")), tmp_path / f"r{k}.parquet"
        )
        shifted = feats.with_columns(pl.lit(k, pl.Int64).alias("iteration"))
        if k == 1:  # iteration 1: the rollout engine disagrees with the trainer on one sequence
            shifted = shifted.with_columns(
                pl.when(pl.int_range(pl.len()) == 0).then(1.0).otherwise(pl.col("seq_max_k2")).alias("seq_max_k2")
            )
        paths[f"f{k}"] = write_parquet(shifted, tmp_path / f"f{k}.parquet")
        given = {
            "iteration": [k, k],
            "step": [0, 1],
            "loss": [0.1, 0.2],
            "clip_fraction": [0.0, 0.1],
            "grad_norm": [1.0, 2.0],
            "lr": [1e-3, 1e-3],
            "entropy": [1.0, 1.0],
            "approx_kl": [0.0, 0.01],
            "tokens": [10, 10],
            "sequences": [4, 4],
            "step_time_s": [0.1, 0.1],
        }
        zero = {pl.Float64: 0.0, pl.Int64: 0, pl.Boolean: False, pl.String: ""}
        paths[f"m{k}"] = write_parquet(
            pl.DataFrame(
                {c: given.get(c, [zero[t]] * 2) for c, t in schemas.TRAIN_METRICS.columns.items()},
                schema=schemas.TRAIN_METRICS.columns,
            ),
            tmp_path / f"m{k}.parquet",
        )
        paths[f"c{k}"] = write_parquet(
            pl.DataFrame(
                [
                    {
                        c: (k if c == "iteration" else "otb" if c == "estimator" else 0.5)
                        for c in schemas.COMPARISON.columns
                    }
                ],
                schema=schemas.COMPARISON.columns,
            ),
            tmp_path / f"c{k}.parquet",
        )
    for name, it, acc in [("initial", -1, 0.2), ("iter_0", 0, 0.3), ("iter_1", 1, 0.4)]:
        paths[name] = write_parquet(
            pl.DataFrame(
                [
                    {
                        "policy": name,
                        "iteration": it,
                        "greedy_accuracy": acc,
                        "sampled_accuracy": acc,
                        "k": 2,
                        "mean_response_length": 10.0,
                        "n_prompts": 8,
                    }
                ],
                schema=schemas.EVAL_SUMMARY.columns,
            ),
            tmp_path / f"{name}.parquet",
        )
    out = tmp_path / "report"
    report.run(
        cfg,
        report.Args(
            summaries=[str(paths[n]) for n in ("iter_1", "initial", "iter_0")],
            metrics=[str(paths["m0"]), str(paths["m1"])],
            rollouts=[str(paths["r0"]), str(paths["r1"])],
            comparisons=[str(paths["c0"]), str(paths["c1"])],
            features=[str(paths["f0"]), str(paths["f1"])],
            out_dir=str(out),
        ),
    )
    progress = read_table(out / "progress.parquet", schemas.PROGRESS)
    per_iter = int(roll["response_length"].sum())
    assert progress["policy"].to_list() == ["initial", "iter_0", "iter_1"]
    assert progress["tokens_generated"].to_list() == [0, per_iter, 2 * per_iter]
    assert read_table(out / "metrics.parquet", schemas.METRICS).height == 4
    mismatch = read_table(out / "mismatch.parquet", schemas.MISMATCH)
    assert mismatch["trm_acceptance"].to_list() == [1.0, pytest.approx(1 - 1 / feats.height)]
    assert mismatch["tokens"].to_list() == [int(feats["response_length"].sum())] * 2
    for png in report.PLOTS:
        assert (out / f"{png}.png").stat().st_size > 1000
    # evaluate.every = 2: iteration 0's policy is not evaluated; the tokens of its rollouts still count
    sparse = tmp_path / "sparse"
    report.run(
        cfg,
        report.Args(
            summaries=[str(paths[n]) for n in ("initial", "iter_1")],
            metrics=[str(paths["m0"]), str(paths["m1"])],
            rollouts=[str(paths["r0"]), str(paths["r1"])],
            comparisons=[str(paths["c0"]), str(paths["c1"])],
            features=[str(paths["f0"]), str(paths["f1"])],
            out_dir=str(sparse),
        ),
    )
    progress = read_table(sparse / "progress.parquet", schemas.PROGRESS)
    assert progress["policy"].to_list() == ["initial", "iter_1"]
    assert progress["tokens_generated"].to_list() == [0, 2 * per_iter]


def test_the_mismatch_table_counts_lag_and_truncation():
    """Iteration 0 on-policy, iteration 1 sampled by iteration 0's policy (rollout.staleness 1):
    the lag, what the log-ratios measure, and the truncated share counted by hand (C = 2)."""
    log_ratio = [[0.1, 0.8, -0.5], [1.0], [0.0, 0.0], [0.3]]
    # token-level weights min(e^log_ratio, 2): e^0.8 = 2.23 and e^1.0 = 2.72 are truncated
    is_weights = [[1.105, 2.0, 0.607], [2.0], [1.0, 1.0], [1.35]]
    features = pl.DataFrame(
        {
            "iteration": [0, 0, 1, 1],
            "behaviour_iteration": [0, 0, 0, 0],
            "log_ratio": log_ratio,
            "k3": [[0.01] * len(x) for x in log_ratio],
            "is_weights": pl.Series(is_weights, dtype=pl.List(pl.Float32)),
            "seq_max_k2": [0.32, 0.5, 0.0, 0.045],
            "seq_mean_k3": [0.01, 0.01, 0.01, 0.01],
            "log_ppl_abs_diff": [0.13, 1.0, 0.0, 0.3],
        }
    )
    table = report.mismatch_table(features, 0.05, 0.02, 2.0)
    assert table["lag"].to_list() == [0, 1]
    assert table["measures"].to_list() == ["engine", "behaviour->proximal"]
    assert table["truncated_fraction"].to_list() == [pytest.approx(2 / 4), 0.0]  # two of iteration 0's four tokens
    assert report.mismatch_table(features, 0.05, 0.02)["truncated_fraction"].is_nan().all()  # rollout_is none
    assert table["trm_acceptance"].to_list() == [0.0, 1.0]  # max k2 0.32 and 0.5 > 0.05; 0 and 0.045 pass


def test_the_front_page_keeps_config_text_inert():
    """A config string on the report's front page (a model path, a task file) stays text when
    Snakemake renders the page (Jinja2, then docutils with file insertion on): a path that closes
    the page's raw block and opens a Jinja expression, or starts an include directive on a new
    line, renders as its characters."""
    import jinja2
    from docutils.core import publish_parts

    from otbflow.stages.report import _inline

    evil = "/models/x {% endraw %}{{ 7 * 7 }}{# c #}\n.. include:: /etc/passwd"
    out = _inline(evil)
    assert "\n" not in out and "{%" not in out and "{{" not in out and "{#" not in out
    rendered = jinja2.Environment().from_string("{% raw %}" + out + "{% endraw %}").render()
    html = publish_parts(rendered, writer_name="html")["html_body"]
    assert "7 * 7" in html and "49" not in html and "root:" not in html and ".. include::" in html


@pytest.mark.parametrize("last_tokens", [154_600, 2_480_000, 61_000_000])
def test_the_learning_curve_reads_at_the_front_pages_width(last_tokens):
    """The learning curve (accuracy.png) at the default run's 154,600 tokens (make run,
    docs/results.md) and at runs 16 and 400 times longer: its tick labels, measured by matplotlib's
    own text extents at the saved 110 dpi, do not overlap on any axis and stay inside the figure;
    the token axis reads with an SI suffix ('150k', not '150000'); and shown 512 px wide (the front
    page's column in a 1400 px window, test_workflow's browser test) its tick labels are at least
    10 px tall. Unstacked, as the report drew it before, the token labels at 154,600 overlapped."""
    import numpy as np

    from otbflow.io import pyplot

    steps = np.linspace(0, last_tokens, 5).round()
    progress = pl.DataFrame(
        {
            "iteration": [-1, 0, 1, 2, 3],
            "tokens_generated": steps.astype(int),
            "greedy_accuracy": [0.625, 0.688, 0.703, 0.766, 0.812],
            "sampled_accuracy": [0.367, 0.469, 0.598, 0.621, 0.660],
            "k": [4] * 5,
        }
    )

    def labels(fig):
        fig.set_dpi(110)
        fig.tight_layout()
        renderer = fig.canvas.get_renderer()
        out = []
        for ax in fig.axes:
            for axis in (ax.xaxis, ax.yaxis):
                lo, hi = sorted(axis.get_view_interval())
                ticks = [(t.label1.get_text(), t.label1.get_window_extent(renderer)) for t in axis.get_major_ticks()]
                ticks = [
                    (text, box) for (text, box), v in zip(ticks, axis.get_majorticklocs()) if lo <= v <= hi and text
                ]
                out.append((axis.axis_name, ticks))
        return out, renderer

    def overlaps(ticks) -> list[tuple[str, str]]:
        return [(a, b) for (a, ba), (b, bb) in zip(ticks, ticks[1:]) if ba.overlaps(bb)]

    fig = report._figure(report.accuracy_panels(progress), stacked=True)
    axes, _ = labels(fig)
    width_px, height_px = fig.get_size_inches() * 110
    for name, ticks in axes:
        assert len(ticks) >= 3 and not overlaps(ticks), (name, [t for t, _ in ticks])
        for text, box in ticks:
            assert box.x0 >= 0 and box.x1 <= width_px and box.y0 >= 0 and box.y1 <= height_px, text
            assert box.height * 512 / width_px >= 10, (text, box.height, width_px)
    tokens = [t for t, _ in axes[2][1]]
    assert all(t == "0" or t[-1] in "kM" for t in tokens), tokens
    pyplot().close(fig)
    if last_tokens == 154_600:  # the layout before: side by side, 5 x 3.6 in each, plain labels
        plt = pyplot()
        old, ax = plt.subplots(1, 1, figsize=(5, 3.6))
        ax.plot(progress["tokens_generated"].to_numpy(), progress["sampled_accuracy"].to_numpy())
        (_, ticks), _ = labels(old)[0]  # its x axis
        assert overlaps(ticks), [t for t, _ in ticks]
        plt.close(old)
