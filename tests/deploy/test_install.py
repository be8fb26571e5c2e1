"""deploy/install.sh: refuses without root, shows every step with --dry-run, never overwrites settings."""

import os
import stat
import subprocess
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[2]
INSTALL = CHECKOUT / "deploy" / "install.sh"
UNITS = sorted(path.name for path in (CHECKOUT / "deploy" / "systemd").glob("*.service"))
ENV_FILES = ("agent.env", "controlplane.env", "ingress.env", "planner.env")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="a real install (even under --root) runs as root only")


def install(*args: str, as_nobody: bool = False) -> subprocess.CompletedProcess[str]:
    command = [str(INSTALL), *args]
    if as_nobody and os.geteuid() == 0:
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_install_refuses_to_run_without_root(tmp_path: Path) -> None:
    result = install("--root", str(tmp_path), as_nobody=True)
    assert result.returncode == 1
    assert "run it as root" in result.stderr
    assert not any(tmp_path.iterdir())


def test_an_unknown_option_is_refused_with_the_usage(tmp_path: Path) -> None:
    result = install("--dry-run", "--bogus")
    assert result.returncode == 2
    assert "unknown option '--bogus'" in result.stderr
    assert "usage: deploy/install.sh" in result.stderr


def test_a_dry_run_shows_every_step_and_changes_nothing(tmp_path: Path) -> None:
    result = install("--dry-run", "--root", str(tmp_path), as_nobody=True)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert f"-m venv {tmp_path}/opt/flotilla/venv" in out
    assert f"pip install --quiet -e {tmp_path}/opt/flotilla/src" in out
    for unit in UNITS:
        assert f"install -m 0644 {CHECKOUT}/deploy/systemd/{unit} {tmp_path}/etc/systemd/system/{unit}" in out
    for env_file in ENV_FILES:
        assert f"install -m 0640 {CHECKOUT}/deploy/systemd/env/{env_file} {tmp_path}/etc/flotilla/{env_file}" in out
    assert f"{tmp_path}/etc/flotilla/worker.env.example" in out
    assert "--root: not reloading systemd" in out
    assert out.rstrip().endswith("Dry run: nothing was changed.")
    assert not any(tmp_path.iterdir())


def test_a_dry_run_keeps_an_existing_env_file(tmp_path: Path) -> None:
    (tmp_path / "etc" / "flotilla").mkdir(parents=True)
    (tmp_path / "etc" / "flotilla" / "agent.env").write_text("FLOTILLA_CONTROL_PLANE=http://cp:8000\n")
    result = install("--dry-run", "--root", str(tmp_path), "--no-venv")
    assert result.returncode == 0, result.stderr
    assert f"keeping {tmp_path}/etc/flotilla/agent.env" in result.stdout
    assert f"{tmp_path}/etc/flotilla/agent.env\n" not in result.stdout.replace("keeping", "")
    assert "-m venv" not in result.stdout


@needs_root
def test_an_install_writes_units_and_settings_and_a_second_one_keeps_edited_settings(tmp_path: Path) -> None:
    first = install("--root", str(tmp_path), "--no-venv")
    assert first.returncode == 0, first.stderr
    assert "Installed. Next steps:" in first.stdout
    etc = tmp_path / "etc" / "flotilla"
    units = tmp_path / "etc" / "systemd" / "system"
    assert sorted(path.name for path in units.iterdir()) == UNITS
    for unit in UNITS:
        assert (units / unit).read_text() == (CHECKOUT / "deploy" / "systemd" / unit).read_text()
    assert stat.S_IMODE(etc.stat().st_mode) == 0o750
    for env_file in ENV_FILES:
        assert stat.S_IMODE((etc / env_file).stat().st_mode) == 0o640  # DATABASE_URL may hold a password
    assert (etc / "worker.env.example").exists()

    (etc / "controlplane.env").write_text("DATABASE_URL=postgres://flotilla:secret@db/flotilla\n")
    (units / "flotilla-agent.service").write_text("stale\n")
    second = install("--root", str(tmp_path), "--no-venv")
    assert second.returncode == 0, second.stderr
    assert f"keeping {etc}/controlplane.env" in second.stdout
    assert (etc / "controlplane.env").read_text() == "DATABASE_URL=postgres://flotilla:secret@db/flotilla\n"
    # Units are code: the newest replace whatever was there.
    assert (units / "flotilla-agent.service").read_text() == (
        CHECKOUT / "deploy" / "systemd" / "flotilla-agent.service"
    ).read_text()


def test_a_dry_run_creates_the_workers_user_beside_the_services_one() -> None:
    result = install("--dry-run", "--no-venv", as_nobody=True)
    assert result.returncode == 0, result.stderr
    created = (
        "+ useradd --system --user-group --home-dir /var/lib/flotilla-worker --create-home --shell /usr/sbin/nologin "
        "--comment Flotilla engine workers flotilla-worker"
    )
    assert created in result.stdout or "user flotilla-worker exists" in result.stdout
