"""The link between prefill and decode replicas: named interconnects (bandwidth and latency, with their
sources) and the time one transfer of a prompt's KV takes.

Imports allowed: the standard library and stallfree.sim.run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = [
    "DEFAULT_INTERCONNECT",
    "INTERCONNECTS",
    "Interconnect",
]


@dataclass(frozen=True, slots=True)
class Interconnect:
    """The link a request's KV crosses from a prefill replica to a decode replica.

    Args:
        name: a label for reports.
        bandwidth_bytes_per_s: bytes per second one transfer gets, > 0.
        latency_s: the fixed cost of one transfer (setup and first byte), s, >= 0.

    Raises:
        ClusterError: a session workload (not modelled here); bandwidth <= 0 or latency < 0 (or not finite).
    """

    name: str
    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.bandwidth_bytes_per_s) and self.bandwidth_bytes_per_s > 0):
            from stallfree.sim.run.result import ClusterError
            raise ClusterError(f"link bandwidth must be > 0 bytes/s, got {self.bandwidth_bytes_per_s!r}")
        if not (math.isfinite(self.latency_s) and self.latency_s >= 0):
            from stallfree.sim.run.result import ClusterError
            raise ClusterError(f"link latency must be >= 0 s, got {self.latency_s!r}")

    def transfer_time(self, num_bytes: float) -> float:
        """Seconds to move `num_bytes`: latency_s + num_bytes / bandwidth_bytes_per_s."""
        return self.latency_s + num_bytes / self.bandwidth_bytes_per_s


#: Named links. Bandwidths are nominal per-direction line rates (NVLink 4 on H100: 900 GB/s both
#: directions; InfiniBand NDR: 400 Gb/s; RoCE at 200 Gb/s; PCIe 5.0 x16: ~64 GB/s). Latencies are
#: this project's assumptions for one KV transfer's fixed cost (connection, registration, first
#: byte), not measurements: 10 us within a node, 50 us over the network.
INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink": Interconnect("nvlink", 450e9, 10e-6),
    "pcie5": Interconnect("pcie5", 64e9, 10e-6),
    "ib-ndr": Interconnect("ib-ndr", 50e9, 50e-6),
    "roce-200": Interconnect("roce-200", 25e9, 50e-6),
}


#: The default: a prefill and a decode replica on different nodes, linked by InfiniBand NDR.
DEFAULT_INTERCONNECT = "ib-ndr"
