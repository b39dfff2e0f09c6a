"""JsonLinesReader: files and globs, gzip, errors, sharding through the loader, memory."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

import aioloader
from aioloader.readers import JsonLinesError, JsonLinesReader
from aioloader.testing import is_helper

pytestmark = pytest.mark.deadline(120)


@pytest.fixture(autouse=True)
def no_child_left() -> Iterator[None]:
    """Every test closes its loaders: no worker process outlives it."""
    yield
    # multiprocessing's resource tracker and forkserver live as long as this process.
    children = [p for p in psutil.Process().children(recursive=True) if not is_helper(p.pid)]
    _, alive = psutil.wait_procs(children, timeout=5)
    assert not alive, f"child processes left behind: {alive}"


def write_jsonl(path: Path, ids: range, *, compress: bool = False, blank_every: int = 0) -> Path:
    lines = []
    for n, i in enumerate(ids):
        if blank_every and n % blank_every == 0:
            lines.append("   ")
        lines.append(json.dumps({"id": i, "text": f"line {i}"}))
    data = ("\n".join(lines) + "\n").encode()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def corpus(tmp_path: Path, files: int, per_file: int, suffix: str = ".jsonl") -> list[int]:
    """``files`` files of ``per_file`` lines each; returns every id written."""
    for k in range(files):
        ids = range(k * per_file, (k + 1) * per_file)
        write_jsonl(tmp_path / f"part-{k:02d}{suffix}", ids, compress=suffix.endswith(".gz"))
    return list(range(files * per_file))


async def read_all(reader: JsonLinesReader, data_path: Any) -> list[Any]:
    return [item async for item in reader.read(data_path)]


def ids_of(batch: dict[str, Any]) -> list[int]:
    return [int(i) for i in batch["id"]]


def add_one(value: dict[str, Any]) -> int:
    return int(value["id"]) + 1


# ---------------------------------------------------------------------- the reader alone

async def test_single_file(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "a.jsonl", range(10))
    items = await read_all(JsonLinesReader(), path)
    assert items == [{"id": i, "text": f"line {i}"} for i in range(10)]


async def test_blank_lines_and_no_final_newline(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"id": 0}\n\n  \r\n{"id": 1}\r\n\t\n{"id": 2}')
    assert await read_all(JsonLinesReader(), str(path)) == [{"id": 0}, {"id": 1}, {"id": 2}]


async def test_glob_list_and_sorted_order(tmp_path: Path) -> None:
    (tmp_path / "sub").mkdir()
    write_jsonl(tmp_path / "b.jsonl", range(3, 6))
    write_jsonl(tmp_path / "a.jsonl", range(0, 3))
    write_jsonl(tmp_path / "sub" / "c.jsonl", range(6, 9))
    reader = JsonLinesReader(transform=add_one)
    assert await read_all(reader, str(tmp_path / "*.jsonl")) == list(range(1, 7))
    assert await read_all(reader, str(tmp_path / "**" / "*.jsonl")) == list(range(1, 10))
    # A list of paths and globs: the union, sorted, each file once.
    listed = [tmp_path / "sub" / "c.jsonl", str(tmp_path / "*.jsonl"), tmp_path / "a.jsonl"]
    assert await read_all(reader, listed) == list(range(1, 10))


async def test_gzip_by_suffix_and_by_magic(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "a.jsonl.gz", range(1000), compress=True, blank_every=7)
    write_jsonl(tmp_path / "b.jsonl", range(1000, 2000), compress=True)  # gzip, no suffix
    # Small chunks: lines and gzip members cross chunk boundaries.
    for reader in (JsonLinesReader(), JsonLinesReader(chunk_size=97)):
        items = await read_all(reader, str(tmp_path / "*"))
        assert [item["id"] for item in items] == list(range(2000))


async def test_gzip_several_members(tmp_path: Path) -> None:
    path = tmp_path / "multi.jsonl.gz"
    path.write_bytes(gzip.compress(b'{"id": 0}\n{"id"') + gzip.compress(b': 1}\n') + b"\0" * 8)
    assert await read_all(JsonLinesReader(chunk_size=5), path) == [{"id": 0}, {"id": 1}]


async def test_line_longer_than_a_chunk(tmp_path: Path) -> None:
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "x" * 10_000}) + "\n" + json.dumps({"id": 1}) + "\n")
    items = await read_all(JsonLinesReader(chunk_size=1000), path)
    assert items == [{"text": "x" * 10_000}, {"id": 1}]


async def test_invalid_line_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0}\n\n{"id": 1,,}\n{"id": 2}\n')
    with pytest.raises(JsonLinesError, match=r"bad\.jsonl, line 3: invalid JSON") as info:
        await read_all(JsonLinesReader(), path)
    assert isinstance(info.value, ValueError)
    assert (info.value.path, info.value.line_number) == (str(path), 3)


async def test_skip_invalid_counts_and_warns_once(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_bytes(b'{"id": 0}\nnot json\n{"id": 1}\n\xff\xfe\n{"id": 2}\n')
    reader = JsonLinesReader(skip_invalid=True)
    with pytest.warns(UserWarning, match=r"bad\.jsonl, line 2: skipping invalid JSON") as rec:
        items = await read_all(reader, path)
    assert items == [{"id": 0}, {"id": 1}, {"id": 2}]
    assert reader.num_skipped == 2
    assert len(rec) == 1


@pytest.mark.filterwarnings("ignore:.*skipping invalid JSON")  # garbage before the CRC check
@pytest.mark.parametrize("damage", ["flip", "truncate", "not gzip"])
async def test_corrupt_gzip_names_the_file(tmp_path: Path, damage: str) -> None:
    path = tmp_path / "broken.jsonl.gz"
    data = gzip.compress(b"".join(b'{"id": %d, "pad": "%d"}\n' % (i, i * i) for i in range(5000)))
    if damage == "flip":
        data = data[:len(data) // 2] + bytes(b ^ 0x55 for b in data[len(data) // 2:])
    elif damage == "truncate":
        data = data[:len(data) // 2]
    else:
        data = b'{"id": 0}\n'
    path.write_bytes(data)
    with pytest.raises(JsonLinesError, match=r"broken\.jsonl\.gz: corrupt gzip data after line"):
        await read_all(JsonLinesReader(skip_invalid=True, chunk_size=4096), path)


async def test_missing_files(tmp_path: Path) -> None:
    reader = JsonLinesReader()
    pattern = str(tmp_path / "nothing" / "*.jsonl")
    with pytest.raises(FileNotFoundError, match="no file matches the glob pattern") as info:
        await read_all(reader, pattern)
    assert pattern in str(info.value)
    with pytest.raises(FileNotFoundError, match=r"missing\.jsonl"):
        await read_all(reader, [tmp_path / "missing.jsonl"])
    with pytest.raises(IsADirectoryError):
        await read_all(reader, tmp_path)
    with pytest.raises(ValueError, match="empty list"):
        await read_all(reader, [])


def test_options_are_checked() -> None:
    with pytest.raises(ValueError, match="ASCII-compatible"):
        JsonLinesReader(encoding="utf-16")
    with pytest.raises(LookupError):
        JsonLinesReader(encoding="no-such-codec")
    with pytest.raises(TypeError, match="callable"):
        JsonLinesReader(transform=3)  # type: ignore[arg-type]


async def test_shards_cover_every_line_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                            ) -> None:
    """Shard by file with at least S files, else by line; ranks x workers, exactly once."""
    async def shares(data_path: str, world_size: int, workers: int) -> list[list[int]]:
        out = []
        for rank in range(world_size):
            for worker in range(workers):
                info = aioloader.WorkerInfo(workers, worker, 0, rank, world_size)
                monkeypatch.setattr("aioloader.readers._jsonl.get_worker_info", lambda i=info: i)
                out.append([item["id"] for item in await read_all(JsonLinesReader(), data_path)])
        return out

    expected = corpus(tmp_path, files=5, per_file=7)
    pattern = str(tmp_path / "*.jsonl")
    by_file = await shares(pattern, world_size=2, workers=2)  # 4 shards, 5 files
    assert by_file[0] == list(range(0, 7)) + list(range(28, 35))
    by_line = await shares(pattern, world_size=2, workers=3)  # 6 shards, 5 files
    assert by_line[4] == list(range(4, 35, 6))
    for share in (by_file, by_line):
        assert sorted(i for part in share for i in part) == expected


# ---------------------------------------------------------------------- through the loader

@pytest.mark.parametrize("num_workers", [0, 1, 2])
@pytest.mark.parametrize("lazy", [False, True], ids=["cached", "lazy"])
@pytest.mark.parametrize("files", [5, 1], ids=["by-file", "by-line"])
async def test_loader_delivers_every_line_once(tmp_path: Path, num_workers: int, lazy: bool,
                                               files: int) -> None:
    expected = corpus(tmp_path, files=files, per_file=1000 // files)
    loader = aioloader.DataLoader(
        JsonLinesReader(), str(tmp_path / "*.jsonl"), batch_size=32, num_workers=num_workers,
        max_instances_in_memory=100 if lazy else None, quiet=True)
    async with loader:
        for _ in range(2):  # two epochs
            got = [i async for batch in loader for i in ids_of(batch)]
            assert sorted(got) == expected


def test_loader_spawn_with_gzip_and_transform(tmp_path: Path) -> None:
    expected = corpus(tmp_path, files=3, per_file=100, suffix=".jsonl.gz")
    loader = aioloader.DataLoader(
        JsonLinesReader(transform=add_one), str(tmp_path / "*.gz"), batch_size=16,
        num_workers=2, max_instances_in_memory=64, start_method="spawn", quiet=True)
    with loader:
        got = [int(i) for batch in loader for i in batch]
    assert sorted(got) == [i + 1 for i in expected]


def test_loader_sync_epochs_resume_a_pass(tmp_path: Path) -> None:
    """With batches_per_epoch a pass spans epochs, each on its own event loop (sync adapter)."""
    expected = corpus(tmp_path, files=2, per_file=500)
    loader = aioloader.DataLoader(
        JsonLinesReader(chunk_size=1024), str(tmp_path / "*.jsonl"), batch_size=10,
        max_instances_in_memory=20, batches_per_epoch=30, quiet=True)
    with loader:
        got = [i for _ in range(4) for batch in loader for i in ids_of(batch)]
    assert got[:1000] == expected


def test_loader_invalid_line_in_worker(tmp_path: Path) -> None:
    corpus(tmp_path, files=1, per_file=100)
    with (tmp_path / "part-00.jsonl").open("a") as f:
        f.write('{"id": 100, "text": "line 100"}\n{"id": oops}\n')
    loader = aioloader.DataLoader(JsonLinesReader(), str(tmp_path / "*.jsonl"), batch_size=8,
                                  num_workers=2, max_instances_in_memory=16, quiet=True)
    with loader, pytest.raises(aioloader.WorkerError) as info:
        list(loader)
    message = str(info.value)
    assert "JsonLinesError" in message and "part-00.jsonl, line 102: invalid JSON" in message
    cause = info.value.__cause__
    assert isinstance(cause, JsonLinesError) and cause.line_number == 102


@pytest.mark.parametrize("lazy", [False, True], ids=["cached", "lazy"])
async def test_loader_invalid_line_in_process(tmp_path: Path, lazy: bool) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0}\n[1, 2\n')
    loader = aioloader.DataLoader(JsonLinesReader(), path, batch_size=1, quiet=True,
                                  max_instances_in_memory=4 if lazy else None)
    async with loader:
        with pytest.raises(JsonLinesError, match=r"bad\.jsonl, line 2"):
            _ = [batch async for batch in loader]


def test_loader_skip_invalid(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"id": 0}\n{\n{"id": 1}\n')
    reader = JsonLinesReader(skip_invalid=True)
    loader = aioloader.DataLoader(reader, path, batch_size=4, quiet=True)
    with loader, pytest.warns(UserWarning, match=r"bad\.jsonl, line 2"):
        assert [ids_of(batch) for batch in loader] == [[0, 1]]
    assert reader.num_skipped == 1


def test_loader_corrupt_gzip_in_worker(tmp_path: Path) -> None:
    (tmp_path / "x.jsonl.gz").write_bytes(gzip.compress(b'{"id": 1}\n' * 1000)[:-30])
    loader = aioloader.DataLoader(JsonLinesReader(), tmp_path / "x.jsonl.gz", batch_size=8,
                                  num_workers=1, quiet=True)
    with loader, pytest.raises(aioloader.WorkerError, match=r"x\.jsonl\.gz: corrupt gzip"):
        list(loader)


def test_loader_glob_matches_nothing(tmp_path: Path) -> None:
    loader = aioloader.DataLoader(JsonLinesReader(), str(tmp_path / "*.jsonl"), batch_size=8,
                                  quiet=True)
    with loader, pytest.raises(FileNotFoundError, match=r"\*\.jsonl"):
        list(loader)


def test_pickles_with_plain_attributes() -> None:
    import pickle

    reader = JsonLinesReader(transform=add_one, skip_invalid=True, encoding="latin-1")
    clone = pickle.loads(pickle.dumps(reader))
    assert repr(clone) == repr(reader)
    err = pickle.loads(pickle.dumps(JsonLinesError("m", "f.jsonl", 3)))
    assert (str(err), err.path, err.line_number) == ("m", "f.jsonl", 3)


# ---------------------------------------------------------------------- memory

MEMORY_SCRIPT = textwrap.dedent("""
    import os, resource, sys
    import aioloader
    from aioloader.readers import JsonLinesReader

    def count(batch):
        return len(batch)

    try:  # reset the peak to the current RSS: imports peak higher than they settle
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass
    with open("/proc/self/statm") as f:
        before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    loader = aioloader.DataLoader(
        JsonLinesReader(), sys.argv[1], batch_size=64, num_workers=2,
        max_instances_in_memory=1024, collate_fn=count, quiet=True)
    with loader:
        total = sum(loader)
    # VmHWM, the peak that clear_refs reset (ru_maxrss keeps the imports' peak)
    with open("/proc/self/status") as f:
        hwm = [line for line in f if line.startswith("VmHWM:")]
    if hwm:
        peak = int(hwm[0].split()[1]) * 1024
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print(total, max(peak - before, 0))
""")


def peak_rss_growth(pattern: str) -> tuple[int, int]:
    """(instances, bytes of peak-RSS growth) of the main process reading ``pattern`` lazily."""
    done = subprocess.run([sys.executable, "-c", MEMORY_SCRIPT, pattern], capture_output=True,
                          text=True, timeout=300, check=True, env=os.environ | {
                              "PYTHONWARNINGS": "ignore"})
    total, growth = done.stdout.split()
    return int(total), int(growth)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss units")
@pytest.mark.parametrize("per_file", [5_000, pytest.param(50_000, marks=pytest.mark.slow)])
def test_lazy_memory_does_not_grow_with_the_corpus(tmp_path: Path, per_file: int) -> None:
    """2 files vs 20 (the issue's case: 50k lines each, ~50 s on 2 busy cores)."""
    body = "".join(f'{{"id": {i}, "text": "lorem ipsum dolor sit amet"}}\n'
                   for i in range(per_file)).encode()
    for files in (2, 20):
        (tmp_path / str(files)).mkdir()
        for k in range(files):
            (tmp_path / str(files) / f"part-{k:02d}.jsonl").write_bytes(body)
    small_total, small = peak_rss_growth(str(tmp_path / "2" / "*.jsonl"))
    large_total, large = peak_rss_growth(str(tmp_path / "20" / "*.jsonl"))
    assert (small_total, large_total) == (2 * per_file, 20 * per_file)
    mib = 1 << 20
    print(f"peak RSS growth: {small / mib:.1f} MiB (2 files), {large / mib:.1f} MiB (20 files)")
    assert large < 100 * mib, f"peak RSS grew by {large / mib:.0f} MiB over {large_total} lines"
    assert large < 2 * small + 30 * mib, (
        f"peak RSS growth: {small / mib:.1f} MiB for 2 files, {large / mib:.1f} MiB for 20")
