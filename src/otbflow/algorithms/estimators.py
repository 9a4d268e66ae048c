"""Advantage estimators: baselines and advantages from stored per-token features, and their
variance diagnostics (numpy and polars; no torch).

    compute_advantages(table, estimator, **options) -> table + advantages, baselines
    diagnostics(table) -> dict of variance-proxy metrics
    compare(table, estimator, **options) -> (table + advantages, baselines; its comparison row)
    ESTIMATORS  (name -> Estimator); add one with @register("name", needs=(...), normalises=...)

Every estimator works on flat token arrays with per-sequence offsets (``Batch``) in float64,
without a Python loop over groups or tokens. Formulas and edge cases: docs/estimators.md and
../shared/docs/algorithms.md §1, §2, §6.2.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import numpy as np
import polars as pl
import pyarrow as pa
from omegaconf import DictConfig

from otbflow import schemas
from otbflow.io import SchemaError, check_finite, check_schema
from otbflow.registry import Entry, Registry

EPS_OTB = 1e-8
EPS_STD = 1e-6


# ------------------------------------------------------------------------------------------
# Flat token layout
# ------------------------------------------------------------------------------------------


def _flat(series: pl.Series, dtype=np.float64) -> np.ndarray:
    """Values of a list column, concatenated (empty lists contribute nothing), as a new
    (writable) array."""
    arr = series.to_arrow()
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks()
    # to numpy through polars: pyarrow's to_numpy imports pandas (0.3 s of the advantages stage)
    return np.array(pl.Series(arr.flatten()).to_numpy(), dtype=dtype)


@dataclass
class Batch:
    """One table laid out as flat token arrays. Sequence i owns tokens offsets[i]:offsets[i+1]."""

    reward: np.ndarray  # [S] outcome reward R_i
    group: np.ndarray  # [S] dense group index 0..n_groups-1
    n_groups: int
    lengths: np.ndarray  # [S] tokens per sequence (list length)
    offsets: np.ndarray  # [S+1]
    has_mask: bool  # False: no loss_mask column, every token counts (multiplications skipped)
    returns: np.ndarray  # [N] G_t: reward-to-go over token_rewards, else R_i
    table: pl.DataFrame

    @cached_property
    def mask(self) -> np.ndarray:
        """[N] float 1/0: the loss_mask, or all ones."""
        if self.has_mask:
            return _flat(self.table["loss_mask"].cast(pl.List(pl.Float64)))
        return np.ones(int(self.offsets[-1]))

    @cached_property
    def seq(self) -> np.ndarray:
        """[N] sequence index of each token."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths)

    @cached_property
    def pos(self) -> np.ndarray:
        """[N] absolute position of each token within its sequence."""
        return np.arange(int(self.offsets[-1]), dtype=np.int64) - np.repeat(self.offsets[:-1], self.lengths)

    @property
    def valid_len(self) -> np.ndarray:
        """T_i: number of mask=1 tokens per sequence."""
        if not self.has_mask:
            return self.lengths.astype(np.float64)
        return np.bincount(self.seq, weights=self.mask, minlength=len(self.reward))

    def group_size(self) -> np.ndarray:
        return np.bincount(self.group, minlength=self.n_groups)

    def seq_to_tokens(self, x: np.ndarray) -> np.ndarray:
        return np.repeat(x, self.lengths)

    def column(self, name: str) -> np.ndarray:
        return _flat(self.table[name])

    def energy(self) -> np.ndarray:
        """Per-token Logit-Gradient Proxy w_t = max(0, 1 - 2 pi + sum_pi_sq), in float64 (where
        the fp32 cancellation near pi = 1 that algorithms.md §1.2 warns about does not arise)."""
        w = self.column("sum_pi_sq")
        w -= 2.0 * np.exp(_flat(self.table["logprobs"], np.float32))  # pi to fp32 precision
        w += 1.0
        return np.maximum(w, 0.0, out=w)


def make_batch(table: pl.DataFrame) -> Batch:
    lengths = table["logprobs"].list.len().to_numpy().astype(np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    n_tok = int(offsets[-1])
    _, group = np.unique(table["group_id"].to_numpy(), return_inverse=True)
    reward = table["reward"].to_numpy().astype(np.float64)
    has_mask = "loss_mask" in table.columns
    if "token_rewards" in table.columns:
        r = _flat(table["token_rewards"])
        if has_mask:
            r *= _flat(table["loss_mask"].cast(pl.List(pl.Float64)))
        csum = np.cumsum(r)
        # reward-to-go: G_t = sum_{k>=t} r_k = (total of the sequence) - (prefix before t)
        seq_end = np.repeat(csum[np.maximum(offsets[1:] - 1, 0)], lengths) if n_tok else csum
        returns = seq_end - csum + r
    else:
        returns = np.repeat(reward, lengths)
    return Batch(
        reward,
        group.astype(np.int64),
        int(group.max()) + 1 if len(group) else 0,
        lengths,
        offsets,
        has_mask,
        returns,
        table,
    )


def _segment_sum(values: np.ndarray, index: np.ndarray, size: int) -> np.ndarray:
    return np.bincount(index, weights=values, minlength=size)


def _cumsum_per_seq(b: Batch, x: np.ndarray) -> np.ndarray:
    """Inclusive cumulative sum of a token array within each sequence."""
    c = np.cumsum(x)
    before = np.concatenate([[0.0], c])[b.offsets[:-1]]
    c -= np.repeat(before, b.lengths)
    return c


# ------------------------------------------------------------------------------------------
# Registry
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Estimator(Entry):
    """A registered estimator: ``obj`` is ``fn(batch, **options) -> (baselines, advantages)``, its
    options (advantages.*) the function's keyword parameters, ``needs`` the input columns it reads."""

    needs: tuple[str, ...] = ()
    normalises: bool | str = False
    """Whether its advantages are divided by a data-dependent scale: True, False, or the name of
    the boolean option that switches the division (its default from the function's signature)."""

    @property
    def fn(self) -> Callable[..., tuple]:
        return self.obj

    def normalises_with(self, options: dict) -> bool:
        """Whether this estimator, run with ``options``, divides its advantages by a scale."""
        if isinstance(self.normalises, bool):
            return self.normalises
        import inspect

        default = inspect.signature(self.fn).parameters[self.normalises].default
        return bool(options.get(self.normalises, default))


ESTIMATORS = Registry("estimator", "advantages", entry=Estimator)
"""The advantage estimators by name (``advantages.estimator``, ``advantages.compare``,
``variance.estimators``): the config's choices are this registry."""


def register(name: str, needs: tuple[str, ...] = (), normalises: bool | str = False) -> Callable:
    """Register ``fn(batch, **options) -> (baselines, advantages)`` (flat per-token float64); its
    keyword parameters are its options, read from the config's ``advantages`` section, and
    ``needs`` the columns it reads beyond group_id, reward and logprobs (the config refuses an
    estimator whose columns the run's tables do not have).

    An estimator that divides its advantages by a data-dependent scale declares it with
    ``normalises`` (True, or the name of the boolean option that switches it) and returns
    ``(baselines, advantages, scale)``: ``scale`` per token, such that advantages x scale is the
    advantage on the raw-reward scale, G - baselines on valid tokens (None when the options turn
    the division off). The comparison table reports its diagnostics on that raw scale."""

    def deco(fn: Callable) -> Callable:
        import inspect

        options = tuple(k for k in inspect.signature(fn).parameters if k != "b")
        columns = ("group_id", "reward", "logprobs") + tuple(needs)
        return ESTIMATORS.register(name, options=options, needs=columns, normalises=normalises)(fn)

    return deco


def with_seq_baseline(
    b: Batch, base_seq: np.ndarray, shift: float, scale_seq: np.ndarray | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """Broadcast a per-sequence baseline b_i. Without a scale: A_t = (G_t - b_i - shift) m_t and the
    baseline column is b_i + shift. With a scale s_i (std-normalised GRPO) the shift acts on the
    normalised scale: A_t = ((G_t - b_i) / s_i - shift) m_t, i.e. the baseline b_i + shift s_i
    (so A_t s_i = (G_t - baseline) m_t: the raw-scale advantage)."""
    base = b.seq_to_tokens(base_seq)
    adv = b.returns - base
    if scale_seq is None:
        if shift:
            base += shift
            adv -= shift
    else:
        scale = b.seq_to_tokens(scale_seq)
        adv /= scale
        if shift:
            base += shift * scale
            adv -= shift
    return base, adv * b.mask if b.has_mask else adv


def _group_first(b: Batch) -> np.ndarray:
    """[n_groups] the row index of each group's first sequence."""
    first = np.full(b.n_groups, len(b.group), dtype=np.int64)
    np.minimum.at(first, b.group, np.arange(len(b.group)))
    return first


def _group_ref(b: Batch) -> np.ndarray:
    """[S] the reward of the first row of each sequence's group. Group statistics are taken of
    R - ref and ref added back, so that an all-equal group gives exactly its reward as every
    baseline (A = 0, no rounding residue: (0.7 + 0.7 + 0.7) / 3 != 0.7 in floating point)."""
    return b.reward[_group_first(b)][b.group]


def group_mean(b: Batch, x: np.ndarray) -> np.ndarray:
    """Each sequence's group mean of the per-sequence values ``x`` (b.reward: each group's mean
    reward), per sequence."""
    n = b.group_size()
    if x is b.reward:
        ref = _group_ref(b)
        return ref + (_segment_sum(x - ref, b.group, b.n_groups) / np.maximum(n, 1))[b.group]
    return (_segment_sum(x, b.group, b.n_groups) / np.maximum(n, 1))[b.group]


@register("none")
def none(b: Batch, baseline_shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """No baseline: the advantage is the return (REINFORCE)."""
    return with_seq_baseline(b, np.zeros_like(b.reward), baseline_shift)


@register("grpo", normalises="std_normalize")
def grpo(b: Batch, std_normalize: bool = True, baseline_shift: float = 0.0) -> tuple:
    """Group mean baseline, optionally divided by the unbiased group std + 1e-6 (Dr.GRPO: off).

    With std normalisation the shift is applied on the normalised scale, A = (G - mean) / (std +
    1e-6) - shift: an all-equal group then gets A = -shift like every other estimator, instead of
    -shift / 1e-6."""
    n = b.group_size()
    mean = group_mean(b, b.reward)
    mean[n[b.group] == 1] = 0.0  # verl: a singleton has mean 0, std 1
    if not std_normalize:
        return (*with_seq_baseline(b, mean, baseline_shift), None)
    sq = _segment_sum((b.reward - mean) ** 2, b.group, b.n_groups)
    std = np.sqrt(sq / np.maximum(n - 1, 1))[b.group]
    std[n[b.group] == 1] = 1.0
    return (*with_seq_baseline(b, mean, baseline_shift, std + EPS_STD), b.seq_to_tokens(std + EPS_STD))


@register("rloo")
def rloo(b: Batch, baseline_shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Leave-one-out mean of the other rewards of the group; a singleton gets baseline 0."""
    n = b.group_size()[b.group]
    ref = _group_ref(b)
    d = b.reward - ref
    total = _segment_sum(d, b.group, b.n_groups)[b.group]
    base = np.where(n > 1, ref + (total - d) / np.maximum(n - 1, 1), 0.0)
    return with_seq_baseline(b, base, baseline_shift)


@register("reinforce_pp_baseline", normalises=True)
def reinforce_pp_baseline(b: Batch) -> tuple:
    """REINFORCE++ with baseline: (R - group mean), whitened over all valid tokens of the batch.

    It takes no baseline_shift: the whitening subtracts the batch mean, which removes any constant
    shift of the baseline. The whitening (x - mu) / sigma over the batch's valid tokens is a
    baseline mean + mu and a division by sigma = sqrt(var + 1e-8): the baselines column holds
    mean + mu (the raw-scale baseline, G - baselines = sigma A on valid tokens), the scale is
    sigma. With fewer than two valid tokens nothing is whitened (baseline mean, scale 1)."""
    n = b.group_size()
    mean = group_mean(b, b.reward)
    mean[n[b.group] == 1] = 0.0
    base, adv = with_seq_baseline(b, mean, 0.0)
    valid = b.mask > 0
    sigma = 1.0
    if valid.sum() > 1:
        mu = adv[valid].mean()
        sigma = float(np.sqrt(adv[valid].var(ddof=1) + 1e-8))
        adv = (adv - mu) / sigma * b.mask
        base = base + mu
    return base, adv, np.full(len(adv), sigma)


def _weighted_baseline(b: Batch, weight: np.ndarray, leave_one_out: bool) -> np.ndarray:
    """Per-sequence sum_j w_j R_j / sum_j w_j over the group (or over j != i). Groups of one
    get baseline 0; a group whose weights are all 0 falls back to the plain mean."""
    n = b.group_size()[b.group]
    ref = _group_ref(b)
    d = b.reward - ref
    num = _segment_sum(weight * d, b.group, b.n_groups)[b.group]
    den = _segment_sum(weight, b.group, b.n_groups)[b.group]
    if leave_one_out:
        num, den = num - weight * d, den - weight
        mean = np.where(n > 1, (_segment_sum(d, b.group, b.n_groups)[b.group] - d) / np.maximum(n - 1, 1), 0.0)
    else:
        mean = _segment_sum(d, b.group, b.n_groups)[b.group] / np.maximum(n, 1)
    base = ref + np.where(den > 0, num / np.where(den > 0, den, 1.0), mean)
    return np.where(n > 1, base, 0.0)


@register("opo")
def opo(b: Batch, baseline_shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """OPO: length-weighted group baseline sum_i T_i R_i / sum_i T_i."""
    return with_seq_baseline(b, _weighted_baseline(b, b.valid_len, False), baseline_shift)


@register("length_power")
def length_power(
    b: Batch, exponent: float = 1.0, leave_one_out: bool = False, baseline_shift: float = 0.0
) -> tuple[np.ndarray, np.ndarray]:
    """Length-power baseline: weights T_i^s (s=0: group mean, s=1: OPO)."""
    t = b.valid_len
    weight = np.ones_like(t) if exponent == 0 else np.where(t > 0, np.power(np.maximum(t, 1e-300), exponent), 0.0)
    return with_seq_baseline(b, _weighted_baseline(b, weight, leave_one_out), baseline_shift)


@register("eob", needs=("grad_sq_norm",))
def eob(b: Batch, baseline_shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Exact optimal baseline: weights = exact per-sequence squared gradient norms.

    b = sum_i n_i R_i / (sum_i n_i + 1e-8) as algorithms.md §1.9, taken relative to a member's
    reward (so an all-equal group gets exactly A = 0); the plain mean when sum_i n_i < 1e-10."""
    n_i = b.table["grad_sq_norm"].to_numpy().astype(np.float64)
    ref = _group_ref(b)
    den = _segment_sum(n_i, b.group, b.n_groups)[b.group]
    num = _segment_sum(n_i * (b.reward - ref), b.group, b.n_groups)[b.group]
    base = np.where(den >= 1e-10, ref + num / (den + EPS_OTB), group_mean(b, b.reward))
    base = np.where(b.group_size()[b.group] > 1, base, 0.0)
    return with_seq_baseline(b, base, baseline_shift)


def _concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, s + n) for each (s, n)."""
    total = int(lengths.sum())
    return np.repeat(starts - np.concatenate([[0], np.cumsum(lengths)[:-1]]), lengths) + np.arange(total)


def _zero_tail_sequences(group: np.ndarray, length: np.ndarray, member: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """verl's handle_zero_tail: among the ``member`` sequences of each group of two or more, a
    unique longest one (by ``length``, ties disable it) gets baseline 0 from the second-longest
    length L2 on. Returns (those sequences, their L2)."""
    idx = np.flatnonzero(member)
    if len(idx) < 2:
        return idx[:0], idx[:0]
    order = idx[np.lexsort((-length[idx], group[idx]))]
    g, ln = group[order], length[order]
    first = np.ones(len(order), bool)
    first[1:] = g[1:] != g[:-1]
    top = np.flatnonzero(first)
    nxt = np.minimum(top + 1, len(order) - 1)
    ok = (top + 1 < len(order)) & (g[nxt] == g[top]) & (ln[top] > ln[nxt])
    return order[top[ok]], ln[nxt[ok]]


def _otb(
    b: Batch,
    pos: np.ndarray | None,
    length: np.ndarray,
    member: np.ndarray,
    handle_zero_tail: bool,
    baseline_shift: float,
) -> tuple[np.ndarray, np.ndarray]:
    """OTB over token positions ``pos`` (the compacted index for TIR; None: absolute positions).
    ``length`` is each sequence's number of mask = 1 tokens (verl: mask.sum(-1)); ``member``
    marks the sequences that count in their group's size (a group of one member gets no baseline)
    and in the zero-tail comparison.

    The baseline lives on a [group, position] grid, B = sum(m W G) / sum(m W), both sums a
    scatter-add (bincount) over (group, position); each token then reads its grid cell. The sums
    are taken relative to a reference return (the group's first reward; with token_rewards, the
    return of any member alive in the cell), so that an all-equal group gets exactly its return as
    the baseline (A = 0, no eps residue). A cell with sum(m W) = 0 (every alive member's prefix
    has zero energy, so their logit gradients are 0) gets the plain mean of its alive returns."""
    w = b.energy()
    if "is_weights" in b.table.columns:
        w *= _flat(b.table["is_weights"]) ** 2
    masked = b.has_mask
    W = _cumsum_per_seq(b, w * b.mask if masked else w)
    n_tok = int(b.offsets[-1])
    width = max(int(b.lengths.max()) if pos is None else int(length.max()), 1) if len(length) else 1
    if pos is None:  # key = group * width + (token index - sequence start), in one pass
        key = np.arange(n_tok, dtype=np.int64)
        key -= np.repeat(b.offsets[:-1] - b.group * width, b.lengths)
    else:
        key = np.repeat(b.group * width, b.lengths) + pos
    size = b.n_groups * width
    G = b.returns
    mW = W * b.mask if masked else W
    if "token_rewards" in b.table.columns:  # returns vary along a sequence: one alive return per cell
        ref = np.zeros(size)
        valid = b.mask > 0
        ref[key[valid]] = G[valid]  # any alive member's (for repeated cells, whichever is written)
        dG = G - ref[key]
    else:  # G = R on every token: the first member's reward, per group
        first = _group_first(b)
        dG = b.seq_to_tokens(b.reward - b.reward[first][b.group])
        ref = np.repeat(b.reward[first], width)
    num = np.bincount(key, weights=mW * dG, minlength=size)
    den = np.bincount(key, weights=mW, minlength=size)
    grid = ref + num / np.where(den > 0, den, 1.0)
    zero = (mW == 0) & (b.mask > 0) if masked else W == 0
    if zero.any():  # cells whose alive members all have zero energy over their prefix: the plain mean
        cells = np.unique(key[zero])
        cells = cells[den[cells] <= 0]
        if len(cells):
            cnt = np.bincount(key, weights=b.mask if masked else None, minlength=size)
            alive = np.bincount(key, weights=dG * b.mask if masked else dG, minlength=size)
            grid[cells] = ref[cells] + alive[cells] / cnt[cells]
    grid = grid.reshape(b.n_groups, width)
    n = np.bincount(b.group, weights=member.astype(np.float64), minlength=b.n_groups)
    grid[n <= 1] = 0.0  # a group of one: no baseline, A = G
    seqs, second = _zero_tail_sequences(b.group, length, member) if handle_zero_tail else ([], [])
    if len(seqs) and not masked:
        # without a mask the other members end by L2: the tail is the group's grid cells [L2, width)
        grid.ravel()[_concat_ranges(b.group[seqs] * width + second, width - second)] = 0.0
    base = grid.ravel()[key]
    if len(seqs) and masked:  # only the longest member's tokens: others may have valid tokens beyond L2
        if pos is None:  # absolute positions: the contiguous range [L2, list length)
            base[_concat_ranges(b.offsets[seqs] + second, b.lengths[seqs] - second)] = 0.0
        else:
            tok = _concat_ranges(b.offsets[seqs], b.lengths[seqs])
            base[tok[pos[tok] >= np.repeat(second, b.lengths[seqs])]] = 0.0
    if baseline_shift:
        base += baseline_shift
    adv = G - base
    return base, adv * b.mask if masked else adv


@register("otb", needs=("sum_pi_sq",))
def otb(b: Batch, handle_zero_tail: bool = True, baseline_shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Optimal Token Baseline: per-position energy-weighted mean of the returns still alive.

    As verl's compute_optimal_token_baseline_advantage: lengths and the zero-tail come from the
    loss_mask (its count of 1s), every row of a group counts as a member (an empty response
    too), the zero-tail starts at the absolute position L2."""
    return _otb(b, None, b.valid_len.astype(np.int64), np.ones(len(b.lengths), bool), handle_zero_tail, baseline_shift)


@register("otb_tir", needs=("sum_pi_sq", "loss_mask"))
def otb_tir(b: Batch, handle_zero_tail: bool = True, baseline_shift: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """Multi-turn OTB: positions are the compacted index of model tokens (loss_mask = 1).

    As verl's compute_multi_turn_optimal_token_baseline_advantage: responses without a model
    token are not group members; lengths and the zero-tail are counted in model tokens."""
    compact = np.maximum(_cumsum_per_seq(b, b.mask) - 1, 0).astype(np.int64)
    length = b.valid_len.astype(np.int64)
    return _otb(b, compact, length, length > 0, handle_zero_tail, baseline_shift)


# ------------------------------------------------------------------------------------------
# Public API
# ------------------------------------------------------------------------------------------


def _check_input(table: pl.DataFrame, est: Estimator) -> None:
    for col in est.needs:
        if col not in table.columns:
            raise SchemaError(
                f"estimator '{est.name}' needs column '{col}', which the table lacks ({est.name}: {est.doc})"
            )
    check_schema(table, schemas.ADVANTAGE_INPUT, f"estimator '{est.name}' input")  # dtypes, nulls, ragged lists
    # every float column it reads: a NaN in one row's would make every advantage of the batch NaN
    read = ("reward", "logprobs", "token_rewards", "is_weights", *est.needs)
    floats = [c for c in dict.fromkeys(read) if c in schemas.ADVANTAGE_INPUT.floats]
    check_finite(table, floats, f"estimator '{est.name}' input")


def _arrow(values: np.ndarray, dtype: type) -> pa.Array:
    """1-D ``values`` cast to ``dtype`` (a copy), as an Arrow array without nulls: the array
    ``pa.array`` makes of them, without its import of pandas (see ``_flat``)."""
    copy = values.astype(dtype)
    return pa.Array.from_buffers(pa.from_numpy_dtype(copy.dtype), len(copy), [None, pa.py_buffer(copy)])


def _to_list_column(name: str, flat: np.ndarray, offsets: np.ndarray) -> pl.Series:
    return pl.Series(name, pa.ListArray.from_arrays(_arrow(offsets, np.int32), _arrow(flat, np.float32)))


def _prepare(table: pl.DataFrame, estimator: str, options: dict) -> tuple[Estimator, Batch]:
    if estimator not in ESTIMATORS:
        raise ValueError(f"unknown estimator '{estimator}'; registered: {', '.join(sorted(ESTIMATORS))}")
    est = ESTIMATORS[estimator]
    accepted = estimator_parameters(estimator)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"estimator '{estimator}' takes no option {', '.join(map(repr, unknown))}; its options: "
            f"{', '.join(accepted) or 'none'}"
        )
    _check_input(table, est)
    return est, make_batch(table)


def compute_advantages(table: pl.DataFrame, estimator: str, **options) -> pl.DataFrame:
    """``table`` plus ``advantages`` and ``baselines`` (list[float32], one entry per token)."""
    est, b = _prepare(table, estimator, options)
    base, adv, _ = _run(est, b, options)
    return _with_advantages(table, b, base, adv)


def _with_advantages(table: pl.DataFrame, b: Batch, base: np.ndarray, adv: np.ndarray) -> pl.DataFrame:
    """``table`` plus the flat per-token ``adv`` and ``base`` as list columns."""
    return table.with_columns(
        _to_list_column("advantages", adv, b.offsets), _to_list_column("baselines", base, b.offsets)
    )


NORMALISED_COLUMNS_OF = ("total_power", "expected_a_squared")
NORMALISED_COLUMNS = tuple(f"{k}_normalised" for k in NORMALISED_COLUMNS_OF)


def compare(table: pl.DataFrame, estimator: str, **options) -> tuple[pl.DataFrame, dict]:
    """``compute_advantages`` and the estimator's row of the comparison table: ``diagnostics`` of
    its advantages on the raw-reward scale, so that every estimator's P and E[A^2] are in the same
    units. For an estimator that divides by a data-dependent scale (``normalises``: std-normalised
    GRPO, REINFORCE++'s whitening) the raw-scale advantage is advantage x scale = G - baseline on
    valid tokens (the same baseline, before the division); ``normalised`` is True and
    ``total_power_normalised``, ``expected_a_squared_normalised`` hold P and E[A^2] of the
    advantages as trained. For the others, whose advantages are already on the raw scale, those
    two are NaN."""
    est, b = _prepare(table, estimator, options)
    base, adv, scale = _run(est, b, options)
    out = _with_advantages(table, b, base, adv)
    if scale is None:
        return out, {**diagnostics(out), "normalised": False} | dict.fromkeys(NORMALISED_COLUMNS, float("nan"))
    trained = diagnostics(out)
    raw = diagnostics(out.with_columns(_to_list_column("advantages", adv * scale, b.offsets)))
    return out, {**raw, "normalised": True} | {f"{k}_normalised": trained[k] for k in NORMALISED_COLUMNS_OF}


def _run(est: Estimator, b: Batch, options: dict) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(baselines, advantages, scale or None) of ``est`` on ``b``; the scale is returned exactly
    when the registry declares that the estimator normalises with these options."""
    out = est.fn(b, **options)
    base, adv, scale = out if len(out) == 3 else (*out, None)
    if (scale is not None) != est.normalises_with(options):
        raise RuntimeError(
            f"estimator '{est.name}' is registered with normalises={est.normalises!r} but returned "
            f"{'a' if scale is not None else 'no'} scale with options {options}"
        )
    return base, adv, scale


def estimator_parameters(name: str) -> list[str]:
    """The keyword options estimator ``name`` takes (e.g. baseline_shift, handle_zero_tail)."""
    return list(ESTIMATORS[name].options)


def estimator_options(cfg: DictConfig, name: str) -> dict:
    """The options of ``advantages`` config that estimator ``name`` accepts."""
    a = cfg.advantages
    return {k: a[k] for k in estimator_parameters(name) if k in a}


def studied(cfg: DictConfig) -> list[str]:
    """The estimators of the variance study: REINFORCE ('none'), variance.estimators, the oracle ('eob')."""
    return list(dict.fromkeys(["none", *cfg.variance.estimators, "eob"]))


def study_keys(name: str) -> list[str]:
    """The ``advantages.*`` options estimator ``name`` takes from the config in the variance study:
    all it takes, less the shift (the study compares baselines unshifted) and grpo's std
    normalisation (the study compares baselines at one scale)."""
    fixed = ("baseline_shift", "std_normalize") if name == "grpo" else ("baseline_shift",)
    return [k for k in estimator_parameters(name) if k not in fixed]


def study_options(cfg: DictConfig, name: str) -> dict:
    """An estimator's options in the variance study (``study_keys``; grpo without std normalisation)."""
    return {k: cfg.advantages[k] for k in study_keys(name)} | ({"std_normalize": False} if name == "grpo" else {})


def total_power(w_hat: np.ndarray, abar: np.ndarray, rho_mean: np.ndarray | None = None) -> float:
    """P = mean_i max(W_i, 0) * Abar_i^2 (algorithms.md §1.8): W_i the summed proxy energy of
    sequence i, Abar_i its mean advantage; with rollout IS, times (mean_t rho_i,t)^2."""
    power = np.maximum(w_hat, 0.0) * abar**2
    if rho_mean is not None:
        power = power * rho_mean**2
    return float(np.mean(power)) if len(power) else 0.0


def variance_proxies(power: float, grad_norm: float, n_seq: int) -> dict[str, float]:
    """verl's three variance proxies of one optimizer step: S = grad_norm^2 (signal), P (total
    power) and V = max(0, (P - S) / (N - 1)) (noise; 0 when N <= 1 or the norm is unknown)."""
    signal = grad_norm**2 if np.isfinite(grad_norm) else float("nan")
    noise = max(0.0, (power - signal) / (n_seq - 1)) if n_seq > 1 and np.isfinite(signal) else 0.0
    return {"proxy1_signal_strength": signal, "proxy2_total_power": power, "proxy3_pure_noise": noise}


def diagnostics(table: pl.DataFrame) -> dict[str, float]:
    """Variance-proxy metrics (algorithms.md §1.8) and advantage statistics of a table that has
    ``advantages`` (and ``logprobs``, ``sum_pi_sq`` for the proxy energy)."""
    b = make_batch(table)
    adv = _flat(table["advantages"])
    base = _flat(table["baselines"])
    m = b.mask
    t = np.maximum(b.valid_len, 1e-12)
    abar = _segment_sum(adv * m, b.seq, len(b.reward)) / t
    w_hat = np.maximum(_segment_sum(b.energy() * m, b.seq, len(b.reward)), 0.0)
    rho = (
        _segment_sum(_flat(table["is_weights"]) * m, b.seq, len(b.reward)) / t
        if "is_weights" in table.columns
        else None
    )
    power = total_power(w_hat, abar, rho)
    valid = m > 0
    base_seq = _segment_sum(base * m, b.seq, len(b.reward)) / t
    has_tokens = b.valid_len > 0
    reward_mean = float(b.reward.mean())
    baseline_mean = float(base_seq[has_tokens].mean()) if has_tokens.any() else 0.0
    return {
        "total_power": float(power),
        "expected_a_squared": float(np.mean(abar**2)),
        "expected_w": float(np.mean(w_hat)),
        "adv_mean": float(adv[valid].mean()) if valid.any() else 0.0,
        "adv_std": float(adv[valid].std()) if valid.any() else 0.0,
        "zero_adv_fraction": float(np.mean(np.abs(adv[valid]) < 1e-8)) if valid.any() else 0.0,
        "baseline_mean": baseline_mean,
        "reward_mean": reward_mean,
        "pessimism": reward_mean - baseline_mean,
    }
