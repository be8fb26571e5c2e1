"""deploy/verify-units.sh (`make verify-units`): systemd-analyze verify passes on the units, and fails on a broken
one, a warning included; and the units say what the services need."""

import configparser
import shutil
import subprocess
from pathlib import Path

import pytest

from controlplane.web_security import PRODUCTION

CHECKOUT = Path(__file__).resolve().parents[2]
UNITS_DIR = CHECKOUT / "deploy" / "systemd"
VERIFY = CHECKOUT / "deploy" / "verify-units.sh"
pytestmark = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="`make system-deps` installs systemd")


def verify(units_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(VERIFY)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "UNITS_DIR": str(units_dir)},
    )


def unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str  # type: ignore[assignment, method-assign]
    parser.read(UNITS_DIR / name)
    return parser


def test_every_unit_passes_systemd_analyze_verify() -> None:
    result = verify(UNITS_DIR)
    assert result.returncode == 0, result.stderr
    assert f"{len(list(UNITS_DIR.glob('*.service')))} units pass" in result.stdout


def test_a_unit_whose_program_is_missing_fails(tmp_path: Path) -> None:
    broken = (
        (UNITS_DIR / "flotilla-agent.service").read_text().replace("venv/bin/flotilla agent", "venv/bin/nosuch agent")
    )
    (tmp_path / "flotilla-agent.service").write_text(broken)
    result = verify(tmp_path)
    assert result.returncode == 1
    assert "venv/bin/nosuch is not executable" in result.stderr


def test_a_unit_with_an_unknown_key_fails_though_systemd_only_warns(tmp_path: Path) -> None:
    text = (UNITS_DIR / "flotilla-controlplane.service").read_text()
    (tmp_path / "flotilla-controlplane.service").write_text(text.replace("Restart=on-failure", "Restrat=on-failure"))
    result = verify(tmp_path)
    assert result.returncode == 1
    assert "Unknown key 'Restrat'" in result.stderr


def test_the_agent_leaves_its_workers_running_when_it_stops() -> None:
    agent = unit("flotilla-agent.service")
    assert agent["Service"]["KillMode"] == "process"
    assert agent["Service"]["ExecStart"] == "/opt/flotilla/venv/bin/flotilla agent"


def environment(name: str) -> dict[str, str]:
    """The unit's ``Environment=`` lines (configparser keeps only the last of a repeated key)."""
    lines = (UNITS_DIR / name).read_text().splitlines()
    return dict(line.removeprefix("Environment=").split("=", 1) for line in lines if line.startswith("Environment="))


def test_the_control_plane_is_secure_by_default_behind_its_tls_proxy() -> None:
    service = environment("flotilla-controlplane.service")
    assert {name: service.get(name) for name in PRODUCTION} == PRODUCTION
    # And its env file (read after them: it wins) leaves them so unless an operator uncomments a line.
    env_file = (UNITS_DIR / "env" / "controlplane.env").read_text().splitlines()
    assert not [line for line in env_file if line.split("=", 1)[0] in PRODUCTION]
    assert {f"#{name}={value}" for name, value in PRODUCTION.items()} <= set(env_file)


def test_the_control_plane_migrates_before_it_serves() -> None:
    service = unit("flotilla-controlplane.service")["Service"]
    assert service["ExecStartPre"].endswith("manage.py migrate --noinput")
    assert service["ExecStart"].startswith("/opt/flotilla/venv/bin/uvicorn controlplane.asgi:application")


@pytest.mark.parametrize("name", sorted(path.name for path in UNITS_DIR.glob("*.service")))
def test_a_bad_configuration_is_not_restarted(name: str) -> None:
    service = unit(name)["Service"]
    assert service["Restart"] == "on-failure"
    assert service["RestartPreventExitStatus"] == "2"
    assert service["User"] == ("root" if name == "flotilla-agent.service" else "flotilla")


def test_the_agent_is_root_with_only_what_starting_its_workers_as_another_user_takes() -> None:
    service = unit("flotilla-agent.service")["Service"]
    assert (service["User"], service["SupplementaryGroups"]) == ("root", "flotilla-worker")
    assert environment("flotilla-agent.service")["FLOTILLA_WORKER_USER"] == "flotilla-worker"
    assert set(service["CapabilityBoundingSet"].split()) == {
        "CAP_SETUID", "CAP_SETGID", "CAP_KILL", "CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH"
    }  # fmt: skip
    # The token is root's, as a credential; the workers reach the models folder through the state folder.
    assert service["LoadCredential"] == "agent-token:/etc/flotilla/agent.token"
    assert (service["UMask"], service["StateDirectoryMode"]) == ("0027", "0711")


HARDENING = {
    "NoNewPrivileges": "yes",
    "UMask": "0077",
    "CapabilityBoundingSet": "",
    "SystemCallFilter": "@system-service",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
}
# Their engine workers use the GPUs' device files (/dev/nvidia*).
NEEDS_GPUS = {"flotilla-agent.service", "flotilla-worker@.service"}
# The agent starts its workers as another user, and shares the models folder with them (the test above).
AGENT_HARDENING = {"UMask": "0027", "CapabilityBoundingSet": "CAP_SETUID CAP_SETGID CAP_KILL CAP_SYS_PTRACE "
                   "CAP_DAC_READ_SEARCH"}  # fmt: skip


@pytest.mark.parametrize("name", sorted(path.name for path in UNITS_DIR.glob("*.service")))
def test_every_unit_carries_the_hardening_keys(name: str) -> None:
    service = unit(name)["Service"]
    wanted = HARDENING | (AGENT_HARDENING if name == "flotilla-agent.service" else {})
    assert {key: service.get(key) for key in HARDENING} == wanted
    families = set(service["RestrictAddressFamilies"].split())
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families <= {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    if name in NEEDS_GPUS:
        assert "PrivateDevices" not in service
    else:
        assert service["PrivateDevices"] == "yes"
