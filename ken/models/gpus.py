"""The GPUs this process can use, as torch sees them (issue 18).

``visible_gpus()`` lists them (index, name, memory); ``gpu_budget_bytes`` is what a plan may
place on one; ``choose_gpus`` checks a requested count against them. Nothing here starts a CUDA
context unless a GPU is there to describe.
"""

from __future__ import annotations

from dataclasses import dataclass

from ken.errors import KenError

#: share of a GPU's memory a plan may fill with weights, activations and KV cache: the rest is
#: left to the CUDA context, cuBLAS workspaces and the caching allocator's fragmentation
GPU_MEMORY_SHARE = 0.9


@dataclass(frozen=True)
class Gpu:
    """One visible GPU: its index as this process numbers it (``cuda:<index>``)."""

    index: int
    name: str
    memory_bytes: int


def visible_gpus() -> tuple[Gpu, ...]:
    """The GPUs torch can use here (none with a CPU build of torch, or none present)."""
    import torch

    if not torch.cuda.is_available():
        return ()
    out = []
    for i in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(i)
        out.append(Gpu(i, str(props.name), int(props.total_memory)))
    return tuple(out)


def gpu_budget_bytes(gpu: Gpu, memory_gb: float | None = None) -> int:
    """What a plan may place on ``gpu``: ``memory_gb`` when given, else ``GPU_MEMORY_SHARE`` of
    its memory."""
    if memory_gb is not None:
        if not memory_gb > 0:
            raise KenError(f"the memory budget per GPU must be > 0 GB, got {memory_gb}")
        if memory_gb * 2**30 > gpu.memory_bytes:
            raise KenError(f"a budget of {memory_gb:g} GB per GPU is more than GPU "
                           f"{gpu.index} ({gpu.name}) has: {gpu.memory_bytes / 2**30:.1f} GB")
        return int(memory_gb * 2**30)
    return int(gpu.memory_bytes * GPU_MEMORY_SHARE)


def choose_gpus(requested: int | None, visible: tuple[Gpu, ...]) -> tuple[Gpu, ...]:
    """The first ``requested`` visible GPUs (all of them when ``requested`` is None: the
    default finds them by itself); a clear error when more are asked for than there are."""
    if requested is None:
        return visible
    if requested < 0:
        raise KenError(f"the number of GPUs must be >= 0, got {requested}")
    if requested > len(visible):
        seen = (", ".join(f"cuda:{g.index} {g.name}" for g in visible) if visible
                else "none: torch has no CUDA build here, or no GPU is visible "
                     "(CUDA_VISIBLE_DEVICES, drivers)")
        raise KenError(f"{requested} GPU(s) asked for, but torch sees {len(visible)} ({seen})")
    return visible[:requested]
