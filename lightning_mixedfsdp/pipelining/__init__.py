"""Pipeline parallelism: a model cut to this rank's stages (``stage_forward.py``) and the step that runs them on
torch's schedules (``runner.py``). The stages are planned in ``planning/stages.py``; the strategies set them up
(``strategies/pipelined.py``)."""
