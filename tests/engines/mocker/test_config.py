"""The mocker's settings file: Dynamo's key names, vLLM's defaults, clear refusals."""

from pathlib import Path

import pytest

from engines.mocker.config import (
    DEFAULT_HOST_BANDWIDTH_GBPS,
    KNOWN_KEYS,
    MockerConfig,
    host_bandwidths,
    load_mocker_config,
    parse_mocker_config,
)
from runtime.errors import ConfigError


def test_defaults_are_vllms() -> None:
    config = load_mocker_config(None)
    assert (config.num_gpu_blocks, config.block_size) == (16384, 64)
    assert (config.max_num_seqs, config.max_num_batched_tokens) == (256, 8192)
    assert config.enable_prefix_caching and config.enable_chunked_prefill
    assert (config.speedup_ratio, config.dp_size) == (1.0, 1)
    # vLLM v1's scheduler, which has no watermark.
    assert (config.scheduler, config.watermark) == ("v1", None)


def test_a_file_sets_the_keys_it_names(tmp_path: Path) -> None:
    path = tmp_path / "mocker.json"
    path.write_text('{"speedup_ratio": 1000, "dp_size": 2, "block_size": 16, "enable_prefix_caching": false}')
    config = load_mocker_config(path)
    assert config == MockerConfig(speedup_ratio=1000, dp_size=2, block_size=16, enable_prefix_caching=False)


def test_an_unknown_key_is_named_with_the_known_ones() -> None:
    with pytest.raises(ConfigError) as raised:
        parse_mocker_config({"num_gpu_block": 10})
    message = str(raised.value)
    assert "unknown key 'num_gpu_block'" in message
    assert all(key in message for key in KNOWN_KEYS)


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"num_gpu_blocks": 0}, "num_gpu_blocks"),
        ({"watermark": 1.0, "scheduler": "v0"}, "watermark"),
        ({"speedup_ratio": -1}, "speedup_ratio"),
        ({"enable_chunked_prefill": "yes"}, "enable_chunked_prefill"),
        ({"preemption_mode": "random"}, "preemption_mode"),
    ],
)
def test_a_bad_value_names_its_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"bad value for key '{key}'"):
        parse_mocker_config(values)


def test_a_file_that_is_not_a_json_object_is_refused(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_text("{speedup_ratio: 10")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_mocker_config(broken)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        load_mocker_config(listed)
    with pytest.raises(ConfigError, match="cannot be read"):
        load_mocker_config(tmp_path / "missing.json")


def test_a_step_must_have_room_for_a_token_of_every_running_sequence() -> None:
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(100\) must be at least max_num_seqs \(256\)"):
        parse_mocker_config({"max_num_batched_tokens": 100})
    assert parse_mocker_config({"max_num_batched_tokens": 100, "max_num_seqs": 100}).max_num_seqs == 100


def test_settings_may_be_given_inline_as_a_json_object() -> None:
    assert load_mocker_config('{"speedup_ratio": 10, "block_size": 16}') == MockerConfig(
        speedup_ratio=10, block_size=16
    )
    with pytest.raises(ConfigError, match=r"--extra-engine-args \(inline JSON\): not valid JSON"):
        load_mocker_config('{"speedup_ratio": ')


def test_the_scheduler_is_v1_or_v0_and_anything_else_is_refused_by_name() -> None:
    assert parse_mocker_config({"scheduler": "v0"}).scheduler == "v0"
    assert parse_mocker_config({"scheduler": "v1"}).scheduler == "v1"
    for bad in ("v2", "V1", 1, None):
        with pytest.raises(ConfigError, match=r'"scheduler" must be "v1" .* or "v0" .*, not ' + repr(bad)):
            parse_mocker_config({"scheduler": bad})


def test_a_watermark_is_refused_under_v1_which_has_none() -> None:
    with pytest.raises(ConfigError, match=r'"watermark" is a setting of vLLM v0.s scheduler; v1 has none'):
        parse_mocker_config({"watermark": 0.05})
    assert parse_mocker_config({"watermark": 0.05, "scheduler": "v0"}).watermark == 0.05


def test_the_host_tier_is_off_unless_num_host_blocks_is_set_and_its_bandwidths_default_to_dynamos() -> None:
    assert load_mocker_config(None).num_host_blocks is None
    config = parse_mocker_config({"num_host_blocks": 128, "kv_bytes_per_token": 1024})
    assert config.num_host_blocks == 128
    assert host_bandwidths(config) == (DEFAULT_HOST_BANDWIDTH_GBPS, DEFAULT_HOST_BANDWIDTH_GBPS) == (32.0, 32.0)
    given = parse_mocker_config(
        {
            "num_host_blocks": 128,
            "kv_bytes_per_token": 1024,
            "host_offload_d2h_bandwidth_gbps": 7,
            "host_offload_h2d_bandwidth_gbps": 0,
        }
    )
    assert host_bandwidths(given) == (7.0, 0.0)


@pytest.mark.parametrize("key", ["host_offload_d2h_bandwidth_gbps", "host_offload_h2d_bandwidth_gbps"])
def test_a_host_bandwidth_without_num_host_blocks_is_refused_saying_to_add_it(key: str) -> None:
    with pytest.raises(ConfigError, match=rf"'{key}' set the host tier's copy speed, .* add \"num_host_blocks\""):
        parse_mocker_config({key: 10, "kv_bytes_per_token": 1024})


def test_num_host_blocks_without_kv_bytes_per_token_is_refused_unless_copies_take_no_time() -> None:
    with pytest.raises(ConfigError, match=r'"num_host_blocks" needs "kv_bytes_per_token" .* add it'):
        parse_mocker_config({"num_host_blocks": 128})
    with pytest.raises(ConfigError, match=r'"num_host_blocks" needs "kv_bytes_per_token"'):
        parse_mocker_config({"num_host_blocks": 128, "host_offload_d2h_bandwidth_gbps": 0})
    # Both copies instant: a block's bytes are never needed.
    instant = {"num_host_blocks": 128, "host_offload_d2h_bandwidth_gbps": 0, "host_offload_h2d_bandwidth_gbps": 0}
    assert parse_mocker_config(instant).num_host_blocks == 128


def test_num_host_blocks_is_refused_under_v0_and_without_prefix_caching() -> None:
    base = {"num_host_blocks": 128, "kv_bytes_per_token": 1024}
    with pytest.raises(ConfigError, match=r'"num_host_blocks" \(the host KV tier\) is simulated with vLLM v1.s'):
        parse_mocker_config({**base, "scheduler": "v0"})
    with pytest.raises(ConfigError, match=r'"num_host_blocks" needs prefix caching'):
        parse_mocker_config({**base, "enable_prefix_caching": False})


@pytest.mark.parametrize(
    ("values", "key"),
    [
        ({"num_host_blocks": 0, "kv_bytes_per_token": 1}, "num_host_blocks"),
        (
            {"num_host_blocks": 8, "kv_bytes_per_token": 1, "host_offload_d2h_bandwidth_gbps": -1},
            "host_offload_d2h_bandwidth_gbps",
        ),
    ],
)
def test_a_bad_host_tier_value_names_its_key(values: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=f"bad value for key '{key}'"):
        parse_mocker_config(values)
