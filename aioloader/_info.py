"""WorkerInfo and get_worker_info(): who am I, inside a worker process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker knows about itself; ``aioloader.get_worker_info()`` returns it.

    Examples:
        >>> info = WorkerInfo(num_workers=2, id=1, seed=7, rank=0, world_size=1)
        >>> info.id
        1
    """

    num_workers: int
    id: int
    seed: int
    rank: int = 0
    world_size: int = 1


_current: WorkerInfo | None = None


def get_worker_info() -> WorkerInfo | None:
    """The :class:`WorkerInfo` of this worker process, or ``None`` in the main process."""
    return _current


def set_worker_info(info: WorkerInfo | None, dataset: Any = None) -> None:
    """Install ``info`` for this process, for aioloader and for torch's own API.

    torch has no public setter: ``torch.utils.data.get_worker_info()`` reads a module global,
    which is what torch's own workers set. Setting it lets IterableDatasets that shard
    themselves the torch way (HuggingFace, WebDataset) work unchanged.
    """
    global _current
    _current = info
    from torch.utils.data._utils import worker as torch_worker

    if info is None:
        torch_worker._worker_info = None
        return
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=info.id, num_workers=info.num_workers, seed=info.seed, dataset=dataset)
