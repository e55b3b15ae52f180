"""Entry point: ``python -m lightning_mixedfsdp.plan --hf-config PATH --world-size N`` (the dry-run planner lives in
``recipes/run/dry_run.py``; the planner itself in ``planning/planner.py``)."""

from lightning_mixedfsdp.recipes.run.dry_run import main

if __name__ == "__main__":
    main()
