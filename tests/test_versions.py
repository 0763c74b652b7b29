"""The supported transformers range is stated once in code (fastft.integrations.transformers.versions) and
agrees with the extras' bounds, the test extra's pin and the newest release the tests run on."""

import pathlib
import re
import warnings

import pytest

from fastft.integrations.transformers import versions

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_range_agrees_with_the_extras_and_the_test_script():
    pyproject = (ROOT / "pyproject.toml").read_text()
    oldest, newest = versions.OLDEST, versions.NEWEST
    assert f'"transformers=={oldest[0]}.{oldest[1]}.0"' in pyproject  # the test extra: the oldest
    bound = f'"transformers>={oldest[0]}.{oldest[1]},<{newest[0]}.{newest[1] + 1}"'
    for extra in ("hf", "peft", "trl"):
        assert re.search(rf"^{extra} = \[{re.escape(bound)}", pyproject, re.M), extra
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert re.search(rf"^NEWEST={newest[0]}\.{newest[1]}\.\d+ ", script, re.M)


def test_release_parsing_and_the_warning(monkeypatch):
    assert versions.release("5.24.0") == (5, 24) and versions.release("5.25.0.dev0") == (5, 25)
    with pytest.raises(ValueError, match="not a transformers version"):
        versions.release("main")
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(transformers, "__version__", "5.99.0")
    with pytest.warns(UserWarning, match=r"tested on transformers 5\.17 to 5\.24; this is 5\.99\.0"):
        versions.check_version()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.check_version()  # once per version
        monkeypatch.setattr(transformers, "__version__", f"{versions.NEWEST[0]}.{versions.NEWEST[1]}.1")
        versions.check_version()  # in range: silent


def test_installed_transformers_is_in_range():
    transformers = pytest.importorskip("transformers")
    assert versions.OLDEST <= versions.release(transformers.__version__) <= versions.NEWEST
