"""The shard helper shared by the preprocessing cache and the feature cache (datamodules/cache.py)."""
import argparse

import pytest
import torch

from datamodules.cache import (CacheError, ShardedCache, add_shard_argument, fill_shards, my_shards, open_cache,
                               shard_count)
from datamodules.features import FeatureShards, open_feature_cache


def test_shard_count_and_workers_cover_every_shard_once():
    assert [shard_count(n, 4) for n in (0, 1, 4, 5, 9)] == [1, 1, 1, 2, 3]
    workers = [my_shards(7, (index, 3)) for index in range(3)]
    assert workers == [[0, 3, 6], [1, 4], [2, 5]]
    assert sorted(sum(workers, [])) == list(range(7))


def test_shard_option_refuses_an_index_outside_its_count():
    parser = argparse.ArgumentParser()
    add_shard_argument(parser)
    assert parser.parse_args(["--shard", "1/3"]).shard == (1, 3)
    for bad in ("3/3", "1", "a/2", "-1/2"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--shard", bad])


def _records(index):
    return [{"caption_id": 10 * index + k} for k in range(2)], {"captions": 2}


def _tensors(index):
    ids = torch.arange(3) + 10 * index
    return {"caption_ids": ids, "text_global": ids.float()[:, None].repeat(1, 4)}, {"captions": 3}


@pytest.mark.parametrize("kind, produce", [(ShardedCache, _records), (FeatureShards, _tensors)])
def test_two_workers_fill_one_cache_of_either_kind(tmp_path, kind, produce):
    settings = {"what": kind.__name__}
    directory = tmp_path / "cache"
    produced = []

    def tracked(index):
        produced.append(index)
        return produce(index)

    first = fill_shards(kind(directory, 3), settings, my_shards(3, (0, 2)), tracked)
    assert not first["complete"] and first["finished_shards"] == 2
    with pytest.raises(CacheError, match="incomplete"):
        open_cache(directory, kind)
    cache = kind(directory, 3)
    assert cache.unfinished((0, 2)) == [] and cache.unfinished((0, 1)) == [1]  # a rerun redoes nothing finished
    manifest = fill_shards(cache, settings, cache.unfinished((1, 2)), tracked)
    assert produced == [0, 2, 1]
    assert manifest["complete"] and manifest["counts"]["captions"] == 3 * produce(0)[1]["captions"]
    opened = open_cache(directory, kind)
    assert type(opened) is kind
    for index in range(3):
        expected, _ = produce(index)
        if kind is FeatureShards:
            assert torch.equal(opened.read_shard(index)["caption_ids"], expected["caption_ids"])
        else:
            assert opened.read_shard(index) == expected


def test_a_job_that_fails_before_its_first_shard_leaves_no_folder(tmp_path):
    def broken(index):
        raise RuntimeError("detector failed to load")

    with pytest.raises(RuntimeError):
        fill_shards(ShardedCache(tmp_path / "cache", 2), {}, [0, 1], broken)
    assert not (tmp_path / "cache").exists()


def test_a_truncated_feature_shard_is_named_and_the_job_to_rerun(tmp_path):
    fill_shards(FeatureShards(tmp_path, 1), {}, [0], _tensors)
    data = FeatureShards(tmp_path, 1).data_path(0)
    data.write_bytes(data.read_bytes()[:-10])
    with pytest.raises(CacheError, match=rf"{data.name}.*python -m datamodules.features"):
        open_feature_cache(tmp_path).read_shard(0)


def test_damaged_shards_are_rebuilt_named_and_counted_never_written_ones_are_not(tmp_path, caplog):
    cache = ShardedCache(tmp_path, 4)
    fill_shards(cache, {}, [0, 1, 2], _records)  # shard 3 never written
    cache.data_path(0).unlink()  # data gone
    cache.meta_path(1).write_text("{not json")  # metadata cut short
    cache.data_path(2).write_bytes(cache.data_path(2).read_bytes()[:-3])  # data truncated
    todo = cache.unfinished((0, 1))
    assert todo == [0, 1, 2, 3]
    with caplog.at_level("WARNING", logger="datamodules.cache"):
        manifest = fill_shards(cache, {}, todo, _records)
    assert manifest["complete"] and manifest["rebuilt_shards"] == 3
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 3 and all(f"shard {i} of 4" in w for i, w in enumerate(warnings))
    assert cache.data_path(0).name in warnings[0] and "missing" in warnings[0]
    assert cache.meta_path(1).name in warnings[1] and cache.data_path(2).name in warnings[2]
    assert [cache.read_shard(i) for i in range(4)] == [_records(i)[0] for i in range(4)]
    assert "rebuilt_shards" not in (tmp_path / "manifest.json").read_text()  # a job's count, not the cache's
