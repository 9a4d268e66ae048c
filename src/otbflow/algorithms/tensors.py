"""Tensor helpers of the code base below every stage: ``padded``, lists of unequal length as one
padded tensor (batches, masks, labels, per-token columns)."""

from __future__ import annotations

import torch


def padded(
    seqs: list[list], value, width: int | None = None, left: bool = False, dtype=torch.long, device=None
) -> torch.Tensor:
    """Lists of unequal length as one [len(seqs), width] tensor, filled with ``value`` on the right
    (``left``: on the left, where generation wants its prompts); ``width`` defaults to the longest.
    The one padding of the code base (batches, masks, labels, per-token columns)."""
    width = max((len(s) for s in seqs), default=0) if width is None else width
    rows = [[value] * (width - len(s)) + list(s) if left else list(s) + [value] * (width - len(s)) for s in seqs]
    return torch.tensor(rows, dtype=dtype, device=device)
