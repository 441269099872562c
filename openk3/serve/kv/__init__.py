"""The hybrid paged cache: block pool, prefix hashes and state checkpoints, the manager that allocates them."""
