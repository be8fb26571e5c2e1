#!/usr/bin/env bash
# `make verify-units`: `systemd-analyze verify` on every unit in deploy/systemd/, and no warning allowed (verify
# only warns, exit status 0, about an unknown key or a misspelt section: here that fails too).
#
# verify also checks that each Exec*= program exists and is executable. The units name /opt/flotilla/venv and
# /opt/flotilla/src, where deploy/install.sh puts the virtual environment and the code, and which this machine
# need not have. So the units verified are copies whose /opt/flotilla/ paths point into a temporary root where
# venv is this checkout's .venv (built by `make install`: the same packages install.sh installs) and src is this
# checkout. Paths outside /opt/flotilla (the env files, the token credential) are read only when a unit starts,
# so verify needs none of them.
set -euo pipefail

checkout="$(cd "$(dirname "$0")/.." && pwd)"
venv="${VENV:-$checkout/.venv}"
units_dir="${UNITS_DIR:-$checkout/deploy/systemd}"  # another folder: the tests check that a broken unit fails
command -v systemd-analyze >/dev/null || { echo "verify-units: systemd-analyze is missing: run \`make system-deps\`" >&2; exit 1; }
[ -x "$venv/bin/python" ] || { echo "verify-units: no virtual environment at $venv: run \`make install\`" >&2; exit 1; }

work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/root/opt/flotilla" "$work/units"
ln -s "$venv" "$work/root/opt/flotilla/venv"
ln -s "$checkout" "$work/root/opt/flotilla/src"

shopt -s nullglob
units=()
for unit in "$units_dir"/*.service; do
    name="$(basename "$unit")"
    sed "s#/opt/flotilla/#$work/root/opt/flotilla/#g" "$unit" > "$work/units/$name"
    units+=("$name")
done

[ "${#units[@]}" -gt 0 ] || { echo "verify-units: no units in $units_dir" >&2; exit 1; }

cd "$work/units"
status=0
# Template units (name@.service) are checked as an instance of themselves. --man=no: no man pages to look up.
output="$(systemd-analyze verify --man=no "${units[@]}" 2>&1)" || status=$?
if [ "$status" -ne 0 ] || [ -n "$output" ]; then
    echo "verify-units: systemd-analyze verify found problems in $units_dir (paths under $work/root are" \
        "/opt/flotilla in the units):" >&2
    echo "$output" >&2
    exit 1
fi
echo "verify-units: ${#units[@]} units pass systemd-analyze verify: ${units[*]}"
