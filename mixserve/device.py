"""Where the engine runs (`--device auto|cpu|cuda`), and the one host-to-device copy of a step.

The engine's core is device-agnostic: weights, the KV cache, the batch tensors, the sampler's and
the rejection sampler's math all live on the engine's device. The host (Python) builds a step's
batch metadata as lists of ints; `HostStager` turns them into one int64 tensor and sends it to the
device in a single copy from pinned memory (CUDA), from which every batch tensor is a view. The
sampled ids come back in one device-to-host copy (`.tolist()` in the sampler). On the CPU both
copies are no-ops.
"""
from __future__ import annotations

import torch

def resolve_device(name: str | torch.device | None) -> torch.device:
    """The torch.device for `--device`: "auto" (or None) is CUDA when PyTorch sees a GPU, else the
    CPU; "cuda:N" names one GPU. Raises ValueError for another name, or for CUDA where PyTorch
    sees no GPU (a CPU build of torch, no driver)."""
    if isinstance(name, torch.device):
        dev = name
    elif name is None or name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            dev = torch.device(name)
        except RuntimeError:
            raise ValueError(f"device: must be auto, cpu or cuda[:N] (got {name!r})") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device: must be auto, cpu or cuda[:N] (got {name!r})")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device: {name!r} asked for, but PyTorch sees no CUDA GPU here "
                             f"(torch {torch.__version__}); use device 'cpu' (--device cpu)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"device: {name!r}, but only {torch.cuda.device_count()} GPU(s) are visible")
    return dev


def synchronize(device: torch.device | str) -> None:
    """Wait for the device's queued work (CUDA launches are asynchronous: a timer must wait for
    them); nothing on the CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def move_module(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move every tensor a model holds to `device`: parameters and buffers (`Module.to`), and the
    tensors our layers keep as plain attributes (DenseLinear's weight, Int4Linear's packed
    integers). A module with a `to_device(device)` method (Int4Linear: CUDA has its own int4
    layout) moves itself. Returns the module."""
    module.to(device)
    for m in module.modules():
        if hasattr(m, "to_device"):
            m.to_device(device)
            continue
        for name, value in list(vars(m).items()):
            if isinstance(value, torch.Tensor) and value.device != device:
                setattr(m, name, value.to(device))
    return module


class HostStager:
    """One host-to-device copy of a step's int64 batch metadata.

    `upload(values)` writes the ints into a host tensor (on CUDA: pinned, from PyTorch's caching
    host allocator, so the copy is asynchronous DMA) and returns the device tensor [len(values)]
    int64 that every batch tensor of the step is a view of. The pinned block is not reused until
    its copy has run: the caching host allocator records the copy's stream event (a step may end
    without any device-to-host copy, a prefill chunk that samples nothing, so a persistent buffer
    rewritten per call could be read by a copy still queued).

    Args: device: the engine's device.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.num_uploads = 0  # copies made (tests count one per step)

    def upload(self, values: list[int]) -> torch.Tensor:
        self.num_uploads += 1
        host = torch.tensor(values, dtype=torch.long, device="cpu")
        if self.device.type == "cpu":
            return host
        return host.pin_memory().to(self.device, non_blocking=True)
