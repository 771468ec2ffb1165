"""Data: packing, local-file loading, the passkey task, and the sequence/data-parallel sampler."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from lightseq_hf.training.config import config_from_dict
from lightseq_hf.training.data import (
    ByteTokenizer,
    ParallelSampler,
    build_train_dataset,
    collate,
    detect_format,
    pack_token_lists,
)
from lightseq_hf.training.synthetic import NEEDLE, QUERY, PasskeySpec, answer_accuracy, make_passkey_sample


def test_pack_concatenates_with_eos_and_carries_the_tail() -> None:
    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    blocks, tail = pack_token_lists(docs, 4, eos_id=0)
    assert blocks == [[1, 2, 3, 0], [4, 5, 0, 6], [7, 8, 9, 0]] and tail == []
    blocks, tail = pack_token_lists(docs, 5, eos_id=None)
    assert blocks == [[1, 2, 3, 4, 5]] and tail == [6, 7, 8, 9]
    more, tail = pack_token_lists([[10]], 5, carry=tail)
    assert more == [[6, 7, 8, 9, 10]] and tail == []


@pytest.mark.parametrize("fmt", ["jsonl", "txt", "parquet"])
def test_local_files_tokenize_and_pack(tmp_path: Path, fmt: str) -> None:
    texts = [f"document number {i} " * (i + 1) for i in range(40)]
    path = tmp_path / f"d.{fmt}"
    if fmt == "jsonl":
        path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    elif fmt == "txt":
        path.write_text("\n".join(texts) + "\n")
    else:
        import datasets

        datasets.Dataset.from_dict({"text": texts}).to_parquet(str(path))
    cfg = config_from_dict({
        "context_length": 64, "sp_size": 1, "tokenizer": "bytes",
        "model": {"config": {"vocab_size": 257}},
        "data": {"type": "files", "paths": [str(path)]},
    })
    ds = build_train_dataset(cfg.data, cfg.context_length, 257, ByteTokenizer())
    total = sum(len(t.encode()) + 1 for t in texts)
    assert len(ds) == total // 64
    batch = collate([ds[0], ds[1]])
    assert batch["input_ids"].shape == (2, 64)
    starts = batch["position_ids"] == 0  # documents packing (the default): labels stay inside documents
    assert torch.equal(batch["labels"], batch["input_ids"].masked_fill(starts, -100))
    assert bytes(batch["input_ids"][0, :8].tolist()) == texts[0].encode()[:8]
    assert detect_format([str(path)]) in ("json", "text", "parquet")


def test_sampler_identical_within_sp_disjoint_across_dp_each_once_per_epoch() -> None:
    n, dp = 24, 3
    for epoch in range(2):
        seen = []
        for dp_rank in range(dp):
            # every sequence-parallel rank of a group builds its sampler from (dp_rank, dp_size) only
            per_sp_rank = []
            for _sp_rank in range(2):
                s = ParallelSampler(n, dp, dp_rank, seed=5)
                s.set_epoch(epoch)
                per_sp_rank.append(list(s))
            assert per_sp_rank[0] == per_sp_rank[1]
            seen.append(set(per_sp_rank[0]))
            assert len(per_sp_rank[0]) == n // dp
        assert all(not (a & b) for i, a in enumerate(seen) for b in seen[i + 1:])
        assert set().union(*seen) == set(range(n))
    s0, s1 = ParallelSampler(n, dp, 0, seed=5), ParallelSampler(n, dp, 0, seed=5)
    s1.set_epoch(1)
    assert list(s0) != list(s1)  # reshuffled per epoch


def test_sampler_uneven_and_resume() -> None:
    s = [ParallelSampler(10, 4, r, seed=1) for r in range(4)]
    got = [list(x) for x in s]
    assert all(len(g) == 3 for g in got)  # every group runs the same number of steps
    assert set().union(*map(set, got)) == set(range(10))
    r = ParallelSampler(10, 4, 2, seed=1)
    r.set_epoch(0, start=4)  # one step of the 4 groups: the position counts all groups' samples
    assert list(r) == got[2][1:] and len(r) == 2


def test_passkey_sample_layout() -> None:
    spec = PasskeySpec(context_length=4096, vocab_size=256, num_values=16, passkey_len=2, seed=3)
    a = make_passkey_sample(spec, 7)
    assert torch.equal(a["input_ids"], make_passkey_sample(spec, 7)["input_ids"])  # deterministic
    ids, labels = a["input_ids"], a["labels"]
    assert ids.shape == labels.shape == (4096,)
    pos = int((ids == NEEDLE).nonzero())
    assert pos < 2048 - 2 and int((ids == QUERY).nonzero()) == 4096 - 3
    assert torch.equal(ids[pos + 1: pos + 3], ids[-2:])
    assert (labels != -100).sum() == 2 and torch.equal(labels[-2:], ids[-2:])
    key_tokens = (ids >= 3) & (ids < spec.first_filler)
    assert key_tokens.sum() == 4  # the key appears only in the needle and the answer
    assert pos + 2 < 2048  # the whole needle lies in the first half
    assert 4096 - 2 - (pos + 2) >= spec.min_distance >= 2048 - 2
    assert spec.chance == 1 / 16


def test_answer_accuracy_counts() -> None:
    labels = torch.tensor([[-100, 5, 6], [-100, 7, 8]])
    pred = torch.tensor([[0, 5, 6], [0, 7, 0]])
    assert answer_accuracy(pred, labels) == (3, 4, 1, 2)


def test_document_packing_keeps_boundaries() -> None:
    from lightseq_hf.training.data import collate, document_labels, pack_documents

    docs = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10, 11]]
    blocks, positions, tail, tail_pos = pack_documents(docs, 5, eos_id=0)
    assert blocks == [[1, 2, 3, 0, 4], [5, 0, 6, 7, 8]]
    # every document restarts at 0; the cut document [4, 5, 0] continues in block 2 as its own
    assert positions == [[0, 1, 2, 3, 0], [0, 1, 0, 1, 2]]
    assert tail == [9, 10, 11, 0] and tail_pos == [0, 1, 2, 3]
    labels = [document_labels(b, p) for b, p in zip(blocks, positions)]
    assert labels == [[-100, 2, 3, 0, -100], [-100, 0, -100, 7, 8]]
    batch = collate([{"input_ids": b, "labels": lab, "position_ids": p}
                     for b, lab, p in zip(blocks, labels, positions)])
    assert batch["position_ids"].tolist() == positions and batch["labels"].shape == (2, 5)


def test_document_packing_from_files(tmp_path: Path) -> None:
    from datasets import Dataset

    from lightseq_hf.training.data import ByteTokenizer, tokenize_and_pack

    ds = Dataset.from_dict({"text": ["abc", "de", "fghijk"]})
    packed = tokenize_and_pack(ds, ByteTokenizer(), 5, packing="documents")
    first = packed[0]
    assert first["position_ids"].tolist() == [0, 1, 2, 3, 0]  # "abc" + EOS, then "de" starts
    assert first["labels"].tolist()[0] == -100 and first["labels"].tolist()[4] == -100
    concat = tokenize_and_pack(ds, ByteTokenizer(), 5, packing="concat")
    assert "position_ids" not in concat.column_names
    assert concat[0]["labels"].tolist() == concat[0]["input_ids"].tolist()
