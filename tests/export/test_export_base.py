"""The exporter base: the safety net for knobs an exporter does not map yet, and warning text."""
from __future__ import annotations

from export_cases import GIB, config_of
from skistune.export import ExportWarning
from skistune.export.base import EngineVersion, Exporter, Plan, Rendered
from skistune.runtime.presets import get_preset


class MapsOnlyBatching(Exporter):
    """An exporter written before most knobs existed."""

    name = "partial"
    engine = "Partial"
    versions = (EngineVersion("1", "test"),)
    default_file = "partial.yaml"

    def render(self, plan: Plan, version: EngineVersion, model, file_name: str) -> Rendered:
        plan.express("batching.max_num_seqs")
        return Rendered(f"max_num_seqs: {plan.config.batching.max_num_seqs}\n")


def test_unmapped_knobs_off_their_default_are_warned_and_defaults_pass():
    exporter = MapsOnlyBatching()
    config = config_of({"offload.host_kv_bytes": GIB, "batching.max_num_seqs": 8})
    result = exporter.export(config, exporter.default_version, get_preset("smollm2-135m"), "partial.yaml")
    assert [w.knob for w in result.warnings] == ["offload.host_kv_bytes"]
    assert "has no mapping for this knob yet" in str(result.warnings[0])
    assert str(result.warnings[0]).startswith("offload.host_kv_bytes=1GiB: ")  # a size, as a config file takes it
    assert "batching.max_num_seqs" in result.expressed and "prefix_reuse.enabled" in result.expressed


def test_warning_text_shows_long_per_layer_lists_briefly():
    w = ExportWarning("bitwidth.layer_bits", tuple((4, 4) for _ in range(30)), "fp8", "one dtype")
    assert str(w) == "bitwidth.layer_bits=[[4, 4], [4, 4], [4, 4], ... (30 in all)]: one dtype; wrote fp8"
    assert w.to_dict()["value"] == [[4, 4]] * 30
