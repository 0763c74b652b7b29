import json

import torch

import fastft  # noqa: F401  (registers the ops' defaults)
from fastft import autotune


def test_bucket():
    assert [autotune.bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]


def test_defaults_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFT_AUTOTUNE_CACHE", str(tmp_path))
    cfg, hit = autotune.lookup("packing.sdpa_mask", torch.device("cpu"), 4096)
    assert not hit and cfg == autotune.DEFAULTS["packing.sdpa_mask"]


def test_roundtrip_and_nearest_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFT_AUTOTUNE_CACHE", str(tmp_path))
    ops = {"packing.sdpa_mask": {"4096": {"BLOCK_Q": 16}, "65536": {"BLOCK_Q": 64}}}
    path = autotune.write("cpu", ops, {"device": "test"})
    assert json.loads(path.read_text())["ops"] == ops
    cpu = torch.device("cpu")
    assert autotune.lookup("packing.sdpa_mask", cpu, 3000) == ({**autotune.DEFAULTS["packing.sdpa_mask"], "BLOCK_Q": 16}, True)
    assert autotune.lookup("packing.sdpa_mask", cpu, 40000)[0]["BLOCK_Q"] == 64
    assert autotune.lookup("packing.sdpa_mask", cpu, 10**7)[0]["BLOCK_Q"] == 64
    # an op with no entry keeps its defaults
    assert autotune.lookup("packing.boundaries", cpu, 4096) == (autotune.DEFAULTS["packing.boundaries"], False)


def test_shipped_caches_hold_only_known_parameters():
    files = sorted(autotune.cache_dir().glob("*.json"))
    assert files, "autotune_cache/ ships at least one measured file"
    for path in files:
        data = json.loads(path.read_text())
        assert data["arch"] == path.stem and data["device"] and data["date"]
        for op, entries in data["ops"].items():
            for bucket, cfg in entries.items():
                assert autotune.bucket(int(bucket)) == int(bucket)
                assert set(cfg) <= set(autotune.DEFAULTS[op]), (path.name, op, cfg)
