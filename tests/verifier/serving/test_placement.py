"""Where Ray puts the prefill and decode workers: GPUs asked for exactly when the engine's device
wants them, one worker per GPU by default, a GPU device on a cluster without GPUs refused, and
on a CPU cluster of fewer than 4 CPUs no prefill worker unless asked for."""

import pytest

from sssd.verifier.serving.config import RayConfig
from sssd.verifier.serving.placement import WorkerPlan, plan_workers


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_cpu_workers_reserve_no_gpu(device):
    assert plan_workers(RayConfig(), device, 0, 16) == WorkerPlan(1, 1, 0.0)
    assert plan_workers(RayConfig(num_prefill_workers=2, num_decode_workers=3), device, 0, 16) == \
        WorkerPlan(2, 3, 0.0)


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_below_four_cpus_the_decode_worker_prefills_unless_told_otherwise(device):
    assert plan_workers(RayConfig(), device, 0, 2) == WorkerPlan(0, 1, 0.0)
    assert plan_workers(RayConfig(), device, 0, 4) == WorkerPlan(1, 1, 0.0)
    assert plan_workers(RayConfig(num_prefill_workers=1), device, 0, 2) == WorkerPlan(1, 1, 0.0)
    assert plan_workers(RayConfig(num_prefill_workers=0), device, 0, 16) == WorkerPlan(0, 1, 0.0)


def test_zero_prefill_workers_is_a_setting_and_zero_decode_workers_is_refused():
    assert plan_workers(RayConfig(num_prefill_workers=0), "cuda", 2, 2) == WorkerPlan(0, 2, 1.0)
    with pytest.raises(ValueError, match="at least one decode worker"):
        RayConfig(num_decode_workers=0)
    with pytest.raises(ValueError, match="0 or more prefill workers"):
        RayConfig(num_prefill_workers=-1)


def test_cpu_device_keeps_workers_off_the_gpus_of_the_cluster():
    assert plan_workers(RayConfig(), "cpu", 8, 16) == WorkerPlan(1, 1, 0.0)


@pytest.mark.parametrize("device", ["auto", "cuda", "cuda:1"])
@pytest.mark.parametrize("gpus,expected", [
    (8, WorkerPlan(1, 7, 1.0)),  # one worker per GPU
    (2, WorkerPlan(1, 1, 1.0)),
    (1, WorkerPlan(1, 1, 0.5)),  # a lone GPU shared by a prefill and a decode worker
])
def test_gpu_workers_get_one_gpu_each_by_default(device, gpus, expected):
    plan = plan_workers(RayConfig(), device, gpus, 16)
    assert plan == expected
    assert plan.num_workers * plan.gpus_per_worker <= gpus


def test_given_counts_share_the_gpus_evenly_when_they_outnumber_them():
    assert plan_workers(RayConfig(num_prefill_workers=2, num_decode_workers=2), "cuda", 2, 16) == \
        WorkerPlan(2, 2, 0.5)
    assert plan_workers(RayConfig(num_decode_workers=2), "cuda", 4, 16) == WorkerPlan(1, 2, 1.0)


def test_gpus_per_worker_set_explicitly_is_kept_and_checked():
    assert plan_workers(RayConfig(gpus_per_worker=0.25, num_decode_workers=3), "auto", 1, 16) == \
        WorkerPlan(1, 3, 0.25)
    with pytest.raises(ValueError, match="need more than the cluster's 1"):
        plan_workers(RayConfig(gpus_per_worker=1.0), "cuda", 1, 16)


def test_a_gpu_device_on_a_cluster_without_gpus_is_refused():
    with pytest.raises(ValueError, match="the Ray cluster has none"):
        plan_workers(RayConfig(), "cuda", 0, 16)


@pytest.mark.parametrize("values,message", [
    (dict(gpus_per_worker=0.0), r"gpus_per_worker must be in \(0, 1\]"),
    (dict(gpus_per_worker=2.0), r"gpus_per_worker must be in \(0, 1\]"),
    (dict(num_decode_workers=0), "at least one"),
])
def test_the_configuration_refuses_impossible_placements(values, message):
    with pytest.raises(ValueError, match=message):
        RayConfig(**values)
