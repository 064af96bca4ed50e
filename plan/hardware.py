"""Hardware profiles for the planner: peak FLOP/s, memory, and link bandwidths, as data.

The GPU profiles are datasheet numbers (dense Tensor Core peaks, no sparsity) of the SXM parts in
DGX-style nodes: 8 GPUs on NVLink, one InfiniBand port per GPU. Two fitted constants turn peaks
into achievable rates, the same for every row of every table the planner is checked against:

- `gemm_efficiency`: the fraction of peak a large GEMM reaches (cuBLAS on big, square-ish
  shapes), scaled down for thin shapes by `gemm_fraction` (see there); fitted once, on
  PTD-P Table 1 (A100), see README "The analytic model";
- `attention_efficiency`: the fraction of peak a fused attention kernel reaches (Dao,
  "FlashAttention-2", arXiv 2307.08691: 50-73% of peak on A100 forward, less backward; about
  35-50% for FlashAttention-2 on H100); `unfused_attention_efficiency` the same for the
  unfused per-head batched GEMMs (Q K^T with an inner dimension of one head, 64-128, does about
  d FLOP per byte of scores it writes, below the A100's 153 FLOP/byte ridge: memory bound);
- `comm_efficiency`: the fraction of the link bandwidth a ring collective reaches (NCCL "bus
  bandwidth" over the link rate);
- `p2p_efficiency`: the same for one point-to-point send between two GPUs (a pipeline stage
  boundary), which NCCL does not drive as hard as a ring: its maintainers say send/receive is
  "mostly optimized for alltoall", so "individual send/recv might not achieve peak bandwidth"
  (NVIDIA/nccl issue #464, 2021). Fitted on PTD-P Fig. 18 (GPT-3 175B, tp8 pp12, 2 layers per
  virtual stage, 96 A100s; Megatron-LM examples/sc21/run_figure_18.sh): switching the
  scatter/gather optimisation off adds (1 - 1/t) s b h x 2 bytes to each of the
  `formulas.pipeline_critical_transfers` sends and costs 11-12% at every batch size (about
  107/120/127/130/131 against 119/134/142/144/147 TFLOP/s for batch 12 to 60), which is
  13.5-15 GB/s per HDR port (25 GB/s), 0.56 of the link.

The `cpu` profile is measured on this machine by `tessera plan --calibrate`, which writes a JSON
file (`load_hardware("cpu", calibration=path)`); a JSON file with every `Hardware` field can also
stand in for any GPU (`load_hardware("my-gpu.json")`), such as the one `tessera plan --calibrate
--device cuda` measures (`plan.calibrate_gpu`).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tessera.plan.errors import PlanError


def default_calibration() -> Path:
    """Where `tessera plan --calibrate` saves the cpu profile unless told otherwise:
    `$TESSERA_CACHE/plan-cpu.json`, else `~/.cache/tessera/plan-cpu.json`."""
    root = os.environ.get("TESSERA_CACHE") or Path.home() / ".cache" / "tessera"
    return Path(root) / "plan-cpu.json"

CALIBRATION_KEYS = ("gemm_tflops", "allreduce_gbps", "memory_gib")


@dataclass(frozen=True)
class Hardware:
    """One accelerator kind and the links between them. Rates are per GPU, in units of 10^12
    FLOP/s (TFLOP/s) and 10^9 bytes/s (GB/s); sizes in GiB (2^30 bytes)."""

    name: str
    peak_tflops: dict[str, float]  # dense peak by precision: "bf16", "fp8", "fp32"
    memory_gib: float  # HBM one process can use
    memory_gbps: float  # HBM bandwidth
    intra_node_gbps: float  # NVLink per GPU, one direction
    inter_node_gbps: float  # network per GPU (one NIC per GPU), one direction
    gemm_efficiency: float = 0.685  # fraction of peak a large GEMM reaches (A100 fit, README)
    gemm_half_size: int = 96  # smallest GEMM side at which a GEMM runs at half that fraction
    attention_efficiency: float = 0.6  # fraction of peak a fused (flash) attention kernel reaches
    unfused_attention_efficiency: float = 0.2  # same for per-head batched GEMMs + softmax
    comm_efficiency: float = 0.8  # fraction of link bandwidth a ring collective reaches
    p2p_efficiency: float = 0.56  # same for one point-to-point send (PTD-P Fig. 18 fit)
    framework_overhead_gib: float = 3.0  # CUDA context, NCCL buffers, allocator slack
    link_latency_us: float = 20.0  # start-up of one collective or p2p operation
    # Fixed costs that do not grow with the work: one layer's forward on one micro-batch
    # (its ops' dispatch and launch; the backward counts twice, a recomputed forward once),
    # and one micro-batch's own (embedding, loss, the schedule's bookkeeping, forward and
    # backward together). Measured for `cpu` by `tessera plan --calibrate`, where eager
    # PyTorch's per-op cost dominates small models; 0 for the GPU profiles, whose kernel
    # launches run ahead of a busy GPU (and which were fitted without them).
    layer_overhead_us: float = 0.0
    microbatch_overhead_us: float = 0.0
    notes: str = field(default="", compare=False)
    # The training loss (cross-entropy forward + backward) per logit, in ns, where its exp and
    # log bound it rather than its bytes: measured for `cpu` by `tessera plan --calibrate`
    # (7-10 ns a logit on one AVX2 core against 0.75 for its memory passes); 0 for the GPU
    # profiles, where the passes bound it. `estimate.step_time` charges the slower of the two.
    loss_ns_per_logit: float = 0.0

    def peak(self, precision: str) -> float:
        """Dense peak TFLOP/s for `precision`; PlanError when this hardware lacks it."""
        if precision not in self.peak_tflops:
            raise PlanError(f"{self.name} has no {precision} peak (it supports "
                            f"{sorted(self.peak_tflops)}); choose one of those precisions")
        return self.peak_tflops[precision]

    def gemm_fraction(self, m: int | float, n: int | float, k: int | float) -> float:
        """Achievable fraction of peak for an (m x k) @ (k x n) GEMM.

        `gemm_efficiency * d / (d + gemm_half_size)` with d the smallest of m, n, k: large GEMMs
        reach `gemm_efficiency`; thin ones (a small per-rank hidden size after tensor
        parallelism, attention's head dimension, a short sequence) lose tile utilisation and
        reach less. One shape rule for every model, not a per-case fudge.
        """
        d = max(1.0, float(min(m, n, k)))
        return self.gemm_efficiency * d / (d + self.gemm_half_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


PROFILES: dict[str, Hardware] = {
    # NVIDIA A100 Tensor Core GPU datasheet (SXM4): BF16 312 TFLOPS dense (624 with sparsity),
    # HBM2 40 GB at 1,555 GB/s, NVLink 3 600 GB/s (both directions, so 300 one way). DGX A100:
    # 8 single-port ConnectX-6 HDR 200 Gb/s, one per GPU = 25 GB/s. No FP8.
    "a100-40gb": Hardware("a100-40gb", {"bf16": 312.0, "fp32": 19.5}, memory_gib=40.0,
                          memory_gbps=1555.0, intra_node_gbps=300.0, inter_node_gbps=25.0,
                          notes="A100 SXM4 40GB datasheet; DGX A100 networking"),
    # Same datasheet, 80 GB HBM2e at 2,039 GB/s (nvidia-smi: 81920 MiB).
    "a100-80gb": Hardware("a100-80gb", {"bf16": 312.0, "fp32": 19.5}, memory_gib=80.0,
                          memory_gbps=2039.0, intra_node_gbps=300.0, inter_node_gbps=25.0,
                          notes="A100 SXM4 80GB datasheet; DGX A100 networking"),
    # NVIDIA H100 datasheet (SXM5): BF16 1,979 and FP8 3,958 TFLOPS with sparsity, so 989.5 and
    # 1,979 dense; HBM3 80 GB at 3.35 TB/s (nvidia-smi: 81559 MiB = 79.6 GiB); NVLink 4
    # 900 GB/s (450 one way). DGX H100: 8 ConnectX-7 400 Gb/s, one per GPU = 50 GB/s.
    # Measured rates (bench/results/gpu_check-NVIDIA-H200-*.md, `tessera plan --calibrate
    # --device cuda`): the GEMM and attention efficiencies are the H200's, whose SMs and clocks
    # are the H100's (bf16 GEMMs of llama-1b and llama2-7b layers at 8,192 tokens: 689-808
    # TFLOP/s, fitted 0.7533; cuDNN attention forward + backward 510-530 TFLOP/s counted as the
    # planner counts, 0.5255); HBM 2.96 TB/s measured by copy on an H100 80GB HBM3 (the first
    # GPU run, ../shared/notes/gpu-first-contact.md).
    "h100-80gb": Hardware("h100-80gb", {"bf16": 989.5, "fp8": 1979.0, "fp32": 66.9},
                          memory_gib=79.6, memory_gbps=2960.0, intra_node_gbps=450.0,
                          inter_node_gbps=50.0, gemm_efficiency=0.7533,
                          attention_efficiency=0.5255,
                          notes="H100 SXM5 datasheet peaks, links; rates measured"),
    # NVIDIA H200 datasheet (SXM): the H100's compute, HBM3e 141 GB at 4.8 TB/s (nvidia-smi:
    # 143771 MiB = 140.4 GiB), NVLink 900 GB/s; DGX H200 networking as DGX H100. Rates measured
    # on an H200 (2026-11-27, torch 2.11+cu130): as above, and HBM 4,194 GB/s by a 1 GiB copy.
    "h200": Hardware("h200", {"bf16": 989.5, "fp8": 1979.0, "fp32": 66.9}, memory_gib=140.4,
                     memory_gbps=4194.0, intra_node_gbps=450.0, inter_node_gbps=50.0,
                     gemm_efficiency=0.7533, attention_efficiency=0.5255,
                     notes="H200 SXM datasheet peaks, links; rates measured"),
}


def load_hardware(name: str, calibration: Path | None = None) -> Hardware:
    """The hardware profile called `name`.

    - one of `PROFILES` (a100-40gb, a100-80gb, h100-80gb, h200);
    - `cpu`: this machine, from the JSON file `tessera plan --calibrate` writes (`calibration`,
      default `default_calibration()`) with at least `gemm_tflops`, `allreduce_gbps` (gloo
      all-reduce bus bandwidth) and `memory_gib`; optional `memory_gbps`,
      `layer_overhead_us`, `microbatch_overhead_us`, `loss_ns_per_logit` (0 when absent);
    - a path ending in `.json`: a full profile, every `Hardware` field by name (defaults
      may be left out), and optionally a `measured` block recording how it was measured
      (`tessera plan --calibrate --device cuda` writes one; the planner does not read it).

    Raises `PlanError` for an unknown name (listing the known ones), a missing or incomplete
    calibration (saying to run `tessera plan --calibrate`), or a profile file with an
    unknown, missing or non-numeric field (naming it).
    """
    if name in PROFILES:
        return PROFILES[name]
    if name == "cpu":
        return _cpu_profile(Path(calibration) if calibration else default_calibration())
    if name.endswith(".json"):
        return _json_profile(Path(name))
    raise PlanError(f"unknown hardware {name!r}; choose one of {sorted(PROFILES) + ['cpu']} "
                    "(cpu after `tessera plan --calibrate`), or pass a profile .json file")


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError as exc:
        raise PlanError(f"no {what} at {path}") from exc
    except json.JSONDecodeError as exc:
        raise PlanError(f"{what} {path} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise PlanError(f"{what} {path} must hold a JSON object, got {type(data).__name__}")
    return data


# Fields of a JSON profile that may be 0 (fixed costs, a shape rule switched off); every other
# number divides something and must be positive.
_MAY_BE_ZERO = {"gemm_half_size", "framework_overhead_gib", "link_latency_us",
                "layer_overhead_us", "microbatch_overhead_us", "loss_ns_per_logit"}


def _json_profile(path: Path) -> Hardware:
    """A `Hardware` from a profile file (see `load_hardware`), every field checked by name."""
    data = _read_json(path, what="hardware profile")
    data.pop("measured", None)  # how the numbers were measured: for people
    fields = {f.name: f for f in dataclasses.fields(Hardware)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise PlanError(f"hardware profile {path}: unknown hardware fields {unknown}; known: "
                        f"{sorted(fields)}")
    missing = [n for n, f in fields.items() if n not in data
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise PlanError(f"hardware profile {path} lacks {', '.join(missing)}: every field "
                        f"without a default is required ({', '.join(_REQUIRED_HELP)})")
    if not isinstance(data["name"], str) or not data["name"]:
        raise PlanError(f"hardware profile {path}: name must be a non-empty string")
    peaks = data["peak_tflops"]
    if (not isinstance(peaks, dict) or not peaks
            or not all(_number(v) and v > 0 for v in peaks.values())):
        raise PlanError(f"hardware profile {path}: peak_tflops must map precisions to positive "
                        f'TFLOP/s, e.g. {{"bf16": 989.5}}; got {peaks!r}')
    for key, value in data.items():
        if key in ("name", "notes", "peak_tflops"):
            continue
        floor = 0 if key in _MAY_BE_ZERO else None
        if not _number(value) or (value < 0 if floor == 0 else value <= 0):
            raise PlanError(f"hardware profile {path}: {key} must be a "
                            f"{'non-negative' if floor == 0 else 'positive'} number, "
                            f"got {value!r}")
    if not isinstance(data.get("notes", ""), str):
        raise PlanError(f"hardware profile {path}: notes must be a string")
    return Hardware(**data)


_REQUIRED_HELP = ("name", "peak_tflops {precision: TFLOP/s}", "memory_gib",
                  "memory_gbps (HBM GB/s)", "intra_node_gbps", "inter_node_gbps")


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _cpu_profile(path: Path) -> Hardware:
    """A `Hardware` for this CPU from its calibration file: measured rates are achieved rates,
    so efficiencies are 1 and no shape penalty applies, except attention's, the ratio of its
    measured rate (`attention_tflops`, optional) to the GEMMs'."""
    if not path.exists():
        raise PlanError(f"no cpu calibration at {path}: run `tessera plan --calibrate` first "
                        "(it measures this machine's GEMM throughput and gloo bandwidth)")
    data = _read_json(path, what="cpu calibration")
    missing = [k for k in CALIBRATION_KEYS if not isinstance(data.get(k), (int, float))]
    if missing:
        raise PlanError(f"cpu calibration {path} lacks numbers for {missing}; run "
                        "`tessera plan --calibrate` again")
    gemm, link = float(data["gemm_tflops"]), float(data["allreduce_gbps"])
    # The attention kernel's measured rate relative to the GEMMs' (1 when not measured).
    attention = min(1.0, float(data.get("attention_tflops", gemm)) / gemm)
    return Hardware(
        name="cpu",
        peak_tflops={"fp32": gemm, "bf16": float(data.get("gemm_tflops_bf16", gemm))},
        memory_gib=float(data["memory_gib"]),
        memory_gbps=float(data.get("memory_gbps", 20.0)),
        intra_node_gbps=link, inter_node_gbps=link,
        gemm_efficiency=1.0, gemm_half_size=0, attention_efficiency=attention,
        unfused_attention_efficiency=attention, comm_efficiency=1.0, p2p_efficiency=1.0,
        framework_overhead_gib=float(data.get("framework_overhead_gib", 0.5)),
        link_latency_us=float(data.get("link_latency_us", 50.0)),
        layer_overhead_us=float(data.get("layer_overhead_us", 0.0)),
        microbatch_overhead_us=float(data.get("microbatch_overhead_us", 0.0)),
        loss_ns_per_logit=float(data.get("loss_ns_per_logit", 0.0)),
        notes=f"measured by tessera plan --calibrate ({path})",
    )
