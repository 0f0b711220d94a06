"""`tandem bench soak`: RSS sampling and its analysis exactly; a 20-second smoke run on the tiny model."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks.bench_soak import Restart, SoakRequest, markdown, summarize
from benchmarks.rss import RssReading, RssSample, RssSampler, parse_rss, parse_vmrss_kib, read_rss_kib, rss_growth
from tandem_cli.cli import main

STATUS = ("Name:\tpython\nState:\tS (sleeping)\nVmPeak:\t  900000 kB\nVmRSS:\t  123456 kB\n"
          "RssAnon:\t  100000 kB\nRssFile:\t   3456 kB\nRssShmem:\t  20000 kB\nThreads:\t4\n")


def test_parse_vmrss() -> None:
    assert parse_vmrss_kib(STATUS) == 123456
    assert parse_vmrss_kib("Name:\tzombie\nState:\tZ (zombie)\n") is None
    assert parse_rss(STATUS) == RssReading(123456, 100000, 20000)
    assert parse_rss("VmRSS:\t 10 kB\n") == RssReading(10, 0, 0)  # an old kernel without the parts


def test_shared_memory_shows_in_rssshmem() -> None:
    import mmap

    from benchmarks.rss import read_rss

    before = read_rss(os.getpid())
    with mmap.mmap(-1, 64 * 2**20, flags=mmap.MAP_SHARED) as shared:
        shared.write(b"x" * (64 * 2**20))  # touch every page
        during = read_rss(os.getpid())
    assert before is not None and during is not None
    assert during.shmem_kib - before.shmem_kib >= 60 * 1024


def test_read_rss_of_this_process_and_of_a_gone_one(tmp_path: Path) -> None:
    assert (read_rss_kib(os.getpid()) or 0) > 1024  # this Python holds more than 1 MiB
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "status").write_text(STATUS)
    assert read_rss_kib(42, proc_root=tmp_path) == 123456
    assert read_rss_kib(43, proc_root=tmp_path) is None  # exited between listing and reading


def test_sampler_follows_a_restarted_process_and_skips_gone_ones() -> None:
    pids = {"gateway": 10, "decode-0": 20}
    rss = {pid: RssReading(kib, kib // 2, 0) for pid, kib in {10: 1000, 20: 2000, 21: 500}.items()}
    sampler = RssSampler(lambda: dict(pids), interval_s=60.0, read=rss.get)
    sampler.sample_once()
    pids["decode-0"] = 21  # restarted
    pids["prefill-0"] = 30  # listed, but gone before it is read
    sampler.sample_once()
    assert [(s.process, s.pid, s.rss_kib) for s in sampler.samples] == [
        ("decode-0", 20, 2000), ("gateway", 10, 1000), ("decode-0", 21, 500), ("gateway", 10, 1000)]


def test_sampler_thread_samples_until_stopped() -> None:
    sampler = RssSampler(lambda: {"me": os.getpid()}, interval_s=0.05).start()
    time.sleep(0.3)
    samples = sampler.stop()
    assert len(samples) >= 3 and {s.pid for s in samples} == {os.getpid()}
    assert [s.t_s for s in samples] == sorted(s.t_s for s in samples)
    with pytest.raises(ValueError, match="interval_s"):
        RssSampler(dict, interval_s=0)


def _series(process: str, pid: int, mib: list[float], t0: float = 0.0) -> list[RssSample]:
    return [RssSample(t0 + i, process, pid, int(m * 1024)) for i, m in enumerate(mib)]


def test_growth_after_warmup_uses_quartile_medians() -> None:
    # Warm-up (t < 4) climbs from 100 to 400 MiB; then flat around 400, except a late climb in "leaky".
    flat = _series("flat", 1, [100, 200, 300, 350, 400, 404, 398, 402, 400, 401, 399, 403])
    leaky = _series("leaky", 2, [100, 200, 300, 350, 400, 400, 420, 440, 460, 480, 500, 520])
    by_name = {g.process: g for g in rss_growth(flat + leaky, warmup_s=4.0)}
    assert by_name["flat"].num_samples == 8
    assert (by_name["flat"].start_mib, by_name["flat"].end_mib, by_name["flat"].peak_mib) == (402, 401, 404)
    assert by_name["flat"].flat() and abs(by_name["flat"].growth_pct) < 1
    assert (by_name["leaky"].start_mib, by_name["leaky"].end_mib) == (400, 510)
    assert by_name["leaky"].growth_pct == pytest.approx(27.5) and not by_name["leaky"].flat()


def test_growth_judges_a_restarted_process_by_its_new_pid_only() -> None:
    before = _series("decode-0", 7, [900, 950, 1000])  # killed at its peak
    after = _series("decode-0", 8, [300, 310, 320, 320, 320, 320], t0=10.0)
    (g,) = rss_growth(before + after, warmup_s=2.0)
    assert (g.pid, g.num_samples, g.start_mib, g.end_mib, g.peak_mib) == (8, 4, 320, 320, 320)
    # No sample after the warm-up: judged on all of its latest pid's samples.
    (short,) = rss_growth(_series("x", 1, [10, 20]), warmup_s=100.0)
    assert (short.num_samples, short.start_mib, short.end_mib) == (2, 10, 20)


def test_failures_while_the_node_was_down_are_listed_apart() -> None:
    restart = Restart("decode-0", killed_at_s=10.0, serving_again_at_s=20.0)
    records = [SoakRequest(1, 2, "OK", False, 5), SoakRequest(1, 2, "CANCELLED", True, 1),
               SoakRequest(8, 11, "UNAVAILABLE", False, 3),  # in flight at the kill
               SoakRequest(21, 22, "UNAVAILABLE", False, 0),  # just after it came back
               SoakRequest(30, 31, "INTERNAL", False, 0),  # long after: a real failure
               SoakRequest(3, 4, "CANCELLED", False, 0)]  # not cancelled by the client: a failure
    summary = summarize(records, restart)
    assert summary == {"total": 6, "ok": 1, "cancelled": 1, "failed": 4, "failed_outside_restart": 2,
                       "failed_codes": {"UNAVAILABLE": 2, "INTERNAL": 1, "CANCELLED": 1}, "output_tokens": 9}
    assert not Restart("decode-0").covers(records[2])  # no kill: nothing is excused


@pytest.mark.e2e
def test_soak_smoke_run_on_the_tiny_model(tiny_served_model_dir: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    """20 seconds of load against 1 prefill + 1 decode node with small pools over a shared offload tier (one
    directory for both), decode-0 killed at 10 s: it is restarted and serves again, nothing leaks (blocks,
    requests, tier files), the tier served prefix hits, only requests around the restart fail, every process has
    RSS samples, and the KV-event subscriber (cut at 5 s) ends with 0 drift."""
    code = main(["bench", "soak", "--minutes", str(20 / 60), "--model", str(tiny_served_model_dir), "--dtype",
                 "float32", "--prefill-nodes", "1", "--decode-nodes", "1", "--concurrency", "4", "--num-blocks",
                 "64", "--kv-offload", "shared", "--kv-offload-gb", "0.05", "--restart-node", "decode-0",
                 "--sample-interval-s", "1", "--out-dir", str(tmp_path)])
    result = json.loads((tmp_path / "soak.json").read_text())
    assert code == 0, result["requests"]
    assert result["restart"]["serving_again_at_s"] is not None
    assert result["leaked_blocks"] == 0 and result["leaked_requests"] == 0
    # A pool of 64 blocks under the shared prefixes: blocks went to the tier and came back from it, and no tier
    # file is left (decode-0's, SIGKILLed, included: its restart found its lock free and removed its files).
    assert result["offload_hits"] > 0 and result["tier_files_left"] == []
    # The KV-event subscriber, cut at 5 s and through decode-0's restart, ends exact: 0 drift on every node.
    kv = result["kv_events"]
    assert kv["drift_blocks"] == 0 and kv["exact"], kv
    assert set(kv["nodes"]) == {"prefill-0", "decode-0"}
    assert kv["resyncs"].get("disconnect", 0) >= 3, kv["resyncs"]  # the cut (2 nodes) and the kill
    assert result["requests"]["ok"] > 10 and result["requests"]["cancelled"] > 0
    assert {g["process"] for g in result["rss"]} == {"gateway", "prefill-0", "decode-0"}
    assert all(g["num_samples"] >= 1 and g["peak_mib"] > 10 for g in result["rss"])
    assert "| decode-0 |" in (tmp_path / "soak.md").read_text()
    assert (tmp_path / "soak.png").stat().st_size > 1000
    assert markdown(result) in capsys.readouterr().out
