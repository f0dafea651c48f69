"""Files that mark a data directory's state, named here for the programs that write them without opening a store
(``lmq-admin restore`` runs in the operator's and the reclaim job's images too, which install no RocksDB)."""

from __future__ import annotations

from typing import Final

# Written by ``lmq-admin restore`` before it removes a data directory's old contents, removed once the restored
# files are all in place: a store that finds it was cut off midway (old and restored files mixed, or missing).
RESTORE_MARKER: Final = "restore-incomplete"

# Written by ``lmq-admin restore`` into what it restores: a random id of that restore. The store's id (what a
# leaving broker's offsets are of, at the brokers it copies messages to) includes it, so a broker restored from
# an older backup, which may number new messages with offsets it used before, is a new source to them.
RESTORED_ID: Final = "restored-id"
