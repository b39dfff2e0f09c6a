"""The data plane: how a batch travels. Leaves that know no caller.

The shared-memory arena and its slots (``_arena``, ``_dataplane``), the batch codec
(structure as msgpack data, tensors as places in a slot), the wire between the supervisor
and its workers (typed messages), and the hand-off to a device (``_device``, ``_staging``).

Knows: torch, msgpack and the public errors and stats types. Must not know: any other layer.
"""
