"""Scheduling, the bottom floor of serving: the front that runs requests on the engine, and what a request is.

:mod:`.batcher` (the serving front: requests share forward passes),
:mod:`.submission` (what it queues: one job and its serving envelope),
:mod:`.requests` (what a request's code and its answer share with it), :mod:`.engine_front`
(what differs per engine), :mod:`.sampling_fields`, :mod:`.params` (typed
parameters of registered interventions), :mod:`.builtins` (the default ones)
and :mod:`.worker_failures` (the failures a worker process can end in).
Imports nothing from the floors above.
"""
