"""Ready-made readers: ``DataLoader(JsonLinesReader(), "data/*.jsonl.gz", ...)``."""

from ._jsonl import JsonLinesError, JsonLinesReader

__all__ = ["JsonLinesError", "JsonLinesReader"]
