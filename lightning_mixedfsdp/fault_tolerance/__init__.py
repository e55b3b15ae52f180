"""Fault-tolerant replica groups with torchft: the session of one group (quorum, commit vote, cross-group reduction,
checkpoint writer) and the state a restarted group heals from."""
