"""kv_connector_extra_config validation; eviction methods are refused."""

import pytest

import kv_baselines
from kv_vllm import ConnectorConfig, check_codec_name


def test_defaults_and_codec():
    cfg = ConnectorConfig.from_extra_config(None)
    assert cfg.codec == "lossless" and cfg.build_codec().lossless
    kivi = ConnectorConfig.from_extra_config({"codec": "kivi-2"}).build_codec()
    assert not kivi.lossless and kivi.config_hash() != cfg.build_codec().config_hash()


def test_eviction_methods_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="must supply every prefix token.*lossless"):
        check_codec_name("snapkv")
    with pytest.raises(ValueError, match="must supply every prefix token"):
        check_codec_name(kv_baselines.snapkv(0.5))
    with pytest.raises(ValueError, match=r"unknown codec 'zstd'; available codecs: \["):
        ConnectorConfig(codec="zstd")


def test_bad_settings(tmp_path):
    with pytest.raises(ValueError, match=r"unknown kv_connector_extra_config keys \['cpu_budget'\]"):
        ConnectorConfig.from_extra_config({"cpu_budget": 1})
    with pytest.raises(ValueError, match="cpu_bytes must be an int >= 0, got -1"):
        ConnectorConfig(cpu_bytes=-1)
    with pytest.raises(TypeError, match="cpu_bytes must be an int"):
        ConnectorConfig(cpu_bytes="1G")
    with pytest.raises(ValueError, match="disk_bytes needs disk_dir"):
        ConnectorConfig(disk_bytes=10)
    with pytest.raises(ValueError, match="does not exist"):
        ConnectorConfig(disk_dir=str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="layout must be 'auto' or one of"):
        ConnectorConfig(layout="NHD")
    with pytest.raises(ValueError, match="could store nothing"):
        ConnectorConfig(cpu_bytes=0)
    cfg = ConnectorConfig(cpu_bytes=0, disk_dir=str(tmp_path), disk_bytes=1 << 20)
    assert cfg.build_store().disk_budget == 1 << 20


def test_method_codecs_are_accepted_and_other_method_names_refused_accurately():
    """kv-hex and kv-hqekv register page codecs: their names pass; a method name that is no codec is refused with
    a message that does not call every method an eviction method, and lists the method's own codecs."""
    for name in ("hex-3", "hex-4", "kcvt-3", "kcvt-4", "hqekv-2", "hqekv-3.2"):
        assert check_codec_name(name) == name
        assert ConnectorConfig(codec=name).build_codec().name == name
    with pytest.raises(ValueError, match=r"whether it evicts tokens or keeps them at lower precision") as e:
        check_codec_name("hex-expander-only-3")
    assert "registers the page codecs ['hex-3', 'hex-4']" in str(e.value)
    with pytest.raises(ValueError, match=r"registers the page codecs \['hqekv-2', 'hqekv-2.8'"):
        check_codec_name("hqekv-3.2-no-evict")
    with pytest.raises(ValueError) as e:
        check_codec_name("snapkv")
    assert "registers the page codecs" not in str(e.value)
