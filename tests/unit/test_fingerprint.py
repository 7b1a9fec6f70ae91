"""model_fingerprint: every weight byte counts, and each file's digest is cached by (path, size, mtime)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from pathlib import Path

import pytest

from meshlm.model import loader
from meshlm.model.loader import DIGEST_CACHE_FILE, DIGEST_CACHE_VERSION, hash_file, model_fingerprint

WEIGHTS = 200 * 1024  # past the 64 KiB the old fingerprint read


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch) -> Path:
    """The meshlm cache directory, away from the real ~/.cache."""
    d = tmp_path / "meshlm-cache"
    monkeypatch.setenv("MESHLM_CACHE_DIR", str(d))
    return d


@pytest.fixture
def hashed(monkeypatch) -> list[str]:
    """Names of the files model_fingerprint actually reads, in order."""
    calls: list[str] = []
    real = loader.hash_file
    monkeypatch.setattr(loader, "hash_file", lambda path, *a: calls.append(path.name) or real(path, *a))
    return calls


def make_model(d: Path, weights: bytes, shards: int = 1) -> Path:
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (d / "tokenizer.json").write_text("{}")
    step = len(weights) // shards
    for i in range(shards):
        (d / f"model-{i:05d}.safetensors").write_bytes(weights[i * step: (i + 1) * step])
    return d


def weights(seed: int = 0) -> bytes:
    return hashlib.shake_256(str(seed).encode()).digest(WEIGHTS)


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 1]) + data[at + 1:]


# -- what the fingerprint covers ----------------------------------------------------------


def test_a_weight_byte_past_the_first_64_kib_changes_the_fingerprint(tmp_path):
    base = make_model(tmp_path / "base", weights())
    tuned = make_model(tmp_path / "tuned", flip(weights(), WEIGHTS - 1))
    assert (base / "config.json").read_bytes() == (tuned / "config.json").read_bytes()
    first = lambda d: (d / "model-00000.safetensors").read_bytes()[:65536]  # noqa: E731
    assert first(base) == first(tuned)
    assert model_fingerprint(base) != model_fingerprint(tuned)


def test_the_fingerprint_is_the_content_not_the_place(tmp_path):
    a = make_model(tmp_path / "a", weights())
    b = make_model(tmp_path / "elsewhere" / "b", weights())
    fp = model_fingerprint(a)
    assert len(fp) == 24 and fp == model_fingerprint(b)
    (b / "tokenizer.json").write_text('{"changed": true}')  # KV depends on token ids, not on the tokenizer
    assert model_fingerprint(b) == fp


@pytest.mark.parametrize("change", ["config", "shard_name", "sharding", "extra_file"])
def test_config_and_file_layout_count_too(tmp_path, change):
    a = make_model(tmp_path / "a", weights())
    b = make_model(tmp_path / "b", weights(), shards=2 if change == "sharding" else 1)
    if change == "config":
        (b / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 65}))
    elif change == "shard_name":
        (b / "model-00000.safetensors").rename(b / "weights.safetensors")
    elif change == "extra_file":
        (b / "adapter.safetensors").write_bytes(b"")
    assert model_fingerprint(a) != model_fingerprint(b)


def test_chunked_hash_equals_the_whole_file_hash(tmp_path):
    f = tmp_path / "w.safetensors"
    f.write_bytes(weights())
    whole = hashlib.blake2b(weights(), digest_size=16).hexdigest()
    assert hash_file(f, chunk=4096) == hash_file(f) == whole


# -- the digest cache -------------------------------------------------------------------


def test_digests_are_cached_by_path_size_times_and_inode(tmp_path, cache_dir, hashed, caplog):
    d = make_model(tmp_path / "m", weights(), shards=2)
    with caplog.at_level(logging.INFO, logger="meshlm.model.loader"):
        fp = model_fingerprint(d)
    assert hashed == ["model-00000.safetensors", "model-00001.safetensors"]
    assert "hashing 0.0 GB of weights in" in caplog.text and "hashed 0.0 GB of weights in" in caplog.text
    cache = json.loads((cache_dir / DIGEST_CACHE_FILE).read_text())  # JSON, not pickle
    entry = cache["files"][str((d / "model-00001.safetensors").resolve())]
    st = (d / "model-00001.safetensors").stat()
    assert (entry["size"], entry["mtime_ns"], entry["ino"], entry["ctime_ns"]) == (
        st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="meshlm.model.loader"):
        assert model_fingerprint(d) == fp  # a restart: nothing read again
    assert len(hashed) == 2 and "hashing" not in caplog.text
    assert not [p for p in cache_dir.iterdir() if p.name != DIGEST_CACHE_FILE]  # no temp files left


def test_a_new_mtime_or_size_invalidates_that_file_only(tmp_path, hashed):
    d = make_model(tmp_path / "m", weights(), shards=2)
    fp = model_fingerprint(d)
    f0, f1 = d / "model-00000.safetensors", d / "model-00001.safetensors"
    st = f1.stat()
    os.utime(f1, ns=(st.st_atime_ns, st.st_mtime_ns + 1))  # same bytes, touched
    assert model_fingerprint(d) == fp and hashed[2:] == [f1.name]
    st = f0.stat()
    f0.write_bytes(f0.read_bytes() + b"\0")  # size changes...
    os.utime(f0, ns=(st.st_atime_ns, st.st_mtime_ns))  # ...even with the old mtime
    assert model_fingerprint(d) != fp and hashed[3:] == [f0.name]


def test_a_file_rewritten_with_its_old_size_and_mtime_is_hashed_again(tmp_path, hashed):
    """Regression: the cache trusted (size, mtime_ns), so weights rewritten in place with their mtime kept
    (`cp -p`, `rsync -a` of a same-shape fine-tune) kept the old fingerprint, and the SSD tier served the
    old model's KV. Setting the mtime back changes the ctime, which no call can set."""
    d = make_model(tmp_path / "m", weights())
    fp = model_fingerprint(d)
    f = d / "model-00000.safetensors"
    st = f.stat()
    f.write_bytes(flip(weights(), 100))
    os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f.stat().st_size == st.st_size and f.stat().st_mtime_ns == st.st_mtime_ns
    assert model_fingerprint(d) != fp and len(hashed) == 2
    assert model_fingerprint(d, digest_cache=tmp_path / "fresh.json") == model_fingerprint(d)


def test_a_copied_model_is_hashed_under_its_own_path(tmp_path, hashed):
    a = make_model(tmp_path / "a", weights())
    fp = model_fingerprint(a)
    b = tmp_path / "b"
    shutil.copytree(a, b)  # copy2 keeps mtimes: only the path tells them apart
    (b / "model-00000.safetensors").write_bytes(flip(weights(), WEIGHTS - 1))
    os.utime(b / "model-00000.safetensors", ns=(0, (a / "model-00000.safetensors").stat().st_mtime_ns))
    assert model_fingerprint(b) != fp and len(hashed) == 2


@pytest.mark.parametrize("content", [b"\x80\x04garbage", b"{not json", b"[1, 2]", b'{"version": 99, "files": {}}',
                                     b'{"version": 2, "files": []}', b"", b"[" * 200_000],
                         ids=["binary", "bad_json", "list", "other_version", "files_not_dict", "empty", "deep"])
def test_a_corrupt_cache_file_is_ignored_and_rewritten(tmp_path, cache_dir, hashed, content):
    d = make_model(tmp_path / "m", weights())
    fp = model_fingerprint(d, digest_cache=tmp_path / "reference.json")
    cache_dir.mkdir()
    (cache_dir / DIGEST_CACHE_FILE).write_bytes(content)
    assert model_fingerprint(d) == fp and len(hashed) == 2
    assert json.loads((cache_dir / DIGEST_CACHE_FILE).read_text())["version"] == DIGEST_CACHE_VERSION
    assert model_fingerprint(d) == fp and len(hashed) == 2


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_cache_path_that_is_no_file_is_ignored_not_waited_on(tmp_path, cache_dir, hashed, kind):
    """Regression: a FIFO there made start-up wait in `open` for ever, with nothing logged."""
    d = make_model(tmp_path / "m", weights())
    cache_dir.mkdir()
    path = cache_dir / DIGEST_CACHE_FILE
    os.mkfifo(path) if kind == "fifo" else path.mkdir()
    assert model_fingerprint(d) == model_fingerprint(d, digest_cache=tmp_path / "reference.json")


def test_a_malformed_entry_is_not_trusted(tmp_path, cache_dir, hashed):
    d = make_model(tmp_path / "m", weights())
    fp = model_fingerprint(d)
    cache_file = cache_dir / DIGEST_CACHE_FILE
    data = json.loads(cache_file.read_text())
    for entry in data["files"].values():
        entry["digest"], entry["mtime_ns"] = 0, str(entry["mtime_ns"])
    cache_file.write_text(json.dumps(data))
    assert model_fingerprint(d) == fp and len(hashed) == 2


def test_an_unwritable_cache_directory_only_costs_hashing_again(tmp_path, monkeypatch, hashed, caplog):
    (tmp_path / "a-file").write_text("not a directory")
    monkeypatch.setenv("MESHLM_CACHE_DIR", str(tmp_path / "a-file" / "meshlm"))
    d = make_model(tmp_path / "m", weights())
    with caplog.at_level(logging.WARNING, logger="meshlm.model.loader"):
        fp = model_fingerprint(d)
        assert model_fingerprint(d) == fp
    assert len(hashed) == 2 and "cannot cache weight digests" in caplog.text


def test_entries_of_deleted_models_are_pruned(tmp_path, cache_dir):
    gone = make_model(tmp_path / "gone", weights(1))
    model_fingerprint(gone)
    shutil.rmtree(gone)
    kept = make_model(tmp_path / "kept", weights(2))
    model_fingerprint(kept)
    files = json.loads((cache_dir / DIGEST_CACHE_FILE).read_text())["files"]
    assert list(files) == [str((kept / "model-00000.safetensors").resolve())]
