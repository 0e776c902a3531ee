"""vLLM versions outside the tested ranges (sut.constants.TESTED_VLLM) are warned once, in the console and run.json."""

from sut.constants import TESTED_VLLM
from sut.record.write import untested_vllm


def test_the_tested_releases_pass_without_a_warning():
    assert untested_vllm(["0.26.0", "0.26.3", "0.32.0", "0.32.0+cpu", None]) is None
    assert ("0.26.0", "0.27") in TESTED_VLLM and ("0.32.0", "0.33") in TESTED_VLLM


def test_a_release_outside_every_range_is_named_once():
    msg = untested_vllm(["0.33.0", "0.33.0", "0.26.0", "0.25.9"])
    assert msg is not None and msg.startswith("vLLM 0.25.9, 0.33.0 is outside the versions")
    assert msg.count("0.33.0") == 1 and "0.26.0 <= v < 0.27" in msg


def test_the_upper_bound_is_exclusive():
    assert untested_vllm(["0.27.0"]) is not None and untested_vllm(["0.26.99"]) is None


class _Started:
    """A SUT whose engines were read back with the given vLLM version (only ``start`` is called)."""

    def __init__(self, version):
        self.version = version

    def start(self):
        return {"engines": [{"vllm_version": self.version, "torch_version": "2.11.0", "device": {"kind": "cuda"},
                             "enable_prefix_caching": False, "engine_args": {"load_format": "auto"}}]}


def test_a_run_on_an_untested_vllm_is_warned_once_in_the_console_and_run_json(tmp_path, caplog):
    import json

    from sut.run.harness import _start_sut

    record = {"versions": {}}
    with caplog.at_level("WARNING", logger="sut.run.harness"):
        _start_sut(_Started("0.33.0"), record, tmp_path)
    on_disk = json.loads((tmp_path / "run.json").read_text())
    assert on_disk["versions"]["vllm"] == "0.33.0" and len(on_disk["warnings"]) == 1
    assert "vLLM 0.33.0 is outside" in on_disk["warnings"][0]
    assert [r.message for r in caplog.records if "outside the versions" in r.message] == [on_disk["warnings"][0]]
    record = {"versions": {}}
    _start_sut(_Started("0.26.0"), record, tmp_path)
    assert "warnings" not in json.loads((tmp_path / "run.json").read_text())


def test_a_preset_names_its_card_and_a_run_on_another_card_is_warned(tmp_path, caplog):
    import json

    from sut.cli import build_parser
    from sut.run.harness import _start_sut
    from sut.settings.from_args import settings_from_args

    a = build_parser().parse_args(["run", "--config", "loadgen_configs/h100_fp8.toml", "--model", "m", "--dataset", "d"])
    rs = settings_from_args(a)[0]
    assert rs.tuned_on == "H100 80GB HBM3"
    record = {"versions": {}, "run_settings": {"tuned_on": rs.tuned_on}}
    on_h200 = _Started("0.26.0")
    on_h200.start = lambda: {"engines": [{"vllm_version": "0.26.0", "device": {"kind": "cuda", "name": "NVIDIA H200"},
                                          "engine_args": {"load_format": "dummy"}}]}
    with caplog.at_level("WARNING", logger="sut.run.harness"):
        _start_sut(on_h200, record, tmp_path)
    (warning,) = json.loads((tmp_path / "run.json").read_text())["warnings"]
    assert warning.startswith("the preset was tuned on H100 80GB HBM3, this run's engines are on NVIDIA H200")
    assert any(warning == r.message for r in caplog.records)
    from sut.record.write import other_card

    assert other_card("H100 80GB HBM3", [{"name": "NVIDIA H100 80GB HBM3"}]) is None
    assert other_card(None, [{"name": "NVIDIA H200"}]) is None


def test_servers_given_by_url_are_on_an_unknown_card_not_on_none():
    from sut.record.write import other_card

    remote = {"kind": "remote", "slot": "http://10.0.0.5:8000", "name": None, "uuid": None}
    said = other_card("H200", [remote, dict(remote, slot="http://10.0.0.6:8000")])
    assert said.startswith("the preset was tuned on H200, this run's engines are on an unknown card (servers given "
                           "by URL report none): ") and "None" not in said, said
    assert "NVIDIA H100 80GB HBM3, an unknown card (the engines report none)" in other_card(
        "H200", [{"kind": "cuda", "name": "NVIDIA H100 80GB HBM3"}, {"kind": "cuda", "name": None}])
