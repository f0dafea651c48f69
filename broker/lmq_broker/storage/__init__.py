"""The LMQ store: an append-only commit log (the truth) and a RocksDB index (a rebuildable cache)."""
