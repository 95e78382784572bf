"""slimwise/serving/shm.py on real files and a real mapping: only vLLM's segment names, only what no live
process maps, only what appeared since a snapshot (the TP engines' own cleanup is tested with real engines in
test_vllm_plugin.py and test_vllm_serve.py)."""

import mmap

from slimwise.serving import shm


def test_only_unmapped_vllm_segments_are_removed(tmp_path):
    names = [
        "vllm_dist_ab12-tp:0-[0-1]-cpushm_0",
        "vllm_dist_ab12-tp:0-[0-1]-cpushm_1",
        "psm_0f1e",
        "psm_live",
        "sem.loky-1-x",
        "notes.txt",
    ]
    for n in names:
        (tmp_path / n).write_bytes(b"\0" * 4096)
    assert shm.segments(tmp_path) == set(names[:4])
    with open(tmp_path / "psm_live", "r+b") as f, mmap.mmap(f.fileno(), 4096) as live:
        # mapped by this process
        live[0] = 1
        assert shm.mapped(tmp_path) == {"psm_live"}
        # a snapshot taken before: what it holds stays
        assert shm.remove_leftovers(since={"psm_0f1e"}, directory=tmp_path) == sorted(names[:2])
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["psm_0f1e", "psm_live", *names[4:]])
        assert shm.remove_leftovers(directory=tmp_path) == ["psm_0f1e"]
    assert shm.remove_after_exit(directory=tmp_path, timeout=5) == ["psm_live"]  # unmapped now
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(names[4:])


def test_a_missing_directory_has_no_segments(tmp_path):
    assert (
        shm.segments(tmp_path / "none") == set() and shm.remove_leftovers(directory=tmp_path / "none") == []
    )
