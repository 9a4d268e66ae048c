"""Laminar's streaming rollout (``rollout.stream``; arXiv 2510.12633, seed 004; algorithms.md
§10-11; docs/training.md, "Streaming rollouts (Laminar)").

A shard's prompts form one stream of *slots*: window 0's prompts (``select_prompts``), then
window 1's, and so on. The rollout job of iteration k continues the stream where the job of k-1
left it (its carry, ``schemas.STREAM``): it resumes the responses still decoding (prefilled
again, under the newest policy), starts new slots as rows free up (``hf_stream.StreamDecoder``,
continuous batching), takes newer policies between decode steps as their train jobs publish them,
and stops as soon as it holds its share of complete groups (``prompts_per_iteration /
n_shards``). Those are the first groups to complete, in the order they completed (the carry's
complete ones first), each group whole: the rollouts of iteration k. The rest (responses in
flight, finished responses of incomplete groups, complete groups beyond the share) is the carry
to k+1. A long response therefore does not hold its iteration back: it lands in a later one.

The bound: iteration k takes a group only if its oldest token was sampled by the policy of
iteration k - rollout.staleness or a later one. At the start of job k the carry's groups older than
that are dropped (``rollout.stale_groups: drop``) or sampled again from their first token
(``regenerate``: the same noise keys, the current weights), and counted. Job k holds only the
policies of k - s .. k, so every group it completes is within the bound.

A group whose responses span versions is taken or dropped whole, by its oldest token. Its mean
baseline then mixes responses of policies at most s apart, as every pipelined group's does; each
token keeps its own version's behaviour log-prob, which the decoupled objective weighs per token.

Each row keeps its noise stream across segments and jobs: its key derives from its window's
rollout seed, its index in the window and its sample index, as in a batch rollout of that window
(``hf.row_keys``). What a streamed rollout samples depends on when the policies were published: a
forced rerun is a new sample."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, replace
from typing import Any

import polars as pl

from otbflow import schemas
from otbflow.engines.hf import row_keys
from otbflow.engines.hf_stream import Trajectory
from otbflow.engines.prompts import use_chat
from otbflow.engines.sampling import GroupSampler, check_logprobs, rollout_table, select_prompts
from otbflow.io import fault_point, read_metadata, read_table
from otbflow.seeds import derive_seed


@dataclass
class CarryStats:
    """What one job did with the stream (the rollouts' metadata ``stream``)."""

    groups_taken: int = 0
    groups_from_carry: int = 0
    """Taken groups that had started in an earlier job."""
    groups_dropped_stale: int = 0
    """Carried groups older than the bound, dropped (rollout.stale_groups: drop)."""
    groups_regenerated: int = 0
    """Carried groups older than the bound, sampled again from their first token."""
    stale_tokens: int = 0
    """The tokens those dropped or regenerated groups had."""
    resumed_responses: int = 0
    """Carried responses in flight that this job continued."""
    resumed_prefill_tokens: int = 0
    """Tokens prefilled again to continue them (their prompts and tokens so far)."""
    slots_started: int = 0
    """New prompts this job started."""
    carried_responses: int = 0
    """Responses left to the next job: in flight (``carried_in_flight``), or finished in a group not taken."""
    carried_in_flight: int = 0
    carried_tokens: int = 0


class ShardStream:
    """One shard's stream of slots for iteration ``iteration``'s job: ``m`` slots per window."""

    def __init__(self, sampler: GroupSampler, prompts: pl.DataFrame, shard: int, iteration: int):
        self.sampler, self.cfg, self.prompts = sampler, sampler.cfg, prompts
        self.shard, self.iteration = shard, iteration
        r = self.cfg.rollout
        self.per_shard = math.ceil(r.prompts_per_iteration / self.cfg.shard.n_shards)
        self.m = min(self.per_shard, prompts.height)
        self.group_size, self.bound = r.group_size, iteration - r.staleness
        self.open_limit = (r.staleness + 1) * self.m
        """Most groups started and not taken: the prompts of this iteration and the s after it."""
        self.groups: dict[int, list[Trajectory]] = {}
        """Every slot started and not taken, by slot: its group's responses, finished or not."""
        self.completed: list[int] = []
        """The slots whose groups have finished, in the order they finished."""
        self.left: dict[int, int] = {}
        """Responses of each slot still decoding."""
        self.next_slot = 0
        self.stats = CarryStats()
        self.chat = use_chat(self.cfg, sampler.tok)
        self._window: tuple[int, list[list[int]]] | None = None
        self._ids: dict[int, int] = {}

    # -- slots ---------------------------------------------------------------------------------

    def window(self, j: int) -> list[list[int]]:
        """Window ``j``'s prompts rendered (the last window rendered is kept)."""
        if self._window is None or self._window[0] != j:
            self._window = (j, self.sampler.render(select_prompts(self.prompts, j, self.per_shard))[0])
        return self._window[1]

    def seed(self, window: int) -> int:
        return derive_seed(self.cfg.seed, "rollout", window, self.shard)

    def prompt_row(self, slot: int) -> dict[str, Any]:
        """The prompts table's row of ``slot`` (``select_prompts``' of its window)."""
        window, index = divmod(slot, self.m)
        return self.prompts.row((window * self.per_shard + index) % self.prompts.height, named=True)

    def prompt_id(self, slot: int) -> int:
        if slot not in self._ids:
            self._ids[slot] = self.prompt_row(slot)["prompt_id"]
        return self._ids[slot]

    def start(self, slot: int) -> list[Trajectory]:
        """The group of a new slot: its G responses, none decoded."""
        window, index = divmod(slot, self.m)
        ids = self.window(window)
        keys = row_keys(self.seed(window), [index], self.group_size, "cpu").tolist()
        budget = self.cfg.rollout.max_new_tokens
        return [Trajectory(slot, j, keys[j], ids[index], budget) for j in range(self.group_size)]

    # -- the carry -----------------------------------------------------------------------------

    def resume(self, path: str) -> None:
        """Continue the stream the job of the previous iteration left at ``path``: its groups within
        the bound kept, the older ones dropped or reset (``rollout.stale_groups``)."""
        df = read_table(path, schemas.STREAM)
        meta = read_metadata(path)
        want = {"shard": self.shard, "group_size": self.group_size, "slots_per_window": self.m}
        got = {k: meta.get(k) for k in want}
        if got != want:
            raise ValueError(
                f"{path}: a stream carry of {got}, and this rollout continues {want}: it was written by another "
                "configuration or shard (rerun the rollouts from the stream's start: snakemake -R rollout)"
            )
        self.next_slot = int(meta["next_slot"])
        regenerate = self.cfg.rollout.stale_groups == "regenerate"
        order = []
        for (slot,), rows in df.group_by("slot", maintain_order=True):
            group = [
                Trajectory(
                    slot,
                    row["sample_idx"],
                    row["key"],
                    row["prompt_ids"],
                    self.cfg.rollout.max_new_tokens,
                    row["response_ids"],
                    row["rollout_logprobs"],
                    row["token_versions"],
                    row["finish_reason"] or None,
                )
                for row in rows.sort("sample_idx").iter_rows(named=True)
            ]
            if len(group) != self.group_size or slot >= self.next_slot:
                raise ValueError(
                    f"{path}: slot {slot} holds {len(group)} responses (rollout.group_size {self.group_size})"
                )
            versions = [v for t in group for v in t.versions]
            if versions and min(versions) < self.bound:
                self.stats.stale_tokens += len(versions)
                if not regenerate:
                    self.stats.groups_dropped_stale += 1
                    continue
                self.stats.groups_regenerated += 1
                for t in group:
                    t.response_ids, t.logprobs, t.versions, t.finish_reason = [], [], [], None
            self.groups[slot] = group
            self.left[slot] = sum(t.finish_reason is None for t in group)
            if not self.left[slot]:
                order.append((int(rows["completed"][0]), slot))
        self.completed = [slot for _, slot in sorted(order)]

    def carry(self) -> tuple[pl.DataFrame, dict[str, Any]]:
        """What this job leaves of the stream (schemas.STREAM) and its metadata."""
        rank = {slot: i for i, slot in enumerate(self.completed)}
        rows = [(slot, t) for slot in sorted(self.groups) for t in self.groups[slot]]
        df = pl.DataFrame(
            {
                "slot": [slot for slot, _ in rows],
                "window": [slot // self.m for slot, _ in rows],
                "prompt_id": [self.prompt_id(slot) for slot, _ in rows],
                "sample_idx": [t.sample_idx for _, t in rows],
                "key": [t.key for _, t in rows],
                "prompt_ids": [t.prompt_ids for _, t in rows],
                "response_ids": [t.response_ids for _, t in rows],
                "rollout_logprobs": [t.logprobs for _, t in rows],
                "token_versions": [t.versions for _, t in rows],
                "response_length": [len(t.response_ids) for _, t in rows],
                "finish_reason": [t.finish_reason or "" for _, t in rows],
                "completed": [rank.get(slot, -1) for slot, _ in rows],
            },
            schema=schemas.STREAM.columns,
        )
        self.stats.carried_responses = df.height
        self.stats.carried_in_flight = int((df["finish_reason"] == "").sum())
        self.stats.carried_tokens = int(df["response_length"].sum())
        meta = {
            "shard": self.shard,
            "iteration": self.iteration,
            "group_size": self.group_size,
            "slots_per_window": self.m,
            "next_slot": self.next_slot,
        }
        return df, meta

    # -- the job -------------------------------------------------------------------------------

    def queue(self):
        """The responses to decode, in order: the carried ones not finished (by slot), then the
        groups of new slots, started as the decoder asks for them while fewer than ``open_limit``
        groups are open (None: none to start now)."""
        for slot in sorted(self.groups):
            for t in self.groups[slot]:
                if t.finish_reason is None:
                    if t.response_ids:
                        self.stats.resumed_responses += 1
                        self.stats.resumed_prefill_tokens += len(t.prompt_ids) + len(t.response_ids)
                    yield t
        while True:
            if len(self.groups) >= self.open_limit:  # none until the iteration takes some
                yield None
                continue
            slot = self.next_slot
            self.next_slot += 1
            group = self.start(slot)
            self.groups[slot], self.left[slot] = group, len(group)
            self.stats.slots_started += 1
            yield from group

    def takeable(self, slots) -> int:
        """How many groups of ``slots`` the iteration can take: one per prompt (group ids are unique
        within an iteration; a prompt seen twice, where a shard holds fewer than two windows of
        prompts, waits for the next)."""
        return len({self.prompt_id(slot) for slot in slots})

    def enough(self, finished: list[Trajectory]) -> bool:
        """Whether the iteration's share of complete groups is held, counting ``finished`` (the
        responses a segment has finished so far, not yet handed back)."""
        done = Counter(t.prompt_index for t in finished)
        newly = [slot for slot, n in done.items() if self.left[slot] == n]
        return self.takeable(self.completed + newly) >= self.m

    def finish(self, t: Trajectory) -> None:
        self.left[t.prompt_index] -= 1
        if not self.left[t.prompt_index]:
            self.completed.append(t.prompt_index)

    def take(self) -> list[int]:
        """The first complete groups, one per prompt, up to the share; removed from the stream."""
        taken, seen = [], set()
        for slot in self.completed:
            pid = self.prompt_id(slot)
            if pid not in seen and len(taken) < self.m:
                taken.append(slot)
                seen.add(pid)
        self.completed = [slot for slot in self.completed if slot not in taken]
        return taken

    def run(self) -> tuple[list[int], dict[int, list[Trajectory]]]:
        """Decode until the share is held; the slots taken and their groups."""
        backend = self.sampler.engine()
        if not self.enough([]):
            longest = max(map(len, self.window(self.next_slot // self.m)))  # the coming window's prompts
            for group in self.groups.values():  # and those it holds
                longest = max([longest, *(len(t.prompt_ids) for t in group)])
            sampling = self.sampler.sampling(self.group_size, self.seed(self.iteration))
            decoder = backend.decoder(sampling, longest + self.cfg.rollout.max_new_tokens)
            for t in decoder.run(self.queue(), enough=self.enough):
                self.finish(t)
                fault_point("rollout:mid-stream")  # a response finished, others in flight
            backend.add_stats(decoder.stats)
        taken = self.take()
        first = self.next_slot - self.stats.slots_started  # the first slot this job started
        self.stats.groups_taken = len(taken)
        self.stats.groups_from_carry = sum(slot < first for slot in taken)
        return taken, {slot: self.groups.pop(slot) for slot in taken}


def stream_rollout(
    sampler: GroupSampler, prompts: pl.DataFrame, shard: int, iteration: int, carry: str | None
) -> tuple[pl.DataFrame, pl.DataFrame, dict[str, Any], dict[str, Any]]:
    """Iteration ``iteration``'s rollouts of ``shard`` from its stream (module docstring), which
    the previous job left at ``carry`` (None: the stream's start): the rollouts table, the carry
    this job leaves (schemas.STREAM) with its metadata, and the rollouts' metadata."""
    stream = ShardStream(sampler, prompts, shard, iteration)
    if carry:
        stream.resume(carry)
    taken, groups = stream.run()
    batch = pl.DataFrame([stream.prompt_row(slot) for slot in taken], schema=prompts.schema)
    samples = [replace(sampler.backend.sample(t), prompt_index=i) for i, slot in enumerate(taken) for t in groups[slot]]
    check_logprobs(samples, batch["prompt_id"].to_list(), sampler.policy)
    df = rollout_table(samples, batch, iteration, shard, 0, 0, sampler.scorer).with_columns(
        seed=pl.Series(
            [stream.seed(slot // stream.m) for slot in taken for _ in range(stream.group_size)], dtype=pl.Int64
        ),
        behaviour_iteration=pl.col("token_versions").list.min(),
    )
    carry_df, carry_meta = stream.carry()
    lags = Counter(iteration - v for t in (t for slot in taken for t in groups[slot]) for v in t.versions)
    sampling = sampler.sampling(stream.group_size, stream.seed(iteration))
    meta = {
        **sampler.describe(sampling, stream.chat, iteration, stream.seed(iteration)),
        "reward_timeouts": sampler.scorer.timeouts,
        "stream": {"carry_in": carry, **asdict(stream.stats), **vars(sampler.backend.stats)},
        "version_lag_tokens": {str(lag): n for lag, n in sorted(lags.items())},
    }
    return df, carry_df, carry_meta, meta
