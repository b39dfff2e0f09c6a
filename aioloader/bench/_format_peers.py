"""The formats workload's peers: each format's own loader, on data converted to its format.

webdataset's ``WebLoader``, MosaicML Streaming's ``StreamingDataset`` (the samples written to
MDS by its ``MDSWriter``), LitData's ``StreamingDataset`` (written by ``litdata.optimize``)
and Hugging Face ``datasets`` on the Parquet files, each at its documented best: batches
made in the workers, torch's ``DataLoader`` (or the library's own) with the same
``num_workers``. On S3 each reads by ``s3://`` URL through its own client, pointed at the
local server by the options it documents. The decoded rows decode a JPEG to a uint8 CHW
tensor as aioloader does (PIL), except webdataset's own ``torchrgb8``.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from typing import Any

Result = dict[str, Any]
Timed = Callable[[Any], Result]  # batches -> the run's figures (``_formats._timed``)
BATCH = 64
CHUNK_BYTES = 1_700_000  # about one tar shard's size: as many MDS/LitData shards as tar ones

# peer -> the modules it needs (the name pip installs it by, for the note)
PEERS = {"webdataset": ("webdataset", "webdataset"),
         "mosaicml-streaming": ("streaming", "mosaicml-streaming"),
         "litdata": ("litdata", "litdata"),
         "datasets": ("datasets", "datasets")}


def installed(peer: str) -> bool:
    found = importlib.util.find_spec(PEERS[peer][0]) is not None
    if peer == "mosaicml-streaming":  # its package imports torchvision (vision datasets)
        return found and importlib.util.find_spec("torchvision") is not None
    return found


def missing() -> list[str]:
    """A note for each peer that is not installed (its rows are left out)."""
    out = [f"{name} is not installed: its rows are left out (pip install {pip})"
           for name, (module, pip) in PEERS.items() if importlib.util.find_spec(module) is None]
    if importlib.util.find_spec("streaming") and not installed("mosaicml-streaming"):
        out.append("mosaicml-streaming is left out: its package imports torchvision, which is "
                   "not installed (a CPU torch needs torchvision's CPU build)")
    if installed("litdata"):
        out.append("litdata has no S3 row: it reads chunks through obstore, which refused the "
                   "local S3's plain-HTTP endpoint (AWS_ALLOW_HTTP=true did not change that)")
    return out


def _import_streaming() -> Any:
    import streaming  # type: ignore[import-not-found]

    return streaming


def decode_jpeg(data: bytes) -> Any:
    from aioloader.readers._webdataset import decode_member

    return decode_member("jpg", data)


def _decoded_sample(sample: dict[str, Any]) -> dict[str, Any]:
    """LitData's ``transform`` (pickled to its workers: a module-level function)."""
    return {"jpg": decode_jpeg(sample["jpg"]), "cls": sample["cls"]}


def _raw(i: int, jpegs: tuple[bytes, ...]) -> dict[str, Any]:
    return {"jpg": jpegs[i % len(jpegs)], "cls": i % 1000}


def _lit_item(i: int) -> dict[str, Any]:  # for litdata.optimize: a module-level function
    from ._workloads import encoded_jpegs

    return _raw(i, encoded_jpegs())


def convert(folder: str, samples: int) -> dict[str, str]:
    """The samples of the tar shards (a JPEG and its label) written to MDS and to LitData's
    format, where the library is installed: {peer: its folder}."""
    from ._workloads import encoded_jpegs

    out = {}
    if installed("mosaicml-streaming"):
        streaming = _import_streaming()
        out["mds"] = os.path.join(folder, "mds")
        jpegs = encoded_jpegs()
        with streaming.MDSWriter(out=out["mds"], columns={"jpg": "bytes", "cls": "int"},
                                 size_limit=CHUNK_BYTES) as writer:
            for i in range(samples):
                writer.write(_raw(i, jpegs))
    if installed("litdata"):
        import litdata  # type: ignore[import-not-found]

        out["litdata"] = os.path.join(folder, "litdata")
        litdata.optimize(fn=_lit_item, inputs=list(range(samples)), output_dir=out["litdata"],
                         chunk_bytes=CHUNK_BYTES, num_workers=1, verbose=False)
    return out


def webdataset_run(urls: str, decode: bool, workers: int, timed: Timed,
                   storage_options: dict[str, Any] | None = None) -> Result:
    import webdataset

    if storage_options is not None:  # s3:// has no gopen handler of its own: fsspec's
        import fsspec
        from webdataset.gopen import gopen_schemes

        def gopen_s3(url: str, mode: str = "rb", bufsize: int = 8192) -> Any:
            return fsspec.open(url, mode, **storage_options).open()

        gopen_schemes["s3"] = gopen_s3
    pipeline = webdataset.WebDataset(urls, shardshuffle=False,
                                     nodesplitter=webdataset.split_by_node)
    if decode:
        pipeline = pipeline.decode("torchrgb8").to_tuple("jpg", "cls")
    return timed(webdataset.WebLoader(pipeline.batched(BATCH), batch_size=None,
                                      num_workers=workers))


def mds_run(local: str, remote: str | None, decode: bool, workers: int,
            timed: Timed) -> Result:
    """MosaicML Streaming; remote: ``s3://`` of the MDS folder (its endpoint from
    ``S3_ENDPOINT_URL``, as it documents), downloaded into ``local`` (empty) as it reads."""
    import torch

    streaming = _import_streaming()

    class Decoded(streaming.StreamingDataset):  # type: ignore[misc, name-defined]
        def get_item(self, idx: int) -> Any:
            sample = super().get_item(idx)
            return {"jpg": decode_jpeg(sample["jpg"]), "cls": sample["cls"]}

    kind = Decoded if decode else streaming.StreamingDataset
    dataset = kind(local=local, remote=remote, batch_size=BATCH, shuffle=False)
    try:
        return timed(torch.utils.data.DataLoader(dataset, batch_size=BATCH,
                                                 num_workers=workers))
    finally:
        streaming.base.util.clean_stale_shared_memory()


def litdata_run(input_dir: str, decode: bool, workers: int, timed: Timed,
                storage_options: dict[str, Any] | None = None,
                cache_dir: str | None = None) -> Result:
    import litdata

    dataset = litdata.StreamingDataset(input_dir, storage_options=storage_options or {},
                                       cache_dir=cache_dir,
                                       transform=_decoded_sample if decode else None)
    return timed(litdata.StreamingDataLoader(dataset, batch_size=BATCH, num_workers=workers))


def hf_run(files: list[str], streaming: bool, workers: int, batch: int, cache: str,
           timed: Timed, storage_options: dict[str, Any] | None = None) -> Result:
    import datasets
    import torch

    datasets.disable_progress_bars()
    ds = datasets.load_dataset("parquet", data_files=files, split="train", streaming=streaming,
                               cache_dir=cache, storage_options=storage_options)
    if not streaming:  # Arrow to tensors per batch; a stream's rows collate as Python values
        ds = ds.with_format("torch")
    return timed(torch.utils.data.DataLoader(ds, batch_size=batch, num_workers=workers))


def hf_prepare(files: list[str], cache: str) -> Result:
    """HF converts Parquet to its Arrow cache on first load: done once, off the clock."""
    import datasets

    datasets.disable_progress_bars()
    datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=cache)
    return {}
