"""Running under torchrun (or Slurm through submitit): the process group and who writes.

expkit starts no processes itself. torchrun (or Slurm) starts one process per device and
sets RANK / LOCAL_RANK / WORLD_SIZE; under Slurm without torchrun, SLURM_PROCID /
SLURM_LOCALID / SLURM_NTASKS and the address of the allocation's first node are used. The
backend is NCCL on GPUs and gloo on the CPU.

Outside torchrun (whose agents rendezvous with timeouts of their own) the group's rendezvous is
bounded: a rank that cannot reach it, or a group that does not fill, fails within
``EXPKIT_RENDEZVOUS_TIMEOUT_S`` (300 s) with one line naming the address and where it came from.
"""

from __future__ import annotations

import datetime
import importlib
import os
import re
import socket
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from expkit.core.errors import ConfigError, TaskExit

_T = TypeVar("_T")

__all__ = [
    "NODES",
    "PEERS",
    "RendezvousError",
    "agree_on_stop",
    "all_gather",
    "all_reduce_sum",
    "asked_once",
    "barrier",
    "broadcast_object",
    "cuda_index",
    "dead_ranks",
    "elastic_attempt",
    "first_problem",
    "gather_peers",
    "hold_mesh",
    "host_leader",
    "init",
    "init_or_exit",
    "is_distributed",
    "is_main",
    "leave_together",
    "local_rank",
    "peer_failure",
    "rank",
    "rank_and_world",
    "recall",
    "reduce_device",
    "remember",
    "rendezvous_timeout_s",
    "requeue_count",
    "restart_count",
    "shutdown",
    "world_info",
    "world_size",
    "writes_for_the_group",
]


class RendezvousError(ConnectionError):
    """The process group could not form within the rendezvous timeout; the message is one line."""


_ADDRESS_FROM = "MASTER_ADDR"  # where MASTER_ADDR came from, for the rendezvous's one line


def _from_slurm() -> None:
    """Fill torch's variables inside a submitit job (submitit_slurm or submitit_local with
    tasks_per_node > 1), or from Slurm's own under a plain srun."""
    global _ADDRESS_FROM
    env = os.environ
    if "WORLD_SIZE" in env:
        return
    if "SUBMITIT_EXECUTOR" in env:
        from submitit.helpers import TorchDistributedEnvironment

        job = TorchDistributedEnvironment()
        if job.world_size > 1:
            given = env.get("MASTER_ADDR")
            job.export(set_cuda_visible_devices=False, overwrite=True)  # (not overwritten, a given one raised)
            if given or "SLURM_JOB_ID" in env:  # (the user's, else an address that needs no lookup where Slurm has one)
                env["MASTER_ADDR"], _ADDRESS_FROM = _master_address(given)
        return
    if "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NTASKS"]
    env["MASTER_ADDR"], _ADDRESS_FROM = _master_address(env.get("MASTER_ADDR"))
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))


def _master_address(given: str | None) -> tuple[str, str]:
    """Where task 0 of this Slurm step listens, and where that came from: MASTER_ADDR when the user
    set it; else the address srun was started from (SLURM_LAUNCH_NODE_IPADDR) when that is task 0's
    node: srun ran in the job's batch script (ENVIRONMENT=BATCH), which Slurm runs on the
    allocation's first node, and the step spans the whole allocation, so task 0 runs there too; else
    the first node of SLURM_JOB_NODELIST, by name (srun from a login node, a step on some nodes)."""
    env = os.environ
    if given:
        return given, "MASTER_ADDR"
    launched_from = env.get("SLURM_LAUNCH_NODE_IPADDR")
    if (
        launched_from
        and env.get("ENVIRONMENT") == "BATCH"
        and env.get("SLURM_STEP_NODELIST") == env.get("SLURM_JOB_NODELIST")
    ):
        return launched_from, "SLURM_LAUNCH_NODE_IPADDR"
    return _first_node(env.get("SLURM_JOB_NODELIST", "")), "the first node of SLURM_JOB_NODELIST"


def _first_node(nodelist: str) -> str:
    """The first host of a Slurm hostlist (``gpu-[003-010,020],login`` -> ``gpu-003``), read here: scontrol
    show hostnames needs the cluster's slurm.conf, and retries for 60 s where it cannot read it."""
    first = re.split(r",(?![^\[]*\])", nodelist, maxsplit=1)[0]  # (a comma outside brackets)
    return re.sub(r"\[([^,\]-]+)[^\]]*\]", r"\1", first)


def rendezvous_timeout_s() -> float:
    """How long a rank waits for the process group to form: ``EXPKIT_RENDEZVOUS_TIMEOUT_S``, 300 s
    when unset (torchrun's own rendezvous waits 600 s for its nodes, then fails).

    Returns:
        The seconds.

    Raises:
        ConfigError: for a value that is not a positive number of seconds.
    """
    text = os.environ.get("EXPKIT_RENDEZVOUS_TIMEOUT_S", "300")
    try:
        seconds = float(text)
    except ValueError:
        seconds = 0.0
    if not seconds > 0 or seconds == float("inf"):
        raise ConfigError(f"EXPKIT_RENDEZVOUS_TIMEOUT_S must be a positive number of seconds, got {text!r}; e.g. 300")
    return seconds


def world_size() -> int:
    """The number of processes launched, from ``WORLD_SIZE`` (filled from Slurm's variables first when
    running under Slurm without torchrun); 1 when not set.

    Returns:
        The launched world size; the process group need not be joined yet.
    """
    _from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


def restart_count() -> int:
    """How many times torchrun (--max-restarts) has restarted this group; 0 outside torchrun.
    Known once the group has formed (``init``): with several nodes, an agent whose own workers
    did not fail restarts them without counting, so its count is not the group's.

    Returns:
        The group's attempt number as agreed in ``init``, else ``TORCHELASTIC_RESTART_COUNT``, else 0.
    """
    if _ATTEMPT is not None:
        return _ATTEMPT
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


_ATTEMPT: int | None = None  # the group's attempt under torchrun, agreed by every rank in init


def requeue_count() -> int:
    """How many times Slurm has requeued this job (preemption, or submitit's requeue at a
    timeout): ``SLURM_RESTART_COUNT``; 0 outside Slurm and on a job's first start.

    Returns:
        ``SLURM_RESTART_COUNT`` as an int; 0 when it is unset or empty.
    """
    return int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)


def rank() -> int:
    """This process's rank: the joined group's, else ``RANK`` (filled from ``SLURM_PROCID`` under a plain
    srun; 0 when not set).

    Returns:
        The rank.
    """
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    _from_slurm()  # (a plain srun: RANK comes from SLURM_PROCID)
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """This process's rank on its node: ``LOCAL_RANK`` (filled from Slurm's ``SLURM_LOCALID`` under a
    plain srun; 0 when not set).

    Returns:
        The local rank, the index of the GPU this process uses.
    """
    _from_slurm()
    return int(os.environ.get("LOCAL_RANK", "0"))


def cuda_index() -> int:
    """The index of this process's GPU among those it sees: its local rank when it sees every GPU of
    the node, 0 when it sees one (Slurm's ``--gpus-per-task=1``, ``--gpu-bind=single:1``, or cgroups
    that hide the others: each task's own GPU is its device 0).

    Returns:
        The CUDA device index to use.

    Raises:
        ConfigError: when the process sees several GPUs but fewer than its local rank needs.
    """
    index, visible = local_rank(), torch.cuda.device_count()
    if visible == 1:
        return 0
    if index >= visible:
        raise ConfigError(
            f"local rank {index} sees {visible} GPUs (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}): "
            "start one process per GPU (torchrun --nproc_per_node, Slurm's --ntasks-per-node) or give each "
            "task its own GPU (--gpus-per-task=1)"
        )
    return index


def rank_and_world() -> tuple[int, int]:
    """(rank, number of processes) of the joined process group; (0, 1) outside one.

    Returns:
        (rank, world size), or (0, 1) when no group of more than one process is joined.
    """
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def is_distributed() -> bool:
    """Whether this process has joined a process group of more than one process.

    Returns:
        True when torch.distributed is available and initialised with a world size above 1.
    """
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main() -> bool:
    """Rank 0, the one process that writes files (and the only one outside torchrun).

    Returns:
        True when ``rank()`` is 0.
    """
    return rank() == 0


def init_or_exit() -> bool:
    """``init()`` at a command's start: a group that cannot form, or a rendezvous setting it refuses,
    is one ``Error:`` line on stderr and the command's exit, not a traceback (nothing is written yet).

    Returns:
        What ``init`` returns.

    Raises:
        TaskExit: with status 2 for a bad setting (``EXPKIT_RENDEZVOUS_TIMEOUT_S``), 1 when no group formed.
    """
    try:
        return init()
    except (ConfigError, RendezvousError) as exc:
        print(f"Error: {exc}", file=sys.stderr)
        raise TaskExit(2 if isinstance(exc, ConfigError) else 1) from None  # (its status kept: exit_status)


def init(timeout_s: int = 1800) -> bool:
    """Join the process group when launched with more than one process; True if distributed.

    Args:
        timeout_s: the collectives' timeout, in seconds.

    Returns:
        True when launched with more than one process (the group is joined, or was already); False
        for a single process, which joins nothing.
    """
    if world_size() < 2:
        return False
    if not dist.is_initialized():
        # torch.distributed.nn.functional binds `group=group.WORLD` as default arguments when it is
        # imported: imported after the group is joined (torch imports it lazily, through torch._dynamo,
        # when the first optimizer is built), its functions hold the world group for the life of the
        # process, past destroy_process_group, into the interpreter's teardown, where gloo's threads
        # abort it (see shutdown). Imported first (3 ms), they hold None: the default group at each call.
        importlib.import_module("torch.distributed.nn")

        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(cuda_index())
        backend, timeout = "nccl" if cuda else "gloo", datetime.timedelta(seconds=timeout_s)
        if (
            "TORCHELASTIC_RESTART_COUNT" in os.environ
            and os.environ.get("MASTER_ADDR")
            and os.environ.get("MASTER_PORT")
        ):
            # torchrun --max-restarts keeps one store across attempts: the group's keys of an earlier
            # attempt (peers' addresses) would be read by the next one (gloo "connectFullMesh" fails);
            # each attempt gets keys of its own
            global _ELASTIC_STORE, _ATTEMPT
            store, rank_, world = next(dist.rendezvous("env://", timeout=timeout))
            _ELASTIC_STORE = store
            prefix, _ATTEMPT = elastic_attempt(store, world)
            store = dist.PrefixStore(prefix, store)
            dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)
        else:
            _rendezvous(backend, timeout)
        gather_peers()
        global _CONTROL
        # small decisions (stop or not) go over gloo on the CPU: no device sync in the loop
        _CONTROL = dist.new_group(backend="gloo") if backend == "nccl" else None
    return True


_ELASTIC_STORE: Any = None  # torchrun's store, the same across its restarts (None outside torchrun)


def elastic_attempt(store: Any, world: int) -> tuple[str, int]:
    """The key prefix of this torchrun attempt's process group in torchrun's store, and the group's
    attempt number. Every worker of one attempt gets the same pair, and no two attempts share a
    prefix, also when the world size changes between them (``--nnodes=1:2``, a node that joins, or
    one that leaves while the node of the store stays).

    The workers count themselves in the store, per world size, and the n-th `world` of them form one
    attempt: with several agents (nodes) only the agent whose worker failed counts a restart in
    ``TORCHELASTIC_RESTART_COUNT``, and a membership change counts nothing. Counting per world size
    keeps the workers of one attempt together when an earlier attempt had another size (one count
    over all sizes would split 2 + 4 workers as 2, 2+2). With one agent the count is also kept per
    ``TORCHELASTIC_RESTART_COUNT``, exact there: a worker that died before joining would otherwise
    shift it (with several agents it does: a start-up crash). The first worker of an attempt numbers
    it from a count of attempts kept in the store, whatever the number of agents.

    Args:
        store: torchrun's store (``dist.rendezvous("env://")``'s).
        world: this attempt's number of workers.

    Returns:
        (the prefix, the attempt number: 0 for the first).
    """
    namespace = f"expkit/w{world}"
    if int(os.environ.get("GROUP_WORLD_SIZE", "1")) <= 1:
        namespace += f"/r{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    joined = store.add(f"{namespace}/joined", 1) - 1
    prefix = f"{namespace}/attempt_{joined // world}/"
    if joined % world == 0:  # the attempt's first worker numbers it
        store.set(f"{prefix}number", str(store.add("expkit/attempts", 1) - 1))
    return prefix, int(store.get(f"{prefix}number"))  # (waits for that worker, within the store's timeout)


def _rendezvous(backend: str, timeout: datetime.timedelta) -> None:
    """Form the group through rank 0's store at MASTER_ADDR:MASTER_PORT, within the rendezvous
    timeout. torch's own env:// rendezvous waits the collectives' timeout (30 min) and, for a name
    that does not resolve or an address where nothing listens, prints only its retries' warnings:
    here the name is looked up and the address tried first, in Python, quietly, until the deadline.

    Raises:
        RendezvousError: one line naming the address, where it came from and what failed.
    """
    address, port, rank_, world = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), rank(), world_size()
    wait_s = rendezvous_timeout_s()
    deadline = time.monotonic() + wait_s
    failed = f"rank {rank_} of {world}: no rendezvous at {address}:{port} (from {_ADDRESS_FROM}) within {wait_s:g} s"
    advice = "set MASTER_ADDR to the address of rank 0's node, or EXPKIT_RENDEZVOUS_TIMEOUT_S to wait longer"
    host = _resolve(address, port, deadline)
    if host is None:
        raise RendezvousError(f"{failed}: the name {address!r} does not resolve; {advice}")
    if rank_ > 0 and not _answers(host, port, deadline):
        raise RendezvousError(f"{failed}: nothing answered there; {advice}")
    try:
        left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
        store = dist.TCPStore(host, port, world, rank_ == 0, timeout=left)
        dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)
    except dist.DistError as exc:  # (rank 0 waited for ranks that never came; a rank's peer left)
        said = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RendezvousError(f"{failed}: not every rank joined ({said}); {advice}") from None
    store.set_timeout(timeout)  # formed: the group's later uses of the store (new groups) wait as collectives do
    global _JOINED_AT
    _JOINED_AT = f"{address}:{port} from {_ADDRESS_FROM}"


def _resolve(address: str, port: int, deadline: float) -> str | None:
    """`address` as an IP address (IPv4 first), retried until `deadline` (a name server may be slow to
    know a new node); None when it never resolved."""
    while True:
        try:
            found = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)
            return min(found, key=lambda entry: entry[0] != socket.AF_INET)[4][0]
        except socket.gaierror:
            if time.monotonic() >= deadline:
                return None
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))


def _answers(host: str, port: int, deadline: float) -> bool:
    """Whether something listens at host:port (rank 0's store) before `deadline`: rank 0 may start later."""
    while True:
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic()))):
                return True
        except OSError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))


def remember(key: str, value: str) -> None:
    """Keep `value` in torchrun's store for the restarts of this torchrun (and nowhere on disk):
    the store lives as long as the torchrun agents do, and holds nothing of another torchrun.

    Args:
        key: the name to keep it under (prefixed with ``expkit/`` in the store).
        value: the value; nothing is kept outside torchrun.
    """
    if _ELASTIC_STORE is not None:
        _ELASTIC_STORE.set(f"expkit/{key}", value)


def recall(key: str) -> str | None:
    """What an earlier attempt of this torchrun `remember`ed under `key`; None when nothing was.

    Args:
        key: the name given to ``remember``.

    Returns:
        The remembered value, or None outside torchrun or when nothing was remembered under `key`.
    """
    if _ELASTIC_STORE is None or not _ELASTIC_STORE.check([f"expkit/{key}"]):
        return None
    return _ELASTIC_STORE.get(f"expkit/{key}").decode("utf-8")


_MESHES: list[Any] = []  # the DeviceMeshes expkit made (FSDP2's), held until shutdown releases them


def hold_mesh(mesh: Any) -> Any:
    """Keep `mesh` (a DeviceMesh expkit made) until ``shutdown``, which lets it go before the
    process groups are destroyed.

    Args:
        mesh: the mesh.

    Returns:
        `mesh`.
    """
    _MESHES.append(mesh)
    return mesh


def shutdown() -> None:
    """Leave the process group before the interpreter exits, and let every process group object
    go while the interpreter still runs. A group object destroyed in the interpreter's
    teardown aborts the process: its gloo threads, unwound there as Python ends them, call
    std::terminate ("terminate called without an active exception", SIGABRT after a completed
    run, which torchrun reports as failed or restarts). DDP's reducer and FSDP's state kept
    groups alive past ``destroy_process_group``, in reference cycles with the runner, frozen out
    of the collector's sight by ``train._freeze_heap``: they are collected here first. The meshes
    expkit made (``hold_mesh``) still hold their groups, and torch's DTensor caches hold the
    meshes for the life of the process: ``_release_groups`` lets each held mesh's groups go
    (with the mesh kept past the group's destruction, 20 of 25 two-rank gloo runs aborted here;
    ``tests/distributed/test_process_exit.py`` checks that no group is left at exit)."""
    global _CONTROL
    _CONTROL = None
    if dist.is_available() and dist.is_initialized():
        import contextlib
        import gc

        gc.unfreeze()
        gc.collect()
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    for mesh in _MESHES:
        _release_groups(mesh)
    _MESHES.clear()


def _release_groups(mesh: Any) -> None:
    """The one place expkit reads a torch internal, because torch has no public way to do it:
    a DeviceMesh keeps its process groups in ``_pg_registry`` (a name -> group cache, unused once
    the groups are destroyed) and offers no call that drops them (checked on torch 2.9 to 2.15),
    while the DTensor caches keep the mesh itself. Only meshes expkit made are touched; a torch
    without the registry holds no group there, and nothing is done."""
    registry = getattr(mesh, "_pg_registry", None)
    if isinstance(registry, dict):
        registry.clear()


_CONTROL: Any = None  # the CPU process group for control messages (None: the default group is gloo)
# the stop codes ranks agree on, weakest first: a stop to be continued (the time limit near, a search's
# storage out of reach) outranks a plain one, so that every rank skips the test pass that rank 0 skips
STOP_NONE, STOP_REQUESTED, STOP_RESUMABLE, STOP_SIGNAL = 0, 1, 2, 3


def agree_on_stop(code: int) -> int:
    """The strongest stop any rank has (a signal > a resumable stop > a requested one > none), on every rank:
    ranks stop after the same iteration (a stop taken alone would leave the others in a
    collective: FSDP's gather, DDP's all-reduce, the checkpoint's save).

    Args:
        code: this rank's stop code: ``STOP_NONE``, ``STOP_REQUESTED``, ``STOP_RESUMABLE`` (an
            interruption to be continued), or ``STOP_SIGNAL`` plus the signal's number (the ranks
            learn which signal; of two, the higher number wins).

    Returns:
        The largest code over all ranks; `code` itself in one process.
    """
    global _CONTROL
    if not is_distributed():
        return code
    if _CONTROL is None and dist.get_backend() == "nccl":  # a group the user's code joined: its gloo side group now
        _CONTROL = dist.new_group(backend="gloo")  # (every rank gets here at the same first check)
    flag = torch.tensor([code], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=_CONTROL)
    return int(flag)


# -- who is who, to say which rank died ------------------------------------------------------------
PEERS: list[tuple[str, int]] = []  # (host, pid) of every rank, by rank; gathered when the group forms
NODES: list[str] = []  # the node of every rank, by rank (Slurm's name for it, else its host name)


def gather_peers() -> None:
    global PEERS, NODES
    if is_distributed():
        peers: list[Any] = [None] * dist.get_world_size()
        node = os.environ.get("SLURMD_NODENAME") or socket.gethostname()  # (Slurm's nodes may share a host)
        dist.all_gather_object(peers, (socket.gethostname(), os.getpid(), node))
        PEERS = [(host, pid) for host, pid, _ in peers]
        NODES = [node for *_, node in peers]


def host_leader() -> int:
    """The lowest rank on this rank's host (by the hosts gathered when the group formed): the one that
    fills a cache in the host's own temporary dir for the others.

    Returns:
        That rank; 0 outside a group.
    """
    if not is_distributed() or not PEERS:
        return 0
    here = socket.gethostname()
    return next(r for r, (host, _) in enumerate(PEERS) if host == here)


def all_gather(value: Any) -> list[Any]:
    """Every rank's `value`, by rank, on every rank (collective).

    Args:
        value: this rank's value; picklable.

    Returns:
        The list of every rank's value; ``[value]`` in one process.
    """
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def world_info() -> dict[str, Any]:
    """The group's shape, for the run's records: ``world_size``, ``nodes`` (in the order of their
    first rank), ``processes_per_node``, and ``rendezvous`` (the address and where it came from)
    where expkit formed the group; empty outside a group (or before it formed).

    Returns:
        The entries, or an empty dict.
    """
    if not NODES:
        return {}
    nodes = list(dict.fromkeys(NODES))
    info = {"world_size": len(NODES), "nodes": nodes, "processes_per_node": {n: NODES.count(n) for n in nodes}}
    return {**info, "rendezvous": _JOINED_AT} if _JOINED_AT else info


_JOINED_AT = ""  # the rendezvous expkit formed the group at ("127.0.0.1:29545 from SLURM_LAUNCH_NODE_IPADDR")


def _pid_gone(pid: int) -> bool:
    """A PID that no longer runs (a zombie waiting for torchrun to reap it counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return False


def dead_ranks() -> list[tuple[int, int]]:
    """(rank, pid) of the ranks on this host whose process is gone.

    Returns:
        (rank, pid) of each rank recorded in ``PEERS`` on this host, other than this process, whose
        process no longer runs (or is a zombie).
    """
    host = socket.gethostname()
    return [(r, pid) for r, (h, pid) in enumerate(PEERS) if h == host and pid != os.getpid() and _pid_gone(pid)]


_CAUSES = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "connection refused",
    "socket closed",
)


def peer_failure(exc: BaseException) -> str | None:
    """One line for a collective that failed because another rank died or stopped answering
    (gloo / NCCL errors are walls of text naming an address, not a rank); None for other errors.

    Args:
        exc: the error a collective (or anything else) raised.

    Returns:
        A line naming the dead ranks on this host (or saying that another rank stopped answering) and
        the cause; None when no peers were gathered or `exc` is not the process group's error.
    """
    if not PEERS:
        return None
    text = str(exc).lower()
    if not isinstance(exc, getattr(dist, "DistError", ())) and not any(k in text for k in ("gloo", "nccl", "c10d")):
        return None  # not the process group's error (a DataLoader timeout, a logger's connection...)
    cause = next((c for c in _CAUSES if c in text), None)
    import time

    dead: list[tuple[int, int]] = []
    for _ in range(20):  # the dying peer may take a moment to be gone after its sockets closed
        dead = dead_ranks()
        if dead:
            break
        time.sleep(0.05)
    cause = cause or "lost contact"
    if dead:
        return "; ".join(f"rank {r} (pid {pid}) died" for r, pid in dead) + f": {cause}"
    return f"another rank stopped answering: {cause}"


def writes_for_the_group() -> bool:
    """Whether this rank writes the run's last records: rank 0, or after rank 0 died, the
    lowest rank still alive on its host (so a crash of rank 0 still leaves a result.json).

    Returns:
        True on rank 0, or on the lowest rank still alive on this host after rank 0 (on this host) died.
    """
    if is_main():
        return True
    gone = {r for r, _ in dead_ranks()}
    return 0 in gone and all(r in gone for r in range(rank()))


def broadcast_object(value: Any) -> Any:
    """Rank 0's value, on every rank.

    Args:
        value: this rank's value; only rank 0's is used. It must be picklable.

    Returns:
        Rank 0's value; `value` itself in one process.
    """
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def asked_once(ask: Callable[[bool], _T]) -> _T:
    """One question for the whole group, asked by rank 0: a scheduler's (``scontrol show job``) is
    asked once per job, not once per rank (a 512-rank job would send slurmctld 512 at once).

    Every rank must call it at the same point (a collective, over the CPU group of control
    messages). A rank that cannot get rank 0's answer (rank 0 gone: a failed node) asks itself.

    Args:
        ask: the question; called as ``ask(True)`` on rank 0 (the one that acts on the answer:
            requeues a job) and, only when rank 0's answer does not come, ``ask(False)`` on another rank.
            Its answer must be picklable.

    Returns:
        Rank 0's answer, on every rank; ``ask(True)`` in one process.
    """
    global _CONTROL
    if not is_distributed():
        return ask(True)
    if _CONTROL is None and dist.get_backend() == "nccl":  # (a group the user's code joined: see agree_on_stop)
        _CONTROL = dist.new_group(backend="gloo")  # (gloo raises when a peer is gone; NCCL may hang)
    answer = ask(True) if is_main() else None
    box = [answer]
    try:
        dist.broadcast_object_list(box, src=0, group=_CONTROL)
    except Exception:  # (a peer gone, its connection closed: the group cannot answer)
        return answer if is_main() else ask(False)  # type: ignore[return-value]
    return box[0]  # type: ignore[return-value]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (a no-op in one process).

    Args:
        tensor: the tensor to sum, on ``reduce_device()``; changed in place.

    Returns:
        `tensor`, holding the sum over ranks.
    """
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def reduce_device() -> torch.device:
    """Where reductions happen: the current GPU under NCCL, else the CPU.

    Returns:
        The current CUDA device when the group's backend is NCCL, else the CPU.
    """
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if is_distributed():
        dist.barrier()


def first_problem(problem: str | None) -> tuple[int, str] | None:
    """Every rank's outcome of the same step, on every rank (collective): the lowest rank's problem
    with that rank, or None when no rank had one; this rank's own `problem` outside a group.

    Args:
        problem: what went wrong on this rank, or None.

    Returns:
        ``(rank, problem)`` of the lowest rank that had one, or None.
    """
    if not is_distributed():
        return None if problem is None else (0, problem)
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, problem)
    return next(((k, what) for k, what in enumerate(outcomes) if what is not None), None)


def leave_together() -> None:
    """At a run's end, on every rank: return once every rank has come here. Rank 0 comes last as a
    rule, after its final save, the run's records and a requeue: a rank above 0 that left at once would
    exit, with 143 or 138 after a signal, while rank 0 still writes, and torchrun's agent or
    ``srun --kill-on-bad-exit`` would then end rank 0 mid-save, before its ``scontrol requeue``.
    The wait is on the CPU group of control messages; a rank that died instead ends it for the
    others (its connections close), and so does the group's own timeout. Nothing outside a group.
    """
    if not is_distributed():
        return
    import contextlib

    if _CONTROL is None and dist.get_backend() == "nccl":
        return  # (no training iteration ran, which makes the gloo side group: no final save to wait for)
    with contextlib.suppress(Exception):  # (a rank gone: nothing left to wait for)
        dist.barrier(group=_CONTROL)
