"""Jobs that outlive a request: submitted without waiting, kept in a store, run once, owned, under quotas.

Why a sub-package: everything a durable job needs on the server (the database schema and its
migrations, the store, the quotas, the runner that claims and runs jobs, the REST routes) sits here,
beside the request-scoped serving code it reuses; ``asyncinterp serve --state-dir DIR`` (SQLite) or
``--database postgresql://...`` turns it on (docs/jobs.md).

This ``__init__`` imports nothing: the client's handle (:mod:`.handle`) lives here too and must load
no server module (tests/test_remote_install.py).
"""
