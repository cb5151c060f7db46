"""OpenAI's Files and Batch API on the kept-jobs store: files, batches and their answered lines.

Why a sub-package: a batch is a kept job (kind ``batch``, :mod:`..durable`) whose lines are answered by
the server's own OpenAI endpoints; its files, its record and each answered line live in the same
database as the jobs (:mod:`.tables`), so a batch survives a restart and, with PostgreSQL, a replica's
loss, like any job. docs/jobs.md ("The batch API against OpenAI's").
"""
