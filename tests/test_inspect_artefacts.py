"""``condmem inspect`` and ``condmem convert`` on every artefact condmem writes: a training run, a
checkpoint folder and its files, a table file, a Hugging Face folder saved with Engram, a released
checkpoint; convert's tables served by `EngramMemory` with the model's exact rows; what is refused."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from condmem.cli import main
from condmem.fp8 import pack_rows, quantize_fp8_e8m0
from condmem.artefacts import find_artefact
from condmem.train.data import stdlib_dir

MODULES = ["textwrap.py", "string.py", "heapq.py", "bisect.py", "colorsys.py", "keyword.py", "fnmatch.py"]
TRAIN = ["--preset", "tiny", "--set", "data.vocab_size=320", "--steps", "2", "--device", "cpu", "--no-progress"]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny corpus, an Engram run and a baseline run trained on it (2 steps each), and a Hugging Face folder."""
    root = tmp_path_factory.mktemp("artefacts")
    corpus = root / "corpus"
    corpus.mkdir()
    for name in MODULES:
        shutil.copy(stdlib_dir() / name, corpus / name)
    assert main(["train", "--out", str(root / "run"), "--corpus", str(corpus), *TRAIN]) == 0
    assert main(["train", "--out", str(root / "base"), "--corpus", str(corpus), "--no-engram", *TRAIN]) == 0
    tokenizer = root / "run" / "checkpoints" / "step-0000002" / "tokenizer.json"
    shutil.copy(tokenizer, root / "tokenizer.json")
    return root


def _hf_model(tokenizer, dtype=torch.float32, head_dim=8):
    from hf_fixtures import engram_config, tiny_model

    from condmem.integrations.transformers import add_engram
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer))
    model = tiny_model("llama", tok.get_vocab_size()).to(dtype)
    add_engram(model, engram_config().replace(head_dim=head_dim), tok)
    with torch.no_grad():  # distinct rows, not all the init's
        for lid, engram in model._condmem_engram.engrams.items():
            engram.table.weight.copy_(
                torch.randn(engram.table.weight.shape, generator=torch.Generator().manual_seed(lid))
            )
    return model


@pytest.fixture(scope="module")
def hf_folder(made):
    model = _hf_model(made / "tokenizer.json")
    model.save_pretrained(made / "hf")
    return made / "hf", model


@pytest.fixture(scope="module")
def released(made):
    from released_fixtures import write_checkpoint

    write_checkpoint(made / "released", "original", 2, "flat")
    return made / "released"


def _report(path, capsys, *extra) -> dict:
    capsys.readouterr()
    assert main(["inspect", str(path), "--no-progress", "--json", *extra]) == 0, capsys.readouterr().err
    return json.loads(capsys.readouterr().out)


KINDS = [
    # id, path under the fixture folder, kind reported, resolved from the path given
    ("run folder", "run", "condmem training checkpoint", True),
    ("checkpoint folder", "run/checkpoints/step-0000002", "condmem training checkpoint", False),
    (
        "checkpoint's tables file",
        "run/checkpoints/step-0000002/tables.safetensors",
        "condmem training checkpoint",
        True,
    ),
    ("checkpoints folder", "run/checkpoints", "condmem training checkpoint", True),
    ("table file", "t.safetensors", "condmem table file", False),
    ("hf folder", "hf", "Hugging Face model with Engram", False),
    ("hf weight file", "hf/model.safetensors", "Hugging Face model with Engram", True),
    ("released", "released", "released checkpoint", False),
]


@pytest.mark.parametrize("case,where,kind,resolved", KINDS, ids=[k[0] for k in KINDS])
def test_inspect_reads_every_artefact_with_one_summary(made, hf_folder, released, capsys, case, where, kind, resolved):
    if not (made / "t.safetensors").exists():
        assert main(["convert", str(made / "run"), str(made / "t.safetensors"), "--to", "bf16", "--no-progress"]) == 0
    report = _report(made / where, capsys)
    assert report["kind"] == kind and report["ok"] and not report["errors"]
    assert ("resolved_from" in report) == resolved
    assert report["format"] and report["file_bytes"] > 0 and report["checks"]
    assert report["layout"]["layer_ids"] == [layer["layer_id"] for layer in report["layers"]]
    for layer in report["layers"]:
        assert layer["rows"] == layer["rows_expected"] and layer["rows_match_primes"]
        assert layer["bytes"]["bf16"] > 0 and layer["row_stats"]["rows_checked"] > 0
    assert main(["inspect", str(made / where), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"{kind}: ") and "\n  tables: " in text and "\n  checks: " in text
    assert "sum of primes" in text and text.rstrip().endswith("ok: the loaders accept it")


@pytest.mark.parametrize("where", ["run", "run/checkpoints/step-0000002", "hf"])
def test_negative_control_the_released_reader_alone_refuses_condmem_artefacts(made, hf_folder, where):
    # What inspect did before it told artefacts apart: every path that is not a table file went to the
    # released-checkpoint reader, which finds no Engram tensors (or no Engram keys) in what condmem writes.
    from condmem.tables.inspect import inspect_checkpoint

    with pytest.raises(ValueError, match="Engram|no .safetensors files"):
        inspect_checkpoint(made / where, progress=False)


def test_a_folder_that_is_none_of_them_gets_one_line_naming_what_was_looked_for(tmp_path, made, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no Engram section
    for argv in (
        ["inspect", str(tmp_path)],
        ["convert", str(tmp_path), str(tmp_path.parent / "x.safetensors"), "--to", "bf16"],
    ):
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and str(tmp_path) in err
        for looked_for in ("checkpoints/LATEST", "state.json", "'condmem_engram' section", ".safetensors"):
            assert looked_for in err
    assert not (tmp_path.parent / "x.safetensors").exists()
    (tmp_path / "notes.txt").write_text("not tensors")
    assert main(["inspect", str(tmp_path / "notes.txt")]) == 1
    assert "the files condmem reads are safetensors files" in capsys.readouterr().err
    # A folder of runs (the demo's) names them.
    demo = tmp_path / "demo"
    (demo / "engram" / "checkpoints").mkdir(parents=True)
    assert main(["inspect", str(demo)]) == 1
    assert "training runs engram: name one" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ convert
def _served_rows(path, layout, lid) -> torch.Tensor:
    """Layer `lid`'s rows as the host tier serves them (raw bytes), from a table file."""
    from condmem.hashing import NgramHasher
    from condmem.serving import EngramMemory

    hasher = NgramHasher(layout)
    memory = EngramMemory.from_table_file(
        path, hasher, tier="host", device="cpu", host_alloc="pageable", progress=False
    )
    try:
        store = memory.stores[lid]
        return store.gather_raw(torch.arange(store.num_rows)).clone()
    finally:
        memory.close()


def test_convert_a_training_run_serves_the_checkpoints_rows_exactly(made, tmp_path):
    from condmem.train.checkpoint import load_checkpoint

    out = tmp_path / "tables.safetensors"
    assert main(["convert", str(made / "run"), str(out), "--to", "bf16", "--no-progress"]) == 0
    model = load_checkpoint(made / "run", load_optimizer=False).model
    for lid in model.layout.layer_ids:
        weight = model.blocks[lid].engram.table.weight.detach()
        served = _served_rows(out, model.layout, lid).view(torch.bfloat16)
        assert torch.equal(served, weight.to(torch.bfloat16))
        # Negative control: truncating to bf16 instead of rounding would not pass (the check is not vacuous).
        truncated = (weight.view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
        assert not torch.equal(served, truncated)


@pytest.mark.parametrize(
    "dtype,fmt", [(torch.bfloat16, "bf16"), (torch.float32, "fp8_interleaved")], ids=["bf16", "fp8i"]
)
def test_convert_a_hugging_face_folder_serves_its_rows_exactly(made, tmp_path, dtype, fmt):
    from condmem.integrations.transformers import get_engram

    model = _hf_model(made / "tokenizer.json", dtype=dtype, head_dim=32)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "modeling_condmem.py").write_text("# remote code\n")  # other files are left alone
    shutil.copy(made / "tokenizer.json", tmp_path / "hf" / "tokenizer.json")
    out = tmp_path / "t.safetensors"
    assert main(["convert", str(tmp_path / "hf"), str(out), "--to", fmt, "--no-progress"]) == 0
    adapter = get_engram(model)
    for lid, engram in adapter.engrams.items():
        weight = engram.table.weight.detach()
        served = _served_rows(out, adapter.layout, lid)
        if fmt == "bf16":  # a bf16 model: the rows are its weights, bit for bit
            assert torch.equal(served.view(torch.bfloat16), weight)
        else:
            assert torch.equal(served, pack_rows(*quantize_fp8_e8m0(weight.float())))


def test_convert_refuses_what_it_cannot_convert(made, tmp_path, capsys, monkeypatch):
    def refused(argv, code, *texts):
        capsys.readouterr()
        assert main(argv) == code
        err = capsys.readouterr().err
        line = [e for e in err.splitlines() if "error:" in e]
        assert len(line) == 1 and all(t in line[0] for t in texts), err

    out = tmp_path / "t.safetensors"
    common = [str(out), "--no-progress"]
    refused(["convert", str(made / "base"), *common, "--to", "bf16"], 1, "without Engram", "baseline")
    refused(["convert", str(made / "run"), *common, "--to", "fp8"], 1, "multiple of 32", "8 wide", "bf16")
    refused(["convert", str(made / "run"), *common, "--to", "bf16", "--config", "c.json"], 2, "--config", "checkpoint")
    inside = made / "run" / "checkpoints" / "step-0000002" / "x.safetensors"
    refused(["convert", str(made / "run"), str(inside), "--to", "bf16", "--no-progress"], 1, "lies inside")
    other = tmp_path / "other.json"
    from condmem.train.bpe import train_bpe

    train_bpe(["a different corpus, a different tokenizer " * 50], vocab_size=300).save(str(other))
    refused(["convert", str(made / "run"), *common, "--to", "bf16", "--tokenizer", str(other)], 1, "tokenizer")
    assert not out.exists() and not inside.exists()  # nothing written by a refusal

    import condmem.train.checkpoint as checkpoint

    real = checkpoint.check_checkpoint

    def sharded(*args, **kwargs):
        parts = real(*args, **kwargs)
        parts.table_meta["sharded"] = "true"
        return parts

    def random_addresses(*args, **kwargs):
        parts = real(*args, **kwargs)
        parts.model_cfg = dataclasses.replace(parts.model_cfg, engram_addresses="random")
        return parts

    monkeypatch.setattr(checkpoint, "check_checkpoint", sharded)
    refused(["convert", str(made / "run"), *common, "--to", "bf16"], 1, "shards", "sharded_tables")
    monkeypatch.setattr(checkpoint, "check_checkpoint", random_addresses)
    refused(["convert", str(made / "run"), *common, "--to", "bf16"], 1, "random table addresses")
    monkeypatch.setattr(checkpoint, "check_checkpoint", real)
    assert main(["convert", str(made / "run"), *common, "--to", "bf16"]) == 0  # negative control: the same run converts
    capsys.readouterr()
    # inspect reads both, and says why convert refuses them.
    report = _report(made / "base", capsys)
    assert report["ok"] and report["layers"] == [] and "without Engram" in report["warnings"][0]["message"]


def test_a_damaged_checkpoint_is_refused_by_inspect_verify_and_convert(made, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(made / "run", run)
    assert main(["inspect", str(run), "--verify"]) == 0  # negative control: intact, it passes
    tables = run / "checkpoints" / "step-0000002" / "tables.safetensors"
    data = bytearray(tables.read_bytes())
    data[-5] ^= 0x10
    tables.write_bytes(bytes(data))
    capsys.readouterr()
    for argv in (
        ["inspect", str(run), "--no-progress"],
        ["inspect", str(run), "--verify"],
        ["convert", str(run), str(tmp_path / "t.safetensors"), "--to", "bf16", "--no-progress"],
    ):
        assert main(argv) == 1
        captured = capsys.readouterr()
        assert "does not match its recorded sha256" in captured.out + captured.err
    assert not (tmp_path / "t.safetensors").exists()


def test_a_hugging_face_folder_with_another_tokenizer_beside_it_is_an_error(made, hf_folder, tmp_path, capsys):
    folder, _ = hf_folder
    copy = tmp_path / "hf"
    shutil.copytree(folder, copy)
    shutil.copy(made / "tokenizer.json", copy / "tokenizer.json")  # the model's own: checked, accepted
    report = _report(copy, capsys)
    assert not report["warnings"] and report["tokenizer"].startswith(str(copy / "tokenizer.json"))
    (copy / "tokenizer.json").unlink()
    report = _report(copy, capsys)
    assert "no tokenizer.json" in report["warnings"][0]["message"]  # none saved: said, not an error
    from condmem.train.bpe import train_bpe

    train_bpe(["a different corpus, a different tokenizer " * 50], vocab_size=300).save(str(copy / "tokenizer.json"))
    assert main(["inspect", str(copy), "--no-progress"]) == 1
    assert "every row id would differ" in capsys.readouterr().out
    assert find_artefact(copy).kind == "hf"
