"""The pure planner: model + config -> ShardPlan. Which tensors stay fp32 (``matching``), every param's and buffer's
dtype and FSDP group (``planner``, data in ``types``), the experts of expert parallelism (``experts``), the text
report (``report``) and the bytes per rank (``memory``). Reads the model, changes nothing, issues no collectives."""
