"""NVML readings through one wrapper: a missing GPU, driver or value reads as None ("n/a").

A value the GPU does not support is None without a word; any other failure (an NVML error, a
driver problem, a function this pynvml lacks) is None too, and said once per function with its
reason, so a broken reading never reads "n/a" in silence and never stops the heartbeat."""

from __future__ import annotations

from typing import Any

from .warn import Warnings

try:  # nvidia-ml-py installs the module `pynvml`
    import pynvml
except ImportError:  # pragma: no cover - scalemon[agent] installs it; usable without it
    pynvml = None


class GpuReader:
    """Reads utilisation, memory, power and temperature of one GPU; all None without NVML."""

    def __init__(self, pci_bus_id: str | None = None, index: int | None = None,
                 warnings: Warnings | None = None) -> None:
        self.handle = None
        self.reason = "no GPU"
        self.warnings = warnings or Warnings()
        if pynvml is None:
            self.reason = "pynvml not installed"
            return
        if pci_bus_id is None and index is None:
            return
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVMLError, or a library that does not load
            self.reason = f"NVML unavailable: {exc}"
            self.warnings.once("nvml-init", "scalemon: GPU readings (utilisation, power, "
                               "temperature) are n/a: NVML did not start: %s", exc)
            return
        if pci_bus_id is not None:
            self.handle = self._query("nvmlDeviceGetHandleByPciBusId", pci_bus_id)
        if self.handle is None and index is not None:
            self.handle = self._query("nvmlDeviceGetHandleByIndex", index)
        self.reason = "ok" if self.handle is not None else "GPU not found by NVML"
        if self.handle is None:
            self.warnings.once("nvml-handle", "scalemon: GPU readings are n/a: NVML does not "
                               "find the GPU (PCI bus id %s, index %s)", pci_bus_id, index)

    def _query(self, name: str, *args: Any) -> Any:
        """pynvml.<name>(*args), or None when it fails: silently where the GPU does not support
        the value, else said once per function with the reason (a pynvml without the
        function, a driver error), so a broken reading does not read "n/a" in silence."""
        try:
            return getattr(pynvml, name)(*args)
        except Exception as exc:
            if not _not_supported(exc):
                self.warnings.once(f"nvml:{name}", "scalemon: NVML %s failed (%s: %s); that "
                                   "reading is n/a", name, type(exc).__name__, exc)
            return None

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
        query = self._query
        util = query("nvmlDeviceGetUtilizationRates", self.handle)
        mem = query("nvmlDeviceGetMemoryInfo", self.handle)
        power_mw = query("nvmlDeviceGetPowerUsage", self.handle)
        temp = query("nvmlDeviceGetTemperature", self.handle, 0)  # NVML_TEMPERATURE_GPU
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


def _not_supported(exc: BaseException) -> bool:
    """True for NVML's "not supported on this GPU" error (a value that cannot exist here)."""
    return pynvml is not None and isinstance(exc, pynvml.NVMLError) and getattr(
        exc, "value", None) == pynvml.NVML_ERROR_NOT_SUPPORTED


def pci_bus_id_of(device_index: int) -> str | None:
    """NVML's PCI bus id of a torch CUDA device (robust to CUDA_VISIBLE_DEVICES), or None."""
    try:
        import torch

        props = torch.cuda.get_device_properties(device_index)
        return f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    except Exception:
        return None
