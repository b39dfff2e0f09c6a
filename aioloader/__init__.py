"""aioloader: an asyncio-native data loader for PyTorch.

Workers build whole batches straight into a shared-memory arena; the event loop is never
blocked waiting for them. ``async for batch in loader`` in async code, ``for batch in
loader`` (or ``loader.sync(device=...)``) everywhere else.
"""

from ._bars import shows_bars
from ._collate import PadCollate, default_collate
from ._errors import (
    FrameTooLargeError,
    LoaderBusyError,
    LoaderClosedError,
    LoadError,
    LoaderTimeoutError,
    ResumeError,
    ResumeWarning,
    SourcePicklingError,
    WorkerDied,
    WorkerError,
)
from ._info import WorkerInfo, get_worker_info
from ._loader import DataLoader
from ._loads import Retry, SkippedLoad
from ._samplers import BatchSampler, BucketBatchSampler
from ._sources import Reader
from ._stats import ArenaStats, LoaderStats, WorkerStats
from ._sync import SyncLoader

__all__ = [
    "ArenaStats",
    "BatchSampler",
    "BucketBatchSampler",
    "DataLoader",
    "FrameTooLargeError",
    "LoadError",
    "LoaderBusyError",
    "LoaderClosedError",
    "LoaderStats",
    "LoaderTimeoutError",
    "PadCollate",
    "Reader",
    "ResumeError",
    "ResumeWarning",
    "Retry",
    "SkippedLoad",
    "SourcePicklingError",
    "SyncLoader",
    "WorkerDied",
    "WorkerError",
    "WorkerInfo",
    "WorkerStats",
    "default_collate",
    "get_worker_info",
    "shows_bars",
]
__version__ = "0.1.0"
