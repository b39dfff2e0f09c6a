"""Workers and their transports: processes, threads, Ray actors, and this process itself.

A :class:`~aioloader.workers._phases.Roster` keeps every worker's phase as pure transitions,
for process, thread and Ray workers alike; ``_supervising`` is the consumer's side of it
(receive, heal, restart), which the :class:`~aioloader.workers._supervisor.Supervisor`
(processes and threads, each over a ``_link``) and ``_ray`` (actors, asking Ray through
``_ray_cluster``) carry; ``_starting`` starts and stops processes, ``_standby`` keeps
spawn's standbys, ``_pickling`` sends a spec as spawn does;
``_worker`` is a worker process's loop, ``_ray_actor`` the actor's; the producers
(``_producers``, ``_local``) are what a session drives to get batches.

Knows: the pipeline (it runs it), plans and positions (it is handed them), the data plane
(how its batches travel). Must not know: the run, epochs or the consumer's face.
"""
