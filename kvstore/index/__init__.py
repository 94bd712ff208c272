"""The block index: records and where they live in the metadata service (`records`), their
nodes' seals (`signatures`), and the watch-fed in-memory mirror every client and the conductor
reads (`mirror`), built of one table per fingerprint (`table`) and loaded at start from a parallel
snapshot (`snapshot`); an index spread over several etcd clusters by block hash (`shards`), read
through one mirror per shard (`sharded_mirror`)."""
from .mirror import IndexMirror, Match, Placement
from .sharded_mirror import ShardedMirror, open_mirror

__all__ = ["IndexMirror", "Match", "Placement", "ShardedMirror", "open_mirror"]
