"""Ready-made readers: ``DataLoader(JsonLinesReader(), "data/*.jsonl.gz", ...)``."""

from ._fsspec import FsspecReader
from ._jsonl import JsonLinesError, JsonLinesReader

__all__ = ["FsspecReader", "JsonLinesError", "JsonLinesReader"]
