"""Process isolation: the worker processes that run submitted code, and the supervisor that watches them.

:mod:`.supervisor` (the serving front over worker processes), :mod:`.pool`
(one worker and its queue), :mod:`.worker_proc` (the process itself),
:mod:`.worker_start` (a fork server started before any thread),
:mod:`.channel` (the pipe and heartbeat), :mod:`.confine` (seccomp) and
:mod:`.worker_results`. Below HTTP and OpenAI compatibility; above jobs,
the sandbox and scheduling.
"""
