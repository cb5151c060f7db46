"""Submitted work: a whole job (``/v1/jobs``) or session (``/v1/sessions``) read, checked and run once.

:mod:`.job_wire` (a job's bytes back into a :class:`~asyncinterp.job.Job`),
:mod:`.jobs_api` (the job endpoint: load, check, run), :mod:`.sessions`,
:mod:`.dryrun` (a job through the wire and back, on the local model) and
:mod:`.errors` (the one table from a failure to its HTTP answer). Above the
sandbox and scheduling, below workers, OpenAI compatibility and HTTP.
"""
