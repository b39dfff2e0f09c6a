"""The formats workload: WebDataset shards and Parquet files, by aioloader and their own loaders.

One data set per format is written to a temporary folder, then each configuration reads one
epoch of it in a fresh forked process (``isolated_call``), ``pairs`` times, in alternating
order; the table shows medians of samples per second (timed from the first batch to the
last) and of the peak memory growth of the run's processes (``Footprint``: the consumer and
its workers, anonymous pages summed, the arena counted once).

* ``wds raw``: 2000 samples of a 224x224 JPEG and a label in 16 shards, members as bytes:
  aioloader's ``WebDatasetReader`` against webdataset's ``WebLoader`` over
  ``WebDataset(...).batched(64)``, MosaicML Streaming's and LitData's ``StreamingDataset`` on
  the same samples converted to their formats (``_format_peers``), all with ``num_workers``.
* ``wds jpeg``: the same, decoded to uint8 CHW tensors (``decode=True`` /
  ``.decode("torchrgb8")`` / the same PIL decode in the others' workers).
* ``wds http``: the raw shards from a local HTTP object server that answers every request
  after ``LATENCY`` seconds (``aioloader.testing.object_server``): aioloader's ranged reads
  (the next shard opened while one is read) against webdataset's ``curl`` per shard.
* ``wds s3``: the raw shards (and the MDS folder) on a local S3 (moto) answering after
  ``LATENCY``, read by ``s3://`` URL: ours by ``storage_options``, WebLoader through fsspec.
* ``parquet rows``: 40k rows (an id, a label, 16 floats, a short text) in 4 files of row
  groups of 2500 rows, in batches of 256: aioloader's ``ParquetReader`` (rows) and its
  ``batch_rows`` path, against Hugging Face ``datasets`` on the same files, streaming
  (``streaming=True``) and memory-mapped (its Arrow cache, built before the clock starts),
  each with torch's ``DataLoader`` at the same ``num_workers``.
* ``parquet s3``: the same files on the local S3 with ``LATENCY``: ours and HF streaming.

Peers that are not installed are left out, with a note.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import statistics
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from . import _format_peers
from ._footprint import Footprint
from ._runner import MeasurementError, isolated_call
from ._workloads import encoded_jpegs

Result = dict[str, Any]
FORMATS = "formats"  # the workload's name on the command line
SHARDS, PER_SHARD = 16, 125
QUICK_SHARDS, QUICK_PER_SHARD = 4, 100
FILES, ROWS, ROW_GROUP = 4, 10_000, 2_500
QUICK_ROWS = 2_500
WDS_BATCH, ROW_BATCH = 64, 256
LATENCY = 0.020  # seconds, per request of the http and s3 workloads
BUCKET = "formats"  # on the local S3: every file of the data folder, by its relative path


def write_data(folder: str, quick: bool) -> Result:
    """The shards and the Parquet files, written once for every run."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    shards, per_shard = (QUICK_SHARDS, QUICK_PER_SHARD) if quick else (SHARDS, PER_SHARD)
    jpegs = encoded_jpegs()
    for s in range(shards):
        with tarfile.open(os.path.join(folder, f"shard-{s:06d}.tar"), "w") as tar:
            for k in range(per_shard):
                i = s * per_shard + k
                for ext, data in (("cls", str(i % 1000).encode()), ("jpg", jpegs[i % len(jpegs)])):
                    info = tarfile.TarInfo(f"{i:08d}.{ext}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    rows = QUICK_ROWS if quick else ROWS
    for f in range(FILES):
        ids = range(f * rows, (f + 1) * rows)
        vec = pa.FixedSizeListArray.from_arrays(
            pa.array([float(i % 97) for i in ids for _ in range(16)], pa.float32()), 16)
        pq.write_table(pa.table({"id": pa.array(ids, pa.int64()),
                                 "label": pa.array([i % 10 for i in ids], pa.int64()),
                                 "vec": vec,
                                 "text": [f"document number {i} of the corpus" for i in ids]}),
                       os.path.join(folder, f"part-{f}.parquet"), row_group_size=ROW_GROUP)
    return {"samples": shards * per_shard, "rows": rows * FILES, "shards": shards,
            "urls": os.path.join(folder, f"shard-{{000000..{shards - 1:06d}}}.tar"),
            "files": [os.path.join(folder, f"part-{f}.parquet") for f in range(FILES)]}


@contextlib.contextmanager
def served_shards(folder: str, shards: int) -> Iterator[str]:
    """The shards on a local HTTP object server with ``LATENCY``: their brace pattern."""
    from aioloader.testing import object_server

    names = [f"shard-{s:06d}.tar" for s in range(shards)]
    objects = {}
    for name in names:
        with open(os.path.join(folder, name), "rb") as f:
            objects[name] = f.read()
    with object_server(objects, latency=LATENCY) as server:
        yield f"{server.url}/o/shard-{{000000..{shards - 1:06d}}}.tar"  # unquoted braces


def _size(batch: Any) -> int:
    if isinstance(batch, dict):
        first = next(iter(batch.values()))
    elif isinstance(batch, (list, tuple)):
        first = batch[0] if len(batch) != 1 else batch
    else:
        first = batch
    return len(first)


def _timed(batches: Iterable[Any]) -> Result:
    """Samples per second from the first batch to the last, and the peak memory growth."""
    footprint = Footprint()
    it = iter(batches)
    first = next(it)
    t0 = time.perf_counter()
    count = 0
    for batch in it:
        count += _size(batch)
    elapsed = time.perf_counter() - t0
    return {"per_s": count / elapsed if elapsed > 0 else float("nan"),
            "samples": count + _size(first), "mem_mb": footprint.growth_mb()}


def _aioloader(kind: str, data: Result, workers: int) -> Result:
    import aioloader
    from aioloader.readers import ParquetReader, WebDatasetReader, prebatched

    s3 = "s3" in kind
    options = data["s3"] if s3 else None
    if kind.startswith("wds"):
        reader: Any = WebDatasetReader(_shards(kind, data), decode=kind == "wds jpeg" or None,
                                       storage_options=options)
        loader: aioloader.DataLoader[Any] = aioloader.DataLoader(
            reader, batch_size=WDS_BATCH, num_workers=workers,
            max_instances_in_memory=WDS_BATCH * 8, quiet=True)
    elif kind.endswith("batches"):
        reader = ParquetReader(data["s3_files"] if s3 else data["files"], batch_rows=ROW_BATCH,
                               storage_options=options)
        loader = aioloader.DataLoader(reader, batch_size=1, collate_fn=prebatched,
                                      num_workers=workers, max_instances_in_memory=8,
                                      quiet=True)
    else:
        reader = ParquetReader(data["s3_files"] if s3 else data["files"],
                               storage_options=options)
        loader = aioloader.DataLoader(reader, batch_size=ROW_BATCH,
                                      num_workers=workers,
                                      max_instances_in_memory=ROW_BATCH * 8, quiet=True)
    with loader:
        return _timed(loader)


def _shards(kind: str, data: Result) -> str:
    """The shards' brace pattern: local, on the HTTP server or on S3."""
    return str(data["http"] if kind == "wds http" else data["s3_urls"] if kind == "wds s3"
               else data["urls"])


def _webdataset(kind: str, data: Result, workers: int) -> Result:
    return _format_peers.webdataset_run(_shards(kind, data), kind == "wds jpeg", workers, _timed,
                                        data["s3"] if kind == "wds s3" else None)


def _mds(kind: str, data: Result, workers: int) -> Result:
    if kind == "wds s3":  # downloaded into an empty folder as it reads, as on a fresh node
        os.environ.update(data["s3_env"])  # its S3 endpoint is read from the environment
        local = tempfile.mkdtemp(prefix="mds-", dir=data["folder"])
        return _format_peers.mds_run(local, f"s3://{BUCKET}/mds", False, workers, _timed)
    return _format_peers.mds_run(data["converted"]["mds"], None, kind == "wds jpeg", workers,
                                 _timed)


def _litdata(kind: str, data: Result, workers: int) -> Result:
    return _format_peers.litdata_run(data["converted"]["litdata"], kind == "wds jpeg", workers,
                                     _timed)


def _hf(kind: str, data: Result, workers: int) -> Result:
    s3 = kind == "hf s3"
    return _format_peers.hf_run(data["s3_files"] if s3 else data["files"],
                                kind != "hf mmap", workers, ROW_BATCH, data["cache"], _timed,
                                data["s3"] if s3 else None)


# (row name, workload, the function that runs it)
def configurations(quick: bool) -> list[tuple[str, str, Callable[..., Result]]]:
    out: list[tuple[str, str, Callable[..., Result]]] = []
    have = _format_peers.installed
    for kind in ("wds raw", "wds jpeg", "wds http", "wds s3"):
        out.append(("aioloader", kind, _aioloader))
        if have("webdataset"):
            out.append(("webdataset WebLoader", kind, _webdataset))
        if kind == "wds http":
            continue  # plain HTTP: MDS and LitData read from object stores
        if have("mosaicml-streaming"):
            out.append(("mosaicml-streaming StreamingDataset", kind, _mds))
        if have("litdata") and kind != "wds s3":  # see _format_peers.missing
            out.append(("litdata StreamingDataset", kind, _litdata))
    out.append(("aioloader rows", "parquet rows", _aioloader))
    out.append(("aioloader batch_rows", "parquet batches", _aioloader))
    if have("datasets"):
        out.append(("hf datasets streaming", "hf streaming", _hf))
        out.append(("hf datasets mmap", "hf mmap", _hf))
    out.append(("aioloader rows", "parquet s3 rows", _aioloader))
    out.append(("aioloader batch_rows", "parquet s3 batches", _aioloader))
    if have("datasets"):
        out.append(("hf datasets streaming", "hf s3", _hf))
    return out


def missing_peers() -> list[str]:
    return _format_peers.missing()


def run_formats(workers: int, pairs: int, quick: bool, timeout: float,
                note: Callable[[str], None]) -> Result:
    if importlib.util.find_spec("pyarrow") is None:
        raise MeasurementError("the formats workload needs pyarrow: pip install "
                               "'aioloader[parquet]'")
    runs: dict[str, list[Result]] = {}
    with contextlib.ExitStack() as stack:
        folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="aioloader-formats-"))
        data = write_data(folder, quick)
        data["folder"] = folder
        # in a child: litdata.optimize sets the start method (spawn) of the process it runs in
        data["converted"] = isolated_call(_format_peers.convert, (folder, data["samples"]),
                                          timeout, "the MDS and LitData conversions")
        data["http"] = stack.enter_context(served_shards(folder, data["shards"]))
        data.update(stack.enter_context(s3_data(folder, data)))
        data["cache"] = os.path.join(folder, "hf-cache")
        configs = configurations(quick)
        if any(kind == "hf mmap" for _, kind, _fn in configs):
            isolated_call(_format_peers.hf_prepare, (data["files"], data["cache"]), timeout,
                          "hf datasets cache")
        for pair in range(pairs):
            order = configs if pair % 2 == 0 else list(reversed(configs))
            for name, kind, fn in order:
                result = isolated_call(fn, (kind, data, workers), timeout,
                                       f"{FORMATS}/{kind}/{name}")
                runs.setdefault(f"{kind}|{name}", []).append(result)
                note(f"{kind} {name}: {result['per_s']:,.0f}/s, {result['mem_mb']:.0f} MB")
    return {"data": {"samples": data["samples"], "rows": data["rows"]}, "runs": runs}


@contextlib.contextmanager
def s3_data(folder: str, data: Result) -> Iterator[Result]:
    """Everything in ``folder`` (shards, Parquet files, MDS and LitData folders) on a local S3
    that answers every request after ``LATENCY``: the URLs and each client's options."""
    from aioloader.testing import s3_server

    objects = {}
    for root, _dirs, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            key = os.path.relpath(path, folder)
            if not key.startswith("hf-cache") and not name.endswith(".lock"):
                with open(path, "rb") as f:
                    objects[key] = f.read()
    with s3_server(latency=LATENCY) as s3:
        s3.make_bucket(BUCKET, objects)
        options = s3.storage_options
        yield {"s3": options,
               "s3_urls": f"s3://{BUCKET}/shard-{{000000..{data['shards'] - 1:06d}}}.tar",
               "s3_files": [f"s3://{BUCKET}/{os.path.basename(p)}" for p in data["files"]],
               "s3_env": {"S3_ENDPOINT_URL": s3.endpoint_url,
                          "AWS_ACCESS_KEY_ID": options["key"],
                          "AWS_SECRET_ACCESS_KEY": options["secret"],
                          "AWS_DEFAULT_REGION": options["client_kwargs"]["region_name"]}}


def summary_rows(raw: Result) -> list[Result]:
    rows = []
    for key, results in raw["runs"].items():
        kind, name = key.split("|", 1)
        rows.append({"workload": _group(kind), "loader": name,
                     "per_s": statistics.median(r["per_s"] for r in results),
                     "mem_mb": statistics.median(r["mem_mb"] for r in results),
                     "samples": results[0]["samples"]})
    return rows


def _group(kind: str) -> str:
    if kind in ("parquet s3 rows", "parquet s3 batches", "hf s3"):
        return "parquet s3"
    return "parquet" if kind.startswith(("parquet", "hf")) else kind


def table(rows: list[Result]) -> str:
    lines = ["| workload | loader | samples/s | vs best peer | peak memory growth (MB) |",
             "|---|---|---:|---:|---:|"]
    for workload in dict.fromkeys(r["workload"] for r in rows):
        group = [r for r in rows if r["workload"] == workload]
        peers = [r["per_s"] for r in group if not r["loader"].startswith("aioloader")]
        best = max(peers) if peers else None
        for r in group:
            ratio = f"{r['per_s'] / best:.2f}x" if best and r["loader"].startswith(
                "aioloader") else ""
            lines.append(f"| {workload} | {r['loader']} | {r['per_s']:,.0f} | {ratio} | "
                         f"{r['mem_mb']:.0f} |")
    return "\n".join(lines)


def run_cli(args: Any, pairs: int) -> tuple[Result, bool]:
    """``--workloads formats`` from the command line: prints its table; (JSON, failed)."""
    t0 = time.monotonic()
    for line in missing_peers():
        print(f"\nnote: {line}", flush=True)
    try:
        raw = run_formats(args.num_workers, pairs, bool(args.quick), float(args.timeout),
                          note=lambda line: print(f"  ({line})", file=sys.stderr, flush=True))
    except MeasurementError as exc:
        print(f"aioloader bench: {FORMATS}: {exc}", file=sys.stderr)
        return {"error": str(exc)}, True
    rows = summary_rows(raw)
    print()
    print(f"formats: {raw['data']['samples']} WebDataset samples, {raw['data']['rows']} Parquet "
          f"rows, num_workers={args.num_workers}, medians over {pairs} pair(s)")
    print(table(rows))
    print(f"  ({FORMATS}: {time.monotonic() - t0:.1f} s)", file=sys.stderr, flush=True)
    return {**raw, "summary": rows}, False

