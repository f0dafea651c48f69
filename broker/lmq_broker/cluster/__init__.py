"""Several brokers sharing the lite topics of a parent: ring slots, membership, owner resolution (no I/O)."""
