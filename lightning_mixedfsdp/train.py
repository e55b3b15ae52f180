"""Public entry point: ``python -m lightning_mixedfsdp.train --config conf/<recipe>.yaml`` (the runner lives in
``recipes/run/runner.py``)."""

from lightning_mixedfsdp.recipes.run.runner import main

if __name__ == "__main__":
    main()
