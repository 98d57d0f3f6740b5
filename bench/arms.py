"""Planning arms: which engine/backend/scheme combinations run, with what sizing, in what order.

Arms are grouped by scheme so the arms compared with each other run next to each other in time,
and rounds visit every arm in turn (A B A B), so drift of the machine (this one's memory
bandwidth flips between two levels within seconds) lands on every arm alike.

Sizing is global (`--runs`, `--warmup`, `--decode-tokens`) with per-arm overrides,
`--set SELECTOR.KEY=VALUE`, where SELECTOR is an engine name (`kipp`, `llama_cpp`) or a prefix of
an arm name (`kipp-reference`, `llama.cpp/q8_0`), optionally limited to one workload with
`@WORKLOAD` (`kipp@prefill512`), and KEY is runs, warmup, decode_tokens or skip (a comma list of
workloads the arm sits out). Overrides apply in order; every one ends up in the record.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

from bench import engines
from bench.engines.base import ArmSpec
from bench.fallback import expected_path

SIZING_KEYS = ("runs", "warmup", "decode_tokens", "skip")


@dataclass(frozen=True)
class Sizing:
    runs: int = 5
    warmup: int = 1
    decode_tokens: int = 128
    skip: frozenset[str] = field(default_factory=frozenset)

    def __post_init__(self):
        if self.runs < 1:
            raise ValueError(f"runs must be at least 1, got {self.runs}")
        if self.warmup < 0:
            raise ValueError(f"warmup must be non-negative, got {self.warmup}")
        if self.decode_tokens < 1:
            raise ValueError(f"decode_tokens must be positive, got {self.decode_tokens}")


@dataclass(frozen=True)
class Override:
    selector: str
    key: str
    value: str
    workload: str | None = None  # only this workload, when given

    def matches(self, spec: ArmSpec, workload: str | None = None) -> bool:
        if self.workload is not None and self.workload != workload:
            return False
        return self.selector == spec.engine or spec.name.startswith(self.selector)


def parse_override(text: str) -> Override:
    """'kipp.decode_tokens=8' -> Override('kipp', 'decode_tokens', '8');
    'kipp@prefill512.runs=1' -> the same limited to the prefill512 workload."""
    target, sep, value = text.partition("=")
    selector, dot, key = target.rpartition(".")
    selector, at, workload = selector.partition("@")
    if not sep or not dot or not selector or key not in SIZING_KEYS or (at and not workload):
        raise ValueError(f"--set {text!r}: expected SELECTOR[@WORKLOAD].KEY=VALUE with KEY one "
                         f"of {', '.join(SIZING_KEYS)}")
    return Override(selector, key, value, workload or None)


def sizing_for(spec: ArmSpec, base: Sizing, overrides: list[Override],
               workload: str | None = None) -> Sizing:
    """The base sizing with every override matching the arm (and workload) applied in order."""
    sizing = base
    for o in overrides:
        if not o.matches(spec, workload):
            continue
        if o.key == "skip":
            sizing = replace(sizing, skip=frozenset(w for w in o.value.split(",") if w))
        else:
            sizing = replace(sizing, **{o.key: int(o.value)})
    return sizing


def interleave(arms: list[str], total: dict[str, int]) -> list[tuple[int, str]]:
    """(round, arm) in execution order: each round visits, in order, every arm with runs left.

    `total[arm]` is the arm's warm-up plus measured runs; round r < warmup is a warm-up."""
    rounds = max((total[a] for a in arms), default=0)
    return [(r, a) for r in range(rounds) for a in arms if r < total[a]]


def plan(checkpoint: str, engine_names: list[str], schemes: list[str], backends: list[str],
         threads: int, context: int, expect_paths: dict[str, tuple[str, ...]] | None = None,
         mlx_root: Path | None = None, weight_memory: list[str] | None = None,
         cpu_dots: list[str] | None = None) -> list[ArmSpec]:
    """Every arm to run, grouped by scheme in `schemes` order, engines in the order given.
    `weight_memory` ("stored", "float32"): one Kipp arm per backend and mode (kipp.memory);
    none given: each backend's own choice ("auto"). `cpu_dots` ("f32", "int8", "bf16",
    "int8+bf16"): one Kipp arm per dot of the stored CPU matmul as well ($KIPP_JAX_CPU_DOT at
    load)."""
    from kipp.formats import store

    expect_paths = expect_paths or {}
    arms = []
    for scheme in schemes:
        artifact = str(store.artifact_path(checkpoint, scheme))
        for name in engine_names:
            info = engines.get(name)
            base = ArmSpec(engine=name, scheme=scheme, checkpoint=checkpoint, threads=threads,
                           context=context)
            if name == "kipp":
                modes = [{"weight_memory": m} for m in weight_memory or []] or [{}]
                modes = [{**m, "cpu_dot": d} for m in modes for d in cpu_dots or []] or modes
                arms += [replace(base, backend=b, artifact=artifact, options=mode,
                                 expect_path=expected_path(b, expect_paths.get(b)))
                         for b in backends for mode in modes]
            elif scheme in info.schemes:
                arms.append(replace(base, artifact=artifact if info.weights == "artifact" else "",
                                    source=_source(checkpoint) if info.weights == "source" else ""))
            elif scheme in info.own_quant:
                arms.append(_own_quant_arm(base, checkpoint, scheme, mlx_root))
    return arms


def _source(checkpoint: str) -> str:
    """The checkpoint's Hugging Face folder (a synthetic one is generated on first use)."""
    from kipp.formats import store

    return str(store.source_folder(checkpoint))


MLX_OWN_QUANT = {"q8_0": ("q8g32", 8), "affine4_gs32": ("q4g32", 4)}


def mlx_quant_path(checkpoint: str, scheme: str, root: Path | None = None) -> Path:
    """Where `python -m bench prepare --mlx` puts mlx-lm's own conversion for `scheme`."""
    from kipp.formats import registry, store

    entry = registry.get(checkpoint)
    root = root or store.home() / "bench" / "mlx"
    return root / checkpoint.replace("/", "--") / entry.revision / MLX_OWN_QUANT[scheme][0]


def _own_quant_arm(base: ArmSpec, checkpoint: str, scheme: str, root: Path | None) -> ArmSpec:
    label = f"own {MLX_OWN_QUANT[scheme][0]}"
    return replace(base, weights=str(mlx_quant_path(checkpoint, scheme, root)),
                   source=_source(checkpoint), options={"own_quant": label})
