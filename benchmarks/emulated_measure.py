"""``nox -s bench-emulated``'s measuring: the device models, the server grid, the calibration and
the runs, each run's record (with its CPU headroom) appended to ``runs.json``.

The scenario's constants live here; ``emulated_analyse`` reads the records and ``emulated_render``
draws the analysis (the CLI and the whole story: ``benchmarks/emulated.py``).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from benchmarks.serve import POLICIES, PlannedRun, Workload, measure_server

MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 2048
# The simulator's default prompts and docs/results.md's small scenario's outputs, as vLLM's random
# dataset draws them: uniform in len * (1 -+ ratio), i.e. prompts 128-1024, outputs 8-40 tokens.
PROMPT_LEN, OUTPUT_LEN = "uniform:128:1024", "uniform:8:40"
WORKLOAD = Workload(
    input_len=576, output_len=24, range_ratio={"input": 448 / 576, "output": 16 / 24}
)
MAX_MODEL_LEN = 1088  # the longest prompt (1024) and output (40) fit
# The e2e tiny MoE made smaller still (one layer, hidden 64): its real forward and its MoE
# collectives are host work that adds to each emulated step; at DP=4 with two layers of hidden 128
# they added ~30% to a 100 ms step and ~0.2 ms per prefill token.
MODEL_SIZES = {
    "max_position_embeddings": MAX_MODEL_LEN,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 32,
}
SERVER_FLAGS = (
    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS),
    # 64 MiB of KV cache per rank hold ~250k tokens of this model, 30x what 8 requests of 1088
    # need (the simulator's cache never preempts either, and the router's KV term stays 0); the
    # e2e default of 1 GiB per rank (VLLM_CPU_KVCACHE_SPACE, unset: server_spec) took 8 GiB
    # at DP=8.
    "--kv-cache-memory-bytes", str(64 << 20),
    # The same seed serves the same prompts in every run: a prefix cache would skip their
    # prefill on the second run, which the simulator (distinct prompts) does not.
    "--no-enable-prefix-caching",
)  # fmt: skip
KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# The simulator's router for the server's vLLM (0.30: the in-flight floor; router.py).
SIM_ARGS = (
    "--max-num-batched-tokens", str(MAX_NUM_BATCHED_TOKENS), "--router", "inflight-floor",
)  # fmt: skip
DEVICES = ("per-rank", "uniform")
DEFAULT_SCALE = 5.0
DEFAULT_POLICIES = "off,on,bounded-hold:8"
DEFAULT_LOADS = "0.6,0.8,1.0,1.2,1.4"
CONTROL_LOADS = "1.0,1.4"
# advise runs ~27 simulations (3 seeds; off, on, the hold; its step-model variants) per rate: at
# every load it would take longer than the sweep's own simulations, so at the knee and above.
ADVISE_LOADS = (1.0, 1.4)
ADVISE_JOBS = 2
# The calibration run's load, x the device model's own knee: below the real server's knee.
CALIBRATION_LOAD = 0.6
# A run is valid when every rank's CPU time is at most this share of the device time it
# emulated: the host work then fits beside the "device" even on the shared 2-core machine.
CPU_SHARE_LIMIT = 0.25


# ------------------------------------------------------------------------ the device models
def per_rank_model(scale: float) -> dict:
    """The simulator's default step model, every time term times ``scale``; the gather is not
    emulated (the real one runs) and ``shared_fraction`` stays 0 (``device_time``)."""
    from balance_sim.stepmodel import StepTimeModel

    default = StepTimeModel()
    keys = ("fixed_ms", "per_prefill_token_ms", "per_decode_request_ms", "per_kv_token_ms")
    return {key: round(getattr(default, key) * scale, 6) for key in keys}


def sim_options(dp: int, model: dict, load: float):
    """The simulator's scenario at ``load`` x its knee: ``load x dp x max_num_seqs`` in flight."""
    from balance_sim.runner import SimOptions
    from balance_sim.stepmodel import StepTimeModel

    return SimOptions(
        dp_size=dp,
        max_num_seqs=MAX_NUM_SEQS,
        max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
        concurrency=max(1, round(load * dp * MAX_NUM_SEQS)),
        prompt_len=PROMPT_LEN,
        output_len=OUTPUT_LEN,
        step_model=StepTimeModel(**model),
    )


def rate_at(dp: int, model: dict, load: float) -> float:
    """The arrival rate of ``load`` x the knee (envelope's definition: runner.build_workload)."""
    from balance_sim.runner import build_workload

    return round(build_workload(sim_options(dp, model, load)).rate_per_s, 3)


def uniform_model(dp: int, model: dict) -> dict:
    """The negative control's device: ``model``'s estimated step at the knee (the calibrated
    model: what a step of the per-rank device costs there, host work included), the same for
    every rank and every step, whatever it runs."""
    from balance_sim.runner import estimated_step_s
    from balance_sim.workload import LengthDist

    options = sim_options(dp, model, 1.0)
    step_s = estimated_step_s(
        options, LengthDist.parse(PROMPT_LEN).mean, LengthDist.parse(OUTPUT_LEN).mean
    )
    return {"fixed_ms": round(step_s * 1000.0, 3)}


def write_device(out: Path, dp: int, device: str, model: dict) -> Path:
    path = out / f"device-dp{dp}-{device}.json"
    path.write_text(json.dumps(model, indent=1) + "\n")
    return path


# ------------------------------------------------------------------------ measuring
@dataclasses.dataclass(frozen=True)
class Server:
    """One server of the grid and the runs it serves."""

    dp: int
    device: str
    policy: str
    repeat: int
    loads: tuple[float, ...]

    @property
    def label(self) -> str:
        return f"dp{self.dp}-{self.device}-{self.policy.replace(':', '-')}-{self.repeat}"


def grid(args) -> list[Server]:
    """Servers in the order they run: per repeat, per DP size, per device, every policy."""
    servers = []
    for repeat in range(args.repeats):
        for dp in args.dp:
            for device in args.devices:
                loads = args.loads if device == "per-rank" else args.control_loads
                policies = args.policies if device == "per-rank" else args.control_policies
                servers += [Server(dp, device, policy, repeat, loads) for policy in policies]
    return servers


def server_spec(model_dir: Path, out: Path, label: str, dp: int, device_file: Path, policy: str):
    """The e2e server at ``dp`` ranks with the device model in ``device_file`` and ``policy``."""
    from vllm_balance_e2e_plugins.device_time import DEVICE_MODEL_ENV
    from vllm_balance_e2e_plugins.step_timing import STEP_DIR_ENV

    from balance_testbed.server import MODEL_DTYPE, ServerSpec

    class Spec(ServerSpec):
        def environ(self, stack_dir: Path) -> dict[str, str]:
            # Unset, so that vLLM takes --kv-cache-memory-bytes (SERVER_FLAGS) instead.
            return {k: v for k, v in super().environ(stack_dir).items() if k != KV_CACHE_ENV}

    steps_dir = out / "servers" / label / "steps"
    steps_dir.mkdir(parents=True, exist_ok=True)
    config, flags = POLICIES[policy]
    return Spec(
        model_dir,
        dp_size=dp,
        dtype=MODEL_DTYPE,
        max_num_seqs=MAX_NUM_SEQS,
        max_model_len=MAX_MODEL_LEN,
        additional_config=config,
        env={STEP_DIR_ENV: str(steps_dir), DEVICE_MODEL_ENV: str(device_file)},
        extra_args=SERVER_FLAGS + flags,
    )


def calibrate(args, out: Path, model_dir: Path, dp: int) -> dict:
    """The step model the server really runs at ``dp`` ranks: the emulated device plus what the
    real server adds to each step (its collectives, its host work), fitted by serve_report's fit
    on one balance-off run at ``CALIBRATION_LOAD`` x the device model's own knee. The loads of
    the grid are multiples of this model's knee. Kept in ``out`` (a resumed sweep reuses it)."""
    from benchmarks.serve_report import cluster_steps, fit_step_model, in_run, load_steps

    path = out / f"calibration-dp{dp}.json"
    if path.exists():
        return json.loads(path.read_text())
    label = f"dp{dp}-calibration"
    device = per_rank_model(args.scale)
    spec = server_spec(model_dir, out, label, dp, write_device(out, dp, "per-rank", device), "off")
    rate = rate_at(dp, device, CALIBRATION_LOAD)
    prompts = max(args.min_prompts, round(rate * args.seconds))
    [run] = measure_server(
        spec, label, model_dir, [PlannedRun("off", rate, 0, prompts, label)], out, WORKLOAD
    )
    steps = in_run(cluster_steps(load_steps(out, label)), run)
    fitted = fit_step_model(steps).to_json()
    calibration = {
        "device": device,
        "fitted": fitted,
        "run": {k: run[k] for k in ("rate", "load", "server_cpu_s", "t0", "t1", "file")},
        "headroom": headroom(run_records(load_steps(out, label), run)),
    }
    path.write_text(json.dumps(calibration, indent=1) + "\n")
    print(f"[{label}] fitted {fitted}", flush=True)
    return calibration


def knee_model(calibration: dict) -> dict:
    keys = ("fixed_ms", "per_prefill_token_ms", "per_decode_request_ms", "per_kv_token_ms")
    return {key: calibration["fitted"][key] for key in keys}


def measure_grid(args, out: Path) -> None:
    from balance_testbed.server import MODEL_DTYPE
    from balance_testbed.tiny_moe import make_tiny_moe

    model_dir = make_tiny_moe(out / "model", MODEL_DTYPE, **MODEL_SIZES)
    path = out / "runs.json"
    runs = json.loads(path.read_text()) if path.exists() else []
    done = {run["server"] for run in runs}  # a sweep may be run in parts, or resumed
    calibrations = {dp: calibrate(args, out, model_dir, dp) for dp in args.dp}
    for server in grid(args):
        if server.label in done:
            print(f"[{server.label}] measured earlier: kept", flush=True)
            continue
        knee = knee_model(calibrations[server.dp])
        device = (
            per_rank_model(args.scale)
            if server.device == "per-rank"
            else uniform_model(server.dp, knee)
        )
        device_file = write_device(out, server.dp, server.device, device)
        spec = server_spec(model_dir, out, server.label, server.dp, device_file, server.policy)
        plan = []
        for load in server.loads:
            rate = rate_at(server.dp, knee, load)
            prompts = max(args.min_prompts, round(rate * args.seconds))
            name = f"{server.label}_l{load:g}"
            plan.append(PlannedRun(server.policy, rate, server.repeat, prompts, name))
        measured = measure_server(spec, server.label, model_dir, plan, out, WORKLOAD)
        for run, load in zip(measured, server.loads):
            run.update(dp=server.dp, device=server.device, knee=load, scale=args.scale)
        runs += measured
        path.write_text(json.dumps(runs, indent=1))


# ------------------------------------------------------------------------ headroom
# A field of each run's record (runs.json, summary.json): a plain dict, as written there.
def run_records(records: list[dict], run: dict) -> dict[int, list[dict]]:
    """Each rank's step records from the run's first to its last request."""
    by_rank: dict[int, list[dict]] = {}
    for record in sorted(records, key=lambda r: r["t"]):
        if run["t0"] <= record["t"] <= run["t1"]:
            by_rank.setdefault(record["rank"], []).append(record)
    return by_rank


def headroom(by_rank: dict[int, list[dict]], limit: float = CPU_SHARE_LIMIT) -> dict:
    """CPU time of each rank (engine core + worker) against the device time it emulated, over
    the run: the worst rank's share decides whether the run is valid.

    A valid emulation needs the host work to fit beside the sleep: where a rank's CPU time
    approaches its device time, its steps (and through lockstep everyone's) stretch by CPU
    contention, and the run measures the machine, not the emulated accelerator.
    """
    shares = {}
    for rank, records in by_rank.items():
        first, last = records[0], records[-1]
        device_ms = last["device_ms"] - first["device_ms"]
        cpu_ms = (last["cpu_s"] - first["cpu_s"]) * 1000.0
        shares[rank] = cpu_ms / device_ms if device_ms > 0 else float("inf")
    worst = max(shares.values()) if shares else float("inf")
    return {
        "cpu_share_per_rank": {rank: round(share, 3) for rank, share in sorted(shares.items())},
        "cpu_share_worst": round(worst, 3),
        "limit": limit,
        "valid": worst <= limit,
    }
