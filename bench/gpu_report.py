"""bench_gpu.py's results as figures: greedy equality (the server's tokens against
transformers' on the same weights), the targets with their ratios, and the plain-text report.
Every figure may be missing (its phase failed or ran out of time): the report says so and
goes on."""

from __future__ import annotations

from typing import Any

from bench.gpu_common import Plan

# (label, model, concurrency's index in plan.concurrencies, figure, "<=" or ">=", target, unit)
TARGETS = (
    ("ITL p50, 1 client", "llama1b", 0, "itl_p50_ms", "<=", 2.5, "ms"),
    ("output tok/s, 32 clients", "llama1b", 1, "output_tok_s", ">=", 9000.0, "tok/s"),
    ("output tok/s, 128 clients", "llama1b", 2, "output_tok_s", ">=", 20000.0, "tok/s"),
    ("TTFT p50, 128 clients", "llama1b", 2, "ttft_p50_ms", "<=", 150.0, "ms"),
    ("ITL p99, 128 clients", "llama1b", 2, "itl_p99_ms", "<=", 25.0, "ms"),
    ("ITL p50, 1 client", "smollm2", 0, "itl_p50_ms", "<=", 2.0, "ms"),
)
_SHAPE_NAMES = {"llama1b": "Llama-3.2-1B shape", "smollm2": "SmolLM2-135M shape"}


def get(data: Any, *keys: str | int) -> Any:
    """data[k0][k1]... or None where any step is missing."""
    for key in keys:
        if isinstance(data, dict):
            data = data.get(key if isinstance(key, str) else str(key))
        elif isinstance(data, list) and isinstance(key, int) and key < len(data):
            data = data[key]
        else:
            return None
    return data


# ------------------------------------------------------------------ derived figures
def compare_tokens(served: list[list[int]], reference: list[list[int]]) -> dict[str, Any]:
    """Greedy tokens prompt by prompt: equal, or where they first differ."""
    mismatch = None
    for prompt, (ours, theirs) in enumerate(zip(served, reference)):
        position = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b),
                        None if len(ours) == len(theirs) else min(len(ours), len(theirs)))
        if position is not None and mismatch is None:
            mismatch = {"prompt": prompt, "position": position,
                        "server": ours[position] if position < len(ours) else None,
                        "transformers": theirs[position] if position < len(theirs) else None}
    matched = sum(a == b for a, b in zip(served, reference))
    return {"prompts": len(reference), "tokens_per_prompt": len(reference[0]) if reference else 0,
            "matched_prompts": matched,
            "equal": mismatch is None and len(served) == len(reference),
            "first_mismatch": mismatch}


def equality(results: dict[str, Any]) -> dict[str, Any]:
    """Each served model's greedy tokens (its served dtype), and the float32 server's,
    against transformers' in the same dtype."""
    pairs = []
    for name, serving in (results.get("serving") or {}).items():
        dtype = get(serving, "greedy", "dtype") or get(serving, "dtype")
        pairs.append((f"{name} ({dtype}, the benchmarked server)", name, dtype,
                      get(serving, "greedy", "tokens")))
    fp32 = results.get("equality_fp32")
    if fp32:
        pairs.append((f"{fp32.get('model')} (float32 server)", fp32.get("model"), "float32",
                      get(fp32, "greedy", "tokens")))
    found: dict[str, Any] = {}
    for label, name, dtype, served in pairs:
        reference = get(results, "transformers", "greedy", name, dtype, "tokens")
        if served is None or reference is None:
            found[label] = {"error": "no tokens from the "
                            + ("server" if served is None else "transformers phase")}
        else:
            found[label] = {"dtype": dtype, **compare_tokens(served, reference)}
    return found


def targets(results: dict[str, Any], plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for label, name, index, figure, direction, target, unit in TARGETS:
        concurrency = plan.concurrencies[index] if index < len(plan.concurrencies) else None
        value = (None if concurrency is None else
                 get(results, "serving", name, "levels", concurrency, figure))
        met = None if value is None else (value <= target if direction == "<=" else
                                          value >= target)
        rows.append({"target": f"{_SHAPE_NAMES[name]}: {label} {direction} {target:g} {unit}",
                     "concurrency": concurrency, "value": value, "unit": unit,
                     "ratio": None if value is None else value / target, "met": met})
    failed = [get(level, key) or 0 for serving in (results.get("serving") or {}).values()
              for level in (serving.get("levels") or {}).values()
              for key in ("failed", "unfinished")]
    rows.append({"target": "no failed (or unfinished) request", "value": sum(failed),
                 "unit": "requests", "ratio": None, "met": sum(failed) == 0 if failed else None})
    return rows


# ------------------------------------------------------------------ the text report
def render(results: dict[str, Any]) -> str:
    lines: list[str] = []
    for part in (_header, _phases, _models, _serving, _transformers, _profile, _equality,
                 _targets):
        try:
            section = part(results)
        except Exception as error:  # a report with one section short beats none
            section = [f"({part.__name__[1:]}: could not be shown: {error!r})"]
        if len(section) == 1 and section[0].endswith(":"):  # a heading alone
            section.append("  (no figures: its phase did not run or failed)")
        lines += [*section, ""]
    return "\n".join(lines)


def _first_line(error: str) -> str:
    """An error's first line (its type and message, see gpu_common.error_text), cut short."""
    return error.strip().splitlines()[0][:240] if error.strip() else "?"


def _f(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _header(results: dict[str, Any]) -> list[str]:
    meta, device = results.get("meta", {}), results.get("device") or {}
    mode = "DRY RUN on the CPU, tiny models" if meta.get("dry_run") else "GPU run"
    return [f"gateway GPU benchmark ({mode}), {meta.get('started')}, "
            f"{_f(meta.get('wall_s'), 0)} s",
            f"device: {device.get('name', '?')} ({device.get('memory_gib', '-')} GiB, "
            f"capability {device.get('capability', '-')}); torch {device.get('torch', '?')}, "
            f"CUDA {device.get('cuda', '-')}, triton {device.get('triton', '-')}, "
            f"transformers {device.get('transformers', '?')}",
            f"gateway commit: {meta.get('gateway_commit')}",
            f"server flags: {' '.join(meta.get('serve_args', []))}"]


def _phases(results: dict[str, Any]) -> list[str]:
    lines = ["phases:"]
    for name, phase in (results.get("phases") or {}).items():
        lines.append(f"  {name:<16}{phase.get('status', '?'):<9}{_f(phase.get('seconds'), 1):>7} s"
                     f" (box {_f(phase.get('box_s'), 0)} s, CPU {_f(phase.get('cpu_s'), 1)} s)"
                     + (f"  {_first_line(phase['error'])}" if phase.get("error") else ""))
    return lines


def _models(results: dict[str, Any]) -> list[str]:
    lines = ["models (random weights, bfloat16):"]
    bandwidth = results.get("bandwidth") or {}
    for name, model in (results.get("models") or {}).items():
        floor = get(bandwidth, "floors", name) or {}
        lines.append(f"  {name:<9}{_f((model.get('parameters') or 0) / 1e9, 3)} B parameters, "
                     f"{_f((model.get('weight_bytes') or 0) / 1e9, 3)} GB; bandwidth floor "
                     f"{_f(floor.get('floor_ms_per_step'), 3)} ms/step (streamed weights only: "
                     f"{_f(floor.get('streamed_floor_ms_per_step'), 3)})"
                     + (f"  ERROR {_first_line(model['error'])}" if model.get("error") else ""))
    if not bandwidth:
        return lines
    lines.append(f"  device-to-device copy: {_f(bandwidth.get('gb_per_s'), 0)} GB/s (read + "
                 f"write, {_f((bandwidth.get('copy_bytes') or 0) / 2**20, 0)} MiB, "
                 f"{bandwidth.get('timer', '-')})"
                 + (f"  ERROR {_first_line(bandwidth['error'])}" if bandwidth.get("error") else ""))
    return lines


def _serving(results: dict[str, Any]) -> list[str]:
    meta = results.get("meta", {})
    lines = [f"gateway serve, streamed completions ({meta.get('prompt_len')} prompt token ids, "
             f"{meta.get('output_len')} output tokens, ignore_eos, temperature 0):"]
    for name, serving in (results.get("serving") or {}).items():
        first, later = serving.get("first_request") or {}, get(serving, "levels", 1) or {}
        ratio = (first["itl_p50_ms"] / later["itl_p50_ms"]
                 if first.get("itl_p50_ms") and later.get("itl_p50_ms") else None)
        lines += [f"  {name}: ready after {_f(serving.get('startup_s'), 1)} s; "
                  f"{serving.get('worker_line', '')[:160]}",
                  f"    first request after start-up: TTFT {_f(first.get('ttft_ms'))} ms, "
                  f"ITL p50 {_f(first.get('itl_p50_ms'))} ms (x{_f(ratio)} the later ones), "
                  f"max gap {_f(first.get('itl_max_ms'))} ms"
                  + (f"  ERROR {_first_line(first['error'])}" if first.get("error") else ""),
                  f"    {'clients':>8}{'tok/s':>10}{'ITL p50':>9}{'ITL p99':>9}{'TTFT p50':>10}"
                  f"{'TTFT p99':>10}{'failed':>8}{'unfinished':>11}  (ms)"]
        for concurrency, level in (serving.get("levels") or {}).items():
            if level.get("error"):
                lines.append(f"    {concurrency:>8}  ERROR {_first_line(level['error'])}")
                continue
            lines.append(f"    {concurrency:>8}{_f(level.get('output_tok_s'), 0):>10}"
                         f"{_f(level.get('itl_p50_ms')):>9}{_f(level.get('itl_p99_ms')):>9}"
                         f"{_f(level.get('ttft_p50_ms'), 1):>10}"
                         f"{_f(level.get('ttft_p99_ms'), 1):>10}{level.get('failed', '-'):>8}"
                         f"{level.get('unfinished', '-'):>11}"
                         + (f"  {level['errors'][0][:120]}" if level.get("errors") else ""))
        if serving.get("error"):
            lines.append(f"    ERROR {_first_line(serving['error'])}")
        if serving.get("log_tail"):
            lines += ["    its log ends:"] + [f"      {line[:200]}" for line in
                                              serving["log_tail"].splitlines()[-8:]]
    return lines


def _transformers(results: dict[str, Any]) -> list[str]:
    hf, floors = results.get("transformers") or {}, get(results, "bandwidth", "floors") or {}
    lines = [f"transformers generate ({results.get('meta', {}).get('hf_dtype')}, greedy, "
             f"{results.get('meta', {}).get('output_len')} new tokens; ms/step includes the "
             "prefill) and the server against it:"]
    for name, batches in (hf.get("generate") or {}).items():
        for key, run in batches.items():
            if run.get("error"):
                lines.append(f"  {name:<9}{key:<10} ERROR {_first_line(run['error'])}")
                continue
            served = get(results, "serving", name, "levels", run["batch"]) or {}
            lines.append(f"  {name:<9}batch {run['batch']:<4}{run['tok_s']:>10,.0f} tok/s"
                         f"{run['ms_per_step']:>8.2f} ms/step"
                         + _against_server(run, served, get(floors, name, "floor_ms_per_step")))
    return lines


def _against_server(run: dict[str, Any], served: dict[str, Any], floor: float | None) -> str:
    if run["batch"] == 1 and served.get("itl_p50_ms") is not None:
        ours = served["itl_p50_ms"]
        return (f"; served ITL p50 {ours:.2f} ms: x{ours / run['ms_per_step']:.2f} this"
                + (f", x{ours / floor:.1f} the bandwidth floor" if floor else ""))
    if served.get("output_tok_s") is not None:
        return (f"; served at {run['batch']} clients: x{served['output_tok_s'] / run['tok_s']:.2f}"
                " this tok/s")
    return ""


def _profile(results: dict[str, Any]) -> list[str]:
    profile = results.get("profile") or {}
    lines = [f"profile of decode steps ({profile.get('model')}, {profile.get('source')}; "
             f"{get(profile, 'device', 'dtype')}):"]
    for batch, run in (profile.get("batches") or {}).items():
        if run.get("error"):
            lines.append(f"  batch {batch}: ERROR {_first_line(run['error'])}")
            continue
        lines.append(f"  batch {batch:<4} wall {run['wall_ms_per_step']:.3f} ms/step, "
                     f"{run['timer']} {run['kernel_ms_per_step']:.3f} ms/step "
                     f"({run['busy_fraction']:.0%} of wall), {run['kernels_per_step']:.0f} "
                     f"{run['unit']}/step")
        for kernel in run.get("busiest", [])[:5]:
            lines.append(f"      {kernel['ms_per_step']:8.3f} ms {kernel['per_step']:6.1f}x  "
                         f"{kernel['name'][:70]}")
    if profile.get("error"):
        lines.append(f"  ERROR {_first_line(profile['error'])}")
    return lines


def _equality(results: dict[str, Any]) -> list[str]:
    lines = ["greedy equality, server against transformers on the same weights:"]
    for label, found in (results.get("equality") or {}).items():
        if found.get("error"):
            lines.append(f"  {label}: {found['error']}")
            continue
        mismatch = found["first_mismatch"]
        lines.append(f"  {label}: {found['matched_prompts']}/{found['prompts']} prompts equal "
                     f"over {found['tokens_per_prompt']} tokens"
                     + ("" if mismatch is None else
                        f"; first mismatch: prompt {mismatch['prompt']}, position "
                        f"{mismatch['position']} (server {mismatch['server']}, transformers "
                        f"{mismatch['transformers']})"))
    return lines


def _targets(results: dict[str, Any]) -> list[str]:
    lines = ["targets (ratio = value / target):"]
    for row in results.get("targets") or []:
        verdict = {True: "met", False: "MISSED", None: "no figure"}[row["met"]]
        clients = row.get("concurrency")
        at = f" (at {clients} client{'s' if clients != 1 else ''})" if clients else ""
        lines.append(f"  {row['target']:<58} {_f(row['value'])} {row['unit']}{at}, "
                     f"ratio {_f(row['ratio'])}: {verdict}")
    return lines
