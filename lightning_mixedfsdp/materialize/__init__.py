"""Models built on the meta device made real after sharding: each module initialised by the model's own init on rank 0
(``meta``) and streamed into every rank's shards one chunk at a time (``stream``, which loads use too)."""
