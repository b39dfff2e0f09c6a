"""WebDatasetReader (issue 35): shards written by the webdataset library, read as it groups
them; sharding across workers and ranks, exact resume by offset, a local S3, bad shards."""

from __future__ import annotations

import asyncio
import io
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import pytest
import torch

import aioloader
from aioloader.readers import WebDatasetError, WebDatasetReader
from aioloader.readers import _ranges as ranges_module
from aioloader.readers._webdataset import parse_header
from aioloader.testing import object_server, s3_server

sys.path.insert(0, str(Path(__file__).parent))
import formats_dist

webdataset = pytest.importorskip("webdataset")
pytestmark = pytest.mark.deadline(90)

SHARDS, PER_SHARD = 6, 7
N = SHARDS * PER_SHARD


def png(value: int) -> bytes:
    buf = io.BytesIO()
    PIL.Image.fromarray(np.full((4, 5, 3), value % 256, dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def write_shards(folder: Path, shards: int = SHARDS, per_shard: int = PER_SHARD) -> list[str]:
    """Shards written by webdataset's TarWriter: sample ``i`` holds its id in ``cls``."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for s in range(shards):
        name = str(folder / f"shard-{s:03d}.tar")
        with webdataset.TarWriter(name) as sink:
            for k in range(per_shard):
                i = s * per_shard + k
                sink.write({"__key__": f"dir/s{s}_{k:03d}", "png": png(i), "cls": i,
                            "json": {"i": i, "text": "x" * i}, "bin": bytes([i]) * (i * 37)})
        names.append(name)
    return names


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("wds")
    write_shards(folder)
    return folder


def pattern(folder: Path) -> str:
    return str(folder / "shard-{000..005}.tar")


def read_all(reader: WebDatasetReader, data_path: Any = None) -> list[dict[str, Any]]:
    async def collect() -> list[dict[str, Any]]:
        return [s async for s in reader.read(data_path)]

    return asyncio.run(collect())


def ids(batches: list[Any]) -> list[int]:
    return [int(i) for b in batches for i in b["cls"].tolist()]


def test_samples_are_what_the_webdataset_library_reads(shards: Path) -> None:
    ours = read_all(WebDatasetReader(pattern(shards)))
    theirs = list(webdataset.WebDataset(pattern(shards), shardshuffle=False))
    assert [s["__key__"] for s in ours] == [s["__key__"] for s in theirs]
    for a, b in zip(ours, theirs, strict=True):
        assert {k: v for k, v in a.items() if k != "__url__"} == {
            k: v for k, v in b.items() if k != "__url__" and not k.startswith("__local")}
        assert a["__url__"] == b["__url__"]


def test_decode_gives_chw_uint8_images_and_values(shards: Path) -> None:
    sample = read_all(WebDatasetReader(pattern(shards), decode=True))[9]
    assert sample["png"].dtype == torch.uint8 and sample["png"].shape == (3, 4, 5)
    assert int(sample["png"][0, 0, 0]) == 9
    assert sample["cls"] == 9 and sample["json"] == {"i": 9, "text": "x" * 9}
    assert sample["bin"] == bytes([9]) * 9 * 37 and sample["__key__"] == "dir/s1_002"


def test_brace_patterns_expand_with_padding() -> None:
    assert WebDatasetReader("s-{000008..000010}.tar").urls == [
        "s-000008.tar", "s-000009.tar", "s-000010.tar"]
    with pytest.raises(ValueError, match="at least one"):
        WebDatasetReader([])


@pytest.mark.parametrize("workers", [0, 2, 4])
def test_workers_see_every_sample_once(shards: Path, workers: int) -> None:
    reader = WebDatasetReader(pattern(shards), decode=True)
    with aioloader.DataLoader(reader, batch_size=4, num_workers=workers,
                              max_instances_in_memory=8, quiet=True) as loader:
        seen = ids(list(loader))
    assert sorted(seen) == list(range(N))


def test_fewer_shards_than_workers_split_within_a_shard(tmp_path: Path) -> None:
    write_shards(tmp_path, shards=2, per_shard=11)

    def make() -> aioloader.DataLoader:
        reader = WebDatasetReader(str(tmp_path / "shard-{000..001}.tar"), decode=True)
        return aioloader.DataLoader(reader, batch_size=2, num_workers=3,
                                    max_instances_in_memory=4, quiet=True)

    whole, before, after = formats_dist.interrupted(make, 4, lambda b: b["cls"].tolist())
    assert sorted(i for b in whole for i in b) == list(range(22))
    formats_dist.check_resumed(whole, before, after, ordered=False)


def test_shard_order_is_shuffled_per_pass_and_seeded(shards: Path) -> None:
    def order(seed: int) -> list[list[str]]:
        reader = WebDatasetReader(pattern(shards), shuffle_shards=True, seed=seed)
        return [[s["__key__"] for s in read_all(reader)] for _ in range(2)]

    first, again = order(3), order(3)
    assert first == again, "the same seed gives the same orders"
    assert first[0] != first[1], "another order each pass"
    assert sorted(first[0]) == sorted(first[1])


def test_resume_seeks_to_the_sample_after_the_state(shards: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    whole = read_all(WebDatasetReader(pattern(shards)))
    reader = WebDatasetReader(pattern(shards))

    async def first_ten() -> dict[str, Any]:
        stream = reader.read(None)
        for _ in range(10):
            await stream.__anext__()
        state = reader.state_dict()
        await stream.aclose()  # type: ignore[attr-defined]
        return state

    state = json.loads(json.dumps(asyncio.run(first_ten())))
    assert (state["piece"], state["counted"]) == (1, 10) and state["offset"] > 0
    opened: list[tuple[str, int]] = []
    real = ranges_module.Ahead.__init__

    def spy(self: Any, url: str, fetch: Any, start: int, **kw: Any) -> None:
        opened.append((url, start))
        real(self, url, fetch, start, **kw)

    monkeypatch.setattr(ranges_module.Ahead, "__init__", spy)
    resumed = WebDatasetReader(pattern(shards))
    resumed.load_state_dict(state)
    rest = read_all(resumed)
    assert [s["__key__"] for s in rest] == [s["__key__"] for s in whole[10:]]
    assert opened[0] == (str(shards / "shard-001.tar"), state["offset"]), \
        "resume opens the state's shard at its offset; the shard before it is not read"


def make_loader(folder: Path, workers: int) -> aioloader.DataLoader:
    reader = WebDatasetReader(pattern(folder), decode=True, shuffle_shards=True, seed=2)
    return aioloader.DataLoader(reader, batch_size=3, shuffle=True, seed=4,
                                num_workers=workers, max_instances_in_memory=6, quiet=True)


@pytest.mark.parametrize("workers", [0, 2])
def test_exact_resume_mid_epoch(shards: Path, workers: int) -> None:
    whole, before, after = formats_dist.interrupted(lambda: make_loader(shards, workers), 5,
                                                    lambda b: b["cls"].tolist())
    formats_dist.check_resumed(whole, before, after, ordered=workers == 0)


def test_resume_on_other_numbers_of_workers(shards: Path) -> None:
    formats_dist.check_workers_reshaped(lambda workers: make_loader(shards, workers), N,
                                        lambda b: b["cls"].tolist())


def test_resume_on_another_shape_with_fewer_shards_than_workers(tmp_path: Path) -> None:
    # 2 shards, 3 workers: each worker kept every third sample of the pass; the new shapes
    # deal the shards (2 workers) or read them whole (1), without what was delivered.
    write_shards(tmp_path, shards=2, per_shard=9)
    formats_dist.check_workers_reshaped(
        lambda workers: aioloader.DataLoader(
            WebDatasetReader(str(tmp_path / "shard-{000..001}.tar")), batch_size=2,
            shuffle=True, seed=3, num_workers=workers, max_instances_in_memory=4, quiet=True),
        18, lambda b: [int(i) for i in b["cls"]], start=3, to=(2, 0))


@pytest.mark.deadline(300)
def test_resume_on_other_numbers_of_ranks_and_workers(shards: Path, tmp_path: Path) -> None:
    formats_dist.check_reshaped("webdataset", shards, tmp_path, N)


def test_s3_url(shards: Path) -> None:
    with s3_server() as s3:
        s3.make_bucket("wds", {f"train/shard-{s:03d}.tar": (shards / f"shard-{s:03d}.tar")
                               .read_bytes() for s in range(SHARDS)})
        reader = WebDatasetReader("s3://wds/train/shard-{000..005}.tar", decode=True,
                                  storage_options=s3.storage_options, chunk_size=4096)
        with aioloader.DataLoader(reader, batch_size=4, num_workers=2,
                                  max_instances_in_memory=8, quiet=True) as loader:
            seen = ids(list(loader))
        assert sorted(seen) == list(range(N))
        assert read_all(WebDatasetReader("s3://wds/train/shard-002.tar",
                                         storage_options=s3.storage_options))[0][
            "__url__"] == "s3://wds/train/shard-002.tar"


@pytest.mark.parametrize("start", [0, 5, 10, 12])
def test_a_file_opened_before_its_size_is_known_reads_exactly_its_bytes(start: int) -> None:
    # the first chunk goes out before the size is known, as a store answers it: what there
    # is, and an error for a range that starts at or past the end (HTTP 416)
    data = bytes(range(10))

    async def fetch(first: int, end: int) -> bytes:
        if first >= len(data):
            raise OSError(f"416: range {first}-{end} not satisfiable")
        return data[first:end]

    async def read() -> bytes:
        source = ranges_module.Ahead("mem://x", fetch, start, chunk=4, ahead=2)
        source.prime()
        await source.sized(len(data))
        try:
            return await source.read(100)
        finally:
            await source.aclose()

    assert asyncio.run(read()) == data[start:]


@pytest.mark.parametrize("ahead", [1, 3])
def test_the_next_shards_open_while_one_is_read(shards: Path, ahead: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    # a remote shard's opening is a round trip: with one shard opened ahead, a worker of
    # small shards waited for one each (the formats bench's S3 row); now ``ahead`` of them
    opened: list[str] = []
    real_open = ranges_module.Files.open

    async def spied_open(self: Any, url: str) -> Any:
        opened.append(url)
        return await real_open(self, url)

    monkeypatch.setattr(ranges_module.Files, "open", spied_open)
    reader = WebDatasetReader(str(shards / "shard-{000..005}.tar"), ahead=ahead)

    async def first() -> int:
        stream = reader.read(None)
        try:
            await stream.__anext__()
            return len(opened)
        finally:
            await stream.aclose()

    assert asyncio.run(first()) == 1 + ahead  # this shard and the next ``ahead``
    assert len(opened) == 1 + ahead  # closed early: none opened after


def test_http_url_reads_in_ranges(shards: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    objects = {f"shard-{s:03d}.tar": (shards / f"shard-{s:03d}.tar").read_bytes()
               for s in range(SHARDS)}
    with object_server(objects, latency=0.01) as server:
        pattern = f"{server.url}/o/shard-{{000..005}}.tar"
        with aioloader.DataLoader(WebDatasetReader(pattern, chunk_size=8192, ahead=3),
                                  batch_size=4, num_workers=2, quiet=True) as loader:
            assert sorted(int(i) for b in loader for i in b["cls"]) == list(range(N))
        # What the reader asks of each shard, seen in this process (num_workers=0): how
        # many requests reach the server depends on timing (reads ahead cancelled at a
        # shard's end may or may not have gone out), what was asked for does not.
        asked: dict[str, set[tuple[int, int]]] = {}
        flying: dict[str, int] = {}
        most: dict[str, int] = {}
        real_open = ranges_module.Files.open

        order: dict[str, list[str]] = {}  # what each shard's opening asked for, in turn

        async def spied_open(self: Any, url: str) -> Any:
            fetch, size, close = await real_open(self, url)

            async def spied_size() -> int:
                try:
                    return await size()
                finally:
                    order.setdefault(url, []).append("size answered")

            async def spied(start: int, end: int) -> bytes:
                if start == 0:
                    order.setdefault(url, []).append("first chunk asked")
                asked.setdefault(url, set()).add((start, end))
                flying[url] = flying.get(url, 0) + 1
                most[url] = max(most.get(url, 0), flying[url])
                try:
                    return await fetch(start, end)
                finally:
                    flying[url] -= 1

            return spied, spied_size, close

        monkeypatch.setattr(ranges_module.Files, "open", spied_open)
        assert [int(s["cls"]) for s in read_all(WebDatasetReader(
            pattern, chunk_size=8192, ahead=3))] == list(range(N))
    for name, data in objects.items():
        url = f"{server.url}/o/{name}"
        with tarfile.open(fileobj=io.BytesIO(data)) as tar:
            last = max(m.offset_data + m.size for m in tar.getmembers())
        chunks = sorted(asked[url])
        assert chunks == [(k * 8192, min((k + 1) * 8192, len(data)))
                          for k in range(len(chunks))], "8 KiB ranges, in order, from 0"
        assert chunks[-1][1] >= last, "every sample's bytes were asked for"
        # one round trip opens a shard: its first chunk is asked for beside its size
        assert order[url][:2] == ["first chunk asked", "size answered"], order[url]
        assert most[url] <= 3, "at most `ahead` ranges in flight a shard"


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_tar_headers_read_as_tarfile_reads_them(fmt: int) -> None:
    # parse_header's fast path against TarInfo.frombuf, on every header block a tar holds:
    # short names, a ustar prefix, a long name (GNU or pax record), a directory, a link,
    # empty and large members, a size past 8 GiB (base-256 in GNU), a non-ASCII name.
    buf = io.BytesIO()
    entries = [("a.cls", 3, tarfile.REGTYPE), ("d" * 90 + "/" + "k" * 60 + ".jpg", 700, None),
               ("x/" + "n" * 150 + ".json", 1, None), ("dir", 0, tarfile.DIRTYPE),
               ("link.txt", 0, tarfile.SYMTYPE), ("empty.txt", 0, None),
               ("été/clé.txt", 512, None)]
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        if fmt == tarfile.USTAR_FORMAT:  # a name past prefix + name has no ustar header
            entries = [e for e in entries if len(e[0]) < 150]
        for name, size, kind in entries:
            info = tarfile.TarInfo(name)
            info.size = size
            info.type = kind or tarfile.REGTYPE
            if kind == tarfile.SYMTYPE:
                info.linkname = "a.cls"
            tar.addfile(info, io.BytesIO(b"z" * size) if info.isreg() else None)
        if fmt == tarfile.GNU_FORMAT:
            huge = tarfile.TarInfo("huge.bin")
            huge.size = 9 << 30
            block = huge.tobuf(fmt, "utf-8", "surrogateescape")
            buf.write(block[:tarfile.BLOCKSIZE])
    data = buf.getvalue()
    seen = 0
    for at in range(0, len(data), tarfile.BLOCKSIZE):
        block = data[at:at + tarfile.BLOCKSIZE]
        try:
            info = tarfile.TarInfo.frombuf(block, "utf-8", "surrogateescape")
        except tarfile.HeaderError:  # data or end-of-archive blocks: parse_header raises too
            with pytest.raises(tarfile.HeaderError):
                parse_header(block)
            continue
        assert parse_header(block) == (info.name, info.size, info.type)
        seen += 1
    assert seen >= len(entries)
    bad = bytearray(data[:tarfile.BLOCKSIZE])
    bad[0] ^= 1  # the checksum no longer matches
    with pytest.raises(tarfile.HeaderError):
        parse_header(bytes(bad))


def _damaged(tmp_path: Path, how: str) -> tuple[Path, str]:
    """A copy of 2 shards, the second damaged: (folder, the member named in the error)."""
    write_shards(tmp_path, shards=2, per_shard=5)
    bad = tmp_path / "shard-001.tar"
    data = bad.read_bytes()
    with tarfile.open(bad) as tar:
        members = tar.getmembers()
    third = members[8]  # dir/s1_002's third member (4 members a sample, sorted by name)
    if how == "truncated":
        bad.write_bytes(data[:third.offset_data + 10])
        return tmp_path, third.name
    if how == "header":
        broken = bytearray(data)
        broken[third.offset:third.offset + 100] = b"\xff" * 100
        bad.write_bytes(bytes(broken))
        return tmp_path, members[7].name  # the last good member before it
    raise AssertionError(how)


@pytest.mark.parametrize("how", ["truncated", "header"])
def test_a_damaged_shard_names_the_shard_and_member(tmp_path: Path, how: str) -> None:
    folder, member = _damaged(tmp_path, how)
    reader = WebDatasetReader(str(folder / "shard-{000..001}.tar"))
    with aioloader.DataLoader(reader, batch_size=2, num_workers=1, timeout=30,
                              quiet=True) as loader, pytest.raises(aioloader.WorkerError) as got:
        list(loader)
    message = str(got.value)
    assert "shard-001.tar" in message and member in message
    assert "on_error='skip'" in message


@pytest.mark.parametrize(("how", "last"), [("truncated", 6), ("header", 5)])
def test_skip_leaves_out_the_rest_of_a_damaged_shard(tmp_path: Path, how: str,
                                                     last: int) -> None:
    # Cut inside a member: the sample before it is whole. A broken header: the sample in
    # progress may have had more members, so it goes with the rest.
    folder, _ = _damaged(tmp_path, how)
    reader = WebDatasetReader(str(folder / "shard-{000..001}.tar"), on_error="skip")
    with pytest.warns(UserWarning, match="skipping"):
        samples = read_all(reader)
    assert [int(s["cls"]) for s in samples] == list(range(last + 1))
    assert reader.num_skipped == 1 and "shard-001.tar" in reader.skipped[0][0]


# A loader over damaged shards, in a subprocess with a hard deadline (a hang fails the test
# there, rather than stalling the suite): each line is what one loader ended with.
DAMAGED_VICTIM = """
import json, sys, warnings
import aioloader
from aioloader.readers import WebDatasetError, WebDatasetReader

pattern, workers = sys.argv[1], int(sys.argv[2])
warnings.simplefilter("ignore")
try:
    with aioloader.DataLoader(WebDatasetReader(pattern), batch_size=2, num_workers=workers,
                              quiet=True) as loader:
        list(loader)
    print(json.dumps({"raised": None}))
except Exception as exc:
    print(json.dumps({"raised": [isinstance(exc, WebDatasetError),
                                 isinstance(exc, aioloader.WorkerError)],
                      "message": str(exc)}))
reader = WebDatasetReader(pattern, on_error="skip")
with aioloader.DataLoader(reader, batch_size=2, num_workers=workers, quiet=True) as loader:
    seen = sorted(int(i) for b in loader for i in b["cls"])
    print(json.dumps({"seen": seen, "stats_skipped": loader.stats().skipped,
                      "keys": [s.key for s in loader.skipped],
                      "workers": [s.worker for s in loader.skipped]}))
"""


@pytest.mark.deadline(200)
@pytest.mark.parametrize(("how", "last"), [("truncated", 6), ("header", 5)])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_damaged_shard_in_a_loader_raises_or_is_counted_never_hangs(
        tmp_path: Path, how: str, last: int, workers: int) -> None:
    folder, member = _damaged(tmp_path, how)
    done = subprocess.run(
        [sys.executable, "-c", DAMAGED_VICTIM, str(folder / "shard-{000..001}.tar"),
         str(workers)], capture_output=True, text=True, timeout=150,
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    raised, skipped = (json.loads(line) for line in done.stdout.splitlines()[-2:])
    assert raised["raised"] == [True, bool(workers)], raised
    assert "shard-001.tar" in raised["message"] and member in raised["message"], raised
    assert "on_error='skip'" in raised["message"]
    assert skipped["seen"] == list(range(last + 1))
    assert skipped["stats_skipped"] == 1, "a shard's rest skipped counts in stats()"
    assert len(skipped["keys"]) == 1 and "shard-001.tar" in skipped["keys"][0]
    assert skipped["workers"] == [None] if not workers else skipped["workers"][0] in (0, 1)


def test_a_sample_that_does_not_decode(tmp_path: Path) -> None:
    name = str(tmp_path / "bad.tar")
    with webdataset.TarWriter(name) as sink:
        sink.write({"__key__": "a", "png": png(1), "cls": 0})
        sink.write({"__key__": "b", "png": b"not a png", "cls": 1})
        sink.write({"__key__": "c", "png": png(2), "cls": 2})
    with pytest.raises(WebDatasetError, match=r"bad\.tar: sample 'b' does not decode"):
        read_all(WebDatasetReader(name, decode=True))
    reader = WebDatasetReader(name, decode=True, on_error="skip")
    with pytest.warns(UserWarning, match="skipping b"):
        assert [s["cls"] for s in read_all(reader)] == [0, 2]


@pytest.mark.deadline(240)
def test_two_ranks_two_workers_once_and_resumed(shards: Path, tmp_path: Path) -> None:
    got = formats_dist.run("webdataset", shards, tmp_path)
    flat = [i for r in got.values() for b in r["whole"] for i in b]
    assert sorted(flat) == list(range(N)), "every sample once across 2 ranks x 2 workers"
    for r in got.values():
        formats_dist.check_resumed(r["whole"], r["before"], r["after"], ordered=False)
