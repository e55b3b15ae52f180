"""The process group: its backend (a CPU backend beside NCCL where host tensors meet collectives), and its end,
destroyed while the interpreter is still whole, by whichever strategy started it."""

import atexit
import time
from typing import Optional

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


def has_host_backend(backend: str) -> bool:
    """Whether a backend spec runs collectives on host tensors: plain ``gloo`` (every device) or ``mpi``, or a device
    map with a ``cpu:`` entry (``cuda:nccl,cpu:gloo``)."""
    parts = [part.strip() for part in backend.split(",")]
    return any(part in ("gloo", "mpi") or part.startswith("cpu:") for part in parts)


def process_group_backend(device_type: str, requested: Optional[str], host_collectives: bool, owner: str) -> str:
    """The backend the strategy's process group is created with. ``host_collectives``: the run puts collectives on
    host tensors (CPU offload: clipping over host grads, an export's gathers, the rank-0 stream, the 4-bit base's
    block maxima), which NCCL rejects: on CUDA it gets gloo for host tensors beside NCCL, as torchtitan does. A
    requested backend without a host part is refused, with the fix."""
    if requested is not None:
        if host_collectives and device_type != "cpu" and not has_host_backend(requested):
            raise ValueError(refused_backend_message(owner, requested, device_type))
        return requested
    if device_type == "cuda":
        return "cuda:nccl,cpu:gloo" if host_collectives else "nccl"
    return "gloo"


def refused_backend_message(owner: str, requested: str, device_type: str = "cuda") -> str:
    return (
        f"{owner}: memory.offload='cpu' runs collectives on host tensors (clipping over host grads, an export's"
        f" gathers, the rank-0 stream, the 4-bit base's block maxima), which process_group_backend={requested!r}"
        " cannot run. Use"
        f" process_group_backend='{device_type}:{requested.split(':')[-1]},cpu:gloo' (or leave it unset)."
    )
