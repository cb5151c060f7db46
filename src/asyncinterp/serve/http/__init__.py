"""The HTTP floor: the Starlette app and its routes, metrics, capabilities, and how a serving process starts.

:mod:`.app` (the :class:`~.app.Server`: auth, limits, native and OpenAI
routes), :mod:`.metrics`, :mod:`.capabilities`, :mod:`.startup` (command-line
options, the model and the server a process builds). It uses the floors
below it (OpenAI compatibility, workers, jobs, the sandbox, scheduling) and
is used only by the command (:mod:`asyncinterp.serve.cli`) and scale-out.
"""
