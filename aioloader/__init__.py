"""aioloader: an asyncio-native data loader for PyTorch.

Workers build whole batches straight into a shared-memory arena; the event loop is never
blocked waiting for them. ``async for batch in loader`` in async code, ``for batch in
loader`` (or ``loader.sync(device=...)``) everywhere else.
"""

from ._errors import (
    ArgumentTypeError,
    CollateKeyError,
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
    from_worker_class,
)
from ._info import WorkerInfo, get_worker_info
from ._loader import DataLoader
from ._stats import ArenaStats, LoaderStats, WorkerStats
from .pipeline._collate import PadCollate, default_collate
from .pipeline._loads import Retry, SkippedLoad
from .plans._samplers import BatchSampler, BucketBatchSampler
from .plans._sources import Reader
from .run._bars import shows_bars
from .run._sync import SyncLoader

__all__ = [
    "ArenaStats",
    "ArgumentTypeError",
    "BatchSampler",
    "BucketBatchSampler",
    "CollateKeyError",
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

# A traceback names an exception's class by its __module__: the public path (aioloader.X),
# not the private module that defines it (trio does the same). Pickles find them here too.
for _name in __all__:
    _obj = globals()[_name]
    if isinstance(_obj, type) and issubclass(_obj, BaseException):
        _obj.__module__ = __name__
del _name, _obj


def __getattr__(name: str) -> type[WorkerError]:
    """``aioloader.ValueErrorFromWorker`` and its kind, as tracebacks name them: a
    :class:`WorkerError` that is also the worker's exception type, made per type (so not in
    ``__all__``). Catch it as ``WorkerError`` or as the original type."""
    cls = from_worker_class(name)
    if cls is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return cls
