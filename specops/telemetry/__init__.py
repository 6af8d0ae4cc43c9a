"""specops.telemetry: the metrics contract, records, Prometheus exporter and Redis publisher.

Torch-free: the controller and sidecar import it without the runtime.
"""

from specops.telemetry.contract import PROMQL, promql
from specops.telemetry.records import DecodeRecord, WindowStats

__all__ = ["PROMQL", "DecodeRecord", "WindowStats", "promql"]
