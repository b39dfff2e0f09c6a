"""ParquetReader (issue 35): files written by pyarrow, rows as dicts or batches as tensors;
row groups dealt to workers and ranks, exact resume by (row group, row), a local S3, damaged
files named or skipped."""

from __future__ import annotations

import asyncio
import json
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import aioloader
from aioloader.readers import ParquetError, ParquetReader, prebatched, to_tensors
from aioloader.readers import _parquet as parquet_module
from aioloader.testing import s3_server

sys.path.insert(0, str(Path(__file__).parent))
import formats_dist

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
pytestmark = pytest.mark.deadline(90)

FILES, ROWS, GROUP = 2, 50, 8  # 7 row groups a file (the last of 2 rows)
N = FILES * ROWS


def table(first: int, rows: int) -> Any:
    ids = list(range(first, first + rows))
    return pa.table({
        "i": pa.array(ids, pa.int64()),
        "f": pa.array([i / 2 for i in ids], pa.float32()),
        "flag": pa.array([i % 3 == 0 for i in ids]),
        "text": [f"row {i}" for i in ids],
        "vec": pa.array([[i, i + 1, i + 2] for i in ids], pa.list_(pa.float32(), 3)),
        "maybe": pa.array([None if i % 4 == 0 else i for i in ids], pa.int32()),
    })


def write_files(folder: Path, files: int = FILES, rows: int = ROWS,
                group: int = GROUP) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for k in range(files):
        pq.write_table(table(k * rows, rows), folder / f"part-{k}.parquet",
                       row_group_size=group, compression="snappy")
    return folder


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_files(tmp_path_factory.mktemp("parquet"))


def read_all(reader: ParquetReader, data_path: Any = None) -> list[Any]:
    async def collect() -> list[Any]:
        return [row async for row in reader.read(data_path)]

    return asyncio.run(collect())


def test_rows_are_pyarrows_rows_in_order(files: Path) -> None:
    rows = read_all(ParquetReader(str(files / "*.parquet")))
    expected = [row for k in range(FILES)
                for row in pq.read_table(files / f"part-{k}.parquet").to_pylist()]
    assert rows == expected


def test_columns_are_projected(files: Path) -> None:
    rows = read_all(ParquetReader(), [str(files / "part-1.parquet")])
    assert read_all(ParquetReader(str(files / "part-1.parquet"), columns=["text", "i"]))[3] == {
        "text": "row 53", "i": 53} and len(rows) == ROWS
    with pytest.raises(TypeError, match="list of column names"):
        ParquetReader("x.parquet", columns="text")  # type: ignore[arg-type]


def test_to_tensors_keeps_numbers_as_tensors_and_the_rest_as_lists() -> None:
    batch = to_tensors(table(0, 5))
    assert batch["i"].dtype == torch.int64 and batch["i"].tolist() == [0, 1, 2, 3, 4]
    assert batch["f"].dtype == torch.float32 and batch["flag"].dtype == torch.bool
    assert batch["vec"].shape == (5, 3) and batch["vec"][2].tolist() == [2, 3, 4]
    assert batch["text"] == [f"row {i}" for i in range(5)]
    assert batch["maybe"] == [None, 1, 2, 3, None], "a column with nulls stays a list"


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_rows_give_whole_batches(files: Path, workers: int) -> None:
    reader = ParquetReader(str(files / "*.parquet"), batch_rows=16, columns=["i", "text", "vec"])
    with aioloader.DataLoader(reader, batch_size=1, collate_fn=prebatched, num_workers=workers,
                              quiet=True) as loader:
        batches = list(loader)
    seen = [i for b in batches for i in b["i"].tolist()]
    assert sorted(seen) == list(range(N))
    assert all(isinstance(b["text"], list) and b["vec"].shape == (len(b["i"]), 3)
               for b in batches)
    assert max(len(b["i"]) for b in batches) == 16
    if workers == 0:  # batches span row groups: only the pass's last is short
        assert [len(b["i"]) for b in batches] == [16] * 6 + [4]
    with pytest.raises(ValueError, match="batch_size=1"):
        prebatched([{}, {}])


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_workers_see_every_row_once(files: Path, workers: int) -> None:
    reader = ParquetReader(str(files / "*.parquet"), columns=["i", "f"])
    with aioloader.DataLoader(reader, batch_size=5, num_workers=workers,
                              max_instances_in_memory=10, quiet=True) as loader:
        seen = [i for b in loader for i in b["i"].tolist()]
    assert sorted(seen) == list(range(N))


def test_fewer_row_groups_than_workers_split_rows(tmp_path: Path) -> None:
    write_files(tmp_path, files=2, rows=11, group=100)

    def make() -> aioloader.DataLoader:
        reader = ParquetReader(str(tmp_path / "*.parquet"), columns=["i"])
        return aioloader.DataLoader(reader, batch_size=2, num_workers=3,
                                    max_instances_in_memory=4, quiet=True)

    whole, before, after = formats_dist.interrupted(make, 4, lambda b: b["i"].tolist())
    assert sorted(i for b in whole for i in b) == list(range(22))
    formats_dist.check_resumed(whole, before, after, ordered=False)


def test_resume_reads_from_the_states_row_group(files: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    whole = read_all(ParquetReader(str(files / "*.parquet"), columns=["i"]))
    reader = ParquetReader(str(files / "*.parquet"), columns=["i"])

    async def first(n: int) -> dict[str, Any]:
        stream = reader.read(None)
        for _ in range(n):
            await stream.__anext__()
        state = reader.state_dict()
        await stream.aclose()  # type: ignore[attr-defined]
        return state

    state = json.loads(json.dumps(asyncio.run(first(61))))
    # Row 61 is file 1's row 11: its second row group (piece 7 + 1), 3 rows in.
    assert (state["piece"], state["offset"]) == (8, 61 - ROWS - GROUP)
    read: list[int] = []
    real = parquet_module._Files.read

    def spy(self: Any, piece: Any, columns: Any) -> Any:
        read.append(piece.file * 7 + piece.row_group)
        return real(self, piece, columns)

    monkeypatch.setattr(parquet_module._Files, "read", spy)
    resumed = ParquetReader(str(files / "*.parquet"), columns=["i"])
    resumed.load_state_dict(state)
    assert read_all(resumed) == whole[61:]
    assert read == list(range(8, 14)), "no row group before the state's is read again"


def make_loader(folder: Path, workers: int, batch_rows: int | None = None
                ) -> aioloader.DataLoader:
    reader = ParquetReader(str(folder / "*.parquet"), columns=["i", "text"],
                           batch_rows=batch_rows, shuffle_row_groups=True, seed=9)
    if batch_rows is not None:
        return aioloader.DataLoader(reader, batch_size=1, collate_fn=prebatched, shuffle=True,
                                    seed=2, num_workers=workers, max_instances_in_memory=3,
                                    quiet=True)
    return aioloader.DataLoader(reader, batch_size=4, shuffle=True, seed=2, num_workers=workers,
                                max_instances_in_memory=12, quiet=True)


@pytest.mark.parametrize(("workers", "batch_rows"), [(0, None), (2, None), (0, 5), (2, 5)])
def test_exact_resume_mid_epoch(files: Path, workers: int, batch_rows: int | None) -> None:
    whole, before, after = formats_dist.interrupted(
        lambda: make_loader(files, workers, batch_rows), 7, lambda b: b["i"].tolist())
    formats_dist.check_resumed(whole, before, after, ordered=workers == 0)


def test_resume_on_other_numbers_of_workers(files: Path) -> None:
    formats_dist.check_workers_reshaped(lambda workers: make_loader(files, workers), N,
                                        lambda b: b["i"].tolist())


def test_resume_on_another_shape_with_fewer_row_groups_than_workers(tmp_path: Path) -> None:
    # 2 row groups, 3 workers: each worker kept every third row of the pass; the new shapes
    # deal the row groups (2 workers) or read them whole (1), without what was delivered.
    write_files(tmp_path, files=1, rows=20, group=10)
    formats_dist.check_workers_reshaped(
        lambda workers: aioloader.DataLoader(
            ParquetReader(str(tmp_path / "*.parquet"), columns=["i"]), batch_size=2,
            shuffle=True, seed=3, num_workers=workers, max_instances_in_memory=4, quiet=True),
        20, lambda b: b["i"].tolist(), start=3, to=(2, 0))


def test_a_pass_resumed_on_another_shape_resumes_again_on_its_own(files: Path) -> None:
    # Taken with 2 workers, resumed with 3, taken again: that state resumes with 3 workers
    # (formats_dist.resume checks it), and with another number says what to do.
    def make(workers: int) -> aioloader.DataLoader:
        return make_loader(files, workers)

    _, state = formats_dist.stop(lambda: make(2), 3, lambda b: b["i"].tolist())
    with make(3) as loader:
        loader.load_state_dict(state)
        next(iter(loader))
        again = loader.state_dict()
    with make(1) as loader, pytest.raises(aioloader.ResumeError,
                                          match="already been resumed on another shape"):
        loader.load_state_dict(again)


def test_a_cached_read_resumes_on_its_own_shape_only_and_says_so(files: Path) -> None:
    # Without max_instances_in_memory the workers' instances are cached as they came: the
    # loader cannot deal them again, and says how to read so that it could.
    def make(workers: int) -> aioloader.DataLoader:
        return aioloader.DataLoader(ParquetReader(str(files / "*.parquet"), columns=["i"]),
                                    batch_size=4, num_workers=workers, quiet=True)

    with make(2) as loader:
        next(iter(loader))
        state = loader.state_dict()
    with make(1) as loader, pytest.raises(aioloader.ResumeError,
                                          match="max_instances_in_memory"):
        loader.load_state_dict(state)


@pytest.mark.deadline(300)
def test_resume_on_other_numbers_of_ranks_and_workers(files: Path, tmp_path: Path) -> None:
    formats_dist.check_reshaped("parquet", files, tmp_path, N)


def test_s3_url(files: Path) -> None:
    with s3_server() as s3:
        s3.make_bucket("tables", {f"t/part-{k}.parquet": (files / f"part-{k}.parquet")
                                  .read_bytes() for k in range(FILES)})
        reader = ParquetReader("s3://tables/t/*.parquet", columns=["i"],
                               storage_options=s3.storage_options)
        with aioloader.DataLoader(reader, batch_size=8, num_workers=2,
                                  max_instances_in_memory=16, quiet=True) as loader:
            seen = [i for b in loader for i in b["i"].tolist()]
        assert sorted(seen) == list(range(N))


def damaged_row_group(folder: Path, group: int) -> Path:
    """part-0's ``group``-th row group with its text column's pages scrambled."""
    path = folder / "part-0.parquet"
    column = pq.ParquetFile(path).metadata.row_group(group).column(3)
    start = column.dictionary_page_offset or column.data_page_offset
    data = bytearray(path.read_bytes())
    for k in range(start + 20, start + column.total_compressed_size - 2):
        data[k] ^= 0x5A
    path.write_bytes(bytes(data))
    return path


def test_a_damaged_row_group_is_named_or_skipped(tmp_path: Path) -> None:
    path = damaged_row_group(write_files(tmp_path), 3)
    reader = ParquetReader(str(tmp_path / "*.parquet"))
    with aioloader.DataLoader(reader, batch_size=4, num_workers=1, timeout=30,
                              quiet=True) as loader, pytest.raises(aioloader.WorkerError) as got:
        list(loader)
    assert f"{path}: row group 3 does not read" in str(got.value)
    assert "on_error='skip'" in str(got.value)
    skipping = ParquetReader(str(tmp_path / "*.parquet"), on_error="skip")
    with pytest.warns(UserWarning, match="skipping row group 3"):
        rows = read_all(skipping)
    assert [r["i"] for r in rows] == [i for i in range(N) if not 24 <= i < 32]
    assert skipping.num_skipped == 1
    for workers, worker_type in ((0, "process"), (2, "process"), (2, "thread")):
        reader = ParquetReader(str(tmp_path / "*.parquet"), columns=["i", "text"],
                               on_error="skip")
        with aioloader.DataLoader(reader, batch_size=4, num_workers=workers, timeout=30,
                                  worker_type=worker_type, quiet=True
                                  ) as loader, warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # the reader's (in the main process)
            seen = sorted(i for b in loader for i in b["i"].tolist())
            assert seen == [i for i in range(N) if not 24 <= i < 32]
            assert loader.stats().skipped == 1, "the row group skipped counts in stats()"
            assert [s.key for s in loader.skipped] == [f"{path}: row group 3"]
        # counted by the reader that read it: a worker's own copy (threads' too), not ours
        assert reader.num_skipped == (1 if workers == 0 else 0)


def test_a_truncated_file_is_named(tmp_path: Path) -> None:
    path = write_files(tmp_path, files=1) / "part-0.parquet"
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(ParquetError, match=r"part-0\.parquet: not a readable Parquet file"):
        read_all(ParquetReader(str(path)))


@pytest.mark.deadline(240)
def test_two_ranks_two_workers_once_and_resumed(files: Path, tmp_path: Path) -> None:
    got = formats_dist.run("parquet", files, tmp_path)
    flat = [i for r in got.values() for b in r["whole"] for i in b]
    assert sorted(flat) == list(range(N)), "every row once across 2 ranks x 2 workers"
    for r in got.values():
        formats_dist.check_resumed(r["whole"], r["before"], r["after"], ordered=False)
