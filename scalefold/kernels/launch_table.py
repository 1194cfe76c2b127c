"""The launch-config table shipped with ScaleFold: Triton launch configs per GPU architecture, no
autotuning at start-up.

``scalefold/kernels/launch_configs.json`` (or the file ``SCALEFOLD_LAUNCH_CONFIGS`` names) maps
``architecture -> kernel -> dtype -> shape class -> config``:

* *architecture*: ``sm_<compute capability>`` (``sm_90`` H100/H200, ``sm_80`` A100); a GPU uses the
  entries of its own architecture only (another one gets the kernels' default configs);
* *kernel*: the :class:`~scalefold.kernels.autotune.Tuner` name (``attention_fwd``,
  ``attention_bwd_dkdv``, ``attention_bwd_dq``, their ``_exact`` twins for fp32/fp64 dots without
  TF32, ``layer_norm_fwd``, ``layer_norm_bwd``, ``adam_swa``, and the fused triangle multiplication's
  ``trimul_in_fwd``, ``trimul_out_fwd``, ``trimul_out_bwd``, ``trimul_in_bwd``);
* *dtype*: ``bf16``/``fp16``/``fp32``/``tf32``/``fp64`` (``tf32``: fp32 tensors with TF32 dots,
  attention only);
* *shape class*: :func:`scalefold.kernels.autotune.shape_class`'s string, e.g. attention
  ``"NQ=256,NK=256,D=32,bias=1,shared=1,gate=1"``, LayerNorm ``"C=128,M=65536"`` (rows bucketed to a
  power of two), Adam ``"numel=134217728,master=fp32,compute=0"``, triangle multiplication
  ``"CZ=128,C=128,M=65536"`` (c_z, c_hidden, rows bucketed);
* *config*: the kernel's launch parameters (``BLOCK_M``, ``BLOCK_N``, ``num_warps``, ``num_stages``
  ...), the same keys as its candidate list.

Each architecture says where its entries come from in ``source``: ``"untimed defaults"`` (each
kernel's default config, checked ahead of time to compile for that architecture without spills:
``scalefold aot-check --table``; written by ``scalefold tune-kernels --untimed-defaults``)
or ``"tuned on <GPU>, <date>"`` (``scalefold tune-kernels`` timed the candidates on that GPU; its
``timings`` give the best and the default config's milliseconds per key). The entries cover every
Triton kernel at the MLPerf call sites (:func:`scalefold.kerneltools.sites.all_sites`) in bf16, tf32 and
fp32; a key not in the table (other shapes, e.g. the demo's) uses the kernel's default config.

Faults never stop a run and never start autotuning: a missing or unreadable table, or one of another
format, gives each kernel its default config with one line on stderr; an entry that does not fit the
kernel (unknown or missing parameters, a block size that is not a power of two) or does not run on
this GPU (:meth:`~scalefold.kernels.autotune.Tuner.run`: too much shared memory ...) is replaced by
the default config with one line.
"""

from __future__ import annotations

import copy
import json
import os
import sys
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path

from scalefold.errors import UserError

FORMAT = "scalefold-launch-configs/1"
PATH_ENV = "SCALEFOLD_LAUNCH_CONFIGS"
SHIPPED = Path(__file__).with_name("launch_configs.json")
UNTIMED = "untimed defaults"
ABOUT = (
    "Triton launch configs of ScaleFold's kernels: archs -> arch -> entries -> kernel -> dtype -> shape class -> "
    "config. Used by default on a GPU (no autotuning at start-up; SCALEFOLD_AUTOTUNE=1 times candidates instead). "
    "See scalefold/kernels/launch_table.py."
)

_lock = threading.Lock()
_active: tuple[str, Table] | None = None  # (path, table) of the table in use
_said: set[str] = set()  # one-line notices already printed


class TableError(UserError, ValueError):
    """A file that is not a launch-config table of this format (``SCALEFOLD_LAUNCH_CONFIGS``, ``--table``)."""


def arch_name(capability: int) -> str:
    """``90`` -> ``"sm_90"``."""
    return f"sm_{int(capability)}"


def table_path() -> Path:
    """The table in use: ``$SCALEFOLD_LAUNCH_CONFIGS`` or the shipped one."""
    return Path(os.environ.get(PATH_ENV) or SHIPPED)


class Table:
    """A launch-config table in memory: ``archs[arch]`` holds ``source`` (and other metadata) and
    ``entries[kernel][dtype][shape class] = config``."""

    def __init__(self, archs: Mapping[str, dict] | None = None) -> None:
        self.archs: dict[str, dict] = copy.deepcopy(dict(archs or {}))  # never shares a caller's dicts

    def entry(self, arch: str, kernel: str, dtype: str, shape: str) -> dict | None:
        node = self.archs.get(arch, {}).get("entries", {})
        return node.get(kernel, {}).get(dtype, {}).get(shape)

    def set_entry(self, arch: str, kernel: str, dtype: str, shape: str, config: Mapping) -> None:
        entries = self.archs.setdefault(arch, {"source": UNTIMED}).setdefault("entries", {})
        entries.setdefault(kernel, {}).setdefault(dtype, {})[shape] = dict(config)

    def entries(self, arch: str | None = None) -> Iterator[tuple[str, str, str, str, dict]]:
        """``(arch, kernel, dtype, shape, config)`` of every entry (of one architecture)."""
        for a in sorted(self.archs) if arch is None else [arch]:
            for kernel, by_dtype in sorted(self.archs.get(a, {}).get("entries", {}).items()):
                for dtype, by_shape in sorted(by_dtype.items()):
                    for shape, config in sorted(by_shape.items()):
                        yield a, kernel, dtype, shape, config

    def to_json(self) -> dict:
        return {"format": FORMAT, "about": ABOUT, "archs": {a: self.archs[a] for a in sorted(self.archs)}}


def parse(data: object) -> Table:
    """A :class:`Table` from decoded JSON; :class:`TableError` names what is wrong."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise TableError(f"format {found!r}, expected {FORMAT!r}")
    archs = data.get("archs")
    if not isinstance(archs, dict):
        raise TableError("no 'archs' object")
    for arch, meta in archs.items():
        if not isinstance(meta, dict) or not isinstance(meta.get("entries", {}), dict):
            raise TableError(f"{arch}: expected an object with 'entries'")
        for kernel, by_dtype in meta.get("entries", {}).items():
            ok = isinstance(by_dtype, dict) and all(
                isinstance(by_shape, dict) and all(isinstance(c, dict) for c in by_shape.values())
                for by_shape in by_dtype.values()
            )
            if not ok:
                raise TableError(f"{arch} {kernel}: expected dtype -> shape class -> config objects")
    return Table(archs)


def read(path: os.PathLike | str) -> Table:
    """Read a table; ``OSError`` when unreadable, :class:`TableError` when not a table."""
    text = Path(path).read_text()
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise TableError(f"not JSON ({exc})") from None
    return parse(data)


def dumps(table: Table) -> str:
    """JSON text, one config per line."""
    lines: list[str] = []

    def emit(value: object, indent: int, prefix: str, last: bool) -> None:
        pad, comma = " " * indent, "" if last else ","
        if (
            isinstance(value, dict)
            and value
            and not all(isinstance(v, (int, float, str, bool)) for v in value.values())
        ):
            lines.append(f"{pad}{prefix}{{")
            items = list(value.items())
            for i, (k, v) in enumerate(items):
                emit(v, indent + 1, f"{json.dumps(k)}: ", i == len(items) - 1)
            lines.append(f"{pad}}}{comma}")
        else:
            lines.append(f"{pad}{prefix}{json.dumps(value)}{comma}")

    emit(table.to_json(), 0, "", True)
    return "\n".join(lines) + "\n"


def write(table: Table, path: os.PathLike | str) -> None:
    """Write atomically (a reader never sees half a table)."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(table))
    tmp.replace(path)


def notice(message: str) -> None:
    """One line on stderr, once per process per message."""
    with _lock:
        if message in _said:
            return
        _said.add(message)
    print(f"launch configs: {message}", file=sys.stderr, flush=True)


def active() -> Table:
    """The table in use, read once per path; an empty table (each kernel's default config) when it
    is missing or unreadable, said in one line."""
    global _active
    path = table_path()
    with _lock:
        if _active is not None and _active[0] == str(path):
            return _active[1]
    try:
        table = read(path)
    except FileNotFoundError:
        notice(f"{path}: not found; each kernel launches its default config (no autotuning)")
        table = Table()
    except (OSError, TableError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        notice(f"{path}: not a readable launch-config table ({reason}); each kernel launches its default config")
        table = Table()
    with _lock:
        _active = (str(path), table)
    return table


def reset() -> None:
    """Forget the table read (tests, a changed ``SCALEFOLD_LAUNCH_CONFIGS``); the configs the kernels chose
    from it are forgotten by :func:`scalefold.kernels.autotune.reset_launch_table`, which calls this."""
    global _active
    with _lock:
        _active = None
        _said.clear()


def misfit(config: Mapping, default: Mapping) -> str | None:
    """Why ``config`` cannot be a config of the kernel whose default is ``default`` (None: it can):
    the same parameter names, positive integers, power-of-two block sizes and warps."""
    if set(config) != set(default):
        extra, missing = sorted(set(config) - set(default)), sorted(set(default) - set(config))
        parts = ([f"unknown {', '.join(extra)}"] if extra else []) + (
            [f"missing {', '.join(missing)}"] if missing else []
        )
        return "; ".join(parts)
    for name, value in config.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            return f"{name}={value!r} is not a positive integer"
        power_of_two = name.startswith("BLOCK") or name in ("ROWS", "num_warps")
        if power_of_two and value & (value - 1):
            return f"{name}={value} is not a power of two"
    if config.get("num_warps", 1) > 32:
        return f"num_warps={config['num_warps']} > 32"
    return None


def describe(kernel: str, key, capability: int) -> str:
    """``"<path>: sm_90 attention_fwd bf16 NQ=256,..."``: where an entry sits, for messages."""
    return f"{table_path()}: {arch_name(capability)} {kernel} {key.dtype} {key.shape}"


def lookup(kernel: str, key, capability: int, default: dict) -> dict:
    """The table's config of ``kernel`` for ``key`` on a GPU of ``capability``; ``default`` where the
    table has none, or (with one line) where its entry does not fit the kernel."""
    arch = arch_name(capability)
    table = active()
    if table.archs and arch not in table.archs:
        notice(f"{table_path()}: no entries for {arch}; each kernel launches its default config")
    config = table.entry(arch, kernel, key.dtype, key.shape)
    if config is None:
        return default
    reason = misfit(config, default)
    if reason is not None:
        notice(f"{describe(kernel, key, capability)}: entry {config} does not fit the kernel ({reason}); "
               f"using the default {default}")  # fmt: skip
        return default
    return dict(config)


__all__ = [
    "FORMAT",
    "PATH_ENV",
    "SHIPPED",
    "UNTIMED",
    "Table",
    "TableError",
    "active",
    "arch_name",
    "dumps",
    "lookup",
    "misfit",
    "notice",
    "parse",
    "read",
    "reset",
    "table_path",
    "write",
]
