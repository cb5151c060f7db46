"""Work that outlives a request: what a server keeps in its state directory (jobs, files, batches, edits).

Modules here keep the server's durable state and the endpoints over it;
each says which part it holds.
"""
