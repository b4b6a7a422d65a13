"""`condmem.ops.launch.FastLaunch`: the shortcut launch of our kernels keeps Triton's results.

* the key: every change Triton compiles a new kernel for (a pointer's dtype or 16-byte
  alignment, an int's ``== 1`` / divisibility by 16 / width, a scalar's type, a constexpr,
  ``num_warps``, the device, a compile knob) misses the cache and takes the normal launch;
  the same specialization hits it; and where our key says "same", Triton's own
  specialization (``native_specialize_impl``) says so too;
* the shortcut calls the compiled kernel's launcher with ``JITFunction.run``'s convention;
* refusals: launch hooks, pre-run hooks, constexprs out of the signature's order, arguments
  the key does not cover, unknown Triton versions and the interpreter all take the normal
  launch;
* the ops: on the CPU (interpreter) the normal launch runs and gives the same results with a
  stand-in runtime installed; on a GPU (`gpu`) the shortcut gives ``torch.equal`` results
  against the plain launch across shapes and views that change the specialization.
"""

from __future__ import annotations

import subprocess
import sys
import types

import numpy as np
import pytest
import torch

import condmem.ops.launch as launch
from condmem.ops.launch import FastLaunch, Runtime
from kernel_helpers import INTERPRET, needs_kernels

pytestmark = needs_kernels


class _Compiled:
    """Stands in for Triton's CompiledKernel: records each shortcut launch."""

    def __init__(self, calls: list):
        self.function = 11
        self.packed_metadata = (4, 1, 0)
        self.calls = calls

    def run(self, *args):
        self.calls.append(args)


class _Kernel:
    """Stands in for a JITFunction of 2 pointers, 2 scalars and the constexprs A, B."""

    arg_names = ["x_ptr", "y_ptr", "n", "eps", "A", "B"]
    constexprs = [4, 5]

    def __init__(self):
        self.pre_run_hooks = []
        self.normal = []  # (grid, args, kwargs) of each normal launch
        self.shortcut = []

    def __getitem__(self, grid):
        def launch_(*args, **kwargs):
            self.normal.append((grid, args, kwargs))
            return _Compiled(self.shortcut)

        return launch_


def _knobs(debug=False):
    hooks = types.SimpleNamespace(calls=[])
    runtime = types.SimpleNamespace(
        launch_enter_hook=hooks, launch_exit_hook=types.SimpleNamespace(calls=[]), debug=debug
    )
    runtime.add_stages_inspection_hook = None
    return types.SimpleNamespace(runtime=runtime, compilation=types.SimpleNamespace(instrumentation_mode=""))


@pytest.fixture
def runtime(monkeypatch):
    """A stand-in Runtime (device 0 unless `state["device"]` says otherwise, stream 100 + device)."""
    state = {"device": 0}
    rt = Runtime(_knobs(), lambda: state["device"], lambda d: 100 + d)
    monkeypatch.setattr(launch, "RUNTIME", rt)
    return types.SimpleNamespace(knobs=rt.knobs, state=state)


def test_the_same_specialization_takes_the_shortcut_with_tritons_calling_convention(runtime):
    kernel = _Kernel()
    fast = FastLaunch(kernel)
    x, y = torch.zeros(32, dtype=torch.int64), torch.zeros(8, dtype=torch.float32)
    fast((3,), (x, y), (48,), (0.5,), 4, A=2, B=True)
    assert len(kernel.normal) == 1 and not kernel.shortcut
    grid, args, kwargs = kernel.normal[0]
    assert grid == (3,) and args == (x, y, 48, 0.5) and kwargs == {"num_warps": 4, "A": 2, "B": True}
    x2 = torch.ones(64, dtype=torch.int64)  # other tensors, same dtypes and alignment, other values
    fast((5, 2), (x2, y), (32,), (0.25,), 4, A=2, B=True)
    assert len(kernel.normal) == 1 and len(kernel.shortcut) == 1
    assert kernel.shortcut[0] == (5, 2, 1, 100, 11, (4, 1, 0), None, None, None, x2, y, 32, 0.25, 2, True)
    assert fast.launches == [1, 1]
    # The compiled kernel itself is held: Triton 3.9 unloads its module when the object goes.
    assert [type(entry[-1]) for entry in fast._compiled.values()] == [_Compiled]


def _variants(x, y):
    """(name, ptrs, ints, floats, num_warps, constexprs): each differs from the first in one thing Triton
    specializes on."""
    base = ((x, y), (32,), (0.5,), 4, {"A": 2, "B": True})
    return [
        ("base", *base),
        ("pointer dtype", (x.view(torch.float64), y), (32,), (0.5,), 4, {"A": 2, "B": True}),
        ("pointer alignment", (x[1:], y), (32,), (0.5,), 4, {"A": 2, "B": True}),
        ("second pointer alignment", (x, y[2:]), (32,), (0.5,), 4, {"A": 2, "B": True}),
        ("int == 1", (x, y), (1,), (0.5,), 4, {"A": 2, "B": True}),
        ("int not divisible by 16", (x, y), (33,), (0.5,), 4, {"A": 2, "B": True}),
        ("int 0", (x, y), (0,), (0.5,), 4, {"A": 2, "B": True}),
        ("int wider than i32", (x, y), (2**32,), (0.5,), 4, {"A": 2, "B": True}),
        ("int wider than i64", (x, y), (2**63 + 16,), (0.5,), 4, {"A": 2, "B": True}),
        ("negative int", (x, y), (-32,), (0.5,), 4, {"A": 2, "B": True}),
        ("float where an int was", (x, y), (32.0,), (0.5,), 4, {"A": 2, "B": True}),
        ("bool where an int was", (x, y), (True,), (0.5,), 4, {"A": 2, "B": True}),
        ("constexpr value", (x, y), (32,), (0.5,), 4, {"A": 3, "B": True}),
        ("constexpr bool", (x, y), (32,), (0.5,), 4, {"A": 2, "B": False}),
        ("constexpr of another type", (x, y), (32,), (0.5,), 4, {"A": 2, "B": 1}),
        ("num_warps", (x, y), (32,), (0.5,), 8, {"A": 2, "B": True}),
    ]


def test_every_change_triton_specializes_on_misses_the_cache(runtime):
    kernel = _Kernel()
    fast = FastLaunch(kernel)
    x, y = torch.zeros(32, dtype=torch.int64), torch.zeros(8, dtype=torch.float32)
    variants = _variants(x, y)
    for name, ptrs, ints, floats, warps, consts in variants:
        before = len(kernel.normal)
        fast((1,), ptrs, ints, floats, warps, **consts)
        assert len(kernel.normal) == before + 1, f"{name}: hit the cache of another specialization"
    for name, ptrs, ints, floats, warps, consts in variants:  # each now cached under its own key
        before = len(kernel.shortcut)
        fast((1,), ptrs, ints, floats, warps, **consts)
        assert len(kernel.shortcut) == before + 1, f"{name}: missed its own entry"
        assert kernel.shortcut[-1][9:] == (*ptrs, *ints, *floats, *consts.values()), name
    base = variants[0]
    for change in ("device", "knob"):
        if change == "device":
            runtime.state["device"] = 1
        else:
            runtime.state["device"] = 0
            runtime.knobs.runtime.debug = True
        before = len(kernel.normal)
        fast((1,), *base[1:5], **base[5])
        assert len(kernel.normal) == before + 1, f"a change of {change} hit the cache"
    assert kernel.shortcut[-1][3] == 100  # the stream of the device the shortcut ran on


def test_a_same_key_means_the_same_triton_specialization():
    """Where `_key` gives two arguments the same part, Triton's own specialization of them is the same."""
    try:
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.compiler import BaseBackend
    except ImportError:
        pytest.skip("this Triton has no native_specialize_impl")
    base = torch.zeros(64, dtype=torch.int64)
    scalars = [0, 1, 2, 8, 15, 16, 17, 24, 32, 40, 2**31 - 16, 2**31 - 1, 2**31, 2**32, -1, -16, -(2**31)]
    scalars += [-(2**31) - 16, -(2**31) - 8]
    scalars += [2**63 - 16, 2**63, 2**63 + 16, 2**64 - 16, True, False, 0.5, 1.0, 16.0]
    tensors = [base, base[1:], base[2:], base.view(torch.int32)[1:], base.view(torch.uint8)[16:], base.float()]
    for specialize in (True, False):  # do_not_specialize arguments: our key splits them further (harmless)

        def triton(a, specialize=specialize):
            return native_specialize_impl(BaseBackend, a, False, specialize, True)

        seen = {}
        for a in scalars:
            part = launch._key((), (a,), ()) if not isinstance(a, float) else launch._key((), (), (a,))
            assert seen.setdefault(part, triton(a)) == triton(a), f"{a!r} shares a key with another specialization"
        seen = {}
        for t in tensors:
            part = launch._key((t,), (), ())
            assert seen.setdefault(part, triton(t)) == triton(t), f"{t.dtype} at {t.data_ptr() % 16} shares a key"


def test_hooks_and_pre_run_hooks_take_the_normal_launch(runtime):
    kernel = _Kernel()
    fast = FastLaunch(kernel)
    x, y = torch.zeros(32, dtype=torch.int64), torch.zeros(8)
    for _ in range(2):
        fast((1,), (x, y), (32,), (0.5,), 4, A=2, B=True)
    assert fast.launches == [1, 1]
    runtime.knobs.runtime.launch_enter_hook.calls.append(print)  # a profiler's hook
    fast((1,), (x, y), (32,), (0.5,), 4, A=2, B=True)
    runtime.knobs.runtime.launch_enter_hook.calls.clear()
    kernel.pre_run_hooks.append(print)
    fast((1,), (x, y), (32,), (0.5,), 4, A=2, B=True)
    kernel.pre_run_hooks.clear()
    runtime.knobs.runtime.add_stages_inspection_hook = print
    fast((1,), (x, y), (32,), (0.5,), 4, A=2, B=True)
    assert fast.launches == [4, 1]


def test_calls_the_shortcut_cannot_reproduce_take_the_normal_launch(runtime):
    x, y = torch.zeros(32, dtype=torch.int64), torch.zeros(8)
    kernel = _Kernel()
    fast = FastLaunch(kernel)
    for _ in range(2):  # constexprs out of the signature's order: Triton binds them by name, the shortcut could not
        fast((1,), (x, y), (32,), (0.5,), 4, B=True, A=2)
    for _ in range(2):  # an argument the key does not cover
        fast((1,), (x, y), (None,), (0.5,), 4, A=2, B=True)
    for _ in range(2):
        fast((1,), (x, 7), (32,), (0.5,), 4, A=2, B=True)
    for value in (1, 2):  # an int among the floats: Triton specializes it on its value
        fast((1,), (x, y), (32,), (value,), 4, A=2, B=True)
    assert fast.launches == [8, 0] and not kernel.shortcut

    class Interpreted(_Kernel):  # a launch that returns no compiled kernel (the interpreter's)
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    fast = FastLaunch(Interpreted())
    for _ in range(2):
        fast((1,), (x, y), (32,), (0.5,), 4, A=2, B=True)
    assert fast.launches == [2, 0]


def test_the_shortcut_runs_only_on_triton_versions_whose_launch_was_read(monkeypatch):
    import triton

    assert launch._version("3.6.0") == (3, 6) and launch._version("3.9.1+git0abc") == (3, 9)
    assert launch._version("nightly") == (0, 0)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    if not hasattr(torch._C, "_cuda_getCurrentRawStream"):  # a CPU-only torch: stand-ins for the two it reads
        monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
        monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    for version in ("3.5.1", "3.10.0", "4.0.0", "nightly"):
        monkeypatch.setattr(triton, "__version__", version)
        assert launch._runtime() is None, version
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert launch._runtime() is None
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("CONDMEM_FAST_LAUNCH", "0")  # the user's switch
    assert launch._runtime() is None
    monkeypatch.delenv("CONDMEM_FAST_LAUNCH")
    assert isinstance(launch._runtime(), Runtime)


def test_the_runtime_is_worked_out_at_the_first_launch_not_at_import(monkeypatch):
    code = "import sys; from condmem import NgramHasher; import condmem.ops.launch; print('triton' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False", "importing the hasher imports Triton"
    stand_in = Runtime(_knobs(), lambda: 0, lambda d: 0)
    monkeypatch.setattr(launch, "RUNTIME", launch._UNSET)
    monkeypatch.setattr(launch, "_runtime", lambda: stand_in)
    kernel = _Kernel()
    fast = FastLaunch(kernel)
    x, y = torch.zeros(32, dtype=torch.int64), torch.zeros(8)
    for _ in range(2):
        fast((1,), (x, y), (32,), (0.5,), 4, A=2, B=True)
    assert launch.RUNTIME is stand_in and fast.launches == [1, 1]


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's fallback")
def test_ops_in_the_interpreter_take_the_normal_launch_and_keep_their_results(runtime):
    """With a runtime installed, the interpreter's launches return no compiled kernel: nothing is cached."""
    saved, launch.RUNTIME = launch.RUNTIME, None
    try:
        want = _op_results("cpu")
    finally:
        launch.RUNTIME = saved
    launchers = _launchers()
    counts = [list(f.launches) for f in launchers]
    for _ in range(2):
        got = _op_results("cpu")
        for name in want:
            assert torch.equal(got[name].nan_to_num(), want[name].nan_to_num()), name
    assert all(f.launches[1] == c[1] for f, c in zip(launchers, counts))
    assert any(f.launches[0] > c[0] for f, c in zip(launchers, counts))


def _launchers() -> list[FastLaunch]:
    from condmem.ops.gate import triton as gate_t
    from condmem.ops.gather import triton as gather_t
    from condmem.ops.hash import triton as hash_t

    return [hash_t._PREFILL, hash_t._RAGGED, hash_t._ADVANCE, hash_t._DECODE, gate_t._GATE_FWD, gather_t._GATHER]


def _hasher(device):
    from condmem import EngramConfig, EngramLayout, NgramHasher

    cfg = EngramConfig(
        layer_ids=[1, 2], max_ngram_size=3, n_heads=3, head_dim=8, table_size=53, compressed_vocab_size=40
    )
    return NgramHasher(EngramLayout(cfg), token_lookup=np.arange(61) % 40, backend="triton")


def _op_results(device, n_tokens: int = 37, offset: int = 0, dim: int = 40) -> dict[str, torch.Tensor]:
    """Every converted op on inputs whose sizes and views (`offset` elements into a buffer) set the specialization."""
    from condmem.fp8 import pack_rows
    from condmem.ops.gate import engram_gate
    from condmem.ops.gather import engram_gather

    gen = torch.Generator().manual_seed(n_tokens * 7 + offset)
    hasher = _hasher(device)
    out = {}
    for dtype in (torch.int64, torch.int32):
        buf = torch.randint(0, 61, (offset + 2 * n_tokens,), generator=gen).to(dtype=dtype, device=device)
        ids = buf[offset:].view(2, n_tokens)
        out[f"hasher {dtype}"] = hasher(ids)
        out[f"hasher blocked {dtype}"] = hasher(ids, blocked=ids % 7 == 0, with_offsets=False)
        a = min(5, 2 * n_tokens)
        b = max(a, n_tokens)
        cu = torch.tensor([0, a, b, max(b, 2 * n_tokens - 3)], dtype=torch.int32, device=device)
        history = hasher.new_history(4, device)
        slots = torch.tensor([2, -1, 0], device=device)
        out[f"ragged {dtype}"] = hasher.hash_ragged(ids.reshape(-1), cu, history=history, slots=slots)
        out[f"ragged again {dtype}"] = hasher.hash_ragged(ids.reshape(-1)[:a], cu[:2], history=history, slots=slots[:1])
        out[f"history {dtype}"] = history.ids.clone()
        new = ids[0, :3]
        out[f"decode {dtype}"] = hasher.decode(history, torch.tensor([0, 2, -1], device=device)[: new.numel()], new)
    hc = 2
    for dtype in (torch.float32, torch.bfloat16):
        h = torch.randn(offset + n_tokens * hc * dim, generator=gen).to(dtype=dtype, device=device)
        kv = torch.randn(n_tokens, (hc + 1) * dim, generator=gen).to(dtype=dtype, device=device)
        qw, kw = (torch.rand(hc, dim, generator=gen).to(dtype=dtype, device=device) + 0.5 for _ in range(2))
        hidden = h[offset:].view(n_tokens, hc, dim)
        mask = torch.arange(n_tokens, device=device) % 3 != 0
        out[f"gate {dtype}"] = engram_gate(hidden, kv, qw, kw, residual=True, backend="triton")
        out[f"gate masked {dtype}"] = engram_gate(hidden, kv, qw, kw, token_mask=mask, backend="triton")
    q = torch.randint(0, 120, (50, 64), generator=gen, dtype=torch.int32).to(torch.uint8)
    e = torch.randint(120, 130, (50, 2), generator=gen, dtype=torch.int32).to(torch.uint8)
    table = pack_rows(q.view(torch.float8_e4m3fn), e).to(device)
    rows = torch.randint(-2, 52, (offset + n_tokens * 3,), generator=gen).to(device)
    out["gather"] = engram_gather(rows[offset:].view(n_tokens, 3), table, backend="triton")
    plain = torch.randn(50, 64, generator=gen).to(device)
    out["gather plain"] = engram_gather(rows[offset:].view(n_tokens, 3), plain, row_range=(3, 53), backend="triton")
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("n_tokens, offset, dim", [(37, 0, 40), (1, 1, 64), (128, 3, 256), (300, 0, 4096)])
def test_gpu_shortcut_equals_the_plain_launch(monkeypatch, n_tokens, offset, dim):
    """Odd sizes and views `offset` elements into a buffer (misaligned pointers) change the specialization;
    the shortcut's results equal the plain launch's bit for bit, its first and its cached calls alike."""
    assert launch.runtime() is not None, "the shortcut is off on this machine (Triton version?)"
    launchers = _launchers()
    with monkeypatch.context() as m:
        m.setattr(launch, "RUNTIME", None)
        want = _op_results("cuda", n_tokens, offset, dim)
    first = _op_results("cuda", n_tokens, offset, dim)  # the normal launch, kernels now cached
    before = sum(f.launches[1] for f in launchers)
    cached = _op_results("cuda", n_tokens, offset, dim)  # the shortcut
    torch.cuda.synchronize()
    assert sum(f.launches[1] for f in launchers) > before, "the shortcut never ran"
    for name in want:
        assert torch.equal(first[name].float().nan_to_num(), want[name].float().nan_to_num()), name
        assert torch.equal(cached[name].float().nan_to_num(), want[name].float().nan_to_num()), name


@pytest.mark.gpu
def test_gpu_shortcut_follows_specialization_changes_back_and_forth():
    """Aligned, misaligned, aligned again, other sizes: each call equals the plain launch of the same inputs."""
    assert launch.runtime() is not None
    for n_tokens, offset in [(64, 0), (64, 1), (64, 0), (17, 1), (16, 0), (1, 0), (64, 1)]:
        got = _op_results("cuda", n_tokens, offset, 48)
        saved, launch.RUNTIME = launch.RUNTIME, None
        try:
            want = _op_results("cuda", n_tokens, offset, 48)
        finally:
            launch.RUNTIME = saved
        for name in want:
            assert torch.equal(got[name].float().nan_to_num(), want[name].float().nan_to_num()), (
                n_tokens,
                offset,
                name,
            )
