"""Flag values that crashed, hung or were silently changed: each is refused before any work with one line
naming the flag (exit status 2, as argparse's usage errors), or goes through with a note on stderr saying
what was capped or cut; a run killed during its first checkpoint save has one command that continues it.
Each case has a negative control: a valid value passes the check, or the old behaviour is shown to fail."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from condmem.cli import main

TEXT = "def add(x, y):\n    return x + y\n\nclass Point:\n    def __init__(self, x):\n        self.x = x\n"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny models: one thread is faster on a shared machine
    yield
    torch.set_num_threads(threads)


def _resume_args(out):
    """What a user types to continue a run: the folder, nothing that would change it."""
    return ["train", "--out", str(out), "--resume", "--device", "cpu", "--no-progress"]


def _usage_error(capsys, rc: int, flag: str) -> str:
    """Assert exit status 2 and one stderr line naming `flag`, no traceback; returns the line."""
    err = capsys.readouterr().err
    assert rc == 2, err
    assert flag in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    import shutil

    from condmem.train.data import stdlib_dir

    root = tmp_path_factory.mktemp("corpus")
    for name in ("textwrap.py", "string.py", "heapq.py", "bisect.py", "colorsys.py"):
        shutil.copy(stdlib_dir() / name, root / name)
    return root


def _train_args(corpus, out, *extra):
    return [
        "train",
        "--out",
        str(out),
        "--preset",
        "tiny",
        "--corpus",
        str(corpus),
        "--set",
        "data.vocab_size=300",
        "--steps",
        "1",
        "--device",
        "cpu",
        "--no-progress",
        *extra,
    ]


@pytest.fixture(scope="module")
def run_dir(corpus, tmp_path_factory):
    """A one-step tiny run (its checkpoint is what `generate` reads)."""
    cache = tmp_path_factory.getbasetemp() / "condmem-cache"
    before = os.environ.get("CONDMEM_CACHE_DIR")
    os.environ["CONDMEM_CACHE_DIR"] = str(cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = tmp_path_factory.mktemp("run") / "run"
        assert main(_train_args(corpus, out)) == 0
    finally:
        torch.set_num_threads(threads)
        if before is None:
            os.environ.pop("CONDMEM_CACHE_DIR", None)
        else:
            os.environ["CONDMEM_CACHE_DIR"] = before
    return out


# ------------------------------------------------------------------------------------------------ generate
@pytest.mark.parametrize("value", ["1e-300", "1e-7", "5e-324", "-0.5", "nan"])
def test_generate_refuses_a_temperature_that_overflows_the_logits(tmp_path, value, capsys):
    rc = main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x", "--temperature", value])
    _usage_error(capsys, rc, "--temperature")


@pytest.mark.parametrize("value", ["0", "1e-6", "0.8", "1e300"])
def test_generate_accepts_greedy_and_every_temperature_that_samples(tmp_path, value, capsys):
    """Negative control: these pass the check and fail only at the missing checkpoint (exit 1)."""
    rc = main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x", "--temperature", value])
    err = capsys.readouterr().err
    assert rc == 1 and "no checkpoint" in err, err


def test_the_refused_temperatures_are_the_ones_sampling_cannot_take():
    """The check's bound against the sampler: 1e-300 gives NaN probabilities (the old traceback);
    the smallest accepted temperature samples (the top token, as greedy would)."""
    from condmem.cli.generate import MIN_TEMPERATURE
    from condmem.models.generate import sample_next

    logits = torch.randn(2, 300) * 20
    with pytest.raises(RuntimeError, match="inf|nan"):
        sample_next(logits, 1e-300, 40, torch.Generator().manual_seed(0))
    got = sample_next(logits, MIN_TEMPERATURE, 40, torch.Generator().manual_seed(0))
    assert torch.equal(got, logits.argmax(-1))


@pytest.mark.parametrize("device", ["bogus", "meta", "cuda:99", "cpu:x"])
def test_generate_refuses_a_device_torch_cannot_use(tmp_path, device, capsys):
    rc = main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x", "--device", device])
    _usage_error(capsys, rc, "--device")


@pytest.mark.parametrize("device", ["cpu", "auto"])
def test_generate_accepts_the_devices_it_runs_on(tmp_path, device, capsys):
    rc = main(["generate", "--checkpoint", str(tmp_path / "none"), "--prompt", "x", "--device", device])
    assert rc == 1 and "no checkpoint" in capsys.readouterr().err


def test_generate_caps_max_new_tokens_with_a_note_and_keeps_the_prompt(run_dir, monkeypatch, capsys):
    import condmem.models as models

    calls = []
    real = models.generate

    def spy(model, ids, n, **kw):
        calls.append((ids.numel(), n, model.cfg.max_seq_len))
        return real(model, ids, n, **kw)

    monkeypatch.setattr(models, "generate", spy)
    argv = ["generate", "--checkpoint", str(run_dir), "--prompt", "def add", "--device", "cpu", "--temperature", "0"]
    assert main([*argv, "--max-new-tokens", str(10**12)]) == 0
    (n_prompt, n_new, room), err = calls[-1], capsys.readouterr().err
    assert n_new == room - n_prompt, "the prompt kept whole, the new tokens capped to what is left"
    notes = [line for line in err.splitlines() if "note:" in line]
    assert notes == [
        f"condmem generate: note: --max-new-tokens 1,000,000,000,000 capped to {n_new}: the model holds {room} "
        f"tokens (max_seq_len), the prompt {n_prompt} of them"
    ]
    # Negative control: what fits is neither capped nor noted.
    assert main([*argv, "--max-new-tokens", "3"]) == 0
    assert calls[-1][1] == 3 and "note:" not in capsys.readouterr().err


def test_generate_cuts_an_over_long_prompt_to_its_tail_with_a_note(run_dir, monkeypatch, capsys):
    import condmem.models as models

    calls = []
    real = models.generate

    def spy(model, ids, n, **kw):
        calls.append((ids.tolist(), n, model.cfg.max_seq_len))
        return real(model, ids, n, **kw)

    monkeypatch.setattr(models, "generate", spy)
    prompt = TEXT * 8
    argv = ["generate", "--checkpoint", str(run_dir), "--prompt", prompt, "--device", "cpu", "--max-new-tokens", "4"]
    assert main(argv) == 0
    (kept, n_new, room), err = calls[-1], capsys.readouterr().err
    from condmem.train.checkpoint import load_checkpoint

    full = load_checkpoint(run_dir, load_optimizer=False).tokenizer.encode(prompt, add_special_tokens=False).ids
    assert len(full) > room and n_new == 4 and len(kept) == room - 4 and kept == full[-len(kept) :]
    assert f"note: the prompt's {len(full)} tokens were cut to its last {room - 4}" in err, err


@pytest.mark.parametrize(
    "n_prompt, max_new, room, expected",
    [
        (10, 20, 64, (10, 20)),  # fits
        (10, 10**12, 64, (10, 54)),  # new tokens capped, the prompt whole
        (100, 4, 64, (60, 4)),  # the prompt's tail, the new tokens whole
        (100, 10**12, 64, (32, 32)),  # both: the prompt keeps half the positions
        (64, 1, 64, (63, 1)),
        (1, 10**12, 2, (1, 1)),
    ],
)
def test_fit_to_model(n_prompt, max_new, room, expected):
    from condmem.cli.generate import fit_to_model

    keep, new = fit_to_model(n_prompt, max_new, room)
    assert (keep, new) == expected and keep + new <= room and keep >= 1 and new >= 1


# --------------------------------------------------------------------------------------------------- train
@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_train_refuses_a_table_init_std_that_is_not_a_finite_positive_number(tmp_path, value, capsys):
    rc = main(_train_args(tmp_path / "missing-corpus", tmp_path / "out", "--set", f"engram.table_init_std={value}"))
    _usage_error(capsys, rc, "engram.table_init_std")
    assert not (tmp_path / "out").exists(), "refused before --out is touched"


def test_a_nan_table_init_std_is_refused_by_the_model_config_too():
    """The library's own check (demo, study, configs): NaN passed `value <= 0`, then crashed in normal_."""
    from condmem.config import ConfigError
    from condmem.models.config import ModelConfig

    for bad in (math.nan, math.inf, 0.0):
        with pytest.raises(ConfigError, match="engram_table_init_std must be a finite positive number"):
            ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, engram_table_init_std=bad)
    ModelConfig(vocab_size=64, dim=32, n_layers=2, n_heads=2, engram_table_init_std=1e-3)  # negative control
    with pytest.raises(RuntimeError, match="std"):  # what a NaN std did once it got through
        torch.nn.init.normal_(torch.empty(4), std=math.nan)


@pytest.mark.parametrize("command", ["train", "tokenizer"])
@pytest.mark.parametrize("value", ["1000000000", "1048577", "100"])
def test_vocab_size_out_of_bounds_is_refused_before_the_corpus_is_read(tmp_path, command, value, capsys):
    if command == "train":
        argv = _train_args(tmp_path / "missing-corpus", tmp_path / "out", "--set", f"data.vocab_size={value}")
        flag = "data.vocab_size"
    else:
        argv = ["tokenizer", "train", "--corpus", str(tmp_path / "missing"), "--out", str(tmp_path / "t.json")]
        argv += ["--vocab-size", value]
        flag = "--vocab-size"
    err = _usage_error(capsys, main(argv), flag)
    assert "259..1,048,576" in err or (command == "train" and "must be >= 257" in err)


def test_train_bpe_refuses_a_vocabulary_it_cannot_allocate_and_trains_the_largest_it_allows():
    from condmem.train.bpe import MAX_VOCAB_SIZE, train_bpe

    with pytest.raises(ValueError, match="above the 1,048,576 ids"):
        train_bpe(iter([TEXT]), 10**9)  # refused before the trainer reserves ~70 GB and aborts
    tok = train_bpe(iter([TEXT * 20]), MAX_VOCAB_SIZE)  # negative control: the bound itself trains
    assert 259 < tok.get_vocab_size() <= MAX_VOCAB_SIZE


def test_train_says_up_front_that_seq_len_raises_max_seq_len(tmp_path, monkeypatch, capsys):
    import condmem.train.build as build

    def stop(*args, **kwargs):
        raise ValueError("stopped where the data would be prepared")

    monkeypatch.setattr(build, "prepare", stop)
    assert main(_train_args(tmp_path / "c", tmp_path / "out", "--set", "train.seq_len=100000")) == 1
    out, err = capsys.readouterr()
    assert (
        "condmem train: note: train.seq_len 100,000 is above the tiny preset's max_seq_len 64: the model's "
        "max_seq_len is raised to 100,000" in err
    ), err
    assert "preset tiny: batches of 4 x 100,000 tokens, 1 step, on cpu; preparing the data" in out, out
    assert "stopped where the data would be prepared" in err
    # Negative control: a window within the preset's positions gets the plan line, no note.
    assert main(_train_args(tmp_path / "c", tmp_path / "out2", "--set", "train.seq_len=32")) == 1
    out, err = capsys.readouterr()
    assert "preparing the data" in out and "note:" not in err


def test_train_refuses_seq_len_longer_than_the_max_seq_len_given(tmp_path, capsys):
    rc = main(
        _train_args(tmp_path / "c", tmp_path / "out", "--set", "train.seq_len=100", "--set", "model.max_seq_len=64")
    )
    _usage_error(capsys, rc, "train.seq_len")


@pytest.mark.parametrize("device", ["bogus", "cuda:99"])
def test_train_refuses_a_device_torch_cannot_use(tmp_path, device, capsys):
    rc = main(_train_args(tmp_path / "c", tmp_path / "out", "--device", device))
    _usage_error(capsys, rc, "--device")


# ----------------------------------------------------------------------------------------------- tokenizer
def test_tokenizer_refuses_a_negative_min_frequency_and_takes_zero(corpus, tmp_path, capsys):
    out = tmp_path / "tok.json"
    argv = ["tokenizer", "train", "--corpus", str(corpus), "--out", str(out), "--vocab-size", "300"]
    _usage_error(capsys, main([*argv, "--min-frequency", "-1"]), "--min-frequency")
    assert not out.exists()
    assert main([*argv, "--min-frequency", "0"]) == 0 and out.is_file()  # negative control
    from condmem.train.bpe import train_bpe

    with pytest.raises(ValueError, match="min_frequency must be >= 0"):  # the library's own check
        train_bpe(iter([TEXT]), 300, min_frequency=-1)


@pytest.mark.parametrize("value", ["0", "-5"])
def test_tokenizer_refuses_max_bytes_below_one(tmp_path, value, capsys):
    argv = ["tokenizer", "train", "--corpus", str(tmp_path), "--out", str(tmp_path / "t.json"), "--max-bytes", value]
    _usage_error(capsys, main(argv), "--max-bytes")


# ------------------------------------------------------------------------------------------------- inspect
@pytest.mark.parametrize("value", ["0", "-5"])
def test_inspect_refuses_a_sample_below_one_row(tmp_path, value, capsys):
    _usage_error(capsys, main(["inspect", str(tmp_path / "t.safetensors"), "--sample", value]), "--sample")


def test_inspect_takes_a_sample_of_one_row(tmp_path, capsys):
    """Negative control: --sample 1 passes the check (the missing file is the error, exit 1)."""
    assert main(["inspect", str(tmp_path / "t.safetensors"), "--sample", "1"]) == 1
    assert "--sample" not in capsys.readouterr().err


# -------------------------------------------------------------------------- a kill during the first save
def _killed_in_first_save(corpus, out, cache) -> None:
    """`condmem train` SIGKILLed while its first checkpoint is being written (state.json not yet)."""
    script = textwrap.dedent(f"""
        import os, signal, sys
        import torch
        torch.set_num_threads(1)
        import condmem.train.checkpoint as checkpoint
        checkpoint._write_state = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        from condmem.cli import main
        sys.exit(main({_train_args(corpus, out)!r}))
    """)
    env = dict(os.environ, CONDMEM_CACHE_DIR=str(cache))
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]


@pytest.fixture
def half_saved(corpus, tmp_path, tmp_path_factory):
    out = tmp_path / "run"
    _killed_in_first_save(corpus, out, tmp_path_factory.getbasetemp() / "condmem-cache")
    left = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert len(left) == 1 and left[0].startswith(".step-0000001."), left  # a temp folder, no LATEST
    return out


def test_resume_after_a_kill_in_the_first_save_starts_afresh_and_a_plain_rerun_says_so(corpus, half_saved, capsys):
    from condmem.train.checkpoint import load_checkpoint

    out = half_saved
    assert main(_train_args(corpus, out)) == 1
    err = capsys.readouterr().err
    assert "no finished checkpoint" in err and "--resume starts the run afresh there" in err, err
    assert main([*_train_args(corpus, out), "--resume"]) == 0
    err = capsys.readouterr().err
    assert f"note: --resume: {out} holds no checkpoint yet" in err, err
    assert "starting the run afresh there with this command's options" in err, err
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["LATEST", "step-0000001"], "the temp swept"
    assert load_checkpoint(out, load_optimizer=False).state["step"] == 1


def test_negative_control_without_the_rule_resume_and_rerun_point_at_each_other(
    corpus, half_saved, monkeypatch, capsys
):
    import condmem.cli.train as train_cli

    monkeypatch.setattr(train_cli, "_nothing_to_resume", lambda out: False)  # the old behaviour
    out = half_saved
    assert main(_train_args(corpus, out)) == 1
    assert "continue that run with --resume" in capsys.readouterr().err
    assert main(_resume_args(out)) == 1
    assert "no checkpoint at" in capsys.readouterr().err
    assert main([*_train_args(corpus, out), "--resume"]) == 1  # the options again: refused as changes
    assert "a resumed run keeps the settings of its checkpoint" in capsys.readouterr().err


def test_resume_does_not_start_afresh_where_a_checkpoint_was_finished(corpus, tmp_path, capsys):
    """LATEST names a checkpoint that is gone: a finished run's folder was damaged; --resume says so
    instead of training over it."""
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "LATEST").write_text("step-0000005\n")
    assert main(_resume_args(out)) == 1
    err = capsys.readouterr().err
    assert "step-0000005" in err and "not a complete checkpoint" in err and "afresh" not in err, err
