"""The process group's end: destroyed while the interpreter is still whole, by whichever strategy started it."""

import atexit
import time

# how long the exit hook hands the GIL to gloo's worker threads; their pending work is microseconds, but on an
# oversubscribed machine a worker may wait a scheduler slice or two before it runs
_DRAIN_SECONDS = 0.1

_registered = False


def destroy_process_group_at_exit() -> None:
    """Destroy the process groups when the program exits, before the interpreter is finalised.

    A gloo worker thread (torch 2.13) releases a finished collective's tensors after the caller's ``wait()`` has
    returned. When the last reference to a tensor with a Python object goes in that thread, it takes the GIL; once
    the interpreter is finalising, taking the GIL ends the thread, and the C++ runtime aborts ("terminate called
    without an active exception"): a run that succeeded exits with SIGABRT, and Lightning's launcher then kills the
    other ranks. Same diagnosis: pytorch/pytorch#179291. There is no barrier: a rank must exit even when a peer died.
    """
    global _registered
    if not _registered:
        atexit.register(_destroy_process_groups)
        _registered = True


def _destroy_process_groups() -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    # joins the worker threads of every group nothing else holds
    dist.destroy_process_group()
    # groups that FSDP's states and device meshes still hold keep their threads until finalisation: let a worker
    # that is still releasing a finished collective take the GIL now
    time.sleep(_DRAIN_SECONDS)
