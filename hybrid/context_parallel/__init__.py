"""Context parallelism (issue 31): the sequence of every sample split across the ranks of a CP group,
with attention computed over the whole sequence by a ring of key/value blocks (p2p) or by an
all-to-all that trades sequence shards for head shards (a2a)."""
