"""Entry point: ``python -m lightning_mixedfsdp.plan --hf-config PATH --world-size N`` (the dry-run planner lives in
``recipes/dry_run.py``; the planner itself in ``planning/planner.py``)."""

from lightning_mixedfsdp.recipes.dry_run import main

if __name__ == "__main__":
    main()
