"""Independent launches started together. A launch spends its first seconds importing torch, Lightning and
transformers on one core (the launcher, then each rank it starts), so two or three launches side by side keep both
cores of a small machine busy where one alone leaves one idle. Each launch is a blocking call that starts its own
processes and waits for them (its own timeouts bound it): nothing here waits on time or speed."""

from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Dict, TypeVar

T = TypeVar("T")


def run_together(launches: Dict[str, Callable[[], T]]) -> Dict[str, T]:
    """Every launch's result by name, once all have finished; a launch that raised raises here (the first by name)."""
    with ThreadPoolExecutor(max_workers=len(launches)) as pool:
        futures = {name: pool.submit(launch) for name, launch in launches.items()}
    return {name: future.result() for name, future in futures.items()}
