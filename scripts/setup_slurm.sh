#!/usr/bin/env bash
# A Slurm 22.05 cluster of several nodes on this machine, for the tests that submit real jobs (Debian
# 12's slurm-wlm, munge, slurmdbd and mariadb-server; sacct, which submitit polls, needs slurmdbd).
#
#   bash scripts/setup_slurm.sh install        # the packages only (apt-get, as root); CI runs this
#   bash scripts/setup_slurm.sh start [DIR]    # munged, mariadbd, slurmdbd, slurmctld, slurmd -N n1 ... -N nN
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
# Ports: $EXPKIT_SLURM_PORT (6817) for slurmctld, +2 for slurmdbd, and +10183 + i for node n<i>'s slurmd
# (17001, 17002...); another cluster (another DIR and EXPKIT_SLURM_PORT) can run beside this one.
#
# Nodes: $EXPKIT_SLURM_NODES (2) nodes n1, n2... each a slurmd of its own on this host (NodeHostname), at
# 127.0.0.1 on its own port, each with all of this machine's CPUs and memory (so one node alone still runs
# what a one-node cluster ran). Their names resolve as on a real cluster: `start` adds them to /etc/hosts
# (127.0.0.1) when they do not resolve. Partitions: `debug` (the default) and `low` (PriorityTier=1,
# GraceTime=30) and `urgent` (PriorityTier=2), whose jobs preempt the others' (PreemptType=
# preempt/partition_prio, PreemptMode=REQUEUE: SIGTERM, GraceTime=30 s, then requeued). With 3 nodes or
# more, the last is kept out of `debug` and alone in `urgent`: a job that asks for it in `low` is the
# only one a test that fails that node or preempts on it stops (the tests' cluster has 3 nodes).
#
# Idempotent: `install` does nothing when the programs are there; `start` starts only the daemons
# that are not running (a second `start` does nothing); `stop` stops only what runs from DIR.
# Where the packages are missing and cannot be installed (not root, no apt-get), `install` says so
# and exits 0, and `start` says so and exits 3, so tests can skip with that reason (CI sets
# EXPKIT_REQUIRE_SLURM=1: there they fail instead).
#
# Measured on a 2-core Debian 12 VM: `install` 28 s (apt-get update, then 33 packages downloaded
# and set up, no recommends; 12 s with the packages already in apt's cache); the first `start` of a
# new DIR with two nodes 8 s (mariadb-install-db, then each daemon until its node is idle), `start`
# of a running one 0.06 s; `stop` about 7 s (each daemon takes about 2 s to go). DIR holds about
# 110 MB (mostly MariaDB's files).
set -uo pipefail
me="scripts/setup_slurm.sh"
command="${1:-}"
dir="${2:-${EXPKIT_SLURM_DIR:-/tmp/expkit-slurm}}"
port="${EXPKIT_SLURM_PORT:-6817}"
node_count="${EXPKIT_SLURM_NODES:-2}"
if ! [[ "$node_count" =~ ^[1-9][0-9]?$ ]]; then
    echo "$me: EXPKIT_SLURM_NODES must be a number of nodes from 1 to 99, not '$node_count'" >&2
    exit 2
fi
nodes=()
for ((i = 1; i <= node_count; i++)); do nodes+=("n$i"); done
node_port() {  # node_port NODE: the port of node n<i>'s slurmd
    echo $((port + 10183 + ${1#n}))
}
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

pid_file() {  # pid_file NAME: where DIR's daemon NAME (slurmd-n1: node n1's) writes its pid (munged, mariadbd: as their users)
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
    [ -n "$pid" ] && [ "$(cat "/proc/$pid/comm" 2>/dev/null)" = "${1%%-*}" ] && echo "$pid"
}

daemons() {  # every daemon of the cluster, by the name pid_of knows it
    echo munged mariadbd slurmdbd slurmctld
    printf 'slurmd-%s\n' "${nodes[@]}"
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
# Written by $me (rewritten at each start): ${#nodes[@]} nodes on this host, at 127.0.0.1.
ClusterName=expkit
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$port
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket,cred_expire=30
CommunicationParameters=NoInAddrAny
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
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
# A requeued job may start again cred_expire (30 s) after its requeue; the main scheduling loop (every
# 60 s by default) then took up to a minute more to start it: 46-86 s a requeue in the tests. Every 5 s.
SchedulerParameters=sched_interval=5,bf_interval=5
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$((memory / cpus))
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
EOF
    local node all shared last
    for node in "${nodes[@]}"; do
        echo "NodeName=$node NodeHostname=$(hostname) NodeAddr=127.0.0.1 Port=$(node_port "$node")" \
            "CPUs=$cpus RealMemory=$memory State=UNKNOWN" >> "$conf"
    done
    all=$(IFS=,; echo "${nodes[*]}")
    shared=$all last=$all
    if [ ${#nodes[@]} -ge 3 ]; then  # (the last node only for jobs that ask for it: a test may fail or preempt it)
        shared=$(IFS=,; echo "${nodes[*]:0:${#nodes[@]}-1}") last=${nodes[-1]}
    fi
    cat >> "$conf" <<EOF
PartitionName=debug Nodes=$shared Default=YES MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=low Nodes=$all MaxTime=INFINITE State=UP PriorityTier=1 GraceTime=30
PartitionName=urgent Nodes=$last MaxTime=INFINITE State=UP PriorityTier=2 PreemptMode=OFF
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
        slurmd-*) "${daemon_env[@]}" slurmd -f "$conf" -N "${name#slurmd-}" ;;
    esac </dev/null >>"$dir/log/$name.log" 2>&1 ||
        { echo "$me: $name did not start; see $dir/log/$name.log" >&2; tail -n 20 "$dir/log/$name.log" >&2; return 1; }
    wait_for 30 "$name" pid_of "$name" && wait_for 30 "$name" "$@" && pid_of "$name" >/dev/null
}

all_running() {
    local name
    for name in $(daemons); do
        pid_of "$name" >/dev/null || return 1
    done
}

node_up() {  # node_up NODE: the node takes jobs (idle, or busy with jobs left from before a restart)
    case "$(sinfo -h -n "$1" -o %T 2>/dev/null)" in
        idle | mixed | allocated) return 0 ;;
        *) return 1 ;;
    esac
}

name_nodes() {  # the nodes' names resolve, as on a real cluster (torch's rendezvous looks up the first)
    local node unnamed=()
    for node in "${nodes[@]}"; do
        getent hosts "$node" >/dev/null || unnamed+=("$node")
    done
    [ ${#unnamed[@]} -eq 0 ] && return 0
    # (appended in place, not replaced by a new file: in a container /etc/hosts is often a mount)
    echo "127.0.0.1 ${unnamed[*]}  # nodes of expkit's test cluster ($me)" >> /etc/hosts ||
        { echo "$me: could not add ${unnamed[*]} to /etc/hosts" >&2; return 1; }
}

start_nodes() {
    local node
    for node in "${nodes[@]}"; do
        start_slurm_daemon "slurmd-$node" "$(node_port "$node")" node_up "$node" || return 1
    done
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
    name_nodes &&
        start_munged &&
        start_mariadb &&
        start_slurm_daemon slurmdbd $((port + 2)) port_open $((port + 2)) &&
        start_slurm_daemon slurmctld "$port" scontrol ping &&
        start_nodes ||
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
    if pid_of slurmctld >/dev/null && pid_of slurmd-n1 >/dev/null; then  # the jobs' processes go with them
        local i jobs
        jobs=$(squeue -h -o %i 2>/dev/null)
        [ -n "$jobs" ] && scancel $jobs 2>/dev/null
        for ((i = 0; i < 100; i++)); do
            [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break
            sleep 0.1
        done
    fi
    # Each takes up to 2 s to go: slurmctld hands its last records to slurmdbd before slurmdbd goes.
    local pid_path
    for pid_path in "$dir"/run/slurmd-*.pid; do  # (every node that runs, however many `start` was told)
        [ -e "$pid_path" ] && stop_pid "$(basename "$pid_path" .pid)" &
    done
    stop_pid slurmctld &
    wait
    stop_pid slurmdbd
    stop_pid mariadbd & stop_pid munged & wait
}

status() {
    local name pid ok=0
    for name in $(daemons); do
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
