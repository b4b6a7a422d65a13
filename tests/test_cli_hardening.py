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
    path.write_text(json.dumps({"layer_ids": [1], "max_ngram_size": 3, "n_heads": 2, "head_dim": 32,
                                "table_size": 1000}))
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
