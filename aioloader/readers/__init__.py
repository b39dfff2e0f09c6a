"""Ready-made readers: ``DataLoader(JsonLinesReader(), "data/*.jsonl.gz", ...)``."""

from ._fsspec import FsspecReader
from ._jsonl import JsonLinesError, JsonLinesReader
from ._parquet import ParquetError, ParquetReader, prebatched, to_tensors
from ._webdataset import WebDatasetError, WebDatasetReader

__all__ = ["FsspecReader", "JsonLinesError", "JsonLinesReader", "ParquetError",
           "ParquetReader", "WebDatasetError", "WebDatasetReader", "prebatched", "to_tensors"]
