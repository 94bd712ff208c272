"""KV store: keys, metadata, daemons, client, tiers (see issues 3-5)."""
