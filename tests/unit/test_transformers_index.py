"""transformers' module index, cached on disk (meshlm/transformers_index.py): the same index, faster, and
any damage falls back to transformers' own scan."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from meshlm import transformers_index

# A fresh interpreter, as `meshlm serve` starts: the hook, then what mlx-lm's tokenizer_utils imports, then a
# tokenizer class through the lazy index (AutoTokenizer's mapping walks it). Prints what the test checks.
PROBE = """
import json, sys
from pathlib import Path
from meshlm import transformers_index
installed = transformers_index.install(Path(sys.argv[1]))
from transformers import AutoTokenizer, PreTrainedTokenizerFast
import transformers.utils.import_utils as iu
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES
import transformers
print(json.dumps({"installed": installed, "wrapped": hasattr(iu.create_import_structure_from_path, "__wrapped__"),
                  "llama": transformers.LlamaConfig.__name__, "fast": PreTrainedTokenizerFast.__name__,
                  "names": len(TOKENIZER_MAPPING_NAMES), "auto": AutoTokenizer.__name__}))
"""


def probe(cache: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(cache)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_index_round_trips_through_json_unchanged():
    import transformers
    import transformers.utils.import_utils as iu

    folder = Path(transformers.__file__).parent / "models"
    scan = getattr(iu.create_import_structure_from_path, "__wrapped__", iu.create_import_structure_from_path)
    structure = scan(str(folder))
    assert any(isinstance(k, frozenset) for v in structure.values() for k in v)  # backends keys are there
    assert transformers_index.decode(json.loads(json.dumps(transformers_index.encode(structure)))) == structure


def test_the_codec_refuses_what_the_index_never_holds():
    with pytest.raises(TypeError):
        transformers_index.encode({"a": [1, 2]})
    with pytest.raises(TypeError):
        transformers_index.encode({("t",): {"a": {"x"}}})
    for bad in (["x", []], ["d", [[["g", ["a"]], "v"]]], ["s", [1]], ["d"]):
        with pytest.raises((ValueError, TypeError)):
            transformers_index.decode(bad)


def test_a_fresh_process_writes_the_index_then_reads_it(tmp_path):
    cache = tmp_path / "index"
    plain = probe(tmp_path / "unused")  # what transformers gives, for the comparison below
    first = probe(cache)
    files = sorted(cache.glob("*.json"))
    assert first["installed"] and first["wrapped"]
    # Only the outermost scans are cached (models/ from transformers' __init__ and models/__init__.py, and
    # models/auto/), not the ~1,100 subfolders the scan recurses into.
    assert 2 <= len(files) <= 8, [f.name for f in files]
    stamps = {f: f.stat().st_mtime_ns for f in files}
    second = probe(cache)
    assert second == first == plain
    assert {f: f.stat().st_mtime_ns for f in files} == stamps  # read, not written again
    assert not list(cache.glob("*.tmp"))


@pytest.mark.parametrize("damage", ["{", '["d", [["x", ["q", []]]]]', "", '["s", [1, 2]]'])
def test_a_damaged_index_file_is_scanned_again_and_rewritten(tmp_path, damage):
    cache = tmp_path / "index"
    good = probe(cache)
    victim = max(cache.glob("*.json"), key=lambda f: f.stat().st_size)  # models/: the one everything needs
    victim.write_text(damage)
    assert probe(cache) == good
    transformers_index.decode(json.loads(victim.read_text()))  # whole again


def test_an_unwritable_cache_still_imports(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = probe(blocker / "index")
    assert result["wrapped"] and result["llama"] == "LlamaConfig"
    assert blocker.read_text() == "not a directory"


def test_installing_after_transformers_is_imported_does_nothing(tmp_path):
    import transformers  # noqa: F401  (this process has it already; made sure)

    before = list(sys.meta_path)
    assert transformers_index.install(tmp_path) is False
    assert sys.meta_path == before and not any(tmp_path.iterdir())


def test_the_cli_installs_it_before_anything_imports_transformers(tmp_path):
    """`meshlm demo-model --tiny` loads its export back through mlx-lm, which imports transformers."""
    env = {**os.environ, "MESHLM_CACHE_DIR": str(tmp_path / "cache")}
    out = subprocess.run([sys.executable, "-m", "meshlm", "demo-model", "--tiny", str(tmp_path / "m")],
                         capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr
    assert list((tmp_path / "cache" / "transformers-index").glob("*.json"))
