"""Planning and positions: pure functions of their inputs, no I/O, no loop.

Which indices form each batch of an epoch on this rank (``_planning``, ``_samplers``), how a
pass is cut into batches and blocks (``_batcher``), where a pass over a stream stands
(``_position``) and how a shard reads it from there (``_shard``), a loader's state dict as
data (``_state``), what an interrupted pass left for another shape (``_reshape``), what a
source is and how it is sharded (``_sources``), and this process's rank (``_distributed``).

Knows: torch, torch.distributed and the public errors. Must not know: any other layer.
"""
