"""What `flotilla up` tells its control plane: the local model roots include the model it deploys first."""

from pathlib import Path

from launcher.stack_controlplane import FirstModel, local_model_roots
from runtime.model_source import default_model_path


def test_the_roots_are_the_defaults_and_the_first_model_wherever_it_is(tmp_path: Path) -> None:
    first = FirstModel(name="qwen", source_kind="gguf", source="/home/me/Downloads/qwen.gguf", engine="llamacpp")
    roots = local_model_roots(tmp_path, first, environ={}).split(",")
    assert roots == [str(tmp_path / "models"), str(default_model_path().parent), "/home/me/Downloads/qwen.gguf"]


def test_roots_the_user_configured_are_kept(tmp_path: Path) -> None:
    environ = {"FLOTILLA_LOCAL_MODEL_ROOTS": "/srv/models"}
    assert local_model_roots(tmp_path, None, environ=environ) == "/srv/models"
