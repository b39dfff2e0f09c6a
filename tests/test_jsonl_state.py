"""JsonLinesReader.state_dict/load_state_dict: exact resume anywhere, seeks, clear errors."""

from __future__ import annotations

import codecs
import contextlib
import gzip
import itertools
import json
import pickle
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from aioloader import WorkerInfo
from aioloader._info import set_worker_info
from aioloader.readers import JsonLinesError, JsonLinesReader
from aioloader.readers._files import CHUNK_SIZE, ByteSource

pytestmark = [pytest.mark.deadline(60),
              pytest.mark.filterwarnings("ignore:.*skipping invalid JSON")]

BOM = codecs.BOM_UTF8


@contextlib.contextmanager
def as_shard(shard: int, shards: int) -> Iterator[None]:
    """Read as shard ``shard`` of ``shards``, the way a worker of a loader does."""
    set_worker_info(WorkerInfo(num_workers=shards, id=shard, seed=0))
    try:
        yield
    finally:
        set_worker_info(None)


def add_key(value: Any) -> Any:
    return [value["id"], "transformed"]


async def take(reader: JsonLinesReader, data_path: Any, stop: int | None = None,
               ) -> tuple[list[Any], dict[str, Any]]:
    """The first ``stop`` instances of a pass (all when None), and the state right after."""
    out: list[Any] = []
    async with contextlib.aclosing(reader.read(data_path)) as items:
        if stop != 0:
            async for item in items:
                out.append(item)
                if len(out) == stop:
                    break
        state = reader.state_dict()
    return out, json.loads(json.dumps(state))


async def pass_with_states(reader: JsonLinesReader, data_path: Any, cuts: set[int],
                           ) -> tuple[list[Any], dict[int, dict[str, Any]]]:
    """A whole pass, and the states taken after the instances numbered in ``cuts``."""
    out: list[Any] = []
    states = {}
    async with contextlib.aclosing(reader.read(data_path)) as items:
        async for item in items:
            out.append(item)
            if len(out) in cuts:
                states[len(out)] = json.loads(json.dumps(reader.state_dict()))
    states[-1] = json.loads(json.dumps(reader.state_dict()))  # after the pass: the end
    return out, states


async def resumed(make: Callable[[], JsonLinesReader], data_path: Any, state: dict[str, Any],
                  stop: int | None = None) -> tuple[list[Any], dict[str, Any]]:
    reader = make()  # a fresh reader: nothing carried over but the state
    reader.load_state_dict(state)
    return await take(reader, data_path, stop)


# ---------------------------------------------------------------------- data

def instance_lines(rng: random.Random, ids: range, dirty: bool) -> list[bytes]:
    """One JSON line per id, among blank lines, CRLF endings and (dirty) invalid lines."""
    lines = []
    for i in ids:
        if rng.random() < 0.15:
            lines.append(rng.choice([b"", b"   ", b"\r", b"\t "]))
        if dirty and rng.random() < 0.15:
            lines.append(rng.choice([b"{not json", b"\xff\xfe", b'{"id": 1,,}']))
        text = "é€" * rng.randrange(4)  # several bytes per character: offsets are bytes
        line = json.dumps({"id": i, "text": text}, ensure_ascii=False).encode()
        lines.append(line + b"\r" if rng.random() < 0.2 else line)
    return lines


def write(path: Path, lines: list[bytes], *, bom: bool = False, trailing: bool = True,
          compress: bool = False) -> None:
    data = (BOM if bom else b"") + b"\n".join(lines) + (b"\n" if trailing and lines else b"")
    if compress:  # two members, split mid-line, and zero padding after them
        cut = len(data) // 2
        path.write_bytes(gzip.compress(data[:cut]) + gzip.compress(data[cut:]) + b"\0" * 4)
    else:
        path.write_bytes(data)


def make_corpus(root: Path, layout: str, compress: bool, dirty: bool, rng: random.Random,
                ) -> str:
    """The files of one test; returns the glob naming them."""
    gz = ".gz" if compress else ""
    if layout == "one":  # a BOM and no newline after the last line
        write(root / f"data.jsonl{gz}", instance_lines(rng, range(40), dirty), bom=True,
              trailing=False, compress=compress)
    else:
        write(root / f"a.jsonl{gz}", instance_lines(rng, range(0, 15), dirty), bom=True,
              compress=compress)
        write(root / f"b.jsonl{gz}", [], compress=compress)  # empty
        # gzip known by its magic bytes only, and no newline after the last line
        write(root / "c.jsonl", instance_lines(rng, range(15, 30), dirty), trailing=False,
              compress=compress)
        write(root / f"d.jsonl{gz}", [*instance_lines(rng, range(30, 40), dirty), b"", b" "],
              compress=compress)
    return str(root / "*")


# ---------------------------------------------------------------------- resume anywhere

SHARDS = [(0, 1), (1, 2), (3, 5)]  # 4 files: 2 shards split by file, 5 by line


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
@pytest.mark.parametrize("layout", ["one", "several"])
@pytest.mark.parametrize("dirty", [False, True], ids=["clean", "dirty"])
async def test_resume_anywhere_reads_the_rest(tmp_path: Path, layout: str, compress: bool,
                                              dirty: bool) -> None:
    """Cut anywhere, resume in a fresh reader, cut and resume again: the same instances.

    Each shard of SHARDS (one file is always split by line), with tiny chunks (lines and
    gzip members straddle them) and default ones. "dirty" adds invalid lines
    (skip_invalid=True) and a transform.
    """
    rng = random.Random(f"{layout}-{compress}-{dirty}")
    data_path = make_corpus(tmp_path, layout, compress, dirty, rng)
    tiny = 5 if compress == dirty else 7  # both sizes, in half of the cases each
    for shard, chunk_size in itertools.product(SHARDS, [tiny, CHUNK_SIZE]):
        def make(chunk_size: int = chunk_size) -> JsonLinesReader:
            if dirty:
                return JsonLinesReader(transform=add_key, skip_invalid=True,
                                       chunk_size=chunk_size)
            return JsonLinesReader(chunk_size=chunk_size)

        with as_shard(*shard):
            await check_resumes(make, data_path, rng, f"shard {shard}, chunk {chunk_size}")


async def check_resumes(make: Callable[[], JsonLinesReader], data_path: str,
                        rng: random.Random, where: str) -> None:
    n = len((await take(make(), data_path))[0])
    assert n > 0
    cuts = {0, 1, n - 1, n, *rng.sample(range(n + 1), min(n + 1, 3))}
    full, states = await pass_with_states(make(), data_path, cuts)
    assert len(full) == n
    for k in sorted(cuts):
        state = states.get(k) or (await take(make(), data_path, stop=k))[1]
        rest, _ = await resumed(make, data_path, state)
        assert rest == full[k:], f"{where}: resumed after {k} of {n}"
        # Resumed, then cut and resumed again.
        more = rng.randrange(n - k + 1)
        part, again = await resumed(make, data_path, state, stop=more)
        assert part == full[k:k + more]
        if more:  # the same position as the first pass had there
            assert again == states.get(k + more, again)
        rest, _ = await resumed(make, data_path, again)
        assert part + rest == full[k:], f"{where}: resumed after {k}, then {k + more} of {n}"
    # From the end of a pass: nothing more.
    assert (await resumed(make, data_path, states[-1]))[0] == []


async def test_state_after_each_instance_of_a_small_file(tmp_path: Path) -> None:
    """Every cut point of a file with every edge in a few lines, byte by byte chunks too."""
    path = tmp_path / "edge.jsonl"
    path.write_bytes(BOM + b'{"a": 1}\r\n\n  \n{"b": "\xc3\xa9"}\nnope\n\n[3]\n4')
    for chunk_size in (1, 2, 3, 4, CHUNK_SIZE):
        def make(chunk_size: int = chunk_size) -> JsonLinesReader:
            return JsonLinesReader(skip_invalid=True, chunk_size=chunk_size)

        full, states = await pass_with_states(make(), path, set(range(5)))
        assert full == [{"a": 1}, {"b": "é"}, [3], 4]
        for k in range(5):
            state = states.get(k) or (await take(make(), path, stop=k))[1]
            assert (await resumed(make, path, state))[0] == full[k:]
        assert states[4]["offset"] == path.stat().st_size  # after the last line, no newline


async def test_gzip_without_suffix_with_one_byte_chunks(tmp_path: Path) -> None:
    path = tmp_path / "data"  # gzip by its magic bytes only
    path.write_bytes(gzip.compress(BOM + b'{"id": 0}\n{"id": 1}\n{"id": 2}\n'))
    full, states = await pass_with_states(JsonLinesReader(chunk_size=1), path, {1, 2})
    assert full == [{"id": 0}, {"id": 1}, {"id": 2}]
    rest, _ = await resumed(lambda: JsonLinesReader(chunk_size=1), path, states[1])
    assert rest == full[1:]


# ---------------------------------------------------------------------- the protocol

async def test_state_is_consumed_by_one_pass(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    write(path, [b'{"id": %d}' % i for i in range(10)])
    reader = JsonLinesReader()
    start = reader.state_dict()  # before any pass: the start
    assert (start["file"], start["offset"], start["num_files"]) == (0, 0, None)
    _, state = await take(reader, path, stop=4)
    reader.load_state_dict(state)
    assert reader.state_dict() == state  # loaded, not read yet: the position loaded
    items = reader.read(path)
    assert reader.state_dict() == state  # the pass has not started
    assert [item["id"] async for item in items] == list(range(4, 10))
    assert reader.state_dict()["file"] == 1  # the end: past the only file
    assert [item["id"] async for item in reader.read(path)] == list(range(10))  # from 0 again
    another = JsonLinesReader()
    another.load_state_dict(start)
    assert len((await take(another, path))[0]) == 10


async def test_state_describes_the_latest_pass(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl"
    write(path, [b'{"id": %d}' % i for i in range(10)])
    reader = JsonLinesReader()
    async with contextlib.aclosing(reader.read(path)) as first:
        assert (await anext(first))["id"] == 0
        _, state = await take(reader, path, stop=6)  # a second pass, now the latest
        assert (await anext(first))["id"] == 1  # the first one goes on, unaffected
        assert reader.state_dict() == state
    clone = pickle.loads(pickle.dumps(reader))  # a worker's copy has read nothing
    assert clone.state_dict()["num_files"] is None


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
async def test_resume_parses_nothing_before_the_offset(tmp_path: Path, compress: bool,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Resuming opens no earlier file and parses no earlier line; a plain file is not read
    before the offset at all (but for the byte before it: a line must start there)."""
    gz = ".gz" if compress else ""
    first, second = tmp_path / f"a.jsonl{gz}", tmp_path / f"b.jsonl{gz}"
    lines = [b'{"id": %d, "pad": "%s"}' % (i, b"x" * (i % 13)) for i in range(300)]
    write(first, lines[:100], compress=compress)
    write(second, lines[100:], compress=compress)
    data_path = str(tmp_path / "*")
    _, state = await take(JsonLinesReader(chunk_size=64), data_path, stop=250)
    assert state["path"] == str(second)
    # Every line before the offset becomes invalid JSON of the same length, and the first file
    # garbage: parsed, either fails the pass.
    offset = state["offset"]
    data = b"\n".join(lines[100:]) + b"\n"
    garbled = bytes(c if c == ord("\n") else ord("!") for c in data[:offset]) + data[offset:]
    second.write_bytes(gzip.compress(garbled) if compress else garbled)
    first.write_bytes(b"\xff" * first.stat().st_size)

    opened: list[tuple[str, int]] = []
    raw_bytes = 0
    open_, read_raw = ByteSource.open.__func__, ByteSource._read_raw  # type: ignore[attr-defined]

    async def spy_open(cls: type[ByteSource], path: str, chunk_size: int = CHUNK_SIZE,
                       offset: int = 0) -> ByteSource:
        opened.append((path, offset))
        source: ByteSource = await open_(cls, path, chunk_size, offset)
        return source

    async def spy_read_raw(self: ByteSource, size: int | None = None) -> bytes:
        nonlocal raw_bytes
        data = await read_raw(self, size)
        raw_bytes += len(data)
        return data

    monkeypatch.setattr(ByteSource, "open", classmethod(spy_open))
    monkeypatch.setattr(ByteSource, "_read_raw", spy_read_raw)
    rest, _ = await resumed(lambda: JsonLinesReader(chunk_size=64), data_path, state)
    assert [item["id"] for item in rest] == list(range(250, 300))
    assert [path for path, _ in opened] == [str(second)]
    if not compress:
        assert raw_bytes == len(data) - offset + 1


async def test_byte_source_opens_at_an_offset(tmp_path: Path) -> None:
    data = b"".join(b'{"id": %d}\n' % i for i in range(20))
    (tmp_path / "x").write_bytes(data)
    (tmp_path / "x.gz").write_bytes(gzip.compress(data[:77]) + gzip.compress(data[77:]))
    for name, chunk_size in itertools.product(["x", "x.gz"], [1, 7, CHUNK_SIZE]):
        path = str(tmp_path / name)
        for offset in (0, 1, 76, 77, 78, 150, len(data) - 1, len(data)):
            source = await ByteSource.open(path, chunk_size, offset)
            try:
                chunks = []
                while chunk := await source.read():
                    chunks.append(chunk)
                assert b"".join(chunks) == data[offset:], (name, chunk_size, offset)
                assert max(map(len, chunks), default=0) <= max(chunk_size, 2)
            finally:
                source.close()
        with pytest.raises(ValueError, match=rf"cannot seek to byte {len(data) + 1} of "):
            await ByteSource.open(path, chunk_size, len(data) + 1)


# ---------------------------------------------------------------------- errors

async def test_foreign_and_corrupt_states_are_refused() -> None:
    reader = JsonLinesReader()
    good = reader.state_dict()
    with pytest.raises(ValueError, match=r"not a JsonLinesReader state: a dict with keys \['a'"):
        reader.load_state_dict({"a": 1})
    with pytest.raises(ValueError, match="not a JsonLinesReader state: a list"):
        reader.load_state_dict([good])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="version 2 is not supported"):
        reader.load_state_dict({**good, "version": 2})
    with pytest.raises(ValueError, match=r"corrupt JsonLinesReader state: 'offset' is -1"):
        reader.load_state_dict({**good, "num_files": 1, "offset": -1})
    with pytest.raises(ValueError, match="corrupt JsonLinesReader state: shard 4 of 4"):
        reader.load_state_dict({**good, "shard": 4, "shards": 4})
    with pytest.raises(ValueError, match="corrupt JsonLinesReader state: file 3 of 2"):
        reader.load_state_dict({**good, "num_files": 2, "files_digest": "x", "file": 3})
    assert reader.state_dict() == good  # nothing was loaded


async def test_state_of_another_shard_is_refused(tmp_path: Path) -> None:
    for k in range(4):
        write(tmp_path / f"{k}.jsonl", [b'{"id": %d}' % k])
    data_path = str(tmp_path / "*.jsonl")
    with as_shard(1, 4):
        _, state = await take(JsonLinesReader(), data_path, stop=1)
    with as_shard(0, 2), pytest.raises(
            ValueError, match="taken for shard 1 of 4, this read is shard 0 of 2"):
        await resumed(JsonLinesReader, data_path, state)
    with pytest.raises(ValueError, match="taken for shard 1 of 4, this read is shard 0 of 1"):
        await resumed(JsonLinesReader, data_path, state)
    with as_shard(1, 4):
        assert (await resumed(JsonLinesReader, data_path, state))[0] == []
        # A state taken before any pass is the start, whichever shard took it.
        start = JsonLinesReader().state_dict()
    assert (start["shard"], start["shards"]) == (1, 4)
    with as_shard(0, 2):
        rest, _ = await resumed(JsonLinesReader, data_path, start)
    assert rest == [{"id": 0}, {"id": 2}]


async def test_state_over_other_files_is_refused(tmp_path: Path) -> None:
    for name in ("a", "b"):
        write(tmp_path / f"{name}.jsonl", [b'{"id": 0}', b'{"id": 1}'])
    data_path = str(tmp_path / "*.jsonl")
    _, state = await take(JsonLinesReader(), data_path, stop=3)  # in b.jsonl
    write(tmp_path / "c.jsonl", [b"{}"])
    with pytest.raises(ValueError, match="taken over 2 files, this read has 3"):
        await resumed(JsonLinesReader, data_path, state)
    (tmp_path / "c.jsonl").unlink()
    (tmp_path / "a.jsonl").rename(tmp_path / "a2.jsonl")
    with pytest.raises(ValueError, match="taken over other files than this read's 2"):
        await resumed(JsonLinesReader, data_path, state)
    (tmp_path / "b.jsonl").rename(tmp_path / "z.jsonl")
    with pytest.raises(ValueError, match=r"taken in file 1 '.*b\.jsonl', this read's file 1 "
                                         r"is '.*z\.jsonl'"):
        await resumed(JsonLinesReader, data_path, state)


@pytest.mark.parametrize("compress", [False, True], ids=["plain", "gzip"])
async def test_offset_that_does_not_fit_the_file_is_refused(tmp_path: Path,
                                                            compress: bool) -> None:
    path = tmp_path / ("a.jsonl.gz" if compress else "a.jsonl")
    write(path, [b'{"id": %d}' % i for i in range(10)], compress=compress)
    _, state = await take(JsonLinesReader(), path, stop=3)
    size = 10 * len(b'{"id": 0}\n')
    for offset in (size + 1, size + 2, size + 1000):
        with pytest.raises(ValueError, match=rf"offset {offset} is past its end"):
            await resumed(JsonLinesReader, path, {**state, "offset": offset})
    with pytest.raises(ValueError, match=r"offset 12 is not where a line starts"):
        await resumed(JsonLinesReader, path, {**state, "offset": 12})
    assert (await resumed(JsonLinesReader, path, {**state, "offset": size}))[0] == []


async def test_corrupt_gzip_before_the_offset_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl.gz"
    write(path, [b'{"id": %d, "pad": "%d"}' % (i, i * i) for i in range(2000)], compress=True)
    _, state = await take(JsonLinesReader(), path, stop=1900)
    data = path.read_bytes()
    path.write_bytes(data[:100] + bytes(b ^ 0x55 for b in data[100:]))
    with pytest.raises(JsonLinesError, match=r"a\.jsonl\.gz: corrupt gzip data"):
        await resumed(JsonLinesReader, path, state)
