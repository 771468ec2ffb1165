"""scripts/benchlib: the benchmarks' transfer-mode ablations (installed over PeerComm, proven through
dist_flash_attn on two processes), timing, exactness helpers and results files."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from distributed import run_distributed

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from benchlib import ablations, exactness, results, timing  # noqa: E402

from lightseq_hf.parallel.comm import PeerComm, Pending, Transfers  # noqa: E402


def _no_sends(ops):
    raise AssertionError("a compute-only post reached torch.distributed")


def test_compute_only_fills_received_buffers_and_sends_nothing(monkeypatch):
    """Nothing is sent, but a received buffer must not keep the zeros (or stale data) of reused memory:
    kernel time depends on the data."""
    monkeypatch.setattr(torch.distributed, "batch_isend_irecv", _no_sends)
    library_post = PeerComm.post
    for comm, mode in ((PeerComm(None, torch.device("cpu")), "compute_only"),
                       (ablations.ComputeOnlyComm(None, torch.device("cpu")), "overlap")):
        sent, received = torch.ones(64), torch.zeros(64)
        with ablations.transfer_mode(mode):
            comm.post(Transfers(sends=[(1, sent)], recvs=[(1, received)])).wait()
        assert torch.isfinite(received).all() and received.std() > 0.5
        assert torch.equal(sent, torch.ones(64))
    assert PeerComm.post is library_post


def test_transfer_mode_restores_the_library_post_and_refuses_unknown_modes():
    library_post = PeerComm.post
    with pytest.raises(RuntimeError, match="inside"):
        with ablations.transfer_mode("serial"):
            assert PeerComm.post is not library_post
            raise RuntimeError("inside")
    assert PeerComm.post is library_post
    with pytest.raises(ValueError, match="unknown transfer mode 'fast'; choose one of overlap, serial"):
        with ablations.transfer_mode("fast"):
            pass


def worker_harness(rank, world):
    """dist_flash_attn in each transfer mode (posts and waits counted from here), and the harness's
    collective helpers."""
    import torch.distributed as dist

    import lightseq_hf

    failures = []
    counts = {"batches": 0, "waits": 0}
    batch, wait = dist.batch_isend_irecv, Pending.wait

    def counting_batch(ops):
        counts["batches"] += 1
        return batch(ops)

    def counting_wait(self):
        counts["waits"] += 1
        return wait(self)

    dist.batch_isend_irecv, Pending.wait = counting_batch, counting_wait
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 32, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True).transpose(1, 2)
    sl = slice(rank * 16, (rank + 1) * 16)
    seen = {}
    try:
        for mode in ("overlap", "serial", "compute_only"):
            counts.update(batches=0, waits=0)
            qs, ks, vs = (t[:, sl].float().requires_grad_() for t in (q, k, v))
            with ablations.transfer_mode(mode):
                out = lightseq_hf.dist_flash_attn(qs, ks, vs, backend="reference")
                out.sum().backward()
            seen[mode] = (out.detach(), dict(counts))
    finally:
        dist.batch_isend_irecv, Pending.wait = batch, wait
    (overlap, c_overlap), (serial, c_serial), (compute, c_compute) = seen.values()
    if not (c_overlap["batches"] > 0 and c_serial["batches"] == c_overlap["batches"]):
        failures.append(f"rank {rank}: transfers overlap {c_overlap}, serial {c_serial}")
    if c_serial["waits"] - c_overlap["waits"] != c_serial["batches"]:  # serial: each post waited at once
        failures.append(f"rank {rank}: waits overlap {c_overlap}, serial {c_serial}")
    if c_compute["batches"] != 0 or not torch.isfinite(compute).all():
        failures.append(f"rank {rank}: compute only {c_compute}")
    for name, out in (("overlap", overlap), ("serial", serial)):
        if exactness.rel_err(out, ref[:, sl]) > 1e-5:
            failures.append(f"rank {rank}: {name} rel err {exactness.rel_err(out, ref[:, sl]):.2e}")
    if rank == 1 and exactness.rel_err(compute, ref[:, sl]) < 1e-2:  # rank 1's rows need rank 0's keys
        failures.append(f"rank {rank}: compute only matched the reference: no transfer was skipped")
    cpu = torch.device("cpu")
    calls = []
    ms = timing.timed(lambda: calls.append(rank), 3, cpu, warmup=2)
    checks = {"timed calls": (len(calls), 5), "timed ms >= 0": (ms >= 0, True),
              "per_rank": (timing.per_rank(rank + 1.0, cpu), [1.0, 2.0]),
              "slowest": (timing.slowest([rank, 1.0 - rank], cpu), [1.0, 1.0]),
              "all_ranks": (exactness.all_ranks(rank == 0, cpu), False),
              "any_rank": (exactness.any_rank(rank == 1, cpu), True)}
    failures += [f"rank {rank}: {name} {got} != {want}" for name, (got, want) in checks.items()
                 if got != want]
    return failures


def test_transfer_modes_through_dist_flash_attn_and_collective_helpers():
    failures = [f for r in run_distributed(worker_harness, 2) for f in r]
    assert not failures, "\n".join(failures)


def test_rel_err_and_timing_without_a_process_group():
    ref = torch.tensor([3.0, 4.0, -float("inf")])
    assert exactness.rel_err(ref, ref) == 0.0
    assert exactness.rel_err(torch.tensor([3.0, 4.5, -float("inf")]), ref) == pytest.approx(0.1)
    assert exactness.rel_err(torch.tensor([3.0, 4.0, 0.0]), ref) == float("inf")
    calls = []
    assert timing.timed(lambda: calls.append(1), 4, "cpu", collective=False) >= 0 and len(calls) == 5
    with pytest.raises(ValueError, match="unknown clock 'gpu'"):
        timing.timed(lambda: None, 1, "cpu", collective=False, clock="gpu")
    assert timing.attention_flops(2, 3, 10, 4, causal=True, with_bwd=False) == 2 * 2 * 3 * 100 * 4
    assert timing.attention_flops(1, 1, 10, 4, causal=False, with_bwd=True) == 4 * 100 * 4 * 3.5


def test_results_file_names_rows_and_failures(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(results, "today", lambda: "2026-11-24")
    assert results.device_slug("NVIDIA H200") == "h200"
    assert results.device_slug("NVIDIA H100 80GB HBM3", short=True) == "h100"
    path = results.results_path(tmp_path / "out", "dist", "NVIDIA H200", 2, "", "tag")
    assert path == tmp_path / "out" / "dist-h200-x2-2026-11-24-tag.json" and path.parent.is_dir()
    meta = results.run_meta("cpu", 2, "no_such_package", env=("LIGHTSEQ_BENCH_UNSET",))
    assert meta == {"device": "cpu", "world": 2, "date": "2026-11-24", "torch": torch.__version__,
                    "env": {"LIGHTSEQ_BENCH_UNSET": None}}
    out = results.ResultsFile(path, {"device": "cpu"}, lambda rows: {"n": len(rows)},
                              echo=lambda row: {"seq": row["seq"]})
    out.sections["check"] = {"passed": True}
    out.record({"seq": 1, "impl": "a", "ms": 2.0})
    out.record({"seq": 1, "impl": "b", "per_rank_ms": [1.0]})
    written = json.loads(path.read_text())
    assert list(written) == ["device", "check", "rows", "summary"] and written["summary"] == {"n": 2}
    assert capsys.readouterr().out.splitlines() == ['{"seq": 1}', '{"seq": 1}']
    assert results.find(out.rows, "ms", impl="a") == 2.0 and results.find(out.rows, "ms", impl="b") is None
    assert results.find(out.rows, "per_rank_ms", seq=1) == [1.0]
    silent = results.ResultsFile(tmp_path / "rank1.json", {}, lambda rows: {}, rank=1)
    silent.record({"seq": 1})
    assert not silent.path.exists()
    try:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")
    except torch.OutOfMemoryError as err:
        assert results.failure(err) == {"error": "out of memory",
                                        "oom_message": "CUDA out of memory. Tried to allocate 2.00 GiB"}
    try:
        raise KeyError("missing")
    except KeyError as err:
        assert "KeyError: 'missing'" in results.failure(err)["error"]
