"""Workers and their transports: processes, threads, Ray actors, and this process itself.

A :class:`~aioloader.workers._phases.Roster` keeps every worker's phase as pure transitions;
the :class:`~aioloader.workers._supervisor.Supervisor` executes them around processes (and
threads), ``_ray`` around actors; ``_starting`` starts processes and keeps standbys;
``_worker`` is a worker process's loop, ``_ray_actor`` the actor's; the producers
(``_producers``, ``_local``) are what a session drives to get batches.

Knows: the pipeline (it runs it), plans and positions (it is handed them), the data plane
(how its batches travel). Must not know: the run, epochs or the consumer's face.
"""
