"""The shape of the model code: one block forward, one loop over the blocks, one class holding
look-back tokens, no bare `rows` name (import circles: tests/test_static.py, every module).

Read from the source (AST), so a second way of running the blocks fails here before it can
drift from the first: training, generate, the serving steps, tensor parallelism and the
Hugging Face hooks build a `ForwardContext` and run `DecoderLM.forward`.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "condmem"


def _functions():
    """(module path, qualified name, function node) of every function in src/condmem."""
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        stack = [(tree, "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    name = f"{prefix}{child.name}"
                    yield path.relative_to(SRC).as_posix(), name, child
                    stack.append((child, name + "."))
                elif isinstance(child, ast.ClassDef):
                    stack.append((child, f"{prefix}{child.name}."))
                else:
                    stack.append((child, prefix))


def _mentions(node: ast.AST, attr: str) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == attr for n in ast.walk(node))


def _own_body(fn: ast.AST):
    """The nodes of `fn` outside the functions nested in it."""
    stack = list(ast.iter_child_nodes(fn))
    while stack:
        node = stack.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            stack.extend(ast.iter_child_nodes(node))


def test_one_class_defines_the_decoder_block_forward():
    """A block forward calls both pre-norms of a block (``attn_norm`` and ``mlp_norm``, or their
    weights); only `Block.forward` does."""
    found = []
    for module, name, fn in _functions():
        calls = [n for n in _own_body(fn) if isinstance(n, ast.Call)]
        if any(_mentions(c, "attn_norm") for c in calls) and any(_mentions(c, "mlp_norm") for c in calls):
            found.append(f"{module}:{name}")
    assert found == ["models/transformer.py:Block.forward"], found


def _iterates_blocks(loop: ast.For | ast.comprehension) -> bool:
    return _mentions(loop.iter, "blocks")


def _runs(target: ast.AST, body: list[ast.AST]) -> bool:
    """Whether `body` runs the loop's block: calls it, one of its sub-modules, or hands it to a call."""
    if not isinstance(target, (ast.Name, ast.Tuple)):
        return False
    names = {n.id for n in ast.walk(target) if isinstance(n, ast.Name)}
    for stmt in body:
        for node in ast.walk(stmt):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Name) and func.id in names:
                return True  # block(x, ...)
            if (
                isinstance(func, ast.Attribute)
                and func.attr in ("engram", "attn", "mlp", "moe", "attn_norm", "mlp_norm", "forward")
                and isinstance(func.value, ast.Name)
                and func.value.id in names
            ):
                return True  # block.attn(...), block.engram(...)
            if any(isinstance(a, ast.Name) and a.id in names for a in node.args):
                return True  # a helper given the block
    return False


def test_one_loop_runs_the_blocks():
    """The only loop over ``.blocks`` that runs them is `DecoderLM.forward`'s (loops that read the
    blocks' modules or parameters are not counted)."""
    found = []
    for module, name, fn in _functions():
        for node in _own_body(fn):
            if isinstance(node, ast.For) and _iterates_blocks(node) and _runs(node.target, node.body):
                found.append(f"{module}:{name}")
            if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp, ast.DictComp)):
                for gen in node.generators:
                    elts = [node.key, node.value] if isinstance(node, ast.DictComp) else [node.elt]
                    if _iterates_blocks(gen) and _runs(gen.target, elts):
                        found.append(f"{module}:{name}")
    assert found == ["models/transformer.py:DecoderLM.forward"], found


def test_the_checks_see_a_second_block_forward_and_loop():
    """Negative control: a serving walk with its own loop and block forward is caught."""
    tree = ast.parse(
        "def _attention_mlp(block, x):\n"
        "    h = rms_norm(x, block.attn_norm.weight)\n"
        "    return rms_norm(h, block.mlp_norm.weight)\n"
        "def run(model, x):\n"
        "    for i, block in enumerate(model.blocks):\n"
        "        x = _attention_mlp(block, x)\n"
        "    return x\n"
    )
    fns = {f.name: f for f in tree.body if isinstance(f, ast.FunctionDef)}
    calls = [n for n in _own_body(fns["_attention_mlp"]) if isinstance(n, ast.Call)]
    assert any(_mentions(c, "attn_norm") for c in calls) and any(_mentions(c, "mlp_norm") for c in calls)
    loop = next(n for n in _own_body(fns["run"]) if isinstance(n, ast.For))
    assert _iterates_blocks(loop) and _runs(loop.target, loop.body)


LOOK_BACK_NAMES = {"tokens", "lookback", "look_back", "window", "_window", "_tail"}


# Attributes so named that hold no look-back: the sequence-parallel slice of tokens a rank keeps, the
# tokens a failed request generated (its result).
NOT_LOOK_BACK = ["serving/memory.py:Prepared", "serving/scheduler.py:RequestFailed"]


def _look_back_holders(src: Path = SRC) -> list[str]:
    """Classes of the model, serving, HF and distributed packages that keep an attribute named like
    a look-back (token ids before the next token)."""
    found = []
    for package in ("models", "serving", "integrations", "distributed"):
        for path in sorted((src / package).rglob("*.py")):
            for cls in ast.walk(ast.parse(path.read_text())):
                if not isinstance(cls, ast.ClassDef):
                    continue
                names = set()
                for node in ast.walk(cls):
                    if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                        names.add(node.target.id)  # a dataclass field
                    targets = node.targets if isinstance(node, ast.Assign) else []
                    for t in targets:
                        if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                            names.add(t.attr)
                        if isinstance(t, ast.Tuple):
                            names.update(
                                e.attr
                                for e in t.elts
                                if isinstance(e, ast.Attribute)
                                and isinstance(e.value, ast.Name)
                                and e.value.id == "self"
                            )
                if names & LOOK_BACK_NAMES:
                    found.append(f"{path.relative_to(src).as_posix()}:{cls.name}")
    return found


def test_one_class_holds_look_back_tokens():
    """Every owner of sequences (the model's cache, the serving cache, the memory, the HF decode state)
    keeps its look-back in an `NgramHistory`; no other class keeps token ids of its own."""
    import numpy as np
    import torch

    from condmem import EngramConfig
    from condmem.hashing import NgramHistory
    from condmem.integrations.transformers.decode_state import DecodeState
    from condmem.models import DecoderLM, ModelConfig
    from condmem.serving import EngramMemory, ServingCache

    assert _look_back_holders() == NOT_LOOK_BACK
    ecfg = EngramConfig(
        layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=53, hidden_size=32, compressed_vocab_size=40
    )
    cfg = ModelConfig(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, engram=ecfg)
    model = DecoderLM(cfg, token_lookup=np.arange(50) % 40)
    tables = {1: model.blocks[1].engram.table.weight.detach()}
    memory = EngramMemory.from_weights(model.hasher, tables, "host", "cpu", host_alloc="pageable", max_sequences=2)
    state = DecodeState.of_window(model.hasher, torch.zeros(2, 3, dtype=torch.long), None, 3)
    owners = [model.new_cache(2, 8).history, ServingCache(model, n_slots=2, max_len=8).history, memory.history]
    assert all(isinstance(h, NgramHistory) for h in [*owners, state.history])
    memory.close()


def test_the_look_back_check_sees_a_token_copy(tmp_path):
    """Negative control: a cache class with its own ``tokens`` tensor is found."""
    package = tmp_path / "models"
    package.mkdir()
    (package / "cache.py").write_text("class Cache:\n    def __init__(self):\n        self.tokens = None\n")
    for name in ("serving", "integrations", "distributed"):
        (tmp_path / name).mkdir()
    assert _look_back_holders(tmp_path) == ["models/cache.py:Cache"]


def test_a_history_by_position_is_refused_by_the_hash_kernels():
    """The two forms of the look-back state do not mix: the decode and ragged hashes name the form they need."""
    import numpy as np
    import pytest
    import torch

    from condmem import EngramConfig, EngramLayout, NgramHasher
    from condmem.hashing import NgramHistory
    from condmem.hashing.hasher import HashInputError

    cfg = EngramConfig(layer_ids=[1], max_ngram_size=3, n_heads=2, head_dim=8, table_size=53, hidden_size=32)
    hasher = NgramHasher(EngramLayout(cfg, compressed_vocab_size=40), token_lookup=np.arange(50) % 40, pad_id=0)
    by_position = NgramHistory(2, 3, hasher.pad_compressed_id, max_len=8)
    slots, ids = torch.tensor([0, 1]), torch.tensor([3, 4])
    with pytest.raises(HashInputError, match="by position"):
        hasher.decode(by_position, slots, ids)
    with pytest.raises(HashInputError, match="by position"):
        hasher.hash_ragged(ids, torch.tensor([0, 1, 2]), history=by_position, slots=slots)
    rolling = hasher.new_history(2)
    assert hasher.decode(rolling, slots, ids).shape == (2, 1, 4)


def _names_called_rows(src: Path = SRC) -> list[str]:
    """Where the model, serving, HF and distributed packages bind the bare name ``rows`` (a variable,
    a parameter, an attribute or a method), other than the deprecated aliases of renamed names."""
    found = []
    for package in ("models", "serving", "integrations", "distributed"):
        for path in sorted((src / package).rglob("*.py")):
            where = path.relative_to(src).as_posix()
            tree = ast.parse(path.read_text())
            aliases = {  # ``rows = renamed_attribute(...)``: a renamed name's deprecated alias
                id(t)
                for node in ast.walk(tree)
                if isinstance(node, ast.Assign)
                and isinstance(node.value, ast.Call)
                and getattr(node.value.func, "id", "") == "renamed_attribute"
                for t in node.targets
            }
            for node in ast.walk(tree):
                if isinstance(node, ast.Name) and node.id == "rows" and isinstance(node.ctx, ast.Store):
                    if id(node) not in aliases:
                        found.append(f"{where}:{node.lineno}")
                elif isinstance(node, ast.arg) and node.arg == "rows":
                    found.append(f"{where}:{node.lineno}")
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == "rows":
                    found.append(f"{where}:{node.lineno}:def")
                elif isinstance(node, ast.keyword) and node.arg == "rows":
                    found.append(f"{where}:{node.lineno}:rows=")
    return sorted(set(found))


def test_no_bare_rows_name():
    """``rows`` said three things (a table's size, row ids, looked-up vectors): the names are now
    ``num_rows``, ``row_ids`` and ``row_vectors``. The one ``rows`` left is the decode fetch's wait
    hook, which its negative-control GPU test replaces by that name."""
    found = _names_called_rows()
    assert [f for f in found if not f.startswith("serving/decode_fetch.py:")] == [], found
    assert len(found) == 1 and found[0].endswith(":def"), found


def test_the_rows_check_sees_a_bare_rows(tmp_path):
    """Negative control: a local ``rows`` and a ``rows=`` keyword are found."""
    for name in ("models", "serving", "integrations", "distributed"):
        (tmp_path / name).mkdir()
    (tmp_path / "models" / "m.py").write_text("def f(t):\n    rows = t(1)\n    return g(rows=rows)\n")
    assert _names_called_rows(tmp_path) == ["models/m.py:2", "models/m.py:3:rows="]
