"""Every rule of what a CUDA-graph capture refuses (scalefold.compilation.capture_rules) has a planted test here:
the rule's operation inside a captured function raises ``CaptureRefused`` naming the rule and the planted line,
and with the rule removed (``capture_rules.without``) the same capture lets it through -- so no rule is dead
and none is shadowed by another. Every operator, Python function and module call a rule lists is planted at
least once. The capturable variants (``output_size`` given, ``check_errors=False``, ``num_classes`` given,
``nonzero_static``, a ``torch.device`` target, a scalar assignment) are recorded and replay as eager does.

``bench/capture_rules_proof.py`` runs these planted tests with each rule removed in turn and prints the
table of rules in bench/RESULTS.md."""

from __future__ import annotations

import importlib
import inspect

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from scalefold.compilation import capture_rules as rules
from scalefold.compilation.emulated_capture import CaptureRefused, record

pytestmark = pytest.mark.usefixtures("one_thread")
T = torch.tensor([0.0, 2.0, 3.0])
A = torch.tensor([[4.0, 1.0, 0.0], [1.0, 3.0, 0.5], [0.0, 0.5, 2.0]])  # symmetric positive definite
COUNTS = torch.tensor([1, 2, 1])


def _item():
    return T * T.sum().item()  # refused


def _float():
    return T * float(T[1])  # refused


def _if_tensor():
    return T * 2 if T[1] > 0 else T  # refused


def _is_nonzero():
    return T * torch.is_nonzero(T[1])  # refused


def _nonzero():
    return T.nonzero()  # refused


def _argwhere():
    return torch.argwhere(T)  # refused


def _where_condition():
    return torch.where(T > 1)  # refused


def _masked_select():
    return T.masked_select(T > 1)  # refused


def _equal():
    return T * torch.equal(T, T + 0)  # refused


def _unique():
    return torch.unique(T)  # refused


def _unique_rows():
    return torch.unique(A, dim=0)  # refused


def _unique_consecutive():
    return torch.unique_consecutive(T)  # refused


def _mask_index():
    return T[T > 1]  # refused


def _mask_assign():
    x = T.clone()
    x[x > 1] = 0.0  # refused
    return x


def _index_put_mask():
    return T.clone().index_put_((T > 1,), T.new_ones(()))  # refused


def _index_put_out_of_place():
    return torch.index_put(T, (T > 1,), T.new_ones(()))  # refused


def _index_put_impl():
    return torch._index_put_impl_(T.clone(), (T > 1,), T.new_ones(()))  # refused


def _repeat_interleave():
    return T.repeat_interleave(COUNTS)  # refused


def _repeat_interleave_counts():
    return torch.repeat_interleave(COUNTS)  # refused


def _bincount():
    return torch.bincount(COUNTS, minlength=4)  # refused


def _histc():
    return torch.histc(T, bins=4)  # refused


def _normal_tensor_std():
    return torch.normal(0.0, T + 1)  # refused


def _normal_tensor_mean_and_std():
    return torch.normal(T, T + 1)  # refused


def _cholesky():
    return torch.linalg.cholesky(A)  # refused


def _inv():
    return torch.linalg.inv(A)  # refused


def _solve():
    return torch.linalg.solve(A, T)  # refused


def _lu_factor():
    return torch.linalg.lu_factor(A)[0]  # refused


def _cholesky_ex_checked():
    return torch.linalg.cholesky_ex(A, check_errors=True).L  # refused


def _inv_ex_checked():
    return torch.linalg.inv_ex(A, check_errors=True).inverse  # refused


def _lu_factor_ex_checked():
    return torch.linalg.lu_factor_ex(A, check_errors=True).LU  # refused


def _ldl_factor_ex_checked():
    return torch.linalg.ldl_factor_ex(A, check_errors=True).LD  # refused


def _solve_ex_checked():
    return torch.linalg.solve_ex(A, T, check_errors=True).result  # refused


def _eigh():
    return torch.linalg.eigh(A).eigenvalues  # refused


def _svdvals():
    return torch.linalg.svdvals(A)  # refused


def _eig():
    return torch.linalg.eig(A).eigenvalues  # refused


def _pinv():
    return torch.linalg.pinv(A)  # refused


def _tolist():
    return T * len(T.tolist())  # refused


def _numpy():
    return T * T.numpy().sum()  # refused


def _array():
    return T * np.asarray(T).sum()  # refused


def _cpu():
    return T.cpu() * 2  # refused


def _to_cpu():
    return T.to("cpu") * 2  # refused


def _one_hot():
    return F.one_hot(COUNTS).float()  # refused


def _python_table():
    return T + torch.tensor([1.0, 2.0, 3.0])  # refused


def _new_tensor():
    return T + T.new_tensor([1.0, 2.0, 3.0])  # refused


def _as_tensor():
    return T + torch.as_tensor([1.0, 2.0, 3.0])  # refused


def _from_numpy():
    return T + torch.from_numpy(np.ones(3, dtype=np.float32))  # refused


def _preserved_checkpoint():
    x = T.clone().requires_grad_()
    y = checkpoint(lambda a: F.dropout(a, 0.5, True) * 2, x, use_reentrant=False)  # refused (preserves the RNG state)
    y.sum().backward()  # refused (the recomputation sets it back)
    return x.grad


def _barrier():
    import torch.distributed as dist

    dist.barrier()  # refused
    return T * 2


def _calling(module: str, attr: str):
    """A planted call of ``module.attr()`` (its arguments do not matter: the capture refuses the call itself)."""

    def planted():
        getattr(importlib.import_module(module), attr)()  # refused
        return T * 2

    planted.__name__ = f"_{module.replace('.', '_')}_{attr}"
    return planted


PLANTED = {
    "item": [_item, _float, _if_tensor, _is_nonzero],
    "nonzero": [_nonzero, _argwhere, _where_condition],
    "masked_select": [_masked_select],
    "equal": [_equal],
    "unique": [_unique, _unique_rows, _unique_consecutive],
    "mask_index": [_mask_index],
    "mask_index_put": [_mask_assign, _index_put_mask, _index_put_out_of_place, _index_put_impl],
    "repeat_interleave": [_repeat_interleave, _repeat_interleave_counts],
    "bincount": [_bincount],
    "histc": [_histc],
    "normal_std_tensor": [_normal_tensor_std, _normal_tensor_mean_and_std],
    "linalg_info": [_cholesky, _inv, _solve, _lu_factor, _cholesky_ex_checked, _inv_ex_checked, _lu_factor_ex_checked,
                    _ldl_factor_ex_checked, _solve_ex_checked],
    "linalg_decomposition": [_eigh, _svdvals, _eig, _pinv],
    "storage_read": [_tolist, _numpy, _array],
    "to_host": [_cpu, _to_cpu],
    "one_hot_unsized": [_one_hot],
    "host_to_device": [_python_table, _new_tensor, _as_tensor, _from_numpy],
    "rng_state": [_preserved_checkpoint] + [_calling(m, a) for m, a in rules.RULES["rng_state"].calls],
    "synchronize": [_calling(m, a) for m, a in rules.RULES["synchronize"].calls],
    "barrier": [_barrier],
}  # fmt: skip
CASES = [(name, fn) for name, fns in PLANTED.items() for fn in fns]
IDS = [f"{name}-{fn.__name__.strip('_')}" for name, fn in CASES]


def _refused_lines(fn) -> set[int]:
    lines, start = inspect.getsourcelines(fn)
    return {start + i for i, line in enumerate(lines) if "# refused" in line}


@pytest.fixture(scope="module")
def one_rank_group(tmp_path_factory):
    """A real (gloo, one rank) process group: without its rule a planted barrier runs, unrefused."""
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path_factory.mktemp("group") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("rule, fn", CASES, ids=IDS)
def test_planted(rule, fn, request):
    """The planted operation raises at its line, naming its rule."""
    if rule == "barrier":
        request.getfixturevalue("one_rank_group")
    with pytest.raises(CaptureRefused) as info:
        record(fn)
    assert info.value.rule == rule, info.value
    assert info.value.what.startswith(rules.RULES[rule].what), info.value
    path, _, rest = info.value.where.partition(":")
    line, _, name = rest.partition(" ")
    assert path == "tests/compilation/test_capture_rules.py" and name == f"({fn.__code__.co_name})", info.value.where
    assert int(line) in _refused_lines(fn), info.value.where


@pytest.mark.parametrize("rule", list(PLANTED))
def test_without_its_rule_every_planted_operation_escapes(rule, request):
    """The rule is what refuses: removed, none of its planted operations is refused by it (nor by another rule)."""
    if rule == "barrier":
        request.getfixturevalue("one_rank_group")
    with rules.without(rule):
        for fn in PLANTED[rule]:
            try:
                record(fn)
            except CaptureRefused as exc:
                pytest.fail(f"{fn.__name__} still refused without rule {rule!r}: {exc}")
            except Exception:  # noqa: BLE001 -- a call that needs a GPU or a process group: it ran, unrefused
                pass
    assert rule in rules.RULES


class _Seen(TorchDispatchMode):
    def __init__(self, seen: set) -> None:
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.seen.add(func)
        return func(*args, **(kwargs or {}))


class _Named(TorchFunctionMode):
    def __init__(self, seen: set) -> None:
        super().__init__()
        self.seen = seen

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.seen.add(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))


def test_every_rule_is_planted_and_every_operator_it_lists_is_run_by_a_planted_test():
    assert set(PLANTED) == set(rules.RULES)
    for name, rule in rules.RULES.items():
        seen: set = set()
        for fn in PLANTED[name]:
            with _Named(seen), _Seen(seen):
                try:
                    fn()
                except Exception:  # noqa: BLE001 -- a call that needs a GPU or a process group
                    pass
        assert set(rule.ops) <= seen, (name, set(rule.ops) - seen)
        assert set(rule.functions) <= seen, (name, set(rule.functions) - seen)
        planted_calls = {fn.__name__ for fn in PLANTED[name]}
        assert {_calling(m, a).__name__ for m, a in rule.calls} <= planted_calls or name == "barrier"


def test_every_rule_says_why_and_where_from():
    for rule in rules.RULES.values():
        assert rule.what and rule.why and rule.source and rule.category in ("read", "write", "rng", "sync"), rule
        assert bool(rule.ops) + bool(rule.functions) + bool(rule.calls) == 1, rule.name


def test_capturable_variants_are_recorded_and_replay_as_eager():
    """What a capture takes: sizes given, error checks off, a scalar fill, a device object, an integer index."""

    def fn(x):
        y = x.clone()
        y[0] = 1.0  # a fill kernel on a device
        y = y + x.repeat_interleave(COUNTS, output_size=4)[:3]
        y = y + torch.nonzero_static(x, size=3).squeeze(1).float()
        y = y + F.one_hot(COUNTS, num_classes=3).float().sum(0)
        y = y + torch.linalg.cholesky_ex(A).L.sum(0) + torch.linalg.inv_ex(A).inverse.sum(0)
        y = y + torch.histc(x, bins=3, min=0.0, max=4.0)
        y = y + x.to(torch.device("cpu")).to(torch.float64).float()  # the run's own device: no copy to the host
        return y + x[COUNTS] + x.masked_fill(x > 1, 0.0)

    x = T.clone()
    graph = record(fn, x)
    x.copy_(torch.tensor([1.0, 5.0, 0.5]))
    assert torch.equal(graph.replay(), fn(x))
