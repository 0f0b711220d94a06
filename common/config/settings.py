"""The one place that reads ``TANDEM_*`` environment variables.

Every settings class is a frozen dataclass. ``load_settings(Cls, overrides)`` fills each field from,
in order of precedence: an explicit override (a CLI flag that was given), the environment variable
``TANDEM_<FIELD>``, the field's default. So flags and environment variables map onto the same fields
by construction. The engine's knobs (``EngineSettings``, which ``NodeSettings`` extends) are not restated
here: they are ``CacheConfig``'s and ``SchedulerConfig``'s fields, with their defaults, help and choices
(``engine_knobs``). A field with choices takes them from one tuple (``choice``, ``check_choices``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import types
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from common.config.engine_config import (
    CacheConfig,
    SchedulerConfig,
    SpeculativeConfig,
    SpeculativeMethod,
    scheduler_config,
)
from common.quant.config import INT4_GROUP_SIZES, QuantMethod

T = TypeVar("T")

ENV_PREFIX = "TANDEM_"


# Choice lists, each in one place: the settings check them and the flags offer them.
DTYPES = ("auto", "float32", "bfloat16", "float16")
QUANTIZATION_METHODS = tuple(m.value for m in QuantMethod)  # common/quant/config.py (no torch: the gateway reads this)
PARALLEL_COLLECTIVES = ("shm", "gloo")  # common/parallel/: the tensor-parallel all-reduce on one host
KV_TRANSPORTS = ("auto", "shm", "socket")  # kv_transfer/transport.py


def default_home() -> Path:
    return Path.home() / ".cache" / "tandem"


def choice(default: Any, choices: tuple[Any, ...], help: str = "") -> Any:
    """A settings field whose value is one of ``choices`` (``check_choices`` checks it; the flag offers them)."""
    return field(default=default, metadata={"help": help, "choices": choices})


def check_choices(settings: Any) -> None:
    """Every field of ``settings`` with ``choices`` holds one of them; else a ValueError naming its flag and
    variable and the choices."""
    for f in dataclasses.fields(settings):
        value, choices = getattr(settings, f.name), f.metadata.get("choices")
        if choices and value not in choices:
            raise ValueError(f"{flag_name(f.name)} ({env_name(f.name, type(settings))}) must be one of "
                             f"{', '.join(map(str, choices))}; got {value!r}")


@dataclass(frozen=True)
class ModelSettings:
    """Which model to run and how."""

    model: str = "SmolLM2-135M-Instruct"  # a local Hugging Face directory or the bundled model's name
    dtype: str = choice("auto", DTYPES)
    device: str = "cpu"
    attention_backend: str = "torch"  # torch | triton | flash_attn | flashinfer
    home: Path = field(default_factory=default_home)  # Tandem's cache (converted models, ...)
    num_threads: int = 0  # torch intra-op threads; 0 = torch's default
    # Packed weights (common/quant/config.py): none | auto (a GGUF source keeps its own) | int8 | int4 | w8a8 | fp8.
    # The names only here (no torch import: the gateway reads these settings); the hardware checks run when
    # the model loads.
    quantization: str = choice("none", QUANTIZATION_METHODS)
    quantization_group_size: int = choice(32, INT4_GROUP_SIZES)  # int4: weights per scale/zero group
    quantization_kernel: str = "auto"  # auto | tandem_cpu | torch | int_mm | triton | scaled_mm | reference
    # One node's model over T x P rank processes (common/parallel/): T splits each layer, P the layer stack.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # A mixture of experts' routed experts split over the T ranks (whole experts each) rather than each
    # expert's columns; attention stays tensor-parallel (common/parallel/layout.py).
    expert_parallel: bool = False
    parallel_collective: str = choice("shm", PARALLEL_COLLECTIVES)  # the tensor-parallel all-reduce on one host

    def __post_init__(self) -> None:
        check_choices(self)
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0, got {self.num_threads}")
        for flag, value in (("--tensor-parallel-size", self.tensor_parallel_size),
                            ("--pipeline-parallel-size", self.pipeline_parallel_size)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        if self.expert_parallel and self.tensor_parallel_size < 2:
            raise ValueError(f"--expert-parallel splits the experts over the --tensor-parallel-size ranks; "
                             f"--tensor-parallel-size is {self.tensor_parallel_size}: give 2 or more")

    @property
    def parallel(self) -> bool:
        """The model spans several rank processes."""
        return self.tensor_parallel_size * self.pipeline_parallel_size > 1


class _EngineDefault:
    def __init__(self, by_device: bool) -> None:
        self.by_device = by_device

    def __repr__(self) -> str:
        return "DEVICE_DEFAULT" if self.by_device else "ENGINE_DEFAULT"


# Markers for ``engine_knobs``: a field that is the engine config's field of the same name, with its default,
# or unset (None) for the device's default (``scheduler_config``).
ENGINE_DEFAULT: Any = _EngineDefault(by_device=False)
DEVICE_DEFAULT: Any = _EngineDefault(by_device=True)


def engine_knobs(*configs: type) -> Callable[[type[T]], type[T]]:
    """Class decorator, under ``@dataclass``: each field marked ``ENGINE_DEFAULT`` or ``DEVICE_DEFAULT`` is the
    field of that name of one of ``configs``, a ``knob`` there: it takes that field's default (or None: the
    device's), help and choices, and its name and type are checked against it here, at import."""
    knobs = {f.name: (config, f) for config in configs for f in dataclasses.fields(config) if "help" in f.metadata}

    def apply(cls: type[T]) -> type[T]:
        for name, hint in cls.__annotations__.items():
            marker = cls.__dict__.get(name)
            if not isinstance(marker, _EngineDefault):
                continue
            if name not in knobs:
                names = ", ".join(c.__name__ for c in configs)
                raise TypeError(f"{cls.__name__}.{name}: no knob of that name in {names}")
            config, f = knobs[name]
            allowed = {f.type, f"{f.type} | None"} if marker.by_device else {f.type}
            if hint not in allowed:
                raise TypeError(f"{cls.__name__}.{name}: {hint} is not {config.__name__}.{name}'s type ({f.type})")
            setattr(cls, name, field(default=None if marker.by_device else f.default,
                                     metadata={**f.metadata, "config": config, "by_device": marker.by_device}))
        return cls

    return apply


@dataclass(frozen=True)
@engine_knobs(CacheConfig, SchedulerConfig)
class EngineSettings:
    """The engine's knobs, read by nodes and by the offline ``LLM``: fields of ``CacheConfig`` and
    ``SchedulerConfig`` (common/config/engine_config.py), whose defaults, help and choices they are
    (``engine_knobs``). ``configs(device)`` builds the engine's configs from them."""

    block_size: int = ENGINE_DEFAULT
    num_blocks: int | None = ENGINE_DEFAULT
    kv_cache_memory_gb: float = ENGINE_DEFAULT
    enable_prefix_caching: bool = ENGINE_DEFAULT
    kv_offload: str = ENGINE_DEFAULT
    kv_offload_gb: float = ENGINE_DEFAULT
    kv_offload_dir: str = ENGINE_DEFAULT
    max_num_seqs: int = ENGINE_DEFAULT
    # The step budget: unset, the device's (CPU 512 / 256, load-aware; GPU 2048 / 512: scheduler_config).
    max_num_batched_tokens: int | None = DEVICE_DEFAULT
    max_prefill_chunk: int | None = DEVICE_DEFAULT
    prefill_order: str = ENGINE_DEFAULT
    defer_shared_prefill: bool = ENGINE_DEFAULT
    max_waiting: int = ENGINE_DEFAULT
    enforce_eager: bool = ENGINE_DEFAULT

    def __post_init__(self) -> None:
        # 0 reads as unset, as these flags and variables have always been documented ("0: derive", "0: by device").
        for f in dataclasses.fields(self):
            if "config" in f.metadata and getattr(self, f.name) == 0 and f.default is None:
                object.__setattr__(self, f.name, None)
        check_choices(self)
        self.configs("cpu")  # the engine's own checks (block size a power of two, limits >= 1), at start-up

    def configs(self, device: str) -> tuple[CacheConfig, SchedulerConfig]:
        """The engine's configs on ``device`` (``cpu``, ``cuda:0``, ...): the knobs that are set, the device's
        step budget where it is not (``scheduler_config``)."""
        values: dict[type, dict[str, Any]] = {CacheConfig: {}, SchedulerConfig: {}}
        for f in dataclasses.fields(self):
            if "config" in f.metadata:
                values[f.metadata["config"]][f.name] = getattr(self, f.name)
        return CacheConfig(**values[CacheConfig]), scheduler_config(device, **values[SchedulerConfig])


@dataclass(frozen=True)
class NodeSettings(EngineSettings):
    """A prefill or decode node: the engine's knobs (``EngineSettings``), and where it listens, how it moves
    KV and how long it waits."""

    host: str = "127.0.0.1"  # binding to other interfaces is an explicit choice
    port: int = 0  # 0: pick a free port (printed at start-up)
    node_id: str = ""  # "" -> "<role>-<port>"
    kv_store_port: int = 0  # decode: the TCPStore KV pair groups rendezvous on (0: pick one)
    # decode: the host prefill nodes dial for KV (the reservation's kv_endpoint); "" = host. Set it when
    # host is a wildcard (0.0.0.0 in a container): the wildcard is no address another machine can dial.
    advertise_host: str = ""
    # how long a transfer may take once its first chunk arrived (a decode node); how long a push may take
    kv_timeout_s: float = 30.0
    # shm: shared memory / CUDA IPC, same host only; socket: gloo / NCCL pair groups
    kv_transport: str = choice("auto", KV_TRANSPORTS, "KV data plane between prefill and decode nodes: auto "
                               "(shared memory on one host, sockets otherwise) | shm | socket")
    # This node's host identity, which decides the KV data plane (same identity: shared memory; else sockets).
    # "": the machine's own (boot id and hostname). Set it to stand in several machines on one box (a test,
    # the raylets of a one-box Ray cluster); nodes that share memory must share the identity.
    host_id: str = ""
    # Admission queues instead of refusing: requests beyond free KV (a decode node's reservations included)
    # wait, at most max_waiting (an engine knob) of them, each at most queue_timeout_s (then RESOURCE_EXHAUSTED).
    queue_timeout_s: float = 300.0
    grace_s: float = 5.0  # graceful shutdown: drain in-flight calls this long
    metrics_port: int = 0  # Prometheus /metrics; 0: off
    # host:port of a gateway's internal port (its Membership service): the node registers there once it serves,
    # again every register_interval_s (so a restarted gateway learns about it), and deregisters on shutdown.
    gateway: str = ""
    register_interval_s: float = 2.0
    # Core lending on one host (common/engine/core_lending.py; ``tandem up`` sets these for each prefill node and
    # the decode node beside it).
    activity_file: str = field(default="", metadata={"help": (
        "decode: keep this file (put it in /dev/shm) saying whether the engine has a step to run, so that a "
        "prefill node on this host borrows this node's CPUs while it is idle")})
    borrow_cpus: str = field(default="", metadata={"help": (
        "prefill: run prefill layers on these CPUs too (as in 1,3-5) while every --borrow-from file says its "
        "node is idle; start the process on its own CPUs and these, with GOMP_SPINCOUNT=10000")})
    borrow_from: str = field(default="", metadata={"help": (
        "prefill: the --activity-file of each node whose CPUs --borrow-cpus names, comma-separated")})

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.borrow_cpus) != bool(self.borrow_from):
            raise ValueError(f"{flag_name('borrow_cpus')} ({env_name('borrow_cpus')}) and {flag_name('borrow_from')} "
                             f"({env_name('borrow_from')}) go together: the CPUs, and the files that say when "
                             f"their node is idle")
        if self.borrow_cpus:
            try:
                parse_cpus(self.borrow_cpus)
            except ValueError as exc:
                raise ValueError(f"{flag_name('borrow_cpus')} ({env_name('borrow_cpus')}): {exc}") from None
        for name in ("port", "kv_store_port", "metrics_port"):
            if not 0 <= getattr(self, name) <= 65535:
                raise ValueError(f"{name} out of range: {getattr(self, name)}")
        if self.kv_timeout_s <= 0 or self.queue_timeout_s <= 0 or self.grace_s < 0:
            raise ValueError("kv_timeout_s and queue_timeout_s must be > 0, grace_s >= 0")
        host, sep, port = self.gateway.rpartition(":")
        if self.gateway and (not sep or not host or not port.isdigit()):
            raise ValueError(f"{flag_name('gateway')} ({env_name('gateway')}): {self.gateway!r} is not host:port")
        if self.register_interval_s <= 0:
            raise ValueError(f"register_interval_s must be > 0, got {self.register_interval_s}")


@dataclass(frozen=True)
class SecuritySettings:
    """TLS and the cluster credential of one process (every role; docs/security.md). All off by default.

    ``tls_cert`` + ``tls_key``: this process serves TLS with them (and presents them as its client
    certificate). ``tls_ca``: the CA that signs the cluster's certificates; clients verify servers with it,
    and the internal services (Prefill, Decode, KVTransfer) then require a client certificate it signed
    (mutual TLS). ``internal_token``: a shared secret the gateway and the prefill nodes send to the internal
    services, which refuse calls without it (UNAUTHENTICATED).
    """

    tls_cert: Path | None = None  # PEM certificate chain
    tls_key: Path | None = None  # PEM private key
    tls_ca: Path | None = None  # PEM CA bundle
    internal_token: str = ""

    def __post_init__(self) -> None:
        for name in ("tls_cert", "tls_key", "tls_ca"):
            value = getattr(self, name)
            if isinstance(value, str):  # an environment variable; "" = unset
                object.__setattr__(self, name, Path(value).expanduser() if value else None)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ValueError("--tls-cert (TANDEM_TLS_CERT) and --tls-key (TANDEM_TLS_KEY) go together; "
                             "one of them is missing")
        for name in ("tls_cert", "tls_key", "tls_ca"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                raise ValueError(f"--{name.replace('_', '-')} ({env_name(name)}): {path} is not a file")

    @property
    def tls(self) -> bool:
        """Whether this process serves TLS."""
        return self.tls_cert is not None

    @property
    def mutual_tls(self) -> bool:
        return self.tls_ca is not None


def parse_cpus(text: str) -> tuple[int, ...]:
    """``"1,3-5"`` -> (1, 3, 4, 5); a ValueError names what is wrong."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        first, sep, last = part.partition("-")
        if not first.isdigit() or (sep and not last.isdigit()):
            raise ValueError(f"{part!r} is not a CPU number or range (as in 1,3-5)")
        lo, hi = int(first), int(last) if sep else int(first)
        if hi < lo:
            raise ValueError(f"{part!r}: the range ends before it starts")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def flag_name(field_name: str) -> str:
    """``--<field-name>``: the flag ``add_settings_flags`` (tandem_cli/cli.py) makes for a field."""
    return "--" + field_name.replace("_", "-")


def env_name(field_name: str, cls: type | None = None) -> str:
    """``TANDEM_<FIELD>``; a field ``cls`` lists in ``ROLE_FIELDS`` (a name that means something else to
    another role reading the same environment) is ``TANDEM_<ROLE>_<FIELD>``."""
    role = getattr(cls, "ENV_ROLE", "") if field_name in getattr(cls, "ROLE_FIELDS", ()) else ""
    return ENV_PREFIX + (f"{role}_" if role else "") + field_name.upper()


def is_set(cls: type, field_name: str, environ: Mapping[str, str] | None = None) -> bool:
    """Whether the environment sets ``cls``'s field (its ``TANDEM_*`` variable), whatever the value."""
    return env_name(field_name, cls) in (os.environ if environ is None else environ)


def load_settings(cls: type[T], overrides: Mapping[str, Any] | None = None,
                  environ: Mapping[str, str] | None = None) -> T:
    """Build ``cls`` from overrides (None values ignored), then ``TANDEM_*`` variables, then defaults."""
    environ = os.environ if environ is None else environ
    overrides = {k: v for k, v in (overrides or {}).items() if v is not None}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in overrides:
            values[f.name] = _coerce(overrides[f.name], hints[f.name], f.name)
        elif env_name(f.name, cls) in environ:
            values[f.name] = _coerce(environ[env_name(f.name, cls)], hints[f.name], env_name(f.name, cls))
    return cls(**values)


def _coerce(value: Any, hint: Any, label: str) -> Any:
    if not isinstance(value, str):
        return value
    if isinstance(hint, types.UnionType) and type(None) in hint.__args__:  # X | None: "" is None, else an X
        if not value.strip():
            return None
        hint = next(arg for arg in hint.__args__ if arg is not type(None))
    try:
        if hint is bool:
            lowered = value.strip().lower()
            if lowered not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                raise ValueError(value)
            return lowered in ("1", "true", "yes", "on")
        if hint is int:
            return int(value)
        if hint is float:
            return float(value)
        if hint is Path:
            return Path(value).expanduser()
    except ValueError:
        raise ValueError(f"{label}={value!r} is not a valid {getattr(hint, '__name__', hint)}") from None
    return value


KERNEL_MODES = ("auto", "on", "off")
CPU_ISAS = ("avx512", "avx2", "generic")  # common/kernels/isa.py ISA_FLAGS, widest first


@dataclass(frozen=True)
class KernelSettings:
    """Which CPU kernels run (docs/cpu-kernels.md): environment variables only, read here alone
    (``kernel_setting(name)``, ``kernel_settings()``), listed by ``tandem --help``. Modes: auto (where the
    kernels build and apply), on (that, or a start-up error), off. One error behaviour: a value that is not a
    choice raises ``ValueError`` naming the variable and the choices; ``on`` where the kernel cannot build
    raises ``RuntimeError`` at start-up; ``auto`` falls back to PyTorch's ops with a log line."""

    cpu_kernels: bool = True  # the compiled CPU attention and KV-write kernels (off: PyTorch's reference ops)
    cpu_isa: str = ""  # force a kernel build: avx512 | avx2 | generic ("": the widest this CPU runs)
    cpu_amx: str = "auto"  # AMX tiles for bf16 panels where the CPU grants them
    cpu_panels: str = "auto"  # float weights in 16-row panels where they pay here (on: always; off: row-major)
    cpu_gemv: str = "auto"  # Tandem's float GEMV and panel methods (off: F.linear only)
    cpu_onednn: str = "auto"  # fp32 row-major / bf16 AMX panel weights also prepacked for oneDNN's GEMM, where faster
    fused_ops: str = "auto"  # the C++ fused elementwise ops (off: the eager reference)
    decode_step: str = "auto"  # the one-call CPU decode step
    row_buckets: str = "auto"  # 16-bit CPU matmuls padded to a few row counts (auto: on for bf16/fp16)
    cpu_moe: str = "auto"  # a mixture of experts' routed experts in one C++ call on panels (off: PyTorch's)
    cpu_malloc: str = "auto"  # glibc malloc keeps a step's freed buffers for the next (off: glibc's defaults)
    cpu_omp_handoff: str = "auto"  # the start-up thread's OpenMP team let go when the engine thread takes over
    cpu_cascade: str = "auto"  # decode attention over a prefix its sequences share, once for all of them

    def __post_init__(self) -> None:
        for name in ("cpu_amx", "cpu_panels", "cpu_gemv", "cpu_onednn", "fused_ops", "decode_step", "row_buckets",
                     "cpu_moe", "cpu_malloc", "cpu_omp_handoff", "cpu_cascade"):
            value = str(getattr(self, name)).strip().lower() or "auto"
            if value not in KERNEL_MODES:
                raise ValueError(f"{env_name(name)}={value!r}; choose one of {', '.join(KERNEL_MODES)}")
            object.__setattr__(self, name, value)
        isa = self.cpu_isa.strip().lower()
        if isa and isa not in CPU_ISAS:
            raise ValueError(f"{env_name('cpu_isa')}={isa!r}; choose one of {', '.join(CPU_ISAS)}")
        object.__setattr__(self, "cpu_isa", isa)


_KERNEL_VARIABLES = {f.name: env_name(f.name) for f in dataclasses.fields(KernelSettings)}


def kernel_settings(environ: Mapping[str, str] | None = None) -> KernelSettings:
    """The kernel settings from the environment, parsed once per value of their variables (a changed variable,
    as tests and benchmarks set them, is seen at the next call)."""
    if environ is not None:
        return load_settings(KernelSettings, environ=environ)
    return _kernel_settings_of(tuple(os.environ.get(name) for name in _KERNEL_VARIABLES.values()))


def kernel_setting(name: str) -> str | bool:
    """One field of the kernel settings, reading only its own variable: what each kernel switch asks, cheap
    enough for the hot path (the attention backend asks ``cpu_kernels`` for every layer of every step)."""
    return _kernel_field(name, os.environ.get(_KERNEL_VARIABLES[name]))


@functools.lru_cache(maxsize=16)
def _kernel_settings_of(values: tuple[str | None, ...]) -> KernelSettings:
    environ = {name: value for name, value in zip(_KERNEL_VARIABLES.values(), values, strict=True) if value is not None}
    return load_settings(KernelSettings, environ=environ)


@functools.lru_cache(maxsize=64)
def _kernel_field(name: str, value: str | None) -> str | bool:
    environ = {} if value is None else {_KERNEL_VARIABLES[name]: value}
    return getattr(load_settings(KernelSettings, environ=environ), name)  # type: ignore[no-any-return]


SPECULATIVE_METHODS = tuple(m.value for m in SpeculativeMethod)


@dataclass(frozen=True)
class SpeculativeSettings:
    """Speculative decoding on decode and colocated nodes (docs/configuration.md): flags and ``TANDEM_*``
    variables alike, so compose and ``tandem up`` turn it on the way they set everything else."""

    speculative: str = "none"  # none | ngram | draft_layers | draft_model
    num_speculative_tokens: int = 4  # the most drafts per request per step (k)
    draft_layers: int = 8  # draft_layers: how many of the target's first layers draft
    # draft_model: a Llama-family directory with the target's tokenizer, or the bundled model's name (with
    # --draft-quantization int4: the target as its own draft)
    draft_model: str = ""
    draft_quantization: str = "none"  # the draft's weights: none | int8 | int4 | ...
    # draft_model: n-gram lookup in the request's own tokens first, the draft model where it finds nothing
    speculative_ngram_first: bool = False
    # with --speculative-ngram-first: the lookup's own limit (0: --num-speculative-tokens, which still bounds
    # the draft model)
    speculative_ngram_max_tokens: int = 0

    def __post_init__(self) -> None:
        method = self.speculative.strip().lower()
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"--speculative ({env_name('speculative')}) {self.speculative!r}: choose one of "
                             f"{', '.join(SPECULATIVE_METHODS)}")
        object.__setattr__(self, "speculative", method)
        if self.draft_quantization not in QUANTIZATION_METHODS:
            raise ValueError(f"--draft-quantization ({env_name('draft_quantization')}) must be one of "
                             f"{', '.join(QUANTIZATION_METHODS)}; got {self.draft_quantization!r}")
        self.config()  # the engine's own checks (k's range, a draft model named, ...), at start-up

    def config(self) -> SpeculativeConfig:
        """The engine's speculative config (disabled: method none)."""
        return SpeculativeConfig(method=SpeculativeMethod(self.speculative),
                                 num_speculative_tokens=self.num_speculative_tokens,
                                 draft_layers=self.draft_layers, draft_model=self.draft_model,
                                 draft_quantization=self.draft_quantization, ngram_first=self.speculative_ngram_first,
                                 ngram_first_max_tokens=self.speculative_ngram_max_tokens or None)
