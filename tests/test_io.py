import os

import polars as pl
import pyarrow.parquet as pq
import pytest

from otbflow import schemas
from otbflow.io import SchemaError, atomic_dir, read_metadata, read_table, write_parquet


def _prompts(n=3):
    return pl.DataFrame(
        {
            "prompt_id": list(range(n)),
            "prompt": ["1+1="] * n,
            "messages": ['[{"role": "user", "content": "1+1="}]'] * n,
            "answer": ["2"] * n,
            "data_source": ["arithmetic"] * n,
            "split": ["train"] * n,
            "shard": [0] * n,
        }
    )


def test_write_is_atomic_and_keeps_metadata(tmp_path):
    path = write_parquet(_prompts(), tmp_path / "a.parquet", metadata={"temperature": 0.7})
    assert read_metadata(path) == {"temperature": 0.7}
    assert pq.ParquetFile(path).metadata.row_group(0).column(0).compression == "ZSTD"
    assert os.listdir(tmp_path) == ["a.parquet"]


def test_killed_write_leaves_nothing_that_looks_done(tmp_path, monkeypatch):
    def boom(table, where, **kw):
        with open(where, "wb") as f:
            f.write(b"PAR1 half a file")
        raise KeyboardInterrupt  # the job is killed mid-write

    monkeypatch.setattr(pq, "write_table", boom)
    with pytest.raises(KeyboardInterrupt):
        write_parquet(_prompts(), tmp_path / "b.parquet")
    assert os.listdir(tmp_path) == []


def test_read_table_names_file_and_column(tmp_path):
    path = write_parquet(_prompts().drop("answer"), tmp_path / "p.parquet")
    with pytest.raises(SchemaError, match=r"p\.parquet: missing column 'answer'"):
        read_table(path, schemas.PROMPTS)
    path = write_parquet(_prompts().with_columns(pl.col("prompt_id").cast(pl.String)), tmp_path / "q.parquet")
    with pytest.raises(SchemaError, match=r"q\.parquet: column 'prompt_id' has dtype String"):
        read_table(path, schemas.PROMPTS)
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(SchemaError, match="junk.parquet: not a readable Parquet"):
        read_table(tmp_path / "junk.parquet", schemas.PROMPTS)


def test_ragged_per_token_lists_are_rejected(rollouts_path, tmp_path):
    df = pl.read_parquet(rollouts_path)
    bad = df.with_columns(
        pl.when(pl.int_range(pl.len()) == 2)
        .then(pl.col("rollout_logprobs").list.slice(1))
        .otherwise(pl.col("rollout_logprobs"))
        .alias("rollout_logprobs")
    )
    path = write_parquet(bad, tmp_path / "r.parquet")
    with pytest.raises(SchemaError, match=r"r\.parquet: column 'rollout_logprobs' is ragged .* row 2"):
        read_table(path, schemas.ROLLOUTS)


def test_atomic_dir_replaces_only_on_success(tmp_path):
    target = tmp_path / "model"
    with atomic_dir(target) as tmp:
        (tmp / "w.bin").write_text("v1")
    with pytest.raises(RuntimeError):
        with atomic_dir(target) as tmp:
            (tmp / "w.bin").write_text("v2-partial")
            raise RuntimeError("killed")
    assert (target / "w.bin").read_text() == "v1"
    assert sorted(os.listdir(tmp_path)) == ["model"]


def test_progress_logs_about_every_tenth_and_the_end(caplog):
    import logging

    from otbflow.progress import Progress

    log = logging.getLogger("otbflow.test")
    with caplog.at_level(logging.INFO, logger="otbflow.test"):
        p = Progress(log, "rollout", 95, "prompts")
        for _ in range(95):
            p.update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 11  # at 9, 18, ..., 90 of 95 (ten), then at the end
    assert lines[0].startswith("rollout: 9/95 prompts (9%)") and lines[-1].startswith("rollout: 95/95 prompts (100%)")
    assert lines[-1].endswith("done") and "s left" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="otbflow.test"):
        Progress(log, "tiny", 1).update()
    assert not caplog.records  # a job of one item writes no progress lines
