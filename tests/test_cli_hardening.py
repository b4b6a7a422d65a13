"""The command line with bad input or under signals: a one-line error naming the flag or file, never a
traceback; SIGTERM unwinds like Ctrl-C, so no partial output is left."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap

import pytest

from condmem.cli import main


@pytest.fixture
def config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(
        json.dumps({"layer_ids": [1], "max_ngram_size": 3, "n_heads": 2, "head_dim": 32, "table_size": 1000})
    )
    return path


@pytest.fixture
def tokenizer(tmp_path):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    tok = Tokenizer(WordLevel({f"w{i}": i for i in range(64)} | {"[UNK]": 64}, unk_token="[UNK]"))
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    return path


@pytest.mark.parametrize("ids", ["1e20", "100000000000000000000", "-1", "5,99999"])
def test_hash_ids_out_of_range_name_the_flag(ids, config, tokenizer, capsys):
    assert main(["hash", "--tokenizer", str(tokenizer), "--config", str(config), "--ids", ids]) == 1
    err = capsys.readouterr().err
    assert "--ids" in err and "Traceback" not in err


def test_bad_config_names_the_flag_and_file(tmp_path, tokenizer, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"layer_ids": [1], "short_conv": "false"}')
    assert main(["hash", "--tokenizer", str(tokenizer), "--config", str(bad), "--ids", "1,2"]) == 1
    err = capsys.readouterr().err
    assert "--config" in err and str(bad) in err and "short_conv" in err
    assert main(["layout", "--config", "/dev/zero"]) == 1
    assert "not a regular file" in capsys.readouterr().err


def test_convert_into_a_directory_is_refused_first(tmp_path, capsys):
    (tmp_path / "out").mkdir()
    assert main(["convert", str(tmp_path / "missing.safetensors"), str(tmp_path / "out"), "--to", "fp8"]) == 1
    err = capsys.readouterr().err
    assert "is a directory" in err and "Traceback" not in err


def test_sigterm_unwinds_like_ctrl_c(tmp_path):
    dst = tmp_path / "out.bin"
    script = textwrap.dedent(f"""
        import os, signal, time
        import condmem.cli as cli
        import condmem.cli.layout as layout
        from condmem.utils.atomic import atomic_path

        def slow(args):
            with atomic_path({str(dst)!r}) as tmp:
                tmp.write_bytes(b"partial")
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
            return 0

        layout.run = slow  # bound as the subcommand's func when main builds the parser
        raise SystemExit(cli.main(["layout", "--config", "x"]))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr
    assert list(tmp_path.iterdir()) == [], "the partial temp file is removed"


# ---------------------------------------------------------------------------- flags and files that were misread
@pytest.mark.parametrize(
    "flag, value",
    [
        ("--temperature", "nan"),
        ("--temperature", "-1"),
        ("--temperature", "inf"),
        ("--max-new-tokens", "-1"),
        ("--max-new-tokens", "0"),
        ("--top-k", "-5"),
    ],
)
def test_generate_refuses_bad_sampling_flags(tmp_path, flag, value, capsys):
    # Refused before the checkpoint is even looked for.
    rc = main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x", f"{flag}={value}"])
    assert rc == 2  # a usage error, as argparse's
    err = capsys.readouterr().err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("text", ['{"a": 1}', '{"a": ', ""], ids=["no_model", "truncated", "empty"])
def test_malformed_tokenizer_json_names_the_file(tmp_path, config, text, capsys):
    bad = tmp_path / "tok.json"
    bad.write_text(text)
    assert main(["hash", "--tokenizer", str(bad), "--config", str(config), "--ids", "1,2"]) == 1
    err = capsys.readouterr().err
    assert str(bad) in err and "tokenizer.json" in err and "Traceback" not in err, err


@pytest.mark.parametrize("ids", ["1,,2", "1,2,", ",1", "1 2", "1_0", "１"])
def test_hash_ids_that_are_not_plain_integers_are_refused(ids, config, tokenizer, capsys):
    assert main(["hash", "--tokenizer", str(tokenizer), "--config", str(config), "--ids", ids]) == 1
    err = capsys.readouterr().err
    assert "--ids" in err and "Traceback" not in err


def test_plain_ids_with_spaces_still_parse(config, tokenizer, capsys):
    assert main(["hash", "--tokenizer", str(tokenizer), "--config", str(config), "--ids", " 1, 2 ,3"]) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == [1, 2, 3]


def _small_table(tmp_path):
    import torch

    from condmem import EngramConfig, EngramLayout
    from condmem.tables.table_file import LayerRows, write_table_file

    layout = EngramLayout(
        EngramConfig(layer_ids=[1], max_ngram_size=2, n_heads=1, head_dim=32, table_size=500, compressed_vocab_size=50)
    )
    rows = torch.randn(layout.num_embeddings[0], 32).to(torch.bfloat16)
    return write_table_file(tmp_path / "src.safetensors", layout, "bf16", {1: [LayerRows("bf16", rows)]})


def test_enospc_mid_convert_names_the_output(tmp_path, monkeypatch, capsys):
    import errno
    import os

    from condmem.tables import safetensors_io

    src = _small_table(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    real = safetensors_io.StreamingWriter.write

    def full_disk(self, name, chunk):
        real(self, name, chunk)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as a write() to a full disk raises it

    monkeypatch.setattr(safetensors_io.StreamingWriter, "write", full_disk)
    dst = out / "dst.safetensors"
    assert main(["convert", str(src), str(dst), "--to", "bf16", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert str(dst) in err and "No space left on device" in err and "Traceback" not in err, err
    assert list(out.iterdir()) == [], "no temp, no lock file left"


def test_convert_keeps_the_destination_mode_and_writes_through_a_symlink(tmp_path):
    import os
    import stat

    src = _small_table(tmp_path)
    real_dir = tmp_path / "real"
    real_dir.mkdir()
    target = real_dir / "t.safetensors"
    target.write_bytes(b"old")
    os.chmod(target, 0o644)
    link = tmp_path / "link.safetensors"
    link.symlink_to(target)
    assert main(["convert", str(src), str(link), "--to", "bf16", "--no-progress"]) == 0
    assert link.is_symlink() and os.readlink(link) == str(target), "the link is kept"
    assert target.read_bytes() != b"old" and target.read_bytes() == (tmp_path / "src.safetensors").read_bytes()
    assert stat.S_IMODE(target.stat().st_mode) == 0o644


def test_inspect_sweeps_temps_of_killed_writers_beside_the_file(tmp_path, capsys):
    import subprocess

    src = _small_table(tmp_path)
    proc = subprocess.Popen(["true"])
    proc.wait()  # a pid no process has any more
    orphan = tmp_path / f".big.safetensors.{proc.pid}.k3j2h1g0.tmp"
    orphan.write_bytes(b"\0" * 4096)
    assert main(["inspect", str(src)]) == 0
    assert not orphan.exists() and str(orphan) in capsys.readouterr().err
