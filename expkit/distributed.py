"""Running under torchrun (or Slurm through submitit): the process group and who writes.

expkit starts no processes itself. torchrun (or Slurm) starts one process per device and
sets RANK / LOCAL_RANK / WORLD_SIZE; under Slurm without torchrun, SLURM_PROCID /
SLURM_LOCALID / SLURM_NTASKS and the first node of the allocation are used. The backend is
NCCL on GPUs and gloo on the CPU.
"""

from __future__ import annotations

import datetime
import os
import subprocess
from typing import Any

import torch
import torch.distributed as dist


def _from_slurm() -> None:
    """Fill torch's variables inside a submitit job (submitit_slurm or submitit_local with
    tasks_per_node > 1), or from Slurm's own under a plain srun."""
    env = os.environ
    if "WORLD_SIZE" in env:
        return
    if "SUBMITIT_EXECUTOR" in env:
        from submitit.helpers import TorchDistributedEnvironment

        job = TorchDistributedEnvironment()
        if job.world_size > 1:
            job.export(set_cuda_visible_devices=False)
        return
    if "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) < 2:
        return
    env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"] = env["SLURM_PROCID"], env["SLURM_LOCALID"], env["SLURM_NTASKS"]
    if "MASTER_ADDR" not in env:
        nodes = subprocess.run(["scontrol", "show", "hostnames", env["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
        env["MASTER_ADDR"] = nodes[0]
    env.setdefault("MASTER_PORT", str(29500 + int(env.get("SLURM_JOB_ID", "0")) % 1000))


def world_size() -> int:
    _from_slurm()
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def rank_and_world() -> tuple[int, int]:
    """(rank, number of processes) of the joined process group; (0, 1) outside one."""
    return (dist.get_rank(), dist.get_world_size()) if is_distributed() else (0, 1)


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def is_main() -> bool:
    """Rank 0, the one process that writes files (and the only one outside torchrun)."""
    return rank() == 0


def init(timeout_s: int = 1800) -> bool:
    """Join the process group when launched with more than one process; True if distributed."""
    if world_size() < 2:
        return False
    if not dist.is_initialized():
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(local_rank())
        dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=timeout_s))
    return True


def broadcast_object(value: Any) -> Any:
    """Rank 0's value, on every rank."""
    if not is_distributed():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place (a no-op in one process)."""
    if is_distributed():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def reduce_device() -> torch.device:
    """Where reductions happen: the current GPU under NCCL, else the CPU."""
    if is_distributed() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def barrier() -> None:
    if is_distributed():
        dist.barrier()
