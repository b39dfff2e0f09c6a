"""Workers and their transports: processes, threads, Ray actors, and this process itself.

Knows: the pipeline (it runs it), plans and positions (it is handed them), the data plane
(how its batches travel). Must not know: the run, epochs or the consumer's face.
"""
