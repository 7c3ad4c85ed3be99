#!/usr/bin/env bash
# PostgreSQL's server programs, for the tests that start a real server on 127.0.0.1 (and stop it):
# Debian's postgresql package, installed when it is missing and this user may (root, apt-get).
# The package's own server is not started (policy-rc.d). Elsewhere those tests skip, saying so
# (CI sets EXPKIT_REQUIRE_POSTGRES=1: there they fail instead).
set -uo pipefail
if command -v pg_ctl >/dev/null || compgen -G "/usr/lib/postgresql/*/bin/pg_ctl" >/dev/null; then
    exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
    echo "scripts/setup_postgres.sh: PostgreSQL is not installed; its tests skip (sudo apt-get install postgresql)" >&2
    exit 0
fi
echo "scripts/setup_postgres.sh: installing Debian's postgresql (for the tests' own servers)"
policy=""
if [ ! -e /usr/sbin/policy-rc.d ]; then
    printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && policy=yes
fi
apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null
status=$?
[ -n "$policy" ] && rm -f /usr/sbin/policy-rc.d
if [ "$status" -ne 0 ]; then
    echo "scripts/setup_postgres.sh: apt-get install postgresql failed (exit $status)" >&2
fi
exit 0
