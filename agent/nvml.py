"""NVML readings through one wrapper: any missing GPU, driver or value reads as None ("n/a")."""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger("scalemon.agent")

try:  # nvidia-ml-py installs the module `pynvml`
    import pynvml
except ImportError:  # pragma: no cover - it is a dependency, but stay usable without it
    pynvml = None


def _query(fn: Any, *args: Any) -> Any:
    try:
        return fn(*args)
    except Exception:
        return None


class GpuReader:
    """Reads utilisation, memory, power and temperature of one GPU; all None without NVML."""

    def __init__(self, pci_bus_id: str | None = None, index: int | None = None) -> None:
        self.handle = None
        self.reason = "no GPU"
        if pynvml is None:
            self.reason = "pynvml not installed"
            return
        if pci_bus_id is None and index is None:
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:
            self.reason = f"NVML unavailable: {exc}"
            return
        if pci_bus_id is not None:
            self.handle = _query(pynvml.nvmlDeviceGetHandleByPciBusId, pci_bus_id)
        if self.handle is None and index is not None:
            self.handle = _query(pynvml.nvmlDeviceGetHandleByIndex, index)
        self.reason = "ok" if self.handle is not None else "GPU not found by NVML"
        log.debug("scalemon: NVML readings: %s", self.reason)

    def read(self) -> dict[str, float | int | None]:
        """One reading; every value None where NVML cannot give it."""
        out: dict[str, float | int | None] = {
            "gpu_util_pct": None,
            "gpu_mem_used_bytes": None,
            "gpu_mem_total_bytes": None,
            "gpu_power_w": None,
            "gpu_temp_c": None,
        }
        if self.handle is None:
            return out
        util = _query(pynvml.nvmlDeviceGetUtilizationRates, self.handle)
        mem = _query(pynvml.nvmlDeviceGetMemoryInfo, self.handle)
        power_mw = _query(pynvml.nvmlDeviceGetPowerUsage, self.handle)
        temp = _query(pynvml.nvmlDeviceGetTemperature, self.handle, 0)  # NVML_TEMPERATURE_GPU
        if util is not None:
            out["gpu_util_pct"] = float(util.gpu)
        if mem is not None:
            out["gpu_mem_used_bytes"] = int(mem.used)
            out["gpu_mem_total_bytes"] = int(mem.total)
        if power_mw is not None:
            out["gpu_power_w"] = power_mw / 1000.0
        if temp is not None:
            out["gpu_temp_c"] = float(temp)
        return out


def pci_bus_id_of(device_index: int) -> str | None:
    """NVML's PCI bus id of a torch CUDA device (robust to CUDA_VISIBLE_DEVICES), or None."""
    try:
        import torch

        props = torch.cuda.get_device_properties(device_index)
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except Exception:
        return None
