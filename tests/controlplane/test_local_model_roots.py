"""Local models live under the local model roots: the catalog refuses, with a 400 that says why, a folder or
GGUF source elsewhere or leading out of them through '..' or a symbolic link, so the control plane reads no
other path of its host."""

from collections.abc import Iterator
from pathlib import Path

import pytest
from django.test import override_settings
from rest_framework.test import APIClient

from controlplane.catalog.local_roots import check_local_source, local_model_roots
from controlplane.catalog.models import LanguageModel
from controlplane.errors import Invalid
from runtime.errors import ConfigError
from tests.controlplane.factories import make_model

pytestmark = pytest.mark.django_db


@pytest.fixture
def root(tmp_path: Path) -> Iterator[Path]:
    models = tmp_path / "models"
    (models / "smol").mkdir(parents=True)
    (models / "smol" / "model.safetensors").write_bytes(b"\0" * 100)
    (models / "smol.gguf").write_bytes(b"GGUF" + b"\0" * 96)
    with override_settings(LOCAL_MODEL_ROOTS=[models]):
        yield models


def add(operator: APIClient, source: str, kind: str = "gguf") -> tuple[int, object]:
    body = {"name": "local", "source_kind": kind, "source": source, "engine": "mocker", "memory_bytes": 1 << 30}
    response = operator.post("/api/v1/models/", body, format="json")
    return response.status_code, response.json()


def test_a_model_under_a_root_is_added_and_measured(operator: APIClient, root: Path) -> None:
    assert add(operator, str(root / "smol.gguf"))[0] == 201
    assert LanguageModel.objects.get(name="local").size_bytes == 100
    # A path that this machine does not have, under a root, is for the nodes: accepted.
    assert make_model("later", source_kind="folder", source=str(root / "not-yet"), engine="mocker").pk


def test_a_path_outside_the_roots_is_a_400_naming_them(operator: APIClient, root: Path) -> None:
    status, body = add(operator, "/etc/passwd.gguf")
    assert status == 400
    assert "'/etc/passwd.gguf' is outside the local model folders" in str(body)
    assert str(root) in str(body) and "FLOTILLA_LOCAL_MODEL_ROOTS" in str(body)
    status, _ = add(operator, "/etc", kind="folder")
    assert status == 400


def test_a_path_that_climbs_out_with_dot_dot_is_a_400(operator: APIClient, root: Path) -> None:
    status, body = add(operator, str(root / ".." / ".." / "secret.gguf"))
    assert status == 400 and "climbs out of its folder with '..'" in str(body)


def test_a_symbolic_link_out_of_the_roots_is_a_400_naming_where_it_leads(
    operator: APIClient, root: Path, tmp_path: Path
) -> None:
    (tmp_path / "private").mkdir()
    (tmp_path / "private" / "weights.safetensors").write_bytes(b"\0" * 10)
    (root / "sneaky").symlink_to(tmp_path / "private")
    status, body = add(operator, str(root / "sneaky"), kind="folder")
    assert status == 400
    assert f"leads to '{tmp_path / 'private'}' (a symbolic link)" in str(body)
    assert not LanguageModel.objects.exists()


def test_a_source_changed_to_outside_the_roots_is_refused(root: Path) -> None:
    from controlplane.catalog import actions
    from tests.controlplane.factories import TEST_ACTOR

    model = make_model("local", source_kind="gguf", source=str(root / "smol.gguf"), engine="mocker")
    with pytest.raises(Invalid, match="outside the local model folders") as raised:
        actions.update_model(TEST_ACTOR, model, source="/root/model.gguf")
    assert raised.value.field == "source"


def test_the_default_roots_are_the_data_folders_models_and_the_bundled_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from runtime.models.source import default_model_path

    monkeypatch.delenv("FLOTILLA_LOCAL_MODEL_ROOTS")
    roots = local_model_roots(tmp_path)
    assert roots[0] == tmp_path / "models"
    bundled = default_model_path()  # what `flotilla up` deploys first
    assert check_local_source(str(bundled), roots) == bundled.resolve()


def test_the_roots_come_from_the_environment_and_must_be_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLOTILLA_LOCAL_MODEL_ROOTS", "/srv/models, /data/llm")
    assert local_model_roots(tmp_path) == [Path("/srv/models"), Path("/data/llm")]
    monkeypatch.setenv("FLOTILLA_LOCAL_MODEL_ROOTS", "models")
    with pytest.raises(ConfigError, match="FLOTILLA_LOCAL_MODEL_ROOTS: 'models' is not an absolute path"):
        local_model_roots(tmp_path)
