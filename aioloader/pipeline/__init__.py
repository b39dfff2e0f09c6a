"""The pipeline, written once: source -> load stage -> batcher -> collate, wherever it runs.

Every transport (a worker process, a thread, a Ray actor, this process) runs the same
pipeline; they differ in how a batch travels, never in how a pass is read.

Knows: plans (positions, samplers, sources) and the collate's allocator. Must not know:
workers, sessions, wire or arena (a batch is written through an allocator it is handed).
"""
