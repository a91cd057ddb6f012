"""Embedding store (writer + lazy reader), prompt-file parsing and the group sampler."""
from __future__ import annotations

import json
import pickle

import pytest
import torch

from fastvideo import data
from fastvideo.data import EmbeddingDataset, EmbeddingWriter, StoreSpec, plan_shards, read_prompt_file
from fastvideo.prompt_groups import GroupSampler

T, D, DP = 6, 5, 3


def _write_store(out, prompts, shard_size=3, dtype="fp32", fingerprint="fp-a", msl=T):
    """A small store with row i filled from a seeded generator; returns (writer, embeds, pooled)."""
    g = torch.Generator().manual_seed(0)
    embeds = torch.randn(len(prompts), T, D, generator=g)
    pooled = torch.randn(len(prompts), DP, generator=g)
    writer = EmbeddingWriter(out, prompts, StoreSpec("/models/x", fingerprint, msl, dtype, shard_size))
    writer.check_existing()
    for shard in writer.shards:
        ids = list(shard.ids)
        writer.write_shard(shard, {"prompt_embeds": embeds[ids], "pooled_prompt_embeds": pooled[ids]},
                           [i % 4 == 1 for i in ids])
    writer.finalize()
    return writer, embeds, pooled


# ------------------------------------------------------------------------------------------ prompt file
def test_read_prompt_file_skips_blank_lines_and_strips(tmp_path):
    f = tmp_path / "p.txt"
    f.write_bytes("\ufefffirst\r\n\n   \nsecond  \n\tthird café\n".encode("utf-8"))
    assert read_prompt_file(f) == ["first", "second", "third café"]


def test_read_prompt_file_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n\n")
    with pytest.raises(ValueError, match="contains no prompts"):
        read_prompt_file(empty)
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok one\n\nok two\nbad \xff\xfe here\n")
    with pytest.raises(ValueError, match=r"line 4: not valid UTF-8"):
        read_prompt_file(bad)
    with pytest.raises(FileNotFoundError, match="--prompt_file"):
        read_prompt_file(tmp_path / "nope.txt")


# ----------------------------------------------------------------------------------------------- store
def test_plan_shards_is_fixed_size_consecutive():
    shards = plan_shards(7, 3)
    assert [(s.index, s.first_id, s.num_prompts) for s in shards] == [(0, 0, 3), (1, 3, 3), (2, 6, 1)]
    assert [s.file for s in shards] == ["shard-00000.safetensors", "shard-00001.safetensors",
                                        "shard-00002.safetensors"]
    with pytest.raises(ValueError, match="--shard_size"):
        plan_shards(3, 0)


def test_store_roundtrip_and_manifest(tmp_path):
    prompts = [f"prompt {i}" for i in range(7)]
    _, embeds, pooled = _write_store(tmp_path / "out", prompts)
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["format_version"] == data.FORMAT_VERSION and manifest["num_prompts"] == 7
    assert manifest["shapes"] == {"prompt_embeds": [T, D], "pooled_prompt_embeds": [DP]}
    assert manifest["embedding_keys"] == ["prompt_embeds", "pooled_prompt_embeds"] and manifest["negative"] is None
    assert [p["id"] for p in manifest["prompts"]] == list(range(7))
    assert manifest["num_truncated"] == 2 and [p["truncated"] for p in manifest["prompts"]][:3] == [False, True, False]
    assert len(manifest["shards"]) == 3

    for source in (tmp_path / "out", tmp_path / "out" / "manifest.json"):
        ds = EmbeddingDataset(source)
        assert len(ds) == 7
        item = ds[4]
        assert item["prompt_id"] == 4 and item["prompt"] == "prompt 4"
        assert torch.equal(item["prompt_embeds"], embeds[4]) and torch.equal(item["pooled_prompt_embeds"], pooled[4])
    ids = [6, 0, 3, 3, 1]
    batch = ds.get_batch(ids)
    assert batch["prompt_ids"].dtype == torch.long and batch["prompt_ids"].tolist() == ids
    assert batch["prompts"] == [prompts[i] for i in ids]
    assert torch.equal(batch["prompt_embeds"], embeds[ids])
    assert torch.equal(batch["pooled_prompt_embeds"], pooled[ids])
    with pytest.raises(IndexError):
        ds[7]


def test_store_bf16(tmp_path):
    _, embeds, _ = _write_store(tmp_path / "out", ["a", "b"], dtype="bf16")
    ds = EmbeddingDataset(tmp_path / "out")
    assert ds.dtype == torch.bfloat16
    assert torch.equal(ds.get_batch([1])["prompt_embeds"], embeds[[1]].bfloat16())


def test_dataset_is_lazy(tmp_path, monkeypatch):
    """Opening reads no shard; a row reads only its shard and only via slices, never whole tensors."""
    _, embeds, _ = _write_store(tmp_path / "out", [f"p{i}" for i in range(9)], shard_size=3)
    ds = EmbeddingDataset(tmp_path / "out")
    assert ds._handles == {}
    assert not any(isinstance(v, torch.Tensor) for v in vars(ds).values())

    import safetensors

    calls = {"get_tensor": 0}
    real_open = safetensors.safe_open

    class Spy:
        def __init__(self, *a, **k):
            self._inner = real_open(*a, **k)

        def get_tensor(self, name):
            calls["get_tensor"] += 1
            return self._inner.get_tensor(name)

        def __getattr__(self, name):
            return getattr(self._inner, name)

    monkeypatch.setattr(safetensors, "safe_open", Spy)
    batch = ds.get_batch([4, 5])
    assert list(ds._handles) == ["shard-00001.safetensors"]
    assert calls["get_tensor"] == 0
    assert torch.equal(batch["prompt_embeds"], embeds[[4, 5]])
    # picklable for DataLoader workers: handles are dropped and reopened on demand
    clone = pickle.loads(pickle.dumps(ds))
    assert clone._handles == {} and torch.equal(clone[8]["prompt_embeds"], embeds[8])


def test_dataset_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="preprocess_embeddings.py"):
        EmbeddingDataset(tmp_path / "missing")
    _write_store(tmp_path / "out", ["a", "b", "c", "d"])
    manifest_path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["format_version"] = 99
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="format_version 99"):
        EmbeddingDataset(manifest_path)
    manifest["format_version"] = data.FORMAT_VERSION
    manifest_path.write_text(json.dumps(manifest))
    (tmp_path / "out" / "shard-00001.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard-00001.*re-run preprocess_embeddings.py"):
        EmbeddingDataset(manifest_path)


def test_writer_refuses_other_encoders_and_length(tmp_path):
    out = tmp_path / "out"
    _write_store(out, ["a", "b", "c", "d"])
    with pytest.raises(ValueError, match="encoders_fingerprint.*--output_dir"):
        EmbeddingWriter(out, ["a"], StoreSpec("/models/x", "fp-b", T, "fp32", 3)).check_existing()
    with pytest.raises(ValueError, match="max_sequence_length.*--output_dir"):
        EmbeddingWriter(out, ["a"], StoreSpec("/models/x", "fp-a", T + 1, "fp32", 3)).check_existing()
    # also without a manifest (a partial run): the shard headers carry the identity
    (out / "manifest.json").unlink()
    with pytest.raises(ValueError, match="max_sequence_length"):
        EmbeddingWriter(out, ["a"], StoreSpec("/models/x", "fp-a", T + 1, "fp32", 3)).check_existing()
    EmbeddingWriter(out, ["a"], StoreSpec("/models/x", "fp-a", T, "fp32", 3)).check_existing()


def test_writer_completeness_tracks_prompt_texts(tmp_path):
    out = tmp_path / "out"
    writer, _, _ = _write_store(out, [f"p{i}" for i in range(7)])
    assert all(writer.is_complete(s) for s in writer.shards)
    changed = EmbeddingWriter(out, ["p0", "p1", "p2", "p3", "CHANGED", "p5"], writer.spec)
    assert [changed.is_complete(s) for s in changed.shards] == [True, False]
    # finalize removes shards that no longer belong to the store
    changed.write_shard(changed.shards[1], {"prompt_embeds": torch.zeros(3, T, D),
                                            "pooled_prompt_embeds": torch.zeros(3, DP)},
                        [False] * 3)
    changed.finalize()
    assert sorted(p.name for p in out.glob("shard-*")) == ["shard-00000.safetensors", "shard-00001.safetensors"]
    assert EmbeddingDataset(out)[4]["prompt"] == "CHANGED"


# --------------------------------------------------------------------------------------------- sampler
def test_sampler_is_pure_function_of_seed_and_step():
    a = GroupSampler(20, 4, 3, seed=7)
    b = GroupSampler(20, 4, 3, seed=7)
    assert [b.samples_for_step(s) for s in (9, 2, 0)] == [a.samples_for_step(s) for s in (9, 2, 0)]
    assert a.samples_for_step(0) != GroupSampler(20, 4, 3, seed=8).samples_for_step(0)
    assert a.samples_for_step(0).group_prompt_ids != a.samples_for_step(1).group_prompt_ids


def test_sampler_groups_contiguous_and_ranks_partition():
    P, G, W = 3, 4, 4
    single = GroupSampler(10, P, G, seed=1).samples_for_step(5)
    assert single.prompt_ids == [p for p in single.group_prompt_ids for _ in range(G)]
    assert single.sample_indices == list(range(G)) * P
    parts = [GroupSampler(10, P, G, seed=1, rank=r, world_size=W).samples_for_step(5) for r in range(W)]
    assert all(len(p.prompt_ids) == P * G // W for p in parts)
    assert sum((p.prompt_ids for p in parts), []) == single.prompt_ids
    assert sum((p.sample_indices for p in parts), []) == single.sample_indices
    assert all(p.group_prompt_ids == single.group_prompt_ids and p.epoch == single.epoch for p in parts)


def test_sampler_epochs_cover_without_replacement():
    N, P = 10, 3  # 3 steps per epoch, one prompt left over each epoch
    s = GroupSampler(N, P, 2, seed=3)
    assert s.steps_per_epoch == 3
    for epoch in range(3):
        steps = [s.samples_for_step(epoch * 3 + k) for k in range(3)]
        assert all(x.epoch == epoch for x in steps)
        ids = sum((x.group_prompt_ids for x in steps), [])
        assert len(set(ids)) == len(ids) == 9 and set(ids) <= set(range(N))
    exact = GroupSampler(12, 4, 1, seed=0)
    assert sorted(sum((exact.samples_for_step(k).group_prompt_ids for k in range(3)), [])) == list(range(12))
    assert exact.samples_for_step(3).epoch == 1


def test_sampler_state_dict_round_trip():
    a = GroupSampler(15, 2, 4, seed=11, rank=1, world_size=2)
    first = [a.next() for _ in range(4)]
    assert [x.step for x in first] == [0, 1, 2, 3]
    state = a.state_dict()
    rest = [a.next() for _ in range(10)]
    b = GroupSampler(15, 2, 4, seed=11, rank=1, world_size=2)
    b.load_state_dict(json.loads(json.dumps(state)))
    assert [b.next() for _ in range(10)] == rest
    with pytest.raises(ValueError, match="seed"):
        GroupSampler(15, 2, 4, seed=12).load_state_dict(state)


def test_sampler_validation():
    with pytest.raises(ValueError, match="not divisible by the world size 4"):
        GroupSampler(10, 3, 3, seed=0, world_size=4)
    with pytest.raises(ValueError, match="only 2 prompts"):
        GroupSampler(2, 3, 1, seed=0)
    with pytest.raises(ValueError, match="rank"):
        GroupSampler(10, 2, 2, seed=0, rank=2, world_size=2)
