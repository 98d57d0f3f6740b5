"""python -m bench COMMAND: Kipp's benchmark harness (bench/README.md has the protocol).

    prepare   make the checkpoint's HF folder and Kipp artifacts (and mlx-lm's own quants)
    peers     which engines this interpreter (or --python ENGINE=PATH) can run
    run       the interleaved head-to-head: throughput records, one per workload
    ceiling   memory read bandwidth and the decode tok/s it implies per scheme
    ppl       perplexity of each scheme against BF16 (multi-row logits)
    interop   llama.cpp on Kipp's GGUF files vs Kipp's reference logits
    report    regenerate bench/README.md's tables and bench/throughput.png from the records
    campaign  the sized campaign for this machine: ceiling, run, ppl, interop, report
    server    the server workloads (concurrent streaming clients, prefix-reuse TTFT) against
              kipp serve, llama-cpp-python's server and vLLM's, same client (bench/server_bench.py)
    engine    Kipp against itself in one run: server vs raw step rate, batch scaling, reused-
              prompt TTFT vs one decode step (bench/engine_bench.py)
    spec      speculative decoding with a draft model: speed-up at each acceptance dial,
              greedy and sampled, 1 stream and 8; the bandwidth model's prediction
              (bench/draft_bench.py)
    kernels   compile every Pallas kernel at every registry shape for an H200 (no GPU needed):
              registers, spills, shared memory, tensor-core dots, roofline (bench/kernels.py)
"""

from __future__ import annotations

import argparse
import functools
import shlex
import sys
import time
from pathlib import Path

DEFAULT_CHECKPOINT = "kipp-synthetic/qwen3-0.6b-shape"
DEFAULT_ENGINES = "kipp,llama_cpp,transformers"
SCHEMES = "bf16,q8_0,scale4_gs32,affine4_gs32"
WORKLOADS = "decode,prefill512,prefill2048"
RESULTS = Path(__file__).resolve().parent / "results"

# The campaign sized for a 2-core machine (roughly 15 minutes once the artifacts exist). The
# reference backend decodes the 0.6B shape at ~1 tok/s and prefills at ~10 tok/s, so its arms
# decode 8 tokens, prefill 512 tokens once (the decode workload has already warmed the same
# worker), and sit out the 2,048-token prefill. Every such choice is written into the records.
CAMPAIGN_RUN = ["run", "--runs", "3", "--warmup", "1",
                "--set", "kipp.decode_tokens=8", "--set", "kipp.skip=prefill2048",
                "--set", "kipp@prefill512.warmup=0", "--set", "kipp@prefill512.runs=1"]
EXPECT_HELP = ("words a Kipp backend's describe() must contain instead of its fast path's, e.g. "
               "jax=twin for JAX's twins on a GPU machine (without a GPU they are the default)")
CAMPAIGN_PPL = ["ppl", "--tokens", "256", "--window", "128"]
CAMPAIGN_INTEROP = ["interop", "--prompts", "2"]


def _list(text: str) -> list[str]:
    return [item for item in text.split(",") if item]


def _mapping(items: list[str], flag: str) -> dict[str, str]:
    out = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"{flag} {item!r}: expected NAME=VALUE")
        out[key] = value
    return out


def _command(argv: list[str]) -> str:
    """The exact command line, with the interpreter relative to the repo when it lives there."""
    import os

    from bench.provenance import REPO

    python = Path(sys.executable)
    try:
        python = Path(os.path.relpath(python, REPO)) if python.is_relative_to(REPO) else python
    except ValueError:
        pass
    return f"{python} -m bench " + shlex.join(argv)


def _threads(value: int | None) -> int:
    from bench.provenance import usable_cores

    return value or usable_cores()


def cmd_prepare(args) -> int:
    from kipp.formats import store

    folder = store.source_folder(args.checkpoint)
    print(f"source: {folder}")
    for scheme in _list(args.schemes):
        print(f"{scheme}: {store.ensure_artifact(args.checkpoint, scheme)}")
    if args.mlx:
        from mlx_lm import convert

        from bench.arms import MLX_OWN_QUANT, mlx_quant_path

        for scheme, (_, bits) in MLX_OWN_QUANT.items():
            out = mlx_quant_path(args.checkpoint, scheme)
            if not out.exists():
                out.parent.mkdir(parents=True, exist_ok=True)
                convert(str(folder), mlx_path=str(out), quantize=True, q_bits=bits,
                        q_group_size=32, quant_predicate=_projections_only)
            print(f"mlx-lm {scheme} ({bits}-bit, group 32): {out}")
    return 0


def _projections_only(path: str, module, config=None) -> bool:
    """mlx-lm quantizes only the seven per-layer projections, as Kipp's schemes do (its default
    would also quantize the embedding and so the tied output head)."""
    return ".layers." in f".{path}." and hasattr(module, "to_quantized")


def cmd_peers(args) -> int:
    from bench import engines

    pythons = _mapping(args.python, "--python")
    for name, info in engines.ENGINES.items():
        python = pythons.get(name, sys.executable)
        ok, why = engines.availability(name, python)
        flag = "optional" if info.optional else "default"
        print(f"{name:<13} {'yes' if ok else 'no ':<4} {flag:<9} {why}")
    return 0


def cmd_run(args, argv) -> int:
    from bench import runner
    from bench.arms import Sizing, parse_override

    engines_ = _list(args.engines) + [e for e in _list(args.with_) if e not in args.engines]
    config = runner.RunConfig(
        checkpoint=args.checkpoint, engines=engines_, schemes=_list(args.schemes),
        workloads=_list(args.workloads), backends=_list(args.backends),
        sizing=Sizing(runs=args.runs, warmup=args.warmup, decode_tokens=args.decode_tokens),
        overrides=[parse_override(o) for o in args.set or []], threads=_threads(args.threads),
        pythons=_mapping(args.python, "--python"),
        expect_paths={k: tuple(_list(v)) for k, v in
                      _mapping(args.expect_path, "--expect-path").items()},
        results=Path(args.results), logs=Path(args.logs), ceiling=not args.no_ceiling,
        ceiling_size_mb=args.ceiling_mb, timeout=args.timeout, command=_command(argv),
        weight_memory=_list(args.weight_memory), cpu_dots=_list(args.cpu_dot))
    paths = runner.run(config)
    from bench.report import summary_lines

    for path in paths:
        print("\n".join(summary_lines(path)))
    for line in runner.failures(paths):  # a crashed peer fails the run too, by name
        print(f"bench: FAILED {line}", file=sys.stderr)
    return runner.exit_status(paths)


def cmd_ceiling(args, argv) -> int:
    from bench import ceiling, provenance, records

    bandwidth = ceiling.measure_bandwidth(args.ceiling_mb, args.runs, _threads(args.threads))
    context = args.context
    block = ceiling.ceiling_block(bandwidth, args.checkpoint, _list(args.schemes), context)
    record = records.new("ceiling", _command(argv), records.checkpoint_block(args.checkpoint),
                         provenance.collect(), ceiling=block)
    path = records.write(record, Path(args.results))
    print(f"{bandwidth['gb_s']:.1f} GB/s ({bandwidth['best_kernel']}, MAD "
          f"{bandwidth['mad']:.1f}, {bandwidth['threads']} threads)")
    for scheme, s in block["schemes"].items():
        print(f"  {scheme:<13} {s['bytes_per_token']['total'] / 1e6:8.1f} MB/token -> "
              f"{s['decode_tok_s']:.1f} tok/s")
    print(f"wrote {path}")
    return 0


def cmd_ppl(args, argv) -> int:
    from bench import ppl, prompts, provenance, records

    schemes = _list(args.schemes)
    models, described = ppl.load_models(args.checkpoint, schemes, args.backend,
                                        kv_tokens=max(args.window, 32))
    tokens = prompts.prompt(args.tokens)
    result = ppl.evaluate(models, tokens, args.window)
    for scheme, s in result["schemes"].items():
        s["describe"] = described[scheme]
    record = records.new("ppl", _command(argv), records.checkpoint_block(args.checkpoint),
                         provenance.collect(), backend=args.backend,
                         corpus={"source": prompts.CORPUS.name, "tokens": args.tokens,
                                 "window": args.window, "windows": result["windows"]},
                         schemes=result["schemes"])
    path = records.write(record, Path(args.results))
    for scheme, s in result["schemes"].items():
        extra = (f"  dNLL {s['nll_change']:+.4f}  KL {s['kl_mean']:.4g}  top-1 "
                 f"{s['top1_agreement']:.3f}" if "kl_mean" in s else "")
        print(f"{scheme:<13} NLL {s['nll_mean']:.4f}  ppl {s['ppl']:.4g}{extra}")
    print(f"wrote {path}")
    return 0


def cmd_interop(args, argv) -> int:
    from bench import interop, provenance, records

    result = interop.compare(args.checkpoint, _list(args.schemes), n_prompts=args.prompts,
                             threads=_threads(args.threads))
    record = records.new("interop", _command(argv), records.checkpoint_block(args.checkpoint),
                         provenance.collect(), schemes=result)
    path = records.write(record, Path(args.results))
    for scheme, s in result.items():
        if s["loaded"]:
            print(f"{scheme:<13} loaded as {s['llama_cpp_type']!r}: argmax "
                  f"{s['argmax_agree']}/{s['prompts']}, max NMSE {s['max_nmse']:.3g}")
        else:
            print(f"{scheme:<13} NOT loaded: {s['error']}")
            for line in s.get("llama_cpp_log", []):
                print(f"    {line}")
    print(f"wrote {path}")
    return 0 if all(s["loaded"] for s in result.values()) else 4


def cmd_report(args) -> int:
    from bench import report

    generated = report.main(Path(args.results), Path(args.readme), Path(args.plot))
    print(generated)
    return 0


def cmd_campaign(args) -> int:
    """The sized campaign, each step as its own explicit command (which its record keeps)."""
    common = ["--checkpoint", args.checkpoint]
    if Path(args.results).resolve() != RESULTS.resolve():
        common += ["--results", args.results]
    run = CAMPAIGN_RUN + common + (["--with", args.with_] if args.with_ else [])
    for mapping in args.python or []:
        run += ["--python", mapping]
    steps = [run, CAMPAIGN_PPL + common, CAMPAIGN_INTEROP + common,
             ["report"] + common[2:]]
    status, start = 0, time.perf_counter()
    for step in steps:
        print(f"\n$ {_command(step)}", flush=True)
        began = time.perf_counter()
        status = max(status, main(step))
        print(f"({time.perf_counter() - began:.0f} s; campaign so far "
              f"{(time.perf_counter() - start) / 60:.1f} min)", flush=True)
    return status


SERVER_QUICK = {"clients": "1,2", "rounds": 1, "warmup": 0, "max_tokens": 8,
                "prompt_tokens": 16, "ttft_tokens": 256, "other_tokens": 64, "others": 1}


def cmd_server(args, argv) -> int:
    from bench import server_bench

    if args.quick:  # a smoke run: small everything, records kept out of results/
        for key, value in SERVER_QUICK.items():
            if getattr(args, key) is None:
                setattr(args, key, value)
        if args.results is None:
            args.results = "/tmp/kipp-bench-server-quick"
    defaults = {"clients": "1,2,4,8", "rounds": 3, "warmup": 1, "max_tokens": 64,
                "prompt_tokens": 16, "ttft_tokens": 2000, "other_tokens": 500, "others": 3,
                "results": str(RESULTS)}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    config = server_bench.ServerBenchConfig(
        checkpoint=args.checkpoint, scheme=args.scheme, servers=_list(args.servers),
        clients=[int(c) for c in _list(args.clients)], rounds=args.rounds, warmup=args.warmup,
        max_tokens=args.max_tokens, prompt_tokens=args.prompt_tokens,
        ttft_tokens=args.ttft_tokens, other_tokens=args.other_tokens, others=args.others,
        kipp_backend=args.backend,
        expect_paths={k: tuple(_list(v)) for k, v in
                      _mapping(args.expect_path, "--expect-path").items()},
        pythons=_mapping(args.python, "--python"), artifact=args.artifact, source=args.source,
        threads=_threads(args.threads), kv_tokens=args.kv_tokens, max_batch=args.max_batch,
        mode=args.mode, results=Path(args.results),
        logs=Path(args.logs), ready_timeout=args.ready_timeout,
        request_timeout=args.request_timeout, command=_command(argv))
    paths = server_bench.run(config)
    for path in paths:
        print("\n".join(server_bench.summary_lines(path)))
    return server_bench.exit_status(paths)


def cmd_engine(args, argv) -> int:
    from bench import engine_bench

    try:
        engine_bench.cpu_dot_env(args.cpu_dot)
    except ValueError as e:
        raise SystemExit(f"bench engine --cpu-dot: {e}") from None
    config = engine_bench.EngineBenchConfig(
        checkpoint=args.checkpoint, scheme=args.scheme, backend=args.backend,
        rounds=args.rounds, warmup=args.warmup, decode_tokens=args.decode_tokens,
        prompt_tokens=args.prompt_tokens, clients=args.clients, max_tokens=args.max_tokens,
        ttft_tokens=args.ttft_tokens, reuse_tokens=args.reuse_tokens,
        threads=_threads(args.threads),
        expect_path=tuple(_list(args.expect_path)) if args.expect_path else None,
        cpu_dot=args.cpu_dot or None,
        kipp_source=Path(args.kipp_source) if args.kipp_source else None,
        results=Path(args.results), logs=Path(args.logs), command=_command(argv))
    paths = engine_bench.run(config)
    for path in paths:
        print("\n".join(engine_bench.summary_lines(path)))
    return 0 if all(json_ok(path) for path in paths) else 3


def json_ok(path) -> bool:
    import json

    return all(arm["status"] == "ok" for arm in json.loads(Path(path).read_text())["arms"])


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    sub = functools.partial(_subcommand, commands)
    for add in (_add_setup_commands, _add_run_command, _add_record_commands, _add_server_command,
                _add_engine_command, _add_kernels_command):
        add(sub)
    return parser


def _subcommand(commands, name, text, checkpoint=True, schemes=SCHEMES, results=True):
    """A command's parser with the shared --checkpoint, --schemes and --results flags."""
    p = commands.add_parser(name, help=text)
    if checkpoint:
        p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    if schemes:
        p.add_argument("--schemes", default=schemes, help="comma list")
    if results:
        p.add_argument("--results", default=str(RESULTS))
    return p


def _add_setup_commands(sub) -> None:
    p = sub("prepare", "make the HF folder and artifacts", results=False)
    p.add_argument("--mlx", action="store_true", help="also mlx-lm's own 8/4-bit conversions")
    p = sub("peers", "engines available here", checkpoint=False, schemes=None, results=False)
    p.add_argument("--python", action="append", metavar="ENGINE=PATH")


def _add_run_command(sub) -> None:
    p = sub("run", "interleaved head-to-head")
    p.add_argument("--engines", default=DEFAULT_ENGINES)
    p.add_argument("--with", dest="with_", default="", help="optional engines: vllm,mlx_lm")
    p.add_argument("--backends", default="reference", help="Kipp backends, comma list")
    p.add_argument("--workloads", default=WORKLOADS)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=128)
    p.add_argument("--set", action="append", metavar="SELECTOR.KEY=VALUE",
                   help="per-arm sizing: runs, warmup, decode_tokens, skip")
    p.add_argument("--threads", type=int, default=None, help="default: usable cores")
    p.add_argument("--python", action="append", metavar="ENGINE=PATH")
    p.add_argument("--expect-path", action="append", metavar="BACKEND=WORDS", help=EXPECT_HELP)
    p.add_argument("--no-ceiling", action="store_true")
    p.add_argument("--ceiling-mb", type=int, default=512)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per measured run")
    p.add_argument("--logs", default="/tmp/kipp-bench-logs")
    p.add_argument("--weight-memory", default="", help="Kipp arms per weight layout, comma "
                   "list of stored,float32 (default: each backend's auto choice)")
    p.add_argument("--cpu-dot", default="", help="Kipp arms per dot of the stored CPU matmul, "
                   "comma list of f32,int8,bf16,int8+bf16 ($KIPP_JAX_CPU_DOT; default: its "
                   "own)")


def _add_record_commands(sub) -> None:
    """ceiling, ppl, interop, report, campaign."""
    p = sub("ceiling", "memory bandwidth ceiling")
    p.add_argument("--ceiling-mb", type=int, default=512)
    p.add_argument("--runs", type=int, default=7)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--context", type=int, default=80, help="mean decode context for KV bytes")
    p = sub("ppl", "perplexity against BF16")
    p.add_argument("--backend", default="reference")
    p.add_argument("--tokens", type=int, default=384)
    p.add_argument("--window", type=int, default=128)
    p = sub("interop", "llama.cpp on Kipp's files")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--prompts", type=int, default=4, help="32-token prompts compared")
    p = sub("report", "regenerate the results page", checkpoint=False, schemes=None)
    p.add_argument("--readme", default=str(Path(__file__).parent / "README.md"))
    p.add_argument("--plot", default=str(Path(__file__).parent / "throughput.png"))
    p = sub("campaign", "the sized campaign for this machine", schemes=None)
    p.add_argument("--with", dest="with_", default="", help="optional engines: vllm,mlx_lm")
    p.add_argument("--python", action="append", metavar="ENGINE=PATH",
                   help="interpreter for an engine's worker (passed to run)")


def _add_server_command(sub) -> None:
    p = sub("server", "server workloads: concurrent clients and prefix-reuse TTFT",
            checkpoint=False, schemes=None, results=False)
    p.add_argument("--model", "--checkpoint", dest="checkpoint", default=DEFAULT_CHECKPOINT,
                   help="registry id (its artifact and HF folder come from `bench prepare`)")
    p.add_argument("--scheme", default="bf16", help="Kipp's and llama.cpp's GGUF (vLLM: bf16)")
    p.add_argument("--servers", default="kipp,llama_cpp,vllm",
                   help="comma list of kipp, llama_cpp, llama_cpp_cache (llama_cpp.server "
                        "with --cache True), vllm")
    p.add_argument("--backend", default="jax", help="kipp serve --backend")
    p.add_argument("--clients", default=None, help="concurrent clients, comma list (1,2,4,8)")
    p.add_argument("--rounds", type=int, default=None, help="measured rounds (3)")
    p.add_argument("--warmup", type=int, default=None, help="discarded rounds first (1)")
    p.add_argument("--max-tokens", type=int, default=None, help="per aggregate client (64)")
    p.add_argument("--prompt-tokens", type=int, default=None, help="aggregate prompts (16)")
    p.add_argument("--ttft-tokens", type=int, default=None, help="repeated prompt (2000)")
    p.add_argument("--other-tokens", type=int, default=None, help="interleaved prompts (500)")
    p.add_argument("--others", type=int, default=None, help="prompts between repeats (3)")
    p.add_argument("--quick", action="store_true",
                   help="smoke sizes (clients 1,2, one round, short prompts), results in /tmp")
    p.add_argument("--mode", default="interleaved", choices=["interleaved", "sequential"])
    p.add_argument("--expect-path", action="append", metavar="BACKEND=WORDS", help=EXPECT_HELP)
    p.add_argument("--python", action="append", metavar="SERVER=PATH",
                   help="interpreter per server (default .venv, .venv-bench, .venv-vllm)")
    p.add_argument("--artifact", help="GGUF for kipp and llama_cpp (default: the registry's)")
    p.add_argument("--source", help="HF folder for vllm (default: the checkpoint's)")
    p.add_argument("--threads", type=int, default=None, help="default: usable cores")
    p.add_argument("--kv-tokens", type=int, default=None, help="kipp serve --kv-tokens")
    p.add_argument("--max-batch", type=int, default=8, help="kipp --max-batch, vllm seqs")
    p.add_argument("--results", default=None, help=f"default {RESULTS}")
    p.add_argument("--logs", default="/tmp/kipp-bench-logs")
    p.add_argument("--ready-timeout", type=float, default=900.0)
    p.add_argument("--request-timeout", type=float, default=1800.0)


def _add_engine_command(sub) -> None:
    p = sub("engine", "Kipp against itself: server vs raw, batch scaling, reused-prompt TTFT",
            schemes=None)
    p.add_argument("--scheme", default="bf16")
    p.add_argument("--backend", default="jax")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--decode-tokens", type=int, default=32, help="raw and single stream")
    p.add_argument("--prompt-tokens", type=int, default=16)
    p.add_argument("--clients", type=int, default=8, help="the batched aggregate round")
    p.add_argument("--max-tokens", type=int, default=64, help="per aggregate client")
    p.add_argument("--ttft-tokens", type=int, default=2000, help="the repeated prompt")
    p.add_argument("--reuse-tokens", type=int, default=8, help="decode steps after the reuse")
    p.add_argument("--threads", type=int, default=None, help="default: usable cores")
    p.add_argument("--expect-path", default=None, metavar="WORDS",
                   help="words the backend's describe() must contain instead of its fast "
                   "path's (jax on a machine without a GPU: twin)")
    p.add_argument("--kipp-source", default=None, metavar="DIR",
                   help="run the server and worker on this checkout's kipp package (before)")
    p.add_argument("--cpu-dot", default="", help="the stored CPU matmul's dot for the server "
                   "and worker: f32, int8, bf16 or int8+bf16 ($KIPP_JAX_CPU_DOT; default: as "
                   "the environment sets it)")
    p.add_argument("--logs", default="/tmp/kipp-bench-logs")


def _add_kernels_command(sub) -> None:
    p = sub("kernels", "H200 compile report of every kernel shape", checkpoint=False,
            schemes=None, results=False)
    p.add_argument("--only", default="", help="cases whose id or checkpoints contain this")
    p.add_argument("--render-only", action="store_true", help="re-render the newest record")
    p.add_argument("--multihost", action="store_true",
                   help="compile only the 2-host x 8-H200 pipelined step (kipp/cuda/aot_hosts.py)")
    p.add_argument("--no-readme", action="store_true",
                   help="leave bench/results/kernels-h200.md alone")


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["spec"]:  # its own flags (bench/draft_bench.py)
        from bench import draft_bench

        return draft_bench.main(argv[1:])
    args = _parser().parse_args(argv)
    simple = {"prepare": cmd_prepare, "peers": cmd_peers, "report": cmd_report,
              "campaign": cmd_campaign}
    if args.command in simple:
        return simple[args.command](args)
    if args.command == "kernels":
        from bench import kernels

        return kernels.main(args, _command(argv))
    return {"run": cmd_run, "ceiling": cmd_ceiling, "ppl": cmd_ppl, "interop": cmd_interop,
            "server": cmd_server, "engine": cmd_engine}[args.command](args, argv)


if __name__ == "__main__":
    sys.exit(main())
