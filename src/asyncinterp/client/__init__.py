"""The remote client: ``ai.remote(url)``, :class:`Client`/:class:`AsyncClient` and the job's wire format.

Why this package exists apart from :mod:`asyncinterp.serve`: a researcher who
only talks to a server installs the ``remote`` extra and imports this package,
which loads no server module (no app, batcher, sandbox or worker) and needs
none of the server's dependencies. The server reads the same wire format
(:mod:`.wire`, :mod:`.capture`, :mod:`.cache_wire`) and the same sandbox
policy (:mod:`.policy`), so they live here, below the server's floors.

* :mod:`.remote` — ``ai.remote(url)``: a served model with the local surface;
* :mod:`.clients` — the HTTP clients mirroring local ``trace``/``generate``;
* :mod:`.job_form` — a job written as bytes (the server reads it back in
  :mod:`asyncinterp.serve.jobs.job_wire`);
* :mod:`.wire`, :mod:`.capture`, :mod:`.cache_wire`, :mod:`.protocol`,
  :mod:`.policy`, :mod:`.remote_check` — what travels and what is checked.
"""


def __getattr__(name):
    if name in ("Client", "AsyncClient"):
        from . import clients
        return getattr(clients, name)
    if name == "remote":
        raise AttributeError(name)   # the module asyncinterp.client.remote; the function is ai.remote
    raise AttributeError(f"module 'asyncinterp.client' has no attribute {name!r}")


__all__ = ["AsyncClient", "Client"]
