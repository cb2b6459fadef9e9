"""The memory a KV cache may take inside a container: the memory cgroup's room, read from
real files laid out as cgroup v2 and v1 write them."""

from __future__ import annotations

from sssd.verifier.engine.machine_probe import cgroup_room


def files(tmp_path, limit: str, usage: int, stat: str, version: int = 2):
    (tmp_path / "limit").write_text(limit + "\n")
    (tmp_path / "usage").write_text(f"{usage}\n")
    (tmp_path / "stat").write_text(stat)
    key = "inactive_file" if version == 2 else "total_inactive_file"
    return ((str(tmp_path / "limit"), str(tmp_path / "usage"), str(tmp_path / "stat"), key),)


def test_a_limit_leaves_its_room_less_what_is_used_but_droppable_page_cache(tmp_path):
    found = files(tmp_path, str(8 << 30), 3 << 30, "anon 1\ninactive_file 1073741824\n")
    assert cgroup_room(found) == (8 << 30) - (2 << 30)


def test_cgroup_v1_reads_its_own_keys_and_its_huge_no_limit(tmp_path):
    v1 = files(tmp_path, str(4 << 30), 1 << 30, "total_inactive_file 0\n", version=1)
    assert cgroup_room(v1) == 3 << 30
    unlimited = files(tmp_path, "9223372036854771712", 1 << 30, "", version=1)
    assert cgroup_room(unlimited) is None


def test_no_limit_or_no_files_means_no_bound(tmp_path):
    assert cgroup_room(files(tmp_path, "max", 1 << 30, "")) is None
    missing = ((str(tmp_path / "none"), str(tmp_path / "none"), str(tmp_path / "none"), "x"),)
    assert cgroup_room(missing) is None


def test_use_over_the_limit_leaves_no_room(tmp_path):
    assert cgroup_room(files(tmp_path, str(1 << 30), 2 << 30, "inactive_file 0\n")) == 0
