"""Jobs that outlive a request: submitted without waiting, kept in a store, run once, owned, under quotas.

Why a sub-package: everything a durable job needs on the server (the database schema and its
migrations, the store, the quotas, the runner that claims and runs jobs, the REST routes) sits here,
on the jobs floor beside the request-scoped job code it reuses (:mod:`..jobs_api`, :mod:`..sessions`);
``asyncinterp serve --state-dir DIR`` (SQLite) or ``--database postgresql://...`` turns it on
(docs/jobs.md). The client's side (the job handle, ``asyncinterp jobs``) is
:mod:`asyncinterp.client.jobs_handle` and :mod:`asyncinterp.client.jobs_cli`.

This ``__init__`` imports nothing, so that the command line can add its flags (:mod:`.options`) without
loading SQLAlchemy.
"""
