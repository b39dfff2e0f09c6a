"""The run and its faces: what a loader's epochs share over its life, and how a consumer meets it.

:class:`~aioloader.run._run.Run` owns the epochs (its phase is the authority, moved only by
the pure table of ``_phase``), a :class:`~aioloader.run._session.Session` is one lifecycle
around a producer of batches, an epoch hands batches to ``async for``, and the
:class:`~aioloader.run._portal.Portal` and the sync adapter drive the same coroutines from
plain code. ``_setup`` is the one place a run's
plans, producers and workers are made from the config.

Knows: workers (as producers it starts and drives), the pipeline's keys, plans and positions,
the data plane's device hand-off. Must not know: how a batch travels (wire, arena, Ray), nor
how a worker runs a pass; nothing here runs user code.
"""
