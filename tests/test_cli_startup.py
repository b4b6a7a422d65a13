"""``condmem --help`` and argument errors start fast: building the parser imports neither torch nor numpy.

Checked in a fresh interpreter (the test process has imported everything already): which heavy modules
`condmem.cli` pulls in while building every subcommand's parser and printing the help, and the time it takes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

SCRIPT = """
import contextlib, io, json, sys
import condmem.cli
with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
    condmem.cli.main(["--help"])
print(json.dumps(sorted(m for m in ("torch", "numpy", "tokenizers", "triton", "transformers") if m in sys.modules)))
"""


def test_help_imports_no_heavy_module():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=120)
    seconds = time.perf_counter() - start
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [], "condmem --help imported these"
    assert seconds < 10, seconds  # a loose bound on a busy 2-core machine; about 0.1 s unloaded


def test_deferred_arguments_appear_in_the_subcommand_help(capsys):
    from condmem.cli import main

    for op, option in (("lookup", "--table-gib"), ("e2e", "--backbones")):
        try:
            main(["bench", op, "--help"])
        except SystemExit:
            pass
        assert option in capsys.readouterr().out  # bench lookup's and bench e2e's options
