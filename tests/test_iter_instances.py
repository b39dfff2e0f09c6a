"""``loader.iter_instances()``: one pass of instances, unbatched (CONTRACT), and the cache it
fills in cached mode, so that ``len()`` and the next epoch read nothing again."""

from __future__ import annotations

import asyncio
import gc
import pathlib
from collections.abc import Iterator
from typing import Any

import pytest
from core_sources import Squares, instance

import aioloader


class CountingReader(aioloader.Reader):
    """Writes a line to ``log`` each time a pass begins (in whichever process reads it)."""

    def __init__(self, n: int, log: pathlib.Path) -> None:
        self.n, self.log = n, log

    def read(self, data_path: Any) -> Iterator[dict[str, Any]]:
        with self.log.open("a") as f:
            f.write("read\n")
        for i in range(self.n):
            yield instance(i)


def reads(log: pathlib.Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


async def collect(loader: aioloader.DataLoader[Any]) -> list[Any]:
    return [item async for item in loader.iter_instances()]


def test_a_map_style_dataset_gives_its_samples_in_index_order() -> None:
    loader = aioloader.DataLoader(Squares(5), batch_size=2, quiet=True)
    items = asyncio.run(collect(loader))
    assert [int(x["index"]) for x in items] == [0, 1, 2, 3, 4]
    assert [float(x["sq"]) for x in items] == [0.0, 1.0, 4.0, 9.0, 16.0]
    loader.close()


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_cached_reader_is_read_once_for_the_instances_len_and_the_epoch(
        tmp_path: pathlib.Path, num_workers: int) -> None:
    log = tmp_path / "reads"
    loader = aioloader.DataLoader(CountingReader(11, log), batch_size=4,
                                  num_workers=num_workers, quiet=True)
    items = asyncio.run(collect(loader))
    assert sorted(x["index"] for x in items) == list(range(11))  # none lost, none twice
    passes = reads(log)
    assert passes == max(1, num_workers)  # one pass: each worker read its share once
    assert len(loader) == 3  # from the cache: nothing read again
    epoch = [int(i) for batch in loader for i in batch["index"]]
    assert sorted(epoch) == list(range(11))
    assert reads(log) == passes
    loader.close()


def test_len_first_fills_the_cache_that_iter_instances_then_reads(
        tmp_path: pathlib.Path) -> None:
    log = tmp_path / "reads"
    loader = aioloader.DataLoader(CountingReader(7, log), batch_size=2, num_workers=2,
                                  quiet=True)
    assert len(loader) == 4
    passes = reads(log)
    items = asyncio.run(collect(loader))
    assert sorted(x["index"] for x in items) == list(range(7))
    assert reads(log) == passes
    loader.close()


def test_a_lazy_reader_reads_a_pass_each_time(tmp_path: pathlib.Path) -> None:
    log = tmp_path / "reads"
    loader = aioloader.DataLoader(CountingReader(6, log), batch_size=2, num_workers=2,
                                  max_instances_in_memory=4, quiet=True)
    for expected in (2, 4):
        items = asyncio.run(collect(loader))
        assert sorted(x["index"] for x in items) == list(range(6))
        assert reads(log) == expected  # no cache: both workers read again
    loader.close()


@pytest.mark.parametrize("close", ["close", "drop"])
def test_leaving_a_pass_half_way_stops_its_workers(tmp_path: pathlib.Path,
                                                   close: str) -> None:
    loader = aioloader.DataLoader(CountingReader(50, tmp_path / "reads"), batch_size=2,
                                  num_workers=2, max_instances_in_memory=4, quiet=True)

    async def first_three() -> list[Any]:
        got = []
        async for item in loader.iter_instances():
            got.append(item)
            if len(got) == 3:
                break
        return got

    assert len(asyncio.run(first_three())) == 3
    if close == "close":
        loader.close()
    else:
        del loader  # nobody closes it: the no-leak fixture checks its workers are gone
        gc.collect()
