"""Laminar at cluster scale, by simulation: a discrete-event model of rollout engines and one
trainer, in four modes, with costs read from measured records (arXiv 2510.12633; docs/training.md,
"Streaming rollouts (Laminar)"; issue 58).

The model
---------
- **Engines.** ``E`` rollout engines, each with a budget of ``rows`` trajectories in flight (its
  KV cache, rows of full length) and continuous batching: a decode step of ``b`` running rows costs
  ``decode_fixed + decode_row * b`` seconds, a new row first prefills its prompt, and a freed slot
  takes the next waiting trajectory at the next step boundary. Context length does not enter a
  step's cost.
- **Trainer.** One trainer group takes an iteration's ``m`` groups of ``G`` trajectories and
  trains for ``train_fixed + train_token * tokens / trainer_devices`` seconds, then publishes the
  next version. An engine that takes a new version pays ``handover`` seconds (the weight load).
- **Lengths.** A response's length is a lognormal's draw, rounded, at least 1 and at most the
  budget (a response that reaches it is cut, as ``max_new_tokens`` cuts one); ``mu`` and ``sigma``
  are fitted to a record's histogram of response lengths (``lengths`` in the config), or with
  ``--rollouts GLOB`` to any run's rollouts.parquet files, the budget's hits counted as censored.
- **Modes.**
  - ``lockstep`` (s = 0): iteration k's trajectories, split evenly over the engines up front (a
    shard each), start when version k is published; the trainer waits for the last one.
  - ``one_step_off`` (s = 1): the same, sampled with version k - 1, so an engine starts iteration
    k's share once version k - 1 is out and its share of k - 1 is done, while the trainer trains.
  - ``stream``: one queue of groups; a free slot takes the next trajectory; at most
    ``(staleness + 1) * m`` groups are open at a time (released, and not yet trained into a
    published version: a group admitted under version v is trained by iteration v + staleness). An engine takes
    the newest version at its first step boundary after it is published, prefilling its rows in
    flight again (AReaL's interrupt and resubmit). Iteration k trains the first ``m`` complete
    groups whose oldest token is at most ``staleness`` versions behind; an older group, complete or
    not, is dropped and a new one released in its place.
  - ``stream_repack``: ``stream``, and when an engine's rows fall below ``repack_below`` of its
    budget with no trajectory waiting, they move to the engine with the most rows that has room
    (prefilled again there, counted as moves), and the emptied engine's next rows start under the
    newest version with nothing in flight to prefill again.
- **Shared cores** (``shared``: the CPU check): engines and the trainer run on ``cores`` cores; an
  active engine asks for one, the trainer while it trains for ``trainer_cores``, and each runs at
  ``min(1, cores / asked)`` of its speed (processor sharing). Without it each has its own devices.

Per mode, over a window from the end of the ``warmup`` iterations' training to the end of the
last's: ``tokens_per_s`` (the response tokens trained in the window over its seconds), each
engine's ``idle_share`` (no row in flight, no load or prefill), ``occupancy_mean`` (rows in flight
over the budget, time-weighted, the engines' mean), the version-lag histogram of the trained
tokens (``lag_tokens``: iteration minus the token's version, every iteration), the groups dropped
as too old and the rows moved.

Prints JSON (and writes it to ``--out``); ``--plot`` draws throughput against GPUs beside seed
004's 5.48x; every parameter is in ``benchmarks/laminar_sim.yaml``, each cost cited by its record::

    python benchmarks/laminar_sim.py --plot docs/laminar_sim.svg     # 23 minutes on a 2-core VM
    python benchmarks/laminar_sim.py --gpus 8 --no-sensitivity          # seconds

The figures, the plot and what the model leaves out: docs/training.md, "Laminar at cluster scale, by
simulation" (record laminar_sim_cluster).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import json
import math
import sys
from collections import Counter, deque
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import yaml

REPO = Path(__file__).resolve().parents[1]
MEASURED = REPO / "benchmarks" / "measured"
MODES = ("lockstep", "one_step_off", "stream", "stream_repack")
SEED_CLAIM = 5.48  # seed 004: "up to 5.48x training throughput speedup" on 1,024 GPUs


# ---------------------------------------------------------------- costs, cited by their records


def record(name: str, records: dict) -> dict:
    """benchmarks/measured/NAME.json, read once into ``records`` (the study cites what it read)."""
    if name not in records:
        path = MEASURED / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"laminar_sim: no record {name} ({path})")
        records[name] = json.loads(path.read_text())
    return records[name]


def walk(x, path: str):
    for part in path.split("/"):
        x = x[int(part)] if isinstance(x, list) else x[part]
    return x


def cited(spec: dict, records: dict) -> float:
    """A cost from its record: ``{record, path}`` reads PATH of benchmarks/measured/RECORD.json
    (list items by index; times ``scale``); ``{record, value, quote}`` takes the value given, and
    checks that the record says it (``quote`` is in its JSON text)."""
    rec = record(spec["record"], records)
    if "path" in spec:
        return float(walk(rec, spec["path"])) * spec.get("scale", 1.0)
    if spec["quote"] not in json.dumps(rec, ensure_ascii=False):
        raise SystemExit(f"laminar_sim: record {spec['record']} does not say {spec['quote']!r}")
    return float(spec["value"])


@dataclass(frozen=True)
class Costs:
    decode_fixed: float  # seconds per decode step
    decode_row: float  # seconds per running row per step
    prefill_token: float  # seconds per prefilled token
    train_fixed: float  # seconds per training iteration
    train_token: float  # seconds per trained token on one trainer device
    handover: float  # seconds an engine spends taking new weights

    def decode(self, rows: int) -> float:
        return self.decode_fixed + self.decode_row * rows


def costs_from(spec: dict, records: dict) -> Costs:
    """Costs from a ``costs`` section: ``decode_step`` (seconds at ``decode_rows`` rows) split by
    ``decode_fixed_share``, or ``decode_fixed`` and ``decode_row``; ``prefill`` seconds over
    ``prefill_tokens``; ``train`` seconds over ``train_tokens`` (and ``train_fixed``); ``handover``."""
    c = {k: cited(v, records) if isinstance(v, dict) else float(v) for k, v in spec.items()}
    if "decode_step" in c:
        share = c["decode_fixed_share"]
        c["decode_fixed"] = c["decode_step"] * share
        c["decode_row"] = c["decode_step"] * (1 - share) / c["decode_rows"]
    return Costs(
        decode_fixed=c["decode_fixed"],
        decode_row=c["decode_row"],
        prefill_token=c["prefill"] / c["prefill_tokens"],
        train_fixed=c.get("train_fixed", 0.0),
        train_token=c["train"] / c["train_tokens"],
        handover=c["handover"],
    )


# ---------------------------------------------------------------- lengths


@dataclass(frozen=True)
class Lengths:
    """Response lengths: round(exp(N(mu, sigma))) within [1, budget]; prompts of ``prompt`` tokens."""

    mu: float
    sigma: float
    budget: int
    prompt: int

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.rint(np.exp(self.mu + self.sigma * rng.standard_normal(n)))
        return np.clip(x, 1, self.budget).astype(np.int64)


def fit_lengths(hist: dict, budget: int, prompt: int) -> Lengths:
    """The lognormal's maximum-likelihood fit, by EM, to a histogram {length: count} whose
    lengths at the budget are censored (the response would have gone on)."""
    lengths = np.array([int(k) for k in hist], dtype=float)
    counts = np.array(list(hist.values()), dtype=float)
    cut = lengths >= budget
    z, w = np.log(lengths[~cut]), counts[~cut]
    n_cut, c = counts[cut].sum(), math.log(budget)
    mu, sigma = float((z * w).sum() / w.sum()), float(np.sqrt((w * (z - (z * w).sum() / w.sum()) ** 2).sum() / w.sum()))
    for _ in range(500):
        a = (c - mu) / sigma
        lam = math.exp(-a * a / 2) / math.sqrt(2 * math.pi) / max(0.5 * math.erfc(a / math.sqrt(2)), 1e-300)
        ez = mu + sigma * lam  # E[z | z >= c]
        ez2 = sigma**2 * (1 + a * lam - lam**2) + ez**2
        n = w.sum() + n_cut
        mu_new = float(((z * w).sum() + n_cut * ez) / n)
        var = float(((z**2 * w).sum() + n_cut * ez2) / n - mu_new**2)
        done = abs(mu_new - mu) < 1e-10 and abs(math.sqrt(var) - sigma) < 1e-10
        mu, sigma = mu_new, math.sqrt(var)
        if done:
            break
    return Lengths(mu=mu, sigma=sigma, budget=budget, prompt=prompt)


# ---------------------------------------------------------------- the simulation


@dataclass(eq=False, slots=True)
class Row:
    """A trajectory. On its engine it has generated ``clock - start`` tokens after ``done`` on
    engines before (a repack), whose versions are in ``spans``."""

    group: int
    prompt: int
    length: int  # the tokens it will generate
    iteration: int = -1  # lockstep and one_step_off: the iteration it was released for
    done: int = 0
    spans: list = field(default_factory=list)  # [version, tokens]
    engine: Engine | None = None
    start: int = 0
    seq: int = -1  # its entry in its engine's heap (another: a stale entry)
    dead: bool = False  # its group was dropped


@dataclass(eq=False)
class Engine:
    index: int
    version: int = -1
    clock: int = 0  # decode steps run
    clocks: list = field(default_factory=lambda: [0])  # the clocks at which it took a version,
    versions: list = field(default_factory=lambda: [-1])  # and the versions
    heap: list = field(default_factory=list)  # (clock at which a row ends, seq, Row)
    live: int = 0  # rows in flight
    context: int = 0  # sum over them of prompt + done - start: their context is this + live * clock
    queue: deque = field(default_factory=deque)  # lockstep and one_step_off: ((iteration, version), Row)
    moved_in: list = field(default_factory=list)
    # the segment in flight: `work` seconds at full speed, `lead` of loads and prefills, then `steps`
    # decode steps of `step` seconds; `left` of that work remained at time `at`
    steps: int = 0
    step: float = 0.0
    lead: float = 0.0
    work: float = 0.0
    left: float = 0.0
    at: float = 0.0
    token: int = 0  # invalidates the scheduled end of a cut or re-timed segment
    running: bool = False
    idle_since: float | None = 0.0
    idle: float = 0.0
    row_seconds: float = 0.0  # sum over segments of rows x wall seconds
    segment_rows: int = 0
    segment_from: float = 0.0


@dataclass(frozen=True)
class Setup:
    mode: str
    engines: int
    rows: int  # trajectories in flight per engine
    groups: int  # m: groups per iteration
    group_size: int
    iterations: int
    warmup: int  # iterations before the measured window (at least 1)
    staleness: int
    repack_below: float
    trainer_devices: float
    costs: Costs
    lengths: Lengths
    seed: int = 0
    shared: bool = False
    cores: int = 0
    trainer_cores: float = 1.0


class Sim:
    def __init__(self, s: Setup):
        if s.mode not in MODES:
            raise ValueError(f"mode {s.mode!r}: one of {', '.join(MODES)}")
        if not 1 <= s.warmup < s.iterations:
            raise ValueError(f"warmup {s.warmup}: at least 1 and fewer than the {s.iterations} iterations")
        self.s = s
        self.stream = s.mode.startswith("stream")
        self.rng = np.random.default_rng(s.seed)
        self.now = 0.0
        self.events: list = []
        self.seq = 0
        self.engines = [Engine(i) for i in range(s.engines)]
        self.published = 0  # the newest version
        self.iteration = 0  # the trainer's next iteration
        self.training = False
        self.train_left = 0.0
        self.train_at = 0.0
        self.train_token = 0
        self.train_ends: list[float] = []
        self.trained: list[int] = []
        self.lag: Counter = Counter()
        self.groups: dict[int, dict] = {}  # group -> {left: rows unfinished, rows, oldest: version}
        self.next_group = 0
        self.complete: list[int] = []  # stream: complete groups, in the order they completed
        self.waiting: deque = deque()  # stream: rows not yet started
        self.open_groups = 0
        self.dropped = 0
        self.moves = 0
        self.reprefilled = 0
        self.speed = 1.0
        self.done_rows: dict[int, list] = {}  # lockstep/one_step_off: iteration -> rows of complete groups
        self.scanned = -1  # stream: the iteration whose stale groups were dropped
        self.window: list[tuple[float, float]] = []  # each engine's (idle, row seconds) when the window opens

    # -- events and shared cores
    def push(self, t: float, kind: str, who: int, token: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, who, token))

    def resync(self) -> None:
        """Processor sharing: re-time what is in flight after the cores asked for changed."""
        if not self.s.shared:
            return
        asked = sum(e.running for e in self.engines) + (self.s.trainer_cores if self.training else 0.0)
        speed = min(1.0, self.s.cores / max(asked, 1e-9))
        if speed == self.speed:
            return
        for e in self.engines:
            if e.running:
                e.left -= (self.now - e.at) * self.speed
                e.at = self.now
                e.token += 1
                self.push(self.now + e.left / speed, "engine", e.index, e.token)
        if self.training:
            self.train_left -= (self.now - self.train_at) * self.speed
            self.train_at = self.now
            self.train_token += 1
            self.push(self.now + self.train_left / speed, "train", 0, self.train_token)
        self.speed = speed

    # -- groups
    def release_group(self, release: tuple[int, int] | None = None) -> None:
        """A new group of ``group_size`` rows: into the stream's queue, or dealt round-robin over the
        engines' queues with ``release`` = (iteration, version)."""
        g, n = self.next_group, self.s.group_size
        self.next_group += 1
        rows = [Row(g, self.s.lengths.prompt, int(x)) for x in self.s.lengths.draw(self.rng, n)]
        self.groups[g] = {"left": n, "rows": rows, "oldest": None}
        if self.stream:
            self.open_groups += 1
            self.waiting.extend(rows)
            return
        for i, r in enumerate(rows):
            r.iteration = release[0]
            self.engines[(g * n + i) % self.s.engines].queue.append((release, r))

    def refill_stream(self) -> None:
        while self.open_groups < (self.s.staleness + 1) * self.s.groups:
            self.release_group()

    # -- rows on engines
    def add(self, e: Engine, r: Row) -> None:
        r.engine, r.start = e, e.clock
        self.seq += 1
        r.seq = self.seq
        heapq.heappush(e.heap, (e.clock + r.length - r.done, r.seq, r))
        e.live += 1
        e.context += r.prompt + r.done - r.start

    def remove(self, e: Engine, r: Row) -> None:
        """Take ``r`` off ``e``, its tokens there added to its spans."""
        last = len(e.clocks) - 1
        for i in range(bisect.bisect_right(e.clocks, r.start) - 1, last + 1):
            n = (e.clocks[i + 1] if i < last else e.clock) - max(e.clocks[i], r.start)
            v = e.versions[i]
            if n > 0:
                if r.spans and r.spans[-1][0] == v:
                    r.spans[-1][1] += n
                else:
                    r.spans.append([v, n])
        e.live -= 1
        e.context -= r.prompt + r.done - r.start
        r.done += e.clock - r.start
        r.engine, r.seq = None, -1

    def take_version(self, e: Engine, v: int) -> None:
        e.version = v
        e.clocks.append(e.clock)
        e.versions.append(v)

    def start_segment(self, e: Engine) -> None:
        """At a step boundary: take new weights, start new rows, and run to the next row's end."""
        lead = 0.0
        moved = [r for r in e.moved_in if not r.dead]
        e.moved_in = []
        free = self.s.rows - e.live - len(moved)
        new = []
        if self.stream:
            while free > 0 and self.waiting:
                r = self.waiting.popleft()
                if not r.dead:
                    new.append(r)
                    free -= 1
            if (e.live or moved or new) and e.version < self.published:
                tokens = e.context + e.live * e.clock  # the rows in flight, prefilled again
                lead += self.s.costs.handover + self.s.costs.prefill_token * tokens
                self.reprefilled += tokens
                self.take_version(e, self.published)
            for r in new:
                g = self.groups[r.group]
                g["oldest"] = e.version if g["oldest"] is None else min(g["oldest"], e.version)
        else:
            running = e.heap[0][2].iteration if e.live else None  # the iteration whose share runs here
            while free > 0 and e.queue:
                (k, v), r = e.queue[0]
                if v > self.published or running not in (None, k):
                    break  # its version is not out, or the engine's share of an earlier iteration runs
                if e.version != v:
                    lead += self.s.costs.handover
                    self.take_version(e, v)
                new.append(e.queue.popleft()[1])
                running = k
                free -= 1
        for r in moved:  # a repacked row: its prompt and its tokens so far
            lead += self.s.costs.prefill_token * (r.prompt + r.done)
            self.add(e, r)
        for r in new:
            lead += self.s.costs.prefill_token * r.prompt
            self.add(e, r)
        while e.heap and e.heap[0][2].seq != e.heap[0][1]:
            heapq.heappop(e.heap)  # stale: moved or dropped
        if not e.live:
            if e.idle_since is None:
                e.idle_since = self.now
            return
        if e.idle_since is not None:
            e.idle += self.now - e.idle_since
            e.idle_since = None
        e.steps = e.heap[0][0] - e.clock
        e.step = self.s.costs.decode(e.live)
        e.lead, e.work = lead, lead + e.steps * e.step
        e.left, e.at = e.work, self.now
        e.segment_rows, e.segment_from = e.live, self.now
        e.token += 1
        e.running = True
        self.resync()
        self.push(self.now + e.left / self.speed, "engine", e.index, e.token)

    def cut(self, e: Engine) -> None:
        """End ``e``'s segment at its next step boundary (a newer version is out)."""
        if not e.running:
            return
        done = e.work - (e.left - (self.now - e.at) * self.speed)  # work done so far
        steps = 1 if done <= e.lead else math.floor((done - e.lead) / e.step) + 1
        if steps >= e.steps:
            return
        e.steps = steps
        e.work = e.lead + steps * e.step
        e.left, e.at = e.work - done, self.now
        e.token += 1
        self.push(self.now + e.left / self.speed, "engine", e.index, e.token)

    def end_segment(self, e: Engine) -> None:
        e.clock += e.steps
        e.row_seconds += e.segment_rows * (self.now - e.segment_from)
        finished = []
        while e.heap and (e.heap[0][2].seq != e.heap[0][1] or e.heap[0][0] <= e.clock):
            _, seq, r = heapq.heappop(e.heap)
            if r.seq == seq:
                self.remove(e, r)
                finished.append(r)
        e.running = False
        for r in finished:
            self.finish(r)
        if self.s.mode == "stream_repack":
            self.repack(e)
        if not e.running:  # finish() may have started it (a new iteration's rows)
            self.start_segment(e)
        if not e.running:
            self.resync()

    def repack(self, e: Engine) -> None:
        """Gather a thinned engine's rows onto the fullest engine with room for them."""
        n = e.live
        if not n or self.waiting or n >= self.s.repack_below * self.s.rows or e.running:
            return
        room = [d for d in self.engines if d is not e and n <= d.live + len(d.moved_in) <= self.s.rows - n]
        if not room:
            return
        d = max(room, key=lambda d: (d.live + len(d.moved_in), -d.index))
        rows = [r for _, seq, r in e.heap if r.seq == seq]
        for r in rows:
            self.remove(e, r)
        e.heap = []
        d.moved_in.extend(rows)
        self.moves += len(rows)
        if not d.running:
            self.start_segment(d)

    def finish(self, r: Row) -> None:
        g = self.groups[r.group]
        g["left"] -= 1
        if g["left"] == 0:
            if self.stream:
                self.complete.append(r.group)
            else:
                self.done_rows.setdefault(r.iteration, []).extend(g["rows"])
            self.try_train()

    # -- trainer
    def try_train(self) -> None:
        if self.training or self.iteration >= self.s.iterations:
            return
        k, s = self.iteration, self.s
        if self.stream:
            if self.scanned < k:  # once an iteration: drop the groups begun too long ago
                self.scanned = k
                stale = [g for g, v in self.groups.items() if v["oldest"] is not None and v["oldest"] < k - s.staleness]
                for g in stale:
                    self.drop(g)
                if stale:  # as many new groups, offered to the engines at once
                    self.refill_stream()
                    self.offer()
            if len(self.complete) < s.groups:
                return
            take, self.complete = self.complete[: s.groups], self.complete[s.groups :]
            rows = [r for g in take for r in self.groups.pop(g)["rows"]]
        else:
            rows = self.done_rows.get(k, [])
            if len(rows) < s.groups * s.group_size:
                return
            for g in {r.group for r in rows}:
                del self.groups[g]
            del self.done_rows[k]
        for r in rows:
            for v, n in r.spans:
                self.lag[k - v] += n
        tokens = sum(r.length for r in rows)
        self.trained.append(tokens)
        self.training = True
        self.train_left = s.costs.train_fixed + s.costs.train_token * tokens / s.trainer_devices
        self.train_at = self.now
        self.resync()
        self.train_token += 1
        self.push(self.now + self.train_left / self.speed, "train", 0, self.train_token)

    def drop(self, g: int) -> None:
        self.dropped += 1
        self.open_groups -= 1
        if g in self.complete:
            self.complete.remove(g)
        for r in self.groups.pop(g)["rows"]:
            if r.engine is not None:
                self.remove(r.engine, r)
            r.dead = True

    def idle(self, e: Engine) -> float:
        return e.idle + (self.now - e.idle_since if e.idle_since is not None else 0.0)

    def occupied(self, e: Engine) -> float:
        """Rows x seconds so far, the segment in flight's included."""
        return e.row_seconds + (e.segment_rows * (self.now - e.segment_from) if e.running else 0.0)

    def end_train(self) -> None:
        self.training = False
        self.train_ends.append(self.now)
        if len(self.train_ends) == self.s.warmup:
            self.window = [(self.idle(e), self.occupied(e)) for e in self.engines]
        self.iteration += 1
        self.published += 1
        self.resync()
        if self.stream:  # the trained groups close: as many new ones open, under the new version
            self.open_groups -= self.s.groups
            self.refill_stream()
            for e in self.engines:
                self.cut(e)
        self.wake()
        self.try_train()

    def wake(self) -> None:
        for e in self.engines:
            if not e.running:
                self.start_segment(e)

    def offer(self) -> None:
        """New rows wait: idle engines start, running ones with free slots take them at their next
        step boundary."""
        for e in self.engines:
            if not e.running:
                self.start_segment(e)
            elif e.live < self.s.rows:
                self.cut(e)

    # -- the run
    def run(self) -> dict:
        s = self.s
        if self.stream:
            self.refill_stream()
            for e in self.engines:
                self.take_version(e, 0)
        else:
            for k in range(s.iterations):
                for _ in range(s.groups):
                    self.release_group((k, k if s.mode == "lockstep" else max(k - 1, 0)))
        self.wake()
        while self.events and self.iteration < s.iterations:
            t, _, kind, who, token = heapq.heappop(self.events)
            self.now = t
            if kind == "train":
                if token == self.train_token and self.training:
                    self.end_train()
            else:
                e = self.engines[who]
                if token == e.token and e.running:
                    self.end_segment(e)
        if self.iteration < s.iterations:
            raise RuntimeError(f"{s.mode}: stalled at iteration {self.iteration}")
        return self.summary()

    def summary(self) -> dict:
        s = self.s
        t0, t1 = self.train_ends[s.warmup - 1], self.train_ends[-1]
        span = t1 - t0
        idle = [(self.idle(e) - i0) / span for e, (i0, _) in zip(self.engines, self.window)]
        rows = [(self.occupied(e) - r0) / span / s.rows for e, (_, r0) in zip(self.engines, self.window)]
        return {
            "mode": s.mode,
            "engines": s.engines,
            "tokens_per_s": sum(self.trained[s.warmup :]) / span,
            "trained_tokens": self.trained,
            "period_s": span / (s.iterations - s.warmup),
            "idle_share": [round(x, 4) for x in idle],
            "idle_share_mean": float(np.mean(idle)),
            "occupancy_mean": float(np.mean(rows)),
            "lag_tokens": {str(k): v for k, v in sorted(self.lag.items())},
            "dropped_groups": self.dropped,
            "moved_rows": self.moves,
            "reprefilled_tokens": self.reprefilled,
        }


def simulate(setup: Setup) -> dict:
    return Sim(setup).run()


# ---------------------------------------------------------------- the studies


def load_config(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def lengths_from(spec: dict, records: dict) -> tuple[Lengths, dict]:
    """The lognormal fitted to the response lengths of a record's histogram (``record``,
    ``histogram_path``, ``prompt_histogram_path``) or of stored rollouts (``rollouts``: a glob of
    rollouts.parquet files; a response cut by ``max_new_tokens`` counts as reaching ``budget``),
    and what it was fitted to."""
    budget = int(spec["budget"])
    if "rollouts" in spec:
        sys.path.insert(0, str(Path(__file__).parent))
        from bench_engine_costs import lengths as stored_lengths  # the histograms, one place

        stored = stored_lengths(spec["rollouts"])
        hist = Counter({int(k): v for k, v in stored["response_length"].items() if int(k) < budget})
        hist[budget] += stored["responses"] - sum(hist.values())  # the cut ones, and any longer
        prompts = {int(k): v for k, v in stored["prompt_length"].items()}
    else:
        rec = record(spec["record"], records)
        hist = {int(k): v for k, v in walk(rec, spec["histogram_path"]).items()}
        prompts = {int(k): v for k, v in walk(rec, spec["prompt_histogram_path"]).items()}
    prompt = round(sum(k * v for k, v in prompts.items()) / sum(prompts.values()))
    n = sum(hist.values())
    stored = {
        "responses": n,
        "mean": sum(k * v for k, v in hist.items()) / n,
        "at_budget_share": sum(v for k, v in hist.items() if k >= budget) / n,
        "prompt_mean": prompt,
    }
    return fit_lengths(hist, budget, prompt), stored


def cluster_setup(cfg: dict, gpus: int, mode: str, costs: Costs, lengths: Lengths, **over) -> Setup:
    """``gpus`` GPUs: ``trainer_share`` of them train, the others are engines of ``gpus_per_engine``;
    an iteration trains as many trajectories as the engines hold at once."""
    c = {**cfg["cluster"], **over}
    trainer = max(1, round(gpus * c["trainer_share"]))
    engines = max(1, (gpus - trainer) // c["gpus_per_engine"])
    return Setup(
        mode=mode,
        engines=engines,
        rows=c["rows_per_engine"],
        groups=max(1, engines * c["rows_per_engine"] // c["group_size"]),
        group_size=c["group_size"],
        iterations=c["iterations"],
        warmup=c["warmup"],
        staleness=c["staleness"],
        repack_below=c["repack_below"],
        trainer_devices=trainer,
        costs=costs,
        lengths=lengths,
        seed=cfg["seed"],
    )


def study(cfg: dict, sensitivity_too: bool = True) -> dict:
    records: dict = {}
    lengths, stored = lengths_from(cfg["lengths"], records)
    costs = costs_from(cfg["cluster"]["costs"], records)
    out: dict = {
        "lengths": {"fit": {"mu": lengths.mu, "sigma": lengths.sigma, "budget": lengths.budget}, "stored": stored},
        "costs": costs.__dict__,
        "scales": {},
    }
    for gpus in cfg["cluster"]["gpus"]:
        runs = {m: simulate(cluster_setup(cfg, gpus, m, costs, lengths)) for m in MODES}
        out["scales"][str(gpus)] = {
            "runs": runs,
            "over_lockstep": {m: r["tokens_per_s"] / runs["lockstep"]["tokens_per_s"] for m, r in runs.items()},
            "over_one_step_off": {m: r["tokens_per_s"] / runs["one_step_off"]["tokens_per_s"] for m, r in runs.items()},
        }
    if sensitivity_too:
        out["sensitivity"] = sensitivity(cfg, costs, lengths, records)
    cpu_lengths = lengths_from(cfg["cpu_check"]["lengths"], records)[0] if "lengths" in cfg["cpu_check"] else lengths
    out["cpu_check"] = cpu_check(cfg, cpu_lengths, records)
    out["cited"] = {
        n: {"title": r["title"], "machine": r["machine"], "date": r["date"]} for n, r in sorted(records.items())
    }
    return out


def sensitivity(cfg: dict, costs: Costs, lengths: Lengths, records: dict) -> dict:
    """stream over lockstep and over one_step_off at ``sensitivity.gpus`` GPUs, one assumption
    moved at a time."""
    sens, gpus = cfg["sensitivity"], cfg["sensitivity"]["gpus"]
    ref = cited(cfg["cluster"]["costs"]["decode_rows"], records)
    step = costs.decode(ref)

    def ratios(costs=costs, lengths=lengths, **over) -> dict:
        r = {
            m: simulate(cluster_setup(cfg, gpus, m, costs, lengths, **over))["tokens_per_s"]
            for m in ("lockstep", "one_step_off", "stream")
        }
        return {"over_lockstep": r["stream"] / r["lockstep"], "over_one_step_off": r["stream"] / r["one_step_off"]}

    rows = {"as configured": ratios()}
    for f in sens["tail_sigma"]:
        rows[f"tail: sigma x {f}"] = ratios(lengths=replace(lengths, sigma=lengths.sigma * f))
    for f in sens["budget"]:
        rows[f"length budget x {f}"] = ratios(lengths=replace(lengths, budget=int(lengths.budget * f)))
    for f in sens["handover"]:
        rows[f"handover x {f}"] = ratios(costs=replace(costs, handover=costs.handover * f))
    for f in sens["trainer_share"]:
        rows[f"trainer share {f}"] = ratios(trainer_share=f)
    for f in sens["decode_fixed_share"]:
        rows[f"decode fixed share {f}"] = ratios(
            costs=replace(costs, decode_fixed=step * f, decode_row=step * (1 - f) / ref)
        )
    for f in sens["staleness"]:
        rows[f"staleness {f}"] = ratios(staleness=f)
    return {"gpus": gpus, "stream": rows}


def cpu_check(cfg: dict, lengths: Lengths, records: dict) -> dict:
    """The measured 2-core CPU run, simulated: its costs, lengths and batch, the cores shared."""
    c = cfg["cpu_check"]
    costs = costs_from(c["costs"], records)

    def run(mode: str, staleness: int) -> dict:
        return simulate(
            Setup(
                mode=mode,
                engines=c["engines"],
                rows=c["rows_per_engine"],
                groups=c["groups"],
                group_size=c["group_size"],
                iterations=c["iterations"],
                warmup=c["warmup"],
                staleness=staleness,
                repack_below=0.0,
                trainer_devices=1,
                costs=costs,
                lengths=lengths,
                seed=cfg["seed"],
                shared=True,
                cores=c["cores"],
                trainer_cores=c["trainer_cores"],
            )
        )

    runs = {"one_step_off": run("one_step_off", 1)}
    check = {}
    for s, spec in c["measured"].items():
        runs[f"stream_s{s}"] = run("stream", int(s))
        sim = runs[f"stream_s{s}"]["tokens_per_s"] / runs["one_step_off"]["tokens_per_s"]
        measured = cited(spec, records)
        check[f"stream_s{s}"] = {
            "simulated": sim,
            "measured": measured,
            "within_15_percent": abs(sim / measured - 1) <= 0.15,
        }
    return {"costs": costs.__dict__, "runs": runs, "stream_over_one_step_off": check}


def plot(out: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    matplotlib.rcParams["svg.hashsalt"] = "laminar_sim"
    gpus = [int(g) for g in out["scales"]]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for m, style in zip(MODES, ("o-", "o-", "o-", "x--")):
        ax.plot(gpus, [out["scales"][str(g)]["over_lockstep"][m] for g in gpus], style, label=m)
    ax.axhline(SEED_CLAIM, color="grey", linestyle=":", label=f"seed 004: up to {SEED_CLAIM}x (1,024 GPUs)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(gpus, [str(g) for g in gpus])
    ax.set_ylim(0, SEED_CLAIM + 0.5)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("trained tokens/s over lockstep")
    ax.set_title("Simulated throughput (benchmarks/laminar_sim.yaml)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, metadata={"Date": None})
    plt.close(fig)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=REPO / "benchmarks" / "laminar_sim.yaml")
    ap.add_argument("--out", type=Path, help="also write the JSON here")
    ap.add_argument("--plot", type=Path, help="write the throughput plot (SVG or PNG) here")
    ap.add_argument("--gpus", help="comma-separated: these scales instead of the config's")
    ap.add_argument("--iterations", type=int, help="instead of the config's (cluster and sensitivity)")
    ap.add_argument("--no-sensitivity", action="store_true", help="skip the sensitivity table")
    ap.add_argument("--rollouts", help="fit the lengths to these rollouts.parquet files (a glob) instead")
    ap.add_argument("--budget", type=int, help="with --rollouts: their max_new_tokens (default: the config's)")
    args = ap.parse_args()
    cfg = load_config(args.config)
    if args.rollouts:  # the cluster's lengths; the CPU check keeps its run's
        cfg["cpu_check"].setdefault("lengths", cfg["lengths"])
        cfg["lengths"] = {"rollouts": args.rollouts, "budget": args.budget or cfg["lengths"]["budget"]}
    if args.gpus:
        cfg["cluster"]["gpus"] = [int(g) for g in args.gpus.split(",")]
    if args.iterations:
        cfg["cluster"]["iterations"] = args.iterations
    out = {
        "command": " ".join(["python", "benchmarks/laminar_sim.py", *sys.argv[1:]]),
        "config": cfg,
        **study(cfg, sensitivity_too=not args.no_sensitivity),
    }
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    if args.plot:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
