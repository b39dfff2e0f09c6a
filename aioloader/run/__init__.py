"""The run and its faces: what a loader's epochs share over its life, and how a consumer meets it.

The roles of its modules are docs/architecture.md's (the layout, and "Inside the run").

Knows: workers (as producers it starts and drives), the pipeline's keys, plans and positions,
the data plane's device hand-off. Must not know: how a batch travels (wire, arena, Ray), nor
how a worker runs a pass; nothing here runs user code.
"""
