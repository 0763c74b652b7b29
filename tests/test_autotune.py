import json

import torch

import fastft  # noqa: F401  (registers the ops' defaults)
from fastft import autotune


def test_bucket():
    assert [autotune.bucket(n) for n in (0, 1, 2, 3, 1000, 1024, 1025)] == [1, 1, 2, 4, 1024, 1024, 2048]


def test_defaults_without_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFT_AUTOTUNE_CACHE", str(tmp_path))
    cfg, hit = autotune.lookup("packing.sdpa_mask", torch.device("cpu"), 4096)
    assert not hit and cfg == autotune.TUNABLES["packing.sdpa_mask"].defaults


def test_roundtrip_and_nearest_bucket(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTFT_AUTOTUNE_CACHE", str(tmp_path))
    ops = {"packing.sdpa_mask": {"4096": {"BLOCK_Q": 16}, "65536": {"BLOCK_Q": 64}}}
    path = autotune.write("cpu", ops, {"device": "test"})
    assert json.loads(path.read_text())["ops"] == ops
    cpu = torch.device("cpu")
    assert autotune.lookup("packing.sdpa_mask", cpu, 3000) == (
        {**autotune.TUNABLES["packing.sdpa_mask"].defaults, "BLOCK_Q": 16},
        True,
    )
    assert autotune.lookup("packing.sdpa_mask", cpu, 40000)[0]["BLOCK_Q"] == 64
    assert autotune.lookup("packing.sdpa_mask", cpu, 10**7)[0]["BLOCK_Q"] == 64
    # an op with no entry keeps its defaults
    assert autotune.lookup("packing.boundaries", cpu, 4096) == (autotune.TUNABLES["packing.boundaries"].defaults, False)


def test_shipped_caches_hold_only_known_parameters():
    files = sorted(autotune.cache_dir().glob("*.json"))
    assert files, "autotune_cache/ ships at least one measured file"
    for path in files:
        data = json.loads(path.read_text())
        assert data["arch"] == path.stem and data["device"] and data["date"]
        for op, entries in data["ops"].items():
            for bucket, cfg in entries.items():
                assert autotune.bucket(int(bucket)) == int(bucket)
                assert set(cfg) <= set(autotune.TUNABLES[op].defaults), (path.name, op, cfg)


def test_every_tunable_grid_is_launchable_by_tune():
    """What ``tune`` iterates: an op with sizes to measure has a grid over its own parameters and a
    launcher in its family's bench module."""
    from fastft.bench import delta_rule, packing, routing, ssd

    launchers = {
        **packing.tune_launchers(torch.device("cpu")),
        **routing.tune_launchers(torch.device("cpu")),
        **delta_rule.tune_launchers(torch.device("cpu")),
        **ssd.tune_launchers(torch.device("cpu")),
    }
    for op, tunable in autotune.TUNABLES.items():
        assert set(tunable.grid) <= set(tunable.defaults), op
        assert set(tunable.interpreter) <= set(tunable.defaults), op
        if tunable.sizes:
            assert tunable.candidates() and op in launchers, op
        assert all(set(c) == set(tunable.grid) for c in tunable.candidates()), op
