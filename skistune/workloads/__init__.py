"""Workloads: what a tuning run serves. Real traces (Azure, Mooncake, BurstGPT, length-only CSVs), seeded
synthetic presets that follow those traces' published statistics, transformations, summary statistics and
the runtime's prompt tokens. `load_workload` is how every command resolves ``--workload``."""
from skistune.workloads.load import load_workload
from skistune.workloads.model import Workload
from skistune.workloads.readers import FORMATS, ArrivalSpec, detect_format, read_trace
from skistune.workloads.stats import WorkloadStats, burstiness, prefix_reuse_ratio, workload_stats
from skistune.workloads.synthetic import (PRESETS, EmpiricalLengths, QuantileLengths, Preset, get_preset,
                                          renewal_arrivals, synthesize)
from skistune.workloads.tokens import TokenSource, prompt_token_ids, to_requests
from skistune.workloads.transforms import (first_n, jitter, sample_n, scale_lengths, scale_rate, set_rate,
                                           time_window)

__all__ = [
    "FORMATS", "PRESETS", "ArrivalSpec", "EmpiricalLengths", "QuantileLengths", "Preset", "TokenSource", "Workload",
    "WorkloadStats", "burstiness", "detect_format", "first_n", "get_preset", "jitter", "load_workload",
    "prefix_reuse_ratio", "prompt_token_ids", "read_trace", "renewal_arrivals", "sample_n", "scale_lengths",
    "scale_rate", "set_rate", "synthesize", "time_window", "to_requests", "workload_stats",
]
