"""Executing a ShardPlan on a model, in torchtitan's order (``applier``: casts -> TP -> EP -> AC -> compile -> FSDP),
with the leaves it is made of: dtype boundaries and class adaptations, activation saving, replicated params and their
grad reducer, buffer sync, step tracking and recovery, expert parallelism; and clipping over the placements it makes."""
