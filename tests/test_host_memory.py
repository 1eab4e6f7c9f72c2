"""shared/host_memory.py on written /proc and cgroup trees (v1 and v2): the host's MemAvailable, a lower cgroup limit
less its working set, the least of several levels, and the OOM-kill counters; then on this host's own files."""

from pathlib import Path

from shared.host_memory import cgroup_folders, oom_kill_count, read_host_memory

GIB = 2**30
MEMINFO = "MemTotal:       24683772 kB\nMemFree:        22808460 kB\nMemAvailable:   20971520 kB\n"  # 20 GiB


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def proc_with(tmp_path: Path, cgroup_line: str, vmstat: str = "oom_kill 3\n") -> Path:
    proc = tmp_path / "proc"
    write(proc / "meminfo", MEMINFO)
    write(proc / "self" / "cgroup", cgroup_line)
    write(proc / "vmstat", vmstat)
    return proc


def test_without_a_limit_the_host_offers_its_memavailable(tmp_path):
    proc = proc_with(tmp_path, "4:memory:/job\n0::/\n")
    root = tmp_path / "cgroup"
    write(root / "memory" / "job" / "memory.limit_in_bytes", "9223372036854771712\n")
    write(root / "memory" / "job" / "memory.usage_in_bytes", str(GIB))
    found = read_host_memory(proc, root)
    assert found.available == 20 * GIB and found.source == "the host's MemAvailable"


def test_a_cgroup_v1_limit_less_its_working_set_wins_where_lower(tmp_path):
    proc = proc_with(tmp_path, "9:name=systemd:/\n4:memory:/outer/inner\n")
    root = tmp_path / "cgroup"
    inner, outer = root / "memory" / "outer" / "inner", root / "memory" / "outer"
    write(inner / "memory.limit_in_bytes", str(16 * GIB))
    write(inner / "memory.usage_in_bytes", str(2 * GIB))
    write(inner / "memory.stat", f"cache 1\ntotal_inactive_file {GIB}\n")
    write(outer / "memory.limit_in_bytes", str(8 * GIB))  # the level above limits more: it decides
    write(outer / "memory.usage_in_bytes", str(3 * GIB))
    write(outer / "memory.stat", f"total_inactive_file {GIB // 2}\n")
    write(outer / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 0\n")
    write(inner / "memory.oom_control", "oom_kill_disable 0\nunder_oom 0\noom_kill 2\n")
    found = read_host_memory(proc, root)
    assert found.available == 8 * GIB - (3 * GIB - GIB // 2)
    assert str(outer) in found.source and "limit 8.0 GiB" in found.source
    assert cgroup_folders((proc / "self" / "cgroup").read_text(), root) == [inner, outer, root / "memory"]
    assert oom_kill_count(proc, root) == 2  # the process's own cgroup, not the host's 3


def test_a_cgroup_v2_limit_and_its_events(tmp_path):
    proc = proc_with(tmp_path, "0::/user.slice/job.scope\n")
    root = tmp_path / "cgroup"
    scope = root / "user.slice" / "job.scope"
    write(scope / "memory.max", str(4 * GIB))
    write(scope / "memory.current", str(GIB))
    write(scope / "memory.stat", f"anon 1\ninactive_file {GIB // 4}\n")
    write(scope / "memory.events", "low 0\nhigh 0\nmax 4\noom 1\noom_kill 1\n")
    write(root / "user.slice" / "memory.max", "max\n")
    write(root / "user.slice" / "memory.current", str(5 * GIB))
    found = read_host_memory(proc, root)
    assert found.available == 4 * GIB - (GIB - GIB // 4)
    assert oom_kill_count(proc, root) == 1


def test_a_namespaced_cgroup_path_the_mount_lacks_falls_back_to_the_mount(tmp_path):
    """In a container the cgroup namespace shows the process's own cgroup as the mount's root."""
    proc = proc_with(tmp_path, "0::/kubepods/pod1/abc\n")
    root = tmp_path / "cgroup"
    write(root / "memory.max", str(2 * GIB))
    write(root / "memory.current", str(GIB // 2))
    assert read_host_memory(proc, root).available == 2 * GIB - GIB // 2
    assert oom_kill_count(proc, root) == 3  # no memory.events there: the host's /proc/vmstat


def test_no_meminfo_means_unknown(tmp_path):
    assert read_host_memory(tmp_path / "nothing", tmp_path) is None


def test_this_host_reads():
    found = read_host_memory()
    meminfo = Path("/proc/meminfo")
    if meminfo.exists():
        available = int(next(line for line in meminfo.read_text().splitlines()
                             if line.startswith("MemAvailable")).split()[1]) * 1024
        assert 0 < found.available <= available * 1.05, found
