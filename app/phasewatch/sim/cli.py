"""`phasewatch sim`: the argparse shell over `run_sim`.

Flags mirror `SimSettings` fields (and vLLM's engine flags where vLLM has one). A flag left out
falls back to its `PHASEWATCH_SIM_*` variable, then to the preset. Exit codes: 0 after a clean
shutdown, 2 for a configuration the simulator refuses (with the reason on stderr).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from phasewatch.sim.config import GPU_PRESETS, MODEL_PRESETS, SimConfigError, load_sim_settings

# (flag, SimSettings field, type, help)
_FLAGS: list[tuple[str, str, type, str]] = [
    ("--host", "host", str, "address to bind (default 127.0.0.1)"),
    ("--port", "port", int, "port to bind (default 8000, like vLLM)"),
    ("--gpu", "gpu", str, f"GPU preset: {', '.join(GPU_PRESETS)} (default t4)"),
    ("--model", "model", str, f"model preset: {', '.join(MODEL_PRESETS)} (default qwen2.5-0.5b)"),
    ("--served-model-name", "served_model_name", str, "model name the API answers to"),
    ("--max-model-len", "max_model_len", int, "context limit (default: the model's)"),
    ("--max-num-seqs", "max_num_seqs", int, "most sequences running at once"),
    ("--max-num-batched-tokens", "max_num_batched_tokens", int, "token budget per step"),
    ("--kv-cache-blocks", "kv_cache_blocks", int, "KV cache size in blocks"),
    ("--kv-cache-gib", "kv_cache_gib", float, "KV cache size in GiB"),
    ("--block-size", "block_size", int, "tokens per KV block (default 16)"),
    ("--gpu-memory-utilization", "gpu_memory_utilization", float, "fraction of GPU memory used"),
    ("--time-scale", "time_scale", float, "wall seconds per model second (10 = 10x slower)"),
    ("--peak-tflops", "peak_tflops", float, "override the GPU's dense peak TFLOP/s"),
    ("--mem-bandwidth-gbs", "mem_bandwidth_gbs", float, "override the GPU's bandwidth, GB/s"),
    ("--gpu-memory-gib", "gpu_memory_gib", float, "override the GPU's memory, GiB"),
    ("--mfu", "mfu", float, "fraction of peak FLOP/s a step reaches"),
    ("--mbu", "mbu", float, "fraction of peak bandwidth a step reaches"),
    ("--step-overhead-ms", "step_overhead_ms", float, "fixed cost per engine step, ms"),
    ("--request-overhead-ms", "request_overhead_ms", float, "frontend cost per request, ms"),
    ("--n-params", "n_params", float, "override the model's parameter count"),
    ("--n-layers", "n_layers", int, "override the model's layer count"),
    ("--n-heads", "n_heads", int, "override the model's attention heads"),
    ("--n-kv-heads", "n_kv_heads", int, "override the model's KV heads"),
    ("--head-dim", "head_dim", int, "override the model's head dimension"),
    ("--seed", "seed", int, "seed for output text and EOS draws (default 0)"),
    ("--eos-probability", "eos_probability", float, "per-token EOS chance without ignore_eos"),
    ("--fault", "fault", str, "fault for every request, same syntax as the x-sim-fault header"),
    ("--timeline-capacity", "timeline_capacity", int, "finished request timelines kept"),
    ("--log-level", "log_level", str, "critical, error, warning, info or debug"),
]


def add_parser(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    """Register `sim` on a parent parser's subcommands; `args.func(args)` runs it."""
    parser = subparsers.add_parser(
        "sim",
        help="serve a simulated vLLM (OpenAI-compatible API, /metrics, roofline timing)",
        description="Serve vLLM's OpenAI-compatible API from a simulated engine whose step "
        "times come from a roofline model of the chosen GPU and model. Faults: send the "
        "x-sim-fault header (stall:after=N,seconds=S | disconnect:after=N | error:after=N | "
        "http:CODE).",
    )
    for flag, field, kind, text in _FLAGS:
        parser.add_argument(flag, dest=field, type=kind, default=None, help=text)
    parser.add_argument(
        "--enable-chunked-prefill",
        dest="enable_chunked_prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="split long prefills across steps (default on, as in vLLM's v1 engine)",
    )
    parser.set_defaults(func=run_from_args)


def settings_overrides(args: argparse.Namespace) -> dict[str, Any]:
    fields = [field for _, field, _, _ in _FLAGS] + ["enable_chunked_prefill"]
    return {f: getattr(args, f) for f in fields if getattr(args, f, None) is not None}


def run_from_args(args: argparse.Namespace) -> int:
    from phasewatch.sim.server import run_sim

    try:
        settings = load_sim_settings(**settings_overrides(args))
        run_sim(settings)
    except SimConfigError as exc:
        print(f"phasewatch sim: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        pass
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m phasewatch.sim ...`: the same command without the phasewatch CLI around it."""
    parser = argparse.ArgumentParser(prog="phasewatch")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", *(sys.argv[1:] if argv is None else argv)])
    code: int = args.func(args)
    return code
