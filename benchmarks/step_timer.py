"""Where a decode step goes: the engine step's parts timed by wrapping one engine's instances.

Only steps that decode one token for each of ``batch`` requests count, so the figures describe the steady
state of decoding that many requests at once (``benchmarks.bench_offline`` profiles its full batch of 64
and a single request, batch 1).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from common.model.layers import SwiGLUMLP

if TYPE_CHECKING:
    from common.engine.engine_core import ColocatedEngine
    from common.engine.scheduler_output import SchedulerOutput
    from common.model.llama import LlamaDecoderLayer

SMALL_OPS = "model: other (norms, rotary, SiLU, residuals, calls)"
# The parts outside the model's matmuls and attention: what the fused ops and a lean runner shrink.
NON_MATMUL_PARTS = (SMALL_OPS, "sampler", "runner inputs + metadata", "scheduler (schedule + update)")


@dataclass
class StepProfile:
    """Seconds spent in each part of the engine step, summed over decode steps of ``batch`` requests only."""

    batch: int
    num_steps: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: dict.fromkeys(
        ("step", "execute", "model", "matmul", "attention", "logits", "sampler"), 0.0))

    def breakdown(self) -> list[tuple[str, float]]:
        """(part, seconds per step) for the parts of a step, which add up to the whole step."""
        s = self.seconds
        # The forward split three ways: its linear layers, attention, and everything else (norms, rotary,
        # SiLU, residual adds, module calls): the non-matmul share that fused ops shrink.
        parts = [("model: linear layers (matmuls)", s["matmul"]), ("model: attention", s["attention"]),
                 (SMALL_OPS, s["model"] - s["matmul"] - s["attention"]),
                 ("LM head (compute_logits)", s["logits"]),
                 ("sampler", s["sampler"]),
                 ("runner inputs + metadata", s["execute"] - s["model"] - s["logits"] - s["sampler"]),
                 ("scheduler (schedule + update)", s["step"] - s["execute"])]
        return [(name, seconds / max(self.num_steps, 1)) for name, seconds in parts]

    @property
    def seconds_per_step(self) -> float:
        return self.seconds["step"] / max(self.num_steps, 1)

    @property
    def non_matmul_share(self) -> float:
        """Share of the step outside the linear layers, attention and the LM head (NON_MATMUL_PARTS)."""
        parts = dict(self.breakdown())
        return sum(parts[name] for name in NON_MATMUL_PARTS) / max(self.seconds_per_step, 1e-12)


class StepTimer:
    """Times the runner's parts by wrapping them on this engine's instances (the engine code is untouched).

    Only steps that decode one token for each of ``batch`` requests are summed, so the figures describe
    the steady state and not the prefill.
    """

    def __init__(self, engine: ColocatedEngine, batch: int) -> None:
        self.profile = StepProfile(batch)
        self._current: dict[str, float] = {}
        self._full_decode = False
        runner, model = engine.runner, engine.runner.model
        setattr(runner, "execute", self._wrap("execute", runner.execute, classify=True))  # noqa: B010
        setattr(model, "forward", self._wrap("model", model.forward))  # noqa: B010
        # The one-call decode step (common/model/decode_step.py) times its own parts: its projections and
        # attention join the wrapped layers' below (a step runs either way, never both).
        self._decode_step = getattr(model, "decode_step", None)
        if self._decode_step is not None:
            self._decode_step.profile(True)
        setattr(model, "compute_logits", self._wrap("logits", model.compute_logits))  # noqa: B010
        setattr(runner, "sampler", self._wrap("sampler", runner.sampler))  # noqa: B010
        for layer in cast("list[LlamaDecoderLayer]", list(model.layers)):
            mlp = layer.mlp  # a mixture of experts' routed layer counts as a whole (experts in one call)
            mlp_parts = (mlp.gate_up_proj, mlp.down_proj) if isinstance(mlp, SwiGLUMLP) else (mlp,)
            for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, *mlp_parts):
                setattr(linear, "forward", self._wrap("matmul", linear.forward))  # noqa: B010
        if len(model.layers):  # one backend instance serves every layer
            backend = cast("LlamaDecoderLayer", model.layers[0]).self_attn.backend
            setattr(backend, "forward", self._wrap("attention", backend.forward))  # noqa: B010

    def _wrap(self, part: str, fn: Callable[..., Any], classify: bool = False) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if classify:
                scheduled: SchedulerOutput = args[0]
                self._full_decode = (len(scheduled.chunks) == self.profile.batch
                                     and all(c.num_tokens == 1 for c in scheduled.chunks))
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            self._current[part] = self._current.get(part, 0.0) + time.perf_counter() - start
            if part == "model" and self._decode_step is not None:
                matmul, attention, _ = self._decode_step.times()
                self._current["matmul"] = self._current.get("matmul", 0.0) + matmul
                self._current["attention"] = self._current.get("attention", 0.0) + attention
            return out

        return timed

    def end_step(self, seconds: float) -> None:
        if self._full_decode:
            self.profile.num_steps += 1
            self.profile.seconds["step"] += seconds
            for part, spent in self._current.items():
                self.profile.seconds[part] += spent
        self._current.clear()
        self._full_decode = False


def print_profile(title: str, profile: StepProfile) -> None:
    """The profile as a Markdown table under ``## Where a decode step goes — {title}``."""
    per_step = profile.seconds_per_step
    print(f"\n## Where a decode step goes — {title}")
    what = "the one request" if profile.batch == 1 else f"all {profile.batch} requests at once"
    print(f"\n{profile.num_steps} steps decoding {what}: **{per_step * 1e3:.1f} ms/step** "
          f"({profile.batch / per_step:.1f} tok/s while decoding)\n")
    print("| part | ms/step | share |")
    print("|---|---:|---:|")
    parts = profile.breakdown()
    for name, seconds in parts:
        print(f"| {name} | {seconds * 1e3:.1f} | {100 * seconds / per_step:.0f}% |")
    small = dict(parts)[SMALL_OPS]
    print(f"\nNon-matmul time (the model's small ops, the sampler, the runner and the scheduler: every part but "
          f"the linear layers, attention and the LM head): **{100 * profile.non_matmul_share:.0f}%** of the step; "
          f"the model's small ops alone {100 * small / per_step:.0f}%.")
