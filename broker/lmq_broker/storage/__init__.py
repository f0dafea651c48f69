"""The LMQ store: an append-only commit log (the truth) and a RocksDB index (a rebuildable cache).

``api.Store`` is the contract; ``store.LmqStore`` (open it with ``store.open_store``) and
``memory.MemoryStore`` (its in-memory twin) implement it. See docs/storage.md.
"""
