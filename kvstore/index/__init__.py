"""The block index: records and where they live in the metadata service (`records`), their
nodes' seals (`signatures`), and the watch-fed in-memory mirror every client and the conductor
reads (`mirror`), built of one table per fingerprint (`table`) and loaded at start from a parallel
snapshot (`snapshot`)."""
from .mirror import IndexMirror, Match, Placement

__all__ = ["IndexMirror", "Match", "Placement"]
