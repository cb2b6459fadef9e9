"""How many prefill and decode workers Ray starts, and the GPUs each reserves.

A pure function of the configuration and of the GPUs the cluster reports, so it is tested
without Ray. The engine's `device` decides whether the workers want GPUs: `cuda`/`cuda:N` always
(and a cluster without GPUs is an error), `auto` when the cluster has some, `cpu` never. With
GPUs and no worker counts given, every GPU gets one worker: one prefill worker and the rest
decode (a lone GPU is shared by one of each, half a GPU each). Ray gives each worker actor its
GPUs through CUDA_VISIBLE_DEVICES, so inside a worker the device is plain `cuda`
(ray_workers.py).

On CPUs with no prefill count given, a cluster of fewer than MIN_CPUS_TO_DISAGGREGATE CPUs gets
no prefill worker: its decode worker prefills its own prompts inside its decode steps, as the
single-process engine does, on every core. A prefill worker there would take cores that the
decode steps need and give back only the overlap of prefill with decoding: on 2 cores the decode
worker alone on both cores served more output tokens/s than a prefill worker and a decode
worker of a core each (bench/results/2026-11-28-epyc-3). It also holds one copy of the model
fewer.
"""

from __future__ import annotations

from dataclasses import dataclass

from sssd.common.model.device import is_gpu_setting
from sssd.verifier.serving.config import RayConfig

# The fewest CPUs in a cluster for which unset counts give CPU workers a prefill worker of their
# own (below: the decode workers prefill; see the module docstring). Measured on 2 cores only;
# 4 leaves a prefill worker and a decode worker two cores each.
MIN_CPUS_TO_DISAGGREGATE = 4


@dataclass(frozen=True)
class WorkerPlan:
    num_prefill_workers: int
    num_decode_workers: int
    gpus_per_worker: float  # Ray num_gpus of every worker actor; 0: CPU workers

    @property
    def num_workers(self) -> int:
        return self.num_prefill_workers + self.num_decode_workers


def plan_workers(config: RayConfig, device: str, cluster_gpus: float,
                 cluster_cpus: float) -> WorkerPlan:
    """The workers for an engine on `device` (EngineConfig.device) in a cluster that reports
    `cluster_gpus` GPUs and `cluster_cpus` CPUs. Raises ValueError when the device asks for GPUs
    the cluster lacks."""
    wants_gpus = is_gpu_setting(device) or (device == "auto" and cluster_gpus > 0) or \
        config.gpus_per_worker is not None  # RayConfig keeps it in (0, 1]
    if not wants_gpus:
        num_prefill = config.num_prefill_workers
        if num_prefill is None:
            num_prefill = 1 if cluster_cpus >= MIN_CPUS_TO_DISAGGREGATE else 0
        return WorkerPlan(num_prefill, config.num_decode_workers or 1, 0.0)
    if cluster_gpus <= 0:
        raise ValueError(f"device {device!r} puts the workers on GPUs, and the Ray cluster has "
                         "none; use --device cpu or auto, or join a cluster with GPU nodes")
    whole_gpus = int(cluster_gpus)
    num_prefill = 1 if config.num_prefill_workers is None else config.num_prefill_workers
    num_decode = config.num_decode_workers or max(1, whole_gpus - num_prefill)
    gpus = config.gpus_per_worker
    if gpus is None:  # one GPU each where there are enough, else an even share
        gpus = 1.0 if num_prefill + num_decode <= cluster_gpus \
            else cluster_gpus / (num_prefill + num_decode)
    if gpus * (num_prefill + num_decode) > cluster_gpus + 1e-9:
        raise ValueError(f"{num_prefill} prefill + {num_decode} decode workers x {gpus:g} "
                         f"GPUs need more than the cluster's {cluster_gpus:g}")
    return WorkerPlan(num_prefill, num_decode, gpus)
