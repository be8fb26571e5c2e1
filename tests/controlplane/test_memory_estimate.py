"""The memory one replica needs: estimated from the model's weights, config and context, unless given."""

import json
import math
from pathlib import Path

import pytest
from rest_framework.test import APIClient

from controlplane.audit.records import Actor
from controlplane.catalog import actions
from controlplane.catalog.memory import (
    KvShape,
    config_subset,
    estimate_memory_bytes,
    kv_shape,
    read_local_model,
)
from controlplane.fleet.actions import report_download
from runtime.fleet_contract.reports import DownloadReport
from tests.controlplane.factories import TEST_ACTOR, GiB, make_model, make_node

# Llama 3.1 8B's config.json, in the part that matters here.
LLAMA_8B = {
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "hidden_size": 4096,
    "max_position_embeddings": 131072,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}


def test_the_kv_cache_per_token_comes_from_layers_kv_heads_and_head_size() -> None:
    shape = kv_shape(LLAMA_8B)
    assert shape == KvShape(layers=32, kv_heads=8, head_dim=128, bytes_per_element=2)
    assert shape.bytes_per_token == 128 * 1024  # 2 × 32 × 8 × 128 × 2


def test_without_kv_heads_every_attention_head_has_its_own_cache() -> None:
    shape = kv_shape({"num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 64, "torch_dtype": "float32"})
    assert shape == KvShape(layers=2, kv_heads=4, head_dim=64, bytes_per_element=4)


def test_a_multimodal_config_is_read_from_its_text_part() -> None:
    assert kv_shape({"architectures": ["Gemma3ForConditionalGeneration"], "text_config": LLAMA_8B}) is not None


@pytest.mark.parametrize("config", [{}, {"num_hidden_layers": 32}, {"num_hidden_layers": "32", "head_dim": 128}])
def test_a_config_without_the_shape_gives_none(config: dict[str, object]) -> None:
    assert kv_shape(config) is None


def test_the_estimate_is_weights_with_overhead_plus_one_full_context_of_kv_cache() -> None:
    weights = 16 * GiB
    assert estimate_memory_bytes(weights, LLAMA_8B, context_length=8192) == math.ceil(weights * 1.2) + 8192 * 128 * 1024
    # the model's own context when the operator sets none: 131072 tokens of 128 KiB = 16 GiB
    assert estimate_memory_bytes(weights, LLAMA_8B) == math.ceil(weights * 1.2) + 16 * GiB


def test_without_a_config_only_the_weights_count_and_without_a_size_nothing_is_known() -> None:
    assert estimate_memory_bytes(10 * GiB, {}) == 12 * GiB
    assert estimate_memory_bytes(None, LLAMA_8B) is None


def test_a_local_folder_gives_its_weights_size_and_config(tmp_path: Path) -> None:
    (tmp_path / "model-00001.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "model-00002.safetensors").write_bytes(b"\0" * 1000)
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    files = read_local_model(str(tmp_path), [tmp_path])
    assert files is not None
    assert files.size_bytes == 4000
    assert files.config == config_subset(LLAMA_8B)
    assert "vocab_size" not in files.config


def test_a_path_this_machine_cannot_see_gives_nothing(tmp_path: Path) -> None:
    assert read_local_model(str(tmp_path / "on-the-nodes-only"), [tmp_path]) is None
    assert read_local_model(str(tmp_path), [tmp_path]) is None  # a folder without weights


def test_files_that_lead_out_of_the_roots_are_not_read(tmp_path: Path) -> None:
    outside, root = tmp_path / "outside", tmp_path / "models"
    outside.mkdir()
    (root / "smol").mkdir(parents=True)
    (outside / "config.json").write_text(json.dumps(LLAMA_8B))
    (outside / "secret.safetensors").write_bytes(b"\0" * 5000)
    (root / "smol" / "model.safetensors").write_bytes(b"\0" * 1000)
    (root / "smol" / "config.json").symlink_to(outside / "config.json")
    (root / "smol" / "linked.safetensors").symlink_to(outside / "secret.safetensors")
    (root / "elsewhere").symlink_to(outside)
    files = read_local_model(str(root / "smol"), [root])
    assert files is not None and (files.size_bytes, files.config) == (1000, {})
    assert read_local_model(str(root / "elsewhere"), [root]) is None
    assert read_local_model(str(outside), [root]) is None


@pytest.mark.django_db
def test_a_model_without_a_memory_figure_gets_an_estimate() -> None:
    model = make_model("llama", engine="vllm", size_bytes=10 * GiB, config=LLAMA_8B, context_length=8192)
    assert model.memory_bytes == 12 * GiB + GiB
    assert model.memory_estimated


@pytest.mark.django_db
def test_a_model_of_an_engine_that_loads_no_weights_gets_no_estimate_and_one_when_its_engine_does() -> None:
    model = make_model("sim", engine="mocker", size_bytes=10 * GiB, config=LLAMA_8B, context_length=8192)
    assert (model.memory_bytes, model.memory_estimated) == (None, False)
    model = actions.update_model(TEST_ACTOR, model, engine="vllm")
    assert (model.memory_bytes, model.memory_estimated) == (13 * GiB, True)
    model = actions.update_model(TEST_ACTOR, model, engine="mocker")
    assert (model.memory_bytes, model.memory_estimated) == (None, False)


@pytest.mark.django_db
def test_the_operators_figure_wins_and_forgetting_it_estimates_again() -> None:
    model = make_model("llama", engine="vllm", size_bytes=10 * GiB, memory_bytes=20 * GiB)
    assert (model.memory_bytes, model.memory_estimated) == (20 * GiB, False)
    model = actions.update_model(TEST_ACTOR, model, size_bytes=20 * GiB)
    assert model.memory_bytes == 20 * GiB  # an operator's figure is not estimated over
    model = actions.update_model(TEST_ACTOR, model, memory_bytes=None)
    assert (model.memory_bytes, model.memory_estimated) == (24 * GiB, True)


@pytest.mark.django_db
def test_an_estimate_follows_what_it_is_made_of() -> None:
    model = make_model("llama", engine="vllm", size_bytes=10 * GiB, config=LLAMA_8B, context_length=8192)
    model = actions.update_model(TEST_ACTOR, model, context_length=16384)
    assert model.memory_bytes == 12 * GiB + 2 * GiB


@pytest.mark.django_db
def test_a_local_source_is_measured_when_this_machine_sees_it(tmp_path: Path) -> None:
    gguf = tmp_path / "smol.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 996)
    model = make_model("smol", source_kind="gguf", source=str(gguf), engine="llamacpp")
    assert (model.size_bytes, model.memory_bytes, model.memory_estimated) == (1000, 1200, True)


@pytest.mark.django_db
def test_a_finished_download_tells_the_catalog_the_size_nobody_gave() -> None:
    make_node("gpu-a", (80,))
    model = make_model("llama", engine="vllm", config=LLAMA_8B, context_length=8192)
    assert model.memory_bytes is None
    agent = Actor.agent("gpu-a")
    report_download(agent, "gpu-a", model.pk, DownloadReport(state="downloading", bytes_done=1, bytes_total=10 * GiB))
    report_download(agent, "gpu-a", model.pk, DownloadReport(state="done", bytes_done=10 * GiB, bytes_total=10 * GiB))
    model.refresh_from_db()
    assert (model.size_bytes, model.memory_bytes) == (10 * GiB, 13 * GiB)


@pytest.mark.django_db
@pytest.mark.parametrize(
    ("fields", "field"),
    [({"context_length": 0}, "context_length"), ({"config": [1]}, "config"), ({"memory_estimated": 5}, None)],
)
def test_the_api_takes_context_and_config_and_names_bad_ones(
    operator: APIClient, fields: dict[str, object], field: str | None
) -> None:
    body = {"name": "llama", "source_kind": "hf", "source": "meta/llama", "engine": "vllm", "size_bytes": GiB}
    response = operator.post("/api/v1/models/", body | fields, format="json")
    if field is None:  # read-only: ignored, and the estimate says itself
        assert response.status_code == 201
        assert response.json()["memory_estimated"] is True
        assert response.json()["memory_bytes"] == math.ceil(GiB * 1.2)
    else:
        assert response.status_code == 400
        assert field in response.json()


@pytest.mark.django_db
def test_a_local_projector_is_measured_and_counted_as_weights_and_another_one_measured_again(tmp_path: Path) -> None:
    gguf, projector, other = tmp_path / "smol.gguf", tmp_path / "mmproj-f16.gguf", tmp_path / "mmproj-q8.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 996)
    projector.write_bytes(b"GGUF" + b"\0" * 496)
    other.write_bytes(b"GGUF" + b"\0" * 246)
    model = make_model("smol", source_kind="gguf", source=str(gguf), engine="llamacpp", projector=str(projector))
    # (1000 + 500) x 1.2: a replica loads the projector beside the weights, on the same GPU.
    assert (model.size_bytes, model.projector_bytes, model.memory_bytes) == (1000, 500, 1800)
    model = actions.update_model(TEST_ACTOR, model, projector=str(other))
    assert (model.projector_bytes, model.memory_bytes) == (250, 1500)
    model = actions.update_model(TEST_ACTOR, model, projector="")
    assert (model.projector_bytes, model.memory_bytes) == (None, 1200)


@pytest.mark.django_db
def test_the_first_node_that_fetched_a_hub_projector_tells_its_size_with_the_models() -> None:
    make_node("gpu-a", (80,))
    model = make_model(
        "vision", source="org/vision-GGUF", filename="v.Q4_0.gguf", engine="llamacpp", projector="mmproj-f16.gguf"
    )
    assert (model.projector_bytes, model.memory_bytes) == (None, None)
    agent = Actor.agent("gpu-a")
    done = DownloadReport(state="done", bytes_done=4 * GiB, bytes_total=4 * GiB, projector_bytes=GiB)
    report_download(agent, "gpu-a", model.pk, done)
    model.refresh_from_db()
    assert (model.size_bytes, model.projector_bytes, model.memory_bytes) == (4 * GiB, GiB, 6 * GiB)
    # A model without a projector takes no projector size from a report.
    plain = make_model("plain", source="org/plain-GGUF", filename="p.Q4_0.gguf", engine="llamacpp")
    report_download(agent, "gpu-a", plain.pk, done)
    plain.refresh_from_db()
    assert (plain.size_bytes, plain.projector_bytes, plain.memory_bytes) == (4 * GiB, None, math.ceil(4 * GiB * 1.2))


@pytest.mark.django_db
def test_a_projector_size_is_the_nodes_to_report_not_the_operators_to_set(operator: APIClient) -> None:
    body = {
        "name": "vision", "source_kind": "hf", "source": "org/vision-GGUF", "filename": "v.Q4_0.gguf",
        "engine": "llamacpp", "projector": "mmproj-f16.gguf", "size_bytes": GiB, "projector_bytes": GiB,
    }  # fmt: skip
    response = operator.post("/api/v1/models/", body, format="json")
    assert response.status_code == 201, response.json()
    assert (response.json()["projector_bytes"], response.json()["memory_bytes"]) == (None, math.ceil(GiB * 1.2))


@pytest.mark.django_db
def test_a_projector_added_to_a_model_a_node_holds_is_measured_at_its_next_done() -> None:
    make_node("gpu-a", (80,))
    model = make_model("vision", source="org/vision-GGUF", filename="v.Q4_0.gguf", engine="llamacpp")
    agent = Actor.agent("gpu-a")
    report_download(agent, "gpu-a", model.pk, DownloadReport(state="done", bytes_done=GiB, bytes_total=GiB))
    model.refresh_from_db()
    model = actions.update_model(TEST_ACTOR, model, projector="mmproj-f16.gguf")
    assert (model.size_bytes, model.projector_bytes) == (GiB, None)
    # The weights were in the node's cache: no "downloading", the state stays done, and the sizes still come.
    done = DownloadReport(state="done", bytes_done=GiB, bytes_total=GiB, projector_bytes=GiB // 2)
    report_download(agent, "gpu-a", model.pk, done)
    model.refresh_from_db()
    assert (model.projector_bytes, model.memory_bytes) == (GiB // 2, math.ceil(1.5 * GiB * 1.2))
