"""Transformer Engine context-parallel attention as a cpq task (TE's ``run_dpa_with_cp``).

Why this exists: the suite cpq was built for is Transformer Engine's context-parallel (CP)
attention matrix (``tests/pytorch/attention/run_attention_with_cp.py``), where each case
used to cost a whole ``torchrun`` (~27 s on an H200 pair, most of it process start, NCCL
init and ``import transformer_engine.pytorch``) for 10 ms of work. This module runs the same
check inside a warm cpq group:

* every rank builds the full Q, K, V and dout from one seed (identical on all ranks) and
  runs TE ``DotProductAttention`` without CP: the reference;
* the sequence is split load-balanced (2*ws chunks, rank r keeps chunks r and 2*ws-1-r; for
  ``thd`` each sequence is split that way through ``tex.thd_get_partitioned_indices``), the
  same module gets ``set_context_parallel_group(...)`` and runs forward and backward on the
  local shard;
* out, dq, dk, dv of the shard are compared with the matching slice of the reference with
  TE's tolerances by dtype, then the CP fwd+bwd is timed after warm-up.

Configurations TE cannot run on this device (its backend selector finds no backend, or TE
raises a "not supported" error) end in ``pytest.skip`` with TE's own reason, as TE's test
does, so a missing cuDNN feature reads as a skip, not a failure.

Calling convention (cpq task): the function runs on every rank of an initialised NCCL group
(``torch.cuda.set_device`` done), reads rank and world size from ``torch.distributed``,
never creates or destroys the default group, and returns a small msgpack-able dict.
``transformer_engine`` and ``torch`` are imported inside the functions only, so this
module (``CASES``, ``case_id``) imports on a CPU-only machine without TE.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = [
    "CASES",
    "CASES_WS4",
    "MODEL_CONFIGS",
    "ModelConfig",
    "case_id",
    "run_dpa_with_cp",
    "state_fingerprint",
]


@dataclass(frozen=True)
class ModelConfig:
    """One attention shape, as in TE's ``model_configs_flash_attn`` (self-attention only)."""

    batch_size: int
    seqlen: int
    num_heads: int
    head_dim: int
    num_gqa_groups: int | None = None  # None: MHA (= num_heads)
    head_dim_v: int | None = None  # None: = head_dim; differs for MLA

    @property
    def gqa(self) -> int:
        return self.num_heads if self.num_gqa_groups is None else self.num_gqa_groups

    @property
    def dv(self) -> int:
        return self.head_dim if self.head_dim_v is None else self.head_dim_v


# Shapes follow TE's CP test table (b=2, s=4096, d=128); cp_1_1 is a small fast one and
# cp_1_2 the shape of the first H200 measurements (tools/gpu/README.md).
MODEL_CONFIGS: dict[str, ModelConfig] = {
    "cp_1_0": ModelConfig(2, 4096, 12, 128),  # MHA (TE cp_1_0)
    "cp_1_1": ModelConfig(2, 2048, 16, 64),  # small MHA
    "cp_1_2": ModelConfig(2, 4096, 16, 128),  # MHA, README's measured shape
    "cp_2_0": ModelConfig(2, 4096, 32, 128, num_gqa_groups=4),  # GQA (TE cp_2_0)
    "cp_2_1": ModelConfig(2, 4096, 12, 128, num_gqa_groups=2),  # GQA (TE cp_2_1)
    "cp_3_0": ModelConfig(2, 4096, 16, 192, head_dim_v=128),  # MLA
}

DTYPE_NAMES = ("bf16", "fp16")
QKV_FORMATS = ("bshd", "sbhd", "thd")
CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
ATTN_MASK_TYPES = ("causal", "no_mask")
KERNEL_BACKENDS = ("auto", "FusedAttention", "FlashAttention")

# Keys a case may override in the model shape, and run knobs.
_SHAPE_KEYS = {f.name for f in fields(ModelConfig)}
_RUN_KEYS = {"kernel_backend", "iters", "warmup", "seed", "compare_grads"}

# TE's error texts for configurations it does not implement: these become skips.
_UNSUPPORTED = re.compile(
    r"No dot product attention backend is available|not[ _]supported|does not support"
    r"|is not implemented|unsupported",
    re.IGNORECASE,
)


def _case(
    model: str, dtype: str, qkv_format: str, cp_comm_type: str, attn_mask_type: str
) -> dict[str, Any]:
    return {
        "dtype": dtype,
        "model": model,
        "qkv_format": qkv_format,
        "cp_comm_type": cp_comm_type,
        "attn_mask_type": attn_mask_type,
    }


def _build_cases() -> list[dict[str, Any]]:
    """The ws=2 matrix: the full format x comm grid on TE's cp_1_0, then spot checks.

    Why not the full cross product: it would be 2*6*3*3*2 = 216 cases of which most repeat
    the same kernels; this keeps every axis covered (format, comm type, mask, dtype, GQA,
    MLA, size) in 24 cases that run in seconds on a warm group.
    """
    cases = [
        _case("cp_1_0", "bf16", fmt, comm, "causal")
        for comm in ("p2p", "all_gather", "a2a")
        for fmt in QKV_FORMATS
    ]
    cases += [
        _case("cp_1_0", "bf16", "bshd", "p2p", "no_mask"),
        _case("cp_1_0", "bf16", "sbhd", "all_gather", "no_mask"),
        _case("cp_1_0", "bf16", "thd", "p2p", "no_mask"),
        _case("cp_1_0", "bf16", "bshd", "a2a", "no_mask"),
        _case("cp_1_0", "fp16", "bshd", "p2p", "causal"),
        _case("cp_1_0", "fp16", "sbhd", "a2a", "causal"),
        _case("cp_1_0", "fp16", "thd", "p2p", "causal"),
        _case("cp_1_0", "fp16", "bshd", "all_gather", "no_mask"),
        _case("cp_2_0", "bf16", "bshd", "p2p", "causal"),
        _case("cp_2_0", "bf16", "sbhd", "a2a", "causal"),
        _case("cp_2_0", "bf16", "thd", "all_gather", "causal"),
        _case("cp_2_1", "bf16", "bshd", "p2p", "no_mask"),
        _case("cp_2_1", "fp16", "sbhd", "all_gather", "causal"),
        _case("cp_3_0", "bf16", "bshd", "p2p", "causal"),
        _case("cp_1_1", "bf16", "bshd", "p2p", "causal"),
    ]
    return cases


#: Cases for a group of world size 2 (an H200 pair).
CASES: list[dict[str, Any]] = _build_cases()

#: Hierarchical a2a+p2p needs world size >= 4 (a2a over pairs, p2p across pairs).
CASES_WS4: list[dict[str, Any]] = [
    _case("cp_1_0", "bf16", "bshd", "a2a+p2p", "causal"),
    _case("cp_1_0", "bf16", "sbhd", "a2a+p2p", "causal"),
    _case("cp_2_0", "bf16", "bshd", "a2a+p2p", "no_mask"),
    _case("cp_1_0", "bf16", "thd", "p2p", "causal"),
    _case("cp_1_0", "bf16", "sbhd", "a2a", "causal"),
]


def case_id(case: dict[str, Any]) -> str:
    """A stable pytest id: ``model-dtype-format-comm-mask`` plus any overrides as ``k=v``."""
    base = [
        str(case.get("model", "cp_1_0")),
        str(case.get("dtype", "bf16")),
        str(case.get("qkv_format", "bshd")),
        str(case.get("cp_comm_type", "p2p")),
        str(case.get("attn_mask_type", "causal")),
    ]
    named = {"model", "dtype", "qkv_format", "cp_comm_type", "attn_mask_type"}
    extra = [f"{k}={case[k]}" for k in sorted(case) if k not in named]
    return "-".join(base + extra)


# ---------------------------------------------------------------------------------------
# helpers that need torch / TE (imported lazily)
# ---------------------------------------------------------------------------------------


def _skip(reason: str) -> None:
    """Raise pytest's Skipped; cpq turns it into the ``skipped`` outcome."""
    import pytest

    pytest.skip(reason)


def _dist() -> Any:
    import torch.distributed as dist

    assert dist.is_available() and dist.is_initialized(), (
        "run_dpa_with_cp must run inside an initialised torch.distributed group (a cpq task)"
    )
    return dist


# Groups are created once per process and default group: a warm rank runs many cases, and a
# fresh NCCL communicator per case would cost ~100 ms and leak communicators.
_GROUP_CACHE: dict[tuple[int, tuple[int, ...]], Any] = {}
_STREAM_CACHE: dict[int, Any] = {}


def _group(dist: Any, ranks: tuple[int, ...]) -> Any:
    key = (id(dist.group.WORLD), ranks)
    if key not in _GROUP_CACHE:
        _GROUP_CACHE[key] = dist.new_group(list(ranks), backend="nccl")
    return _GROUP_CACHE[key]


def _cp_groups(dist: Any, cp_comm_type: str, world_size: int, rank: int) -> Any:
    """The CP group argument TE expects: one group, or [a2a group, p2p group] for a2a+p2p.

    Every rank must call ``new_group`` for every group in the same order, so all groups
    are created here even where this rank is not a member.
    """
    whole = _group(dist, tuple(range(world_size)))
    if cp_comm_type != "a2a+p2p":
        return whole
    subsets = [tuple(range(i * 2, i * 2 + 2)) for i in range(world_size // 2)]
    subsets += [tuple(range(i, world_size, 2)) for i in range(2)]
    mine = []
    for ranks in subsets:
        group = _group(dist, ranks)
        if rank in ranks:
            mine.append(group)
    return mine


def _cp_stream(torch: Any) -> Any:
    device = torch.cuda.current_device()
    if device not in _STREAM_CACHE:
        _STREAM_CACHE[device] = torch.cuda.Stream()
    return _STREAM_CACHE[device]


@contextlib.contextmanager
def _env(**values: str) -> Iterator[None]:
    """Set NVTE_* selection variables for the case and put the old values back after."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class _ListHandler(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def _te_selection_log(dpa_utils: Any) -> Iterator[list[str]]:
    """Collect TE's "Disabling X as ..." debug lines without printing them.

    TE logs why it rejects each backend only at debug level (NVTE_DEBUG=1 NVTE_DEBUG_LEVEL=2);
    those lines are the honest skip reason, so they are captured for the duration of one
    selection while TE's own stream handler keeps its previous verbosity.
    """
    log_cls = dpa_utils.AttentionLogging
    logger = logging.getLogger("DotProductAttention")
    old_level = log_cls._log_level
    stream = log_cls._stream_handler
    old_stream_level = stream.level
    handler = _ListHandler()
    stream.setLevel(old_level if isinstance(old_level, int) else logging.WARNING)
    log_cls._log_level = logging.DEBUG
    logger.addHandler(handler)
    try:
        yield handler.messages
    finally:
        logger.removeHandler(handler)
        log_cls._log_level = old_level
        logger.setLevel(old_level)
        stream.setLevel(old_stream_level)


def _available_backends(
    te_mods: dict[str, Any],
    torch_dtype: Any,
    cfg: ModelConfig,
    qkv_format: str,
    mask: str,
    cp_comm_type: str,
    world_size: int,
    context_parallel: bool,
    deterministic: bool,
) -> tuple[list[bool], list[str]]:
    """TE's ``get_available_attention_backends`` (tests/pytorch/utils.py), trimmed.

    Returns ([flash, fused, unfused] availability, TE's reasons for disabling backends).
    Fields are filtered against ``AttentionParams`` so that other TE 2.x releases, whose
    dataclass has fewer fields, work too.
    """
    dpa_utils = te_mods["dpa_utils"]
    backends_cache = te_mods["attention_backends"]
    window = dpa_utils.check_set_window_size(mask, None)
    tokens = cfg.batch_size * cfg.seqlen
    local_tokens = tokens // world_size if context_parallel else tokens
    params: dict[str, Any] = {
        "qkv_dtype": torch_dtype,
        "qkv_layout": "_".join([qkv_format] * 3),
        "batch_size": cfg.batch_size + (1 if qkv_format == "thd" else 0),
        "num_heads": cfg.num_heads,
        "num_gqa_groups": cfg.gqa,
        "max_seqlen_q": cfg.seqlen,
        "max_seqlen_kv": cfg.seqlen,
        "num_tokens_q": local_tokens if qkv_format == "thd" else 0,
        "num_tokens_kv": local_tokens if qkv_format == "thd" else 0,
        "head_dim_qk": cfg.head_dim,
        "head_dim_v": cfg.dv,
        "attn_mask_type": mask,
        "window_size": window,
        # as DotProductAttention.forward: top-left diagonal for causal, bottom-right otherwise
        "bottom_right_diagonal": mask not in ("causal", "padding_causal"),
        "core_attention_bias_type": "no_bias",
        "core_attention_bias_requires_grad": False,
        "pad_between_seqs": qkv_format == "thd",
        "attention_dropout": 0.0,
        "context_parallel": context_parallel,
        "cp_comm_type": cp_comm_type,
        "cp_size": world_size if context_parallel else 1,
        "cp_size_a2a": 2 if (context_parallel and cp_comm_type == "a2a+p2p") else 1,
        "deterministic": deterministic,
        "is_training": True,
        "fp8": False,
        "fp8_meta": {"recipe": None, "local_recipes": []},
    }
    known = {f.name for f in fields(dpa_utils.AttentionParams)}
    attention_params = dpa_utils.AttentionParams(**{k: v for k, v in params.items() if k in known})
    with (
        _env(NVTE_FLASH_ATTN="1", NVTE_FUSED_ATTN="1", NVTE_UNFUSED_ATTN="1"),
        _te_selection_log(dpa_utils) as reasons,
    ):
        backends_cache["backend_selection_requires_update"] = True
        *_, available = dpa_utils.get_attention_backend(attention_params)
        backends_cache["backend_selection_requires_update"] = True
    keep = [r for r in reasons if r.startswith("Disabling")]
    return [bool(x) for x in available], list(dict.fromkeys(keep))


def _choose_backend(
    te_mods: dict[str, Any],
    torch_dtype: Any,
    cfg: ModelConfig,
    qkv_format: str,
    mask: str,
    cp_comm_type: str,
    world_size: int,
    requested: str,
    deterministic: bool,
) -> str:
    """Pick FusedAttention or FlashAttention the way TE's CP tests gate their cases.

    For fused attention with a causal mask TE also checks the non-CP ``*_bottom_right``
    variant, because CP runs bottom-right-aligned causal sub-steps internally. No backend:
    ``pytest.skip`` with TE's reasons.
    """
    args = (te_mods, torch_dtype, cfg, qkv_format, mask, cp_comm_type, world_size)
    available, reasons = _available_backends(*args, True, deterministic)
    flash_ok, fused_ok = available[0], available[1]
    if fused_ok and "causal" in mask:
        br, br_reasons = _available_backends(
            te_mods,
            torch_dtype,
            cfg,
            qkv_format,
            mask + "_bottom_right",
            cp_comm_type,
            world_size,
            False,
            deterministic,
        )
        if not br[1]:
            fused_ok = False
            reasons += [r for r in br_reasons if "FusedAttention" in r]
    order = ["FusedAttention", "FlashAttention"] if requested == "auto" else [requested]
    ok = {"FusedAttention": fused_ok, "FlashAttention": flash_ok}
    for name in order:
        if ok[name]:
            return name
    wanted = "any backend" if requested == "auto" else requested
    why = "; ".join(r for r in reasons if "Unfused" not in r) or "no reason logged"
    _skip(f"No attention backend available ({wanted}) in TE: {why}")
    raise AssertionError("unreachable")


def _import_te() -> dict[str, Any]:
    """Import TE here, not at module level: this module must import where TE is absent."""
    import importlib

    te = importlib.import_module("transformer_engine")
    importlib.import_module("transformer_engine.pytorch")
    base = "transformer_engine.pytorch.attention.dot_product_attention"
    dpa = importlib.import_module(f"{base}.dot_product_attention")
    return {
        "te": te,
        "tex": importlib.import_module("transformer_engine_torch"),
        "dpa_utils": importlib.import_module(f"{base}.utils"),
        "attention_backends": dpa._attention_backends,
        "DotProductAttention": dpa.DotProductAttention,
    }


def _select_chunks(x: torch.Tensor, seq_dim: int, world_size: int, rank: int) -> torch.Tensor:
    """Keep sequence chunks ``rank`` and ``2*ws-1-rank`` of ``2*ws`` (load-balanced causal)."""
    import torch

    n = 2 * world_size
    shape = x.shape
    chunked = x.reshape(*shape[:seq_dim], n, shape[seq_dim] // n, *shape[seq_dim + 1 :])
    idx = torch.tensor([rank, n - 1 - rank], device=x.device)
    picked = chunked.index_select(seq_dim, idx)
    return picked.reshape(*shape[:seq_dim], -1, *shape[seq_dim + 1 :])


@dataclass
class _Inputs:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    cu_seqlens_padded: torch.Tensor | None = None
    valid: torch.Tensor | None = None  # thd: which token slots hold real tokens


def _make_inputs(
    torch: Any,
    cfg: ModelConfig,
    qkv_format: str,
    dtype: Any,
    world_size: int,
    seed: int,
    kernel_backend: str,
) -> _Inputs:
    """Full-sequence inputs, bitwise identical on every rank (seeded CUDA generator)."""
    gen = torch.Generator(device="cuda")
    gen.manual_seed(seed)
    b, s, h, g, d, dv = cfg.batch_size, cfg.seqlen, cfg.num_heads, cfg.gqa, cfg.head_dim, cfg.dv
    if qkv_format == "bshd":
        lead: tuple[int, ...] = (b, s)
    elif qkv_format == "sbhd":
        lead = (s, b)
    else:
        lead = (b * s,)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device="cuda", dtype=dtype)

    inputs = _Inputs(
        q=randn(*lead, h, d), k=randn(*lead, g, d), v=randn(*lead, g, dv), dout=randn(*lead, h * dv)
    )
    if qkv_format != "thd":
        return inputs
    # As TE's test: random lengths, each padded to a multiple of 2*ws, plus one trailing
    # dummy sequence that owns the tail padding; FusedAttention sees the real lengths
    # (padding between sequences), FlashAttention the padded ones.
    cpu_gen = torch.Generator().manual_seed(seed)
    seqlens = torch.randint(0, s + 1, (b,), generator=cpu_gen, dtype=torch.int32)
    padded = (seqlens + 2 * world_size - 1) // (2 * world_size) * (2 * world_size)
    zero = torch.zeros(1, dtype=torch.int32)
    total = torch.tensor([b * s], dtype=torch.int32)
    cu_padded = torch.cat([zero, padded.cumsum(0, dtype=torch.int32), total]).cuda()
    cu = cu_padded.clone()
    if kernel_backend == "FusedAttention":
        cu[1:-1] = seqlens.cumsum(0, dtype=torch.int32).cuda()
    cu[-1] = cu[-2]
    # valid[t]: slot t lies inside the real part of its sequence
    pos = torch.arange(b * s, device="cuda", dtype=torch.int32)
    seg = torch.searchsorted(cu_padded[1:], pos, right=True).clamp(max=b)
    lengths = cu[1:] - cu[:-1]
    inputs.valid = (pos - cu_padded[seg]) < lengths[seg]
    inputs.cu_seqlens, inputs.cu_seqlens_padded = cu, cu_padded
    return inputs


def _is_unsupported(exc: BaseException) -> bool:
    return isinstance(exc, (ValueError, AssertionError, NotImplementedError, RuntimeError)) and (
        _UNSUPPORTED.search(str(exc)) is not None
    )


def _time_ms(torch: Any, dist: Any, group: Any, step: Callable[[], None], n: int) -> float:
    """Mean ms per ``step`` over ``n`` calls on this rank, after a group barrier."""
    dist.barrier(group=group, device_ids=[torch.cuda.current_device()])
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        step()
    end.record()
    torch.cuda.synchronize()
    return float(start.elapsed_time(end)) / max(n, 1)


def run_dpa_with_cp(
    dtype: str = "bf16",
    model: str = "cp_1_0",
    qkv_format: str = "bshd",
    cp_comm_type: str = "p2p",
    attn_mask_type: str = "causal",
    **overrides: Any,
) -> dict[str, Any]:
    """TE ``DotProductAttention`` with CP vs without; see the module docstring.

    ``overrides``: shape fields of :class:`ModelConfig` (``batch_size``, ``seqlen``,
    ``num_heads``, ``head_dim``, ``num_gqa_groups``, ``head_dim_v``) and run knobs
    ``kernel_backend`` ("auto" | "FusedAttention" | "FlashAttention"), ``iters`` (timed
    fwd+bwd, default 10), ``warmup`` (default 2), ``seed`` (default 1234),
    ``compare_grads`` (default True).
    Returns rank-0-meaningful numbers: errors and times are maxima over the CP group.
    """
    unknown = set(overrides) - _SHAPE_KEYS - _RUN_KEYS
    assert not unknown, f"unknown run_dpa_with_cp arguments: {sorted(unknown)}"
    assert dtype in DTYPE_NAMES, f"dtype {dtype!r} not in {DTYPE_NAMES}"
    assert model in MODEL_CONFIGS, f"model {model!r} not in {sorted(MODEL_CONFIGS)}"
    assert qkv_format in QKV_FORMATS, f"qkv_format {qkv_format!r} not in {QKV_FORMATS}"
    assert cp_comm_type in CP_COMM_TYPES, f"cp_comm_type {cp_comm_type!r} not in {CP_COMM_TYPES}"
    assert attn_mask_type in ATTN_MASK_TYPES, f"attn_mask_type {attn_mask_type!r} unknown"
    kernel_backend = str(overrides.get("kernel_backend", "auto"))
    assert kernel_backend in KERNEL_BACKENDS, f"kernel_backend {kernel_backend!r} unknown"
    iters = int(overrides.get("iters", 10))
    warmup = int(overrides.get("warmup", 2))
    seed = int(overrides.get("seed", 1234))
    compare_grads = bool(overrides.get("compare_grads", True))
    cfg = replace(MODEL_CONFIGS[model], **{k: overrides[k] for k in _SHAPE_KEYS & set(overrides)})

    import torch

    dist = _dist()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    if cp_comm_type == "a2a+p2p" and (world_size < 4 or world_size % 2):
        _skip(f"cp_comm_type=a2a+p2p needs an even world size >= 4 (have {world_size})")
    assert cfg.seqlen % (2 * world_size) == 0, (
        f"seqlen {cfg.seqlen} must be divisible by 2*world_size={2 * world_size}"
    )
    if not torch.cuda.is_available():
        _skip("run_dpa_with_cp needs CUDA")
    te_mods = _import_te()
    torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
    # TE's rule: thd needs padding masks; causal -> padding_causal, no_mask -> padding
    mask = attn_mask_type
    if qkv_format == "thd":
        mask = "padding_causal" if "causal" in mask else "padding"
    deterministic = not bool(int(os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1")))
    backend = _choose_backend(
        te_mods,
        torch_dtype,
        cfg,
        qkv_format,
        mask,
        cp_comm_type,
        world_size,
        kernel_backend,
        deterministic,
    )
    case = _Resolved(
        cfg=cfg,
        dtype=dtype,
        torch_dtype=torch_dtype,
        model=model,
        qkv_format=qkv_format,
        cp_comm_type=cp_comm_type,
        mask=mask,
        backend=backend,
        rank=rank,
        world_size=world_size,
        seed=seed,
        iters=iters,
        warmup=warmup,
        compare_grads=compare_grads,
    )
    env = {
        "NVTE_FLASH_ATTN": "1" if backend == "FlashAttention" else "0",
        "NVTE_FUSED_ATTN": "1" if backend == "FusedAttention" else "0",
    }
    try:
        with _env(**env):
            return _run(torch, dist, te_mods, case)
    except BaseException as exc:
        if _is_unsupported(exc):
            _skip(f"TE: {type(exc).__name__}: {str(exc).splitlines()[0][:400]}")
        raise


@dataclass
class _Resolved:
    """A case after defaults, overrides and backend choice: what :func:`_run` needs."""

    cfg: ModelConfig
    dtype: str
    torch_dtype: Any
    model: str
    qkv_format: str
    cp_comm_type: str
    mask: str
    backend: str
    rank: int
    world_size: int
    seed: int
    iters: int
    warmup: int
    compare_grads: bool


def _run(torch: Any, dist: Any, te_mods: dict[str, Any], c: _Resolved) -> dict[str, Any]:
    """The body of :func:`run_dpa_with_cp`, with the backend's NVTE_* variables in force."""
    cfg, backends_cache = c.cfg, te_mods["attention_backends"]
    kv_channels: int | tuple[int, int] = (
        cfg.head_dim if cfg.dv == cfg.head_dim else (cfg.head_dim, cfg.dv)
    )
    core_attn = te_mods["DotProductAttention"](
        cfg.num_heads,
        kv_channels,
        num_gqa_groups=cfg.gqa,
        attention_dropout=0.0,
        qkv_format=c.qkv_format,
        attn_mask_type=c.mask,
    ).cuda()
    inp = _make_inputs(torch, cfg, c.qkv_format, c.torch_dtype, c.world_size, c.seed, c.backend)
    thd_kwargs: dict[str, Any] = {}
    if c.qkv_format == "thd":
        thd_kwargs = {
            "cu_seqlens_q": inp.cu_seqlens,
            "cu_seqlens_kv": inp.cu_seqlens,
            "cu_seqlens_q_padded": inp.cu_seqlens_padded,
            "cu_seqlens_kv_padded": inp.cu_seqlens_padded,
        }
    group_all = _group(dist, tuple(range(c.world_size)))

    # --- reference: no CP, full sequence on every rank ---
    q, k, v = (x.clone().requires_grad_() for x in (inp.q, inp.k, inp.v))
    backends_cache["backend_selection_requires_update"] = True
    out = core_attn(q, k, v, **thd_kwargs)
    out.backward(inp.dout)
    ref = {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}
    ref_backend = _backend_name(backends_cache)

    def ref_step() -> None:
        q.grad = k.grad = v.grad = None
        core_attn(q, k, v, **thd_kwargs).backward(inp.dout)

    ref_ms = _time_ms(torch, dist, group_all, ref_step, max(c.iters // 2, 1))

    # --- CP: this rank's load-balanced shard of the sequence ---
    shard = _sharder(torch, te_mods["tex"], c, inp)
    q_, k_, v_ = (shard(x).detach().clone().requires_grad_() for x in (inp.q, inp.k, inp.v))
    dout_ = shard(inp.dout).contiguous()
    core_attn.set_context_parallel_group(
        _cp_groups(dist, c.cp_comm_type, c.world_size, c.rank),
        list(range(c.world_size)),
        _cp_stream(torch),
        c.cp_comm_type,
    )
    backends_cache["backend_selection_requires_update"] = True
    out_ = core_attn(q_, k_, v_, **thd_kwargs)
    out_.backward(dout_)
    torch.cuda.synchronize()
    cp_backend = _backend_name(backends_cache)
    got = {"out": out_.detach(), "dq": q_.grad, "dk": k_.grad, "dv": v_.grad}
    want = {name: shard(t) for name, t in ref.items()}
    pad = None if inp.valid is None else ~shard(inp.valid)
    tol, max_err = _compare(torch, dist, group_all, c, got, want, pad, cp_backend)

    # --- timing: CP fwd+bwd after warm-up ---
    def cp_step() -> None:
        q_.grad = k_.grad = v_.grad = None
        core_attn(q_, k_, v_, **thd_kwargs).backward(dout_)

    for _ in range(c.warmup):
        cp_step()
    cp_ms = _time_ms(torch, dist, group_all, cp_step, c.iters)
    times = torch.tensor([cp_ms, ref_ms], device="cuda", dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group_all)
    plain_mask = "causal" if "causal" in c.mask else "no_mask"
    return {
        "case": case_id(_case(c.model, c.dtype, c.qkv_format, c.cp_comm_type, plain_mask)),
        "world_size": c.world_size,
        "attn_mask_type": c.mask,
        "backend": cp_backend,
        "ref_backend": ref_backend,
        "cp_ms": round(float(times[0]), 4),
        "ref_ms": round(float(times[1]), 4),
        "iters": c.iters,
        "max_abs_err": max_err,
        "tol": tol,
        "te_version": str(getattr(te_mods["te"], "__version__", "?")),
    }


def _sharder(
    torch: Any, tex: Any, c: _Resolved, inp: _Inputs
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Map a full-sequence tensor to this rank's CP shard (same split for inputs and refs)."""
    if c.qkv_format == "thd":
        idx = tex.thd_get_partitioned_indices(
            inp.cu_seqlens_padded, inp.q.shape[0], c.world_size, c.rank
        )
        return lambda x: x.index_select(0, idx)
    seq_dim = c.qkv_format.index("s")
    return lambda x: _select_chunks(x, seq_dim, c.world_size, c.rank)


def _compare(
    torch: Any,
    dist: Any,
    group: Any,
    c: _Resolved,
    got: dict[str, torch.Tensor],
    want: dict[str, torch.Tensor],
    pad: torch.Tensor | None,
    backend: str,
) -> tuple[float, dict[str, float]]:
    """Check CP results against the reference with TE's tolerances; all ranks agree.

    Every rank checks its shard, then the maxima and a failure flag are all-reduced, so
    either every rank returns or every rank raises (a lone raising rank would leave the
    others waiting in the next collective).
    """
    if c.torch_dtype == torch.bfloat16:
        tol = 2.5e-2 if c.cfg.gqa == c.cfg.num_heads else 3.5e-2
    else:
        tol = 5e-3
    names = ["out", "dq", "dk", "dv"] if c.compare_grads else ["out"]
    errors = torch.zeros(len(names) + 1, device="cuda", dtype=torch.float64)
    messages: list[str] = []
    for i, name in enumerate(names):
        a, b = got[name], want[name]
        assert a is not None and b is not None, f"{name} missing (no gradient flowed)"
        if not bool(torch.isfinite(a).all()):
            messages.append(f"{name}: CP result has NaN/Inf")
        errors[i] = (a.float() - b.float()).abs().max()
        try:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)
        except AssertionError as exc:
            messages.append(f"{name}: {exc}")
        if pad is not None:
            for label, t in (("CP", a), ("reference", b)):
                if int(torch.count_nonzero(t[pad])) != 0:
                    messages.append(f"{name}: {label} result is non-zero in thd padding")
    errors[-1] = float(bool(messages))
    dist.all_reduce(errors, op=dist.ReduceOp.MAX, group=group)
    max_err = {name: float(errors[i]) for i, name in enumerate(names)}
    if float(errors[-1]) != 0:
        local = "\n".join(messages) or "this rank matched; a peer rank did not"
        raise AssertionError(
            f"CP vs non-CP mismatch for {c.model} {c.dtype} {c.qkv_format} {c.cp_comm_type} "
            f"{c.mask} (backend {backend}, atol=rtol={tol}, max |err| over ranks {max_err}) "
            f"on rank {c.rank}:\n{local}"
        )
    return tol, max_err


def _backend_name(cache: dict[str, Any]) -> str:
    """Which backend TE's selector last chose, from its module-level cache."""
    if cache.get("use_flash_attention"):
        return f"FlashAttention {cache.get('flash_attention_backend')}"
    if cache.get("use_fused_attention"):
        sub = cache.get("fused_attention_backend")
        return f"FusedAttention {int(sub) if sub is not None else '?'}"
    if cache.get("use_unfused_attention"):
        return "UnfusedDotProductAttention"
    return "none"


def state_fingerprint(import_te: bool = True) -> dict[str, Any]:
    """TE's process-global state, to show that a warm rank's state is reset between tasks.

    Run it first, then after many other cases: the FP8 flags and the backend-selection flag
    should read the same (cpq resets FP8 state and marks the backend cache stale before
    every task), and NVTE_* variables a case set should be gone. ``attention_params`` shows
    what the selector cache holds; it may name the last case, which is harmless while
    ``backend_selection_requires_update`` is True.
    """
    import sys

    if import_te:
        with contextlib.suppress(ImportError):
            import transformer_engine.pytorch  # noqa: F401
    result: dict[str, Any] = {
        "te_imported": "transformer_engine.pytorch" in sys.modules,
        "nvte_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NVTE_")},
    }
    torch = sys.modules.get("torch")
    if torch is not None:
        result["torch_initial_seed"] = int(torch.initial_seed())
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            result["cuda_allocated"] = int(torch.cuda.memory_allocated())
    if not result["te_imported"]:
        return result
    fp8 = None
    for name in ("transformer_engine.pytorch.quantization", "transformer_engine.pytorch.fp8"):
        module = sys.modules.get(name)
        if module is not None and hasattr(module, "FP8GlobalStateManager"):
            fp8 = module.FP8GlobalStateManager
            break
    if fp8 is not None:
        state = getattr(fp8, "quantization_state", None)
        if state is not None:  # TE >= 2.1x keeps the flags on one instance
            flags = {
                k: getattr(state, k, None)
                for k in (
                    "fp8_enabled",
                    "fp8_calibration",
                    "fp8_parameters",
                    "is_first_fp8_module",
                    "fp8_graph_capturing",
                    "autocast_depth",
                    "high_precision_init_val",
                )
            }
            flags["fp8_recipe"] = repr(getattr(state, "fp8_recipe", None))
            flags["amax_buffers"] = len(getattr(state, "global_amax_buffer", {}) or {})
            flags["autocast_arguments"] = len(getattr(state, "autocast_arguments", {}) or {})
        else:  # older 2.x: class attributes
            flags = {
                k: getattr(fp8, k, None)
                for k in (
                    "FP8_ENABLED",
                    "FP8_CALIBRATION",
                    "FP8_PARAMETERS",
                    "IS_FIRST_FP8_MODULE",
                    "FP8_GRAPH_CAPTURING",
                    "FP8_AUTOCAST_DEPTH",
                )
            }
            flags["FP8_RECIPE"] = repr(getattr(fp8, "FP8_RECIPE", None))
        result["fp8"] = {k: _plain(v) for k, v in flags.items()}
    dpa = sys.modules.get(
        "transformer_engine.pytorch.attention.dot_product_attention.dot_product_attention"
    )
    cache = getattr(dpa, "_attention_backends", None)
    if isinstance(cache, dict):
        params = cache.get("attention_params")
        result["attention_backends"] = {
            "backend_selection_requires_update": bool(
                cache.get("backend_selection_requires_update")
            ),
            "last_selected": _backend_name(cache),
            "attention_params": None if params is None else _params_summary(params),
        }
    return result


def _plain(value: Any) -> Any:
    """msgpack-safe scalar."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _params_summary(params: Any) -> str:
    keys = (
        "qkv_dtype",
        "qkv_layout",
        "max_seqlen_q",
        "num_heads",
        "attn_mask_type",
        "context_parallel",
        "cp_comm_type",
    )
    return ", ".join(f"{k}={getattr(params, k, None)}" for k in keys)
