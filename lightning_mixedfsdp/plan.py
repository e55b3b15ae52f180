"""``python -m lightning_mixedfsdp.plan``: the dry-run planner (lives in ``recipes/dry_run.py``); the planner's own
names are importable from here too, as before the layout change."""

from lightning_mixedfsdp.sharding.plan import DtypeKey, ShardGroup, ShardPlan, plan_sharding

__all__ = ["DtypeKey", "ShardGroup", "ShardPlan", "plan_sharding"]

if __name__ == "__main__":
    from lightning_mixedfsdp.recipes.dry_run import main

    main()
