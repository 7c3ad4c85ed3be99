#!/usr/bin/env bash
# A one-node Slurm 22.05 cluster on this machine, for the tests that submit real jobs (Debian 12's
# slurm-wlm, munge, slurmdbd and mariadb-server; sacct, which submitit polls, needs slurmdbd).
#
#   bash scripts/setup_slurm.sh install        # the packages only (apt-get, as root); CI runs this
#   bash scripts/setup_slurm.sh start [DIR]    # munged, mariadbd, slurmdbd, slurmctld, slurmd -N localhost
#   bash scripts/setup_slurm.sh stop [DIR]     # cancels the cluster's jobs, stops what start started
#   bash scripts/setup_slurm.sh status [DIR]   # each daemon, and sinfo; exit 0 when all run, 3 when not
#
# All of a cluster's state (configs, munge key and socket, the MariaDB data dir, spool, state, logs,
# pid files) is under DIR (or $EXPKIT_SLURM_DIR; /tmp/expkit-slurm by default), nothing in the
# repository or /etc. Clients find the cluster through SLURM_CONF=DIR/etc/slurm.conf; `start`
# prints the line to export. No systemd: the daemons are started directly, as root (the jobs run as
# whoever submits them). Addresses: slurmd and the clients (srun) bind 127.0.0.1 only
# (CommunicationParameters=NoInAddrAny), MariaDB has no TCP port (a unix socket in DIR), munged a
# unix socket in DIR; slurmctld and slurmdbd listen on every address, as 22.05 has no setting for
# theirs (NoInAddrAny leaves slurmctld out, and slurmdbd.conf has none), and answer only messages
# signed with the cluster's own munge key (made at the first start, readable by munge only).
# Ports: $EXPKIT_SLURM_PORT (6817) for slurmctld, +1 for slurmd, +2 for slurmdbd; another cluster
# (another DIR and EXPKIT_SLURM_PORT) can run beside this one.
#
# Idempotent: `install` does nothing when the programs are there; `start` starts only the daemons
# that are not running (a second `start` does nothing); `stop` stops only what runs from DIR.
# Where the packages are missing and cannot be installed (not root, no apt-get), `install` says so
# and exits 0, and `start` says so and exits 3, so tests can skip with that reason (CI sets
# EXPKIT_REQUIRE_SLURM=1: there they fail instead).
#
# Measured on a 2-core Debian 12 VM: `install` 28 s (apt-get update, then 33 packages downloaded
# and set up, no recommends; 12 s with the packages already in apt's cache); the first `start` of a
# new DIR 3.5-6 s (mariadb-install-db, then each daemon until the node is idle), `start` of a
# stopped cluster about 2 s, `start` of a running one 0.05 s; `stop` about 7 s (each daemon takes
# about 2 s to go). DIR holds about 110 MB (mostly MariaDB's files).
set -uo pipefail
me="scripts/setup_slurm.sh"
command="${1:-}"
dir="${2:-${EXPKIT_SLURM_DIR:-/tmp/expkit-slurm}}"
port="${EXPKIT_SLURM_PORT:-6817}"
programs=(munged mungekey mariadbd mariadb-install-db slurmdbd slurmctld slurmd sbatch sacct scontrol sinfo)
packages=(slurm-wlm slurmdbd munge mariadb-server)

missing() {  # the programs that are not installed (the daemons are in /usr/sbin, often not on PATH)
    local p
    for p in "${programs[@]}"; do
        PATH="$PATH:/usr/sbin:/sbin" command -v "$p" >/dev/null || echo "$p"
    done
}

install() {
    [ -z "$(missing)" ] && return 0
    if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null; then
        echo "$me: Slurm is not installed; its tests skip (as root: apt-get install ${packages[*]})" >&2
        return 0
    fi
    echo "$me: installing Debian's ${packages[*]} (for the tests' own one-node cluster)"
    local policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then  # (the packages' own services are not started)
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d && policy=yes
    fi
    apt-get update -qq >/dev/null &&
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${packages[@]}" >/dev/null
    local status=$?
    [ -n "$policy" ] && rm -f /usr/sbin/policy-rc.d
    [ "$status" -ne 0 ] && echo "$me: apt-get install ${packages[*]} failed (exit $status)" >&2
    return 0
}

export PATH="/usr/sbin:/usr/bin:/sbin:/bin"
conf="$dir/etc/slurm.conf"
export SLURM_CONF="$conf"

pid_file() {  # pid_file NAME: where DIR's daemon NAME writes its pid (munged and mariadbd run as their users)
    case $1 in
        munged) echo "$dir/munge/munged.pid" ;;
        mariadbd) echo "$dir/db/mariadbd.pid" ;;
        *) echo "$dir/run/$1.pid" ;;
    esac
}

pid_of() {  # pid_of NAME: the pid of DIR's daemon NAME when it runs
    local pid
    pid=$(cat "$(pid_file "$1")" 2>/dev/null) || return 1
    # (the process must be that daemon: a stale pid file's number may belong to another process by now)
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "$1" ] && echo "$pid"
}

wait_for() {  # wait_for SECONDS WHAT COMMAND...: until COMMAND succeeds; says which log to read if not
    local deadline=$((SECONDS + $1)) what=$2
    shift 2
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then
            echo "$me: $what did not come up; see $dir/log/" >&2
            tail -n 20 "$dir/log/$what.log" >&2 2>/dev/null
            return 1
        fi
        sleep 0.2
    done
}

configure() {  # the configs, from this machine's CPUs and memory
    local cpus memory
    cpus=$(nproc)
    memory=$(awk '/^MemTotal:/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)  # MiB, some left to the OS
    mkdir -p "$dir/etc" "$dir/run" "$dir/log" "$dir/state" "$dir/spool" "$dir/munge" "$dir/db"
    chmod 755 "$dir" "$dir/etc" "$dir/run" "$dir/log"
    cat > "$conf" <<EOF
# Written by $me (rewritten at each start): a one-node cluster on 127.0.0.1.
ClusterName=expkit
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port
SlurmdPort=$((port + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=30
CommunicationParameters=NoInAddrAny
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$dir/etc/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
SwitchType=switch/none
MpiDefault=none
MailProg=/bin/true
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort=$((port + 2))
AccountingStoragePass=$dir/munge/munge.socket
JobCompType=jobcomp/none
JobRequeue=1
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$((memory / cpus))
NodeName=localhost NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=localhost Default=YES MaxTime=INFINITE State=UP
EOF
    : > "$dir/etc/plugstack.conf"
    cat > "$dir/etc/slurmdbd.conf" <<EOF
# Written by $me (rewritten at each start). MariaDB: root over DIR's unix socket (MYSQL_UNIX_PORT).
AuthType=auth/munge
AuthInfo=socket=$dir/munge/munge.socket
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort=$((port + 2))
SlurmUser=root
PidFile=$dir/run/slurmdbd.pid
LogFile=$dir/log/slurmdbd.log
DebugLevel=info
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF
    chmod 600 "$dir/etc/slurmdbd.conf"
}

daemon_env=(env -i PATH="$PATH" SLURM_CONF="$conf" MYSQL_UNIX_PORT="$dir/db/mysqld.sock")

start_munged() {
    pid_of munged >/dev/null && return 0
    chown munge:munge "$dir/munge" && chmod 755 "$dir/munge"  # (clients reach the socket; the key is 0600)
    if [ ! -s "$dir/munge/munge.key" ]; then
        mungekey --create --keyfile="$dir/munge/munge.key" && chown munge:munge "$dir/munge/munge.key" || return 1
    fi
    "${daemon_env[@]}" runuser -u munge -- munged --socket="$dir/munge/munge.socket" \
        --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
        --seed-file="$dir/munge/munged.seed" --log-file="$dir/munge/munged.log" </dev/null >/dev/null 2>&1 ||
        { echo "$me: munged did not start:" >&2; tail -n 5 "$dir/munge/munged.log" >&2; return 1; }
    wait_for 10 munged pid_of munged
}

start_mariadb() {
    pid_of mariadbd >/dev/null && return 0
    chown mysql:mysql "$dir/db"
    if [ ! -d "$dir/db/mysql" ]; then
        mariadb-install-db --no-defaults --datadir="$dir/db" --user=mysql --skip-test-db \
            --auth-root-authentication-method=socket >"$dir/log/mariadb-install-db.log" 2>&1 ||
            { echo "$me: mariadb-install-db failed; see $dir/log/mariadb-install-db.log" >&2; return 1; }
    fi
    # No TCP port at all (skip-networking): slurmdbd reaches it through the socket.
    setsid "${daemon_env[@]}" mariadbd --no-defaults --user=mysql --datadir="$dir/db" \
        --socket="$dir/db/mysqld.sock" --pid-file="$(pid_file mariadbd)" --skip-networking \
        --log-error="$dir/db/mariadbd.log" --innodb-buffer-pool-size=64M --innodb-log-file-size=16M \
        --innodb-lock-wait-timeout=900 </dev/null >/dev/null 2>&1 &
    wait_for 30 mariadbd pid_of mariadbd || { tail -n 20 "$dir/db/mariadbd.log" >&2; return 1; }
    wait_for 30 mariadbd test -S "$dir/db/mysqld.sock"
}

port_open() {  # port_open PORT: something listens on 127.0.0.1:PORT
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

start_slurm_daemon() {  # start_slurm_daemon NAME PORT READY-COMMAND...
    local name=$1 port=$2
    shift 2
    pid_of "$name" >/dev/null && return 0
    if port_open "$port"; then
        echo "$me: port $port, $name's, is taken (another cluster? EXPKIT_SLURM_PORT picks other ports)" >&2
        return 1
    fi
    case $name in
        slurmdbd) "${daemon_env[@]}" slurmdbd ;;
        slurmctld) "${daemon_env[@]}" slurmctld -f "$conf" ;;
        slurmd) "${daemon_env[@]}" slurmd -f "$conf" -N localhost ;;
    esac </dev/null >>"$dir/log/$name.log" 2>&1 ||
        { echo "$me: $name did not start; see $dir/log/$name.log" >&2; tail -n 20 "$dir/log/$name.log" >&2; return 1; }
    wait_for 30 "$name" pid_of "$name" && wait_for 30 "$name" "$@" && pid_of "$name" >/dev/null
}

all_running() {
    local name
    for name in munged mariadbd slurmdbd slurmctld slurmd; do
        pid_of "$name" >/dev/null || return 1
    done
}

node_up() {  # the node takes jobs (idle, or busy with jobs left from before a restart)
    case "$(sinfo -h -n localhost -o %T 2>/dev/null)" in
        idle | mixed | allocated) return 0 ;;
        *) return 1 ;;
    esac
}

start() {
    if [ -n "$(missing)" ]; then
        echo "$me: Slurm is not installed (missing: $(missing | paste -sd ' ')); as root: bash $me install" >&2
        return 3
    fi
    if [ "$(id -u)" -ne 0 ]; then
        echo "$me: starting the cluster's daemons needs root" >&2
        return 3
    fi
    if all_running; then
        echo "export SLURM_CONF=$conf"
        return 0
    fi
    configure
    start_munged &&
        start_mariadb &&
        start_slurm_daemon slurmdbd $((port + 2)) port_open $((port + 2)) &&
        start_slurm_daemon slurmctld "$port" scontrol ping &&
        start_slurm_daemon slurmd $((port + 1)) node_up ||
        return 1
    echo "export SLURM_CONF=$conf"
}

stop_pid() {  # stop_pid NAME: SIGTERM, then SIGKILL after 30 s
    local pid i
    pid=$(pid_of "$1") || return 0
    kill "$pid" 2>/dev/null
    for ((i = 0; i < 300; i++)); do
        kill -0 "$pid" 2>/dev/null || break
        sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "$me: $1 ($pid) did not stop on SIGTERM in 30 s; killing it" >&2
        kill -9 "$pid" 2>/dev/null
    fi
    rm -f "$(pid_file "$1")"
}

stop() {
    [ -d "$dir" ] || return 0
    if pid_of slurmctld >/dev/null && pid_of slurmd >/dev/null; then  # the jobs' processes go with them
        local i jobs
        jobs=$(squeue -h -o %i 2>/dev/null)
        [ -n "$jobs" ] && scancel $jobs 2>/dev/null
        for ((i = 0; i < 100; i++)); do
            [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
    # Each takes up to 2 s to go: slurmctld hands its last records to slurmdbd before slurmdbd goes.
    stop_pid slurmd & stop_pid slurmctld & wait
    stop_pid slurmdbd
    stop_pid mariadbd & stop_pid munged & wait
}

status() {
    local name pid ok=0
    for name in munged mariadbd slurmdbd slurmctld slurmd; do
        if pid=$(pid_of "$name"); then
            echo "$name: running ($pid)"
        else
            echo "$name: not running"
            ok=3
        fi
    done
    if [ "$ok" -eq 0 ]; then
        echo "export SLURM_CONF=$conf"
        sinfo
    fi
    return $ok
}

case "$command" in
    install) install ;;
    start) start ;;
    stop) stop ;;
    status) status ;;
    *)
        echo "usage: bash $me install | start [DIR] | stop [DIR] | status [DIR]   (DIR: \$EXPKIT_SLURM_DIR or /tmp/expkit-slurm)" >&2
        exit 2
        ;;
esac
