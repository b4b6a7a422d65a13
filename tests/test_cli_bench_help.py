"""``condmem bench OP --help``: each op its own short help, with its own options and examples."""

from __future__ import annotations

import pytest

from condmem.cli import main

OWN = {
    "hash": ["--hash-tokens", "--decode-batch"],
    "gather": ["--gather-ids", "--table-mib"],
    "gate": ["--variants"],
    "all": ["--hash-tokens", "--gather-ids"],
    "lookup": ["--tiers", "--streams", "--table-gib"],
    "e2e": ["--backbones", "--e2e-variants", "--table-gib"],
}
OTHERS = {"--hash-tokens", "--gather-ids", "--tiers", "--backbones"}


def _help(capsys, *argv: str) -> str:
    with pytest.raises(SystemExit) as done:
        main(["bench", *argv, "--help"])
    assert done.value.code == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("op", sorted(OWN))
def test_each_op_has_its_own_help(op, capsys):
    text = _help(capsys, op)
    assert text.startswith(f"usage: condmem bench {op} ")
    assert f"condmem bench {op}:" in text and f"\n  condmem bench {op}" in text, "its description and examples"
    for option in OWN[op]:
        assert option in text, option
    strangers = OTHERS - set(OWN[op])
    assert not [o for o in strangers if o in text], "another op's options in this op's help"
    assert len(text.splitlines()) < 100


def test_the_helps_differ_and_the_overview_lists_the_ops(capsys):
    texts = {op: _help(capsys, op) for op in OWN}
    assert len(set(texts.values())) == len(OWN)
    overview = _help(capsys)
    assert all(f"\n    {op} " in overview for op in OWN) and "condmem bench OP --help" in overview
    assert len(overview.splitlines()) < 40
