"""Research tools built on the public run interface: caches, scan, persistent edits, sessions."""
