"""The `kipp` command line: thin wrappers over the same calls the Python API makes."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kipp.errors import KippError

SCHEME_NAMES = ("bf16", "q8_0", "affine4_gs32", "scale4_gs32")
KV_SCHEME_NAMES = ("bf16", "q8_0")


def _synthesize(args) -> None:
    from kipp.synthetic import synthesize

    folder = synthesize(args.checkpoint, args.out)
    print(folder)


def _download(args) -> None:
    from kipp.download import download

    print(download(args.checkpoint, revision=args.revision, cache_dir=args.cache_dir))


def _convert(args) -> None:
    from kipp.convert import convert

    out = convert(args.checkpoint, args.source, args.scheme, args.out,
                  progress=not args.quiet)
    print(out)


def _prepare(args) -> None:
    from kipp.store import ensure_artifact

    _describe(ensure_artifact(args.checkpoint, args.scheme, progress=not args.quiet))


def _inspect(args) -> None:
    _describe(args.artifact)


def _describe(path) -> None:
    from kipp.artifact import open_artifact

    artifact = open_artifact(path)
    entry, file = artifact.entry, artifact.file
    size = file.mapping.size
    print(f"{artifact.path}: valid Kipp artifact ({size / 2**20:.1f} MiB)")
    print(f"  checkpoint   {entry.id} @ {entry.revision} ({entry.variant})")
    print(f"  scheme       {artifact.scheme.name}")
    print(f"  dims         hidden {entry.hidden}, intermediate {entry.intermediate}, "
          f"layers {entry.layers}, query heads {entry.query_heads}, "
          f"attention width {entry.attention_width}")
    print(f"  context      {entry.context_length} tokens, rope theta {entry.rope_theta:g}, "
          f"{'tied' if entry.tied else 'untied'} lm_head")
    print(f"  tensors      {len(file.tensors)}; KV {entry.kv_bytes_per_token} bytes/token")


def _load(args):
    from kipp.model import load

    return load(args.model, backend=args.backend, scheme=args.scheme,
                kv_tokens=getattr(args, "kv_tokens", None), kv_mib=getattr(args, "kv_mib", None),
                kv_scheme=getattr(args, "kv_scheme", "bf16"))


def _sampling(args) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "seed": args.seed}


def _run(args) -> None:
    model = _load(args)
    generation = model.generate(args.prompt, args.max_tokens, stream=True, speculative=args.spec,
                                **_sampling(args))
    _stream(generation)


def _stream(generation) -> None:
    for piece in generation:
        print(piece, end="", flush=True)
    print()
    s = generation.stats
    print(f"[{s.prompt_tokens} prompt tokens ({s.reused_tokens} reused), prefill "
          f"{s.prefill_tokens_per_second:.1f} tok/s; {s.completion_tokens} generated, decode "
          f"{s.decode_tokens_per_second:.1f} tok/s; finish: {s.finish_reason}]", file=sys.stderr)
    if s.spec is not None:
        print(f"[spec: {s.spec.accepted}/{s.spec.drafted} draft tokens accepted "
              f"({s.spec.acceptance_rate:.0%}); {s.spec.evals} decode evals for "
              f"{s.decode_tokens} tokens]", file=sys.stderr)


def _chat(args) -> None:
    model = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kipp chat: an empty line or Ctrl-D ends the conversation", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        messages.append({"role": "user", "content": line})
        generation = model.chat(messages, args.max_tokens, stream=True, speculative=args.spec,
                                enable_thinking=not args.no_think, **_sampling(args))
        _stream(generation)
        messages.append({"role": "assistant",
                         "content": model.tokenizer.decode(generation.stats.tokens)})


def _serve(args) -> None:
    from kipp.http import serve

    model = _load(args)
    serve(model, args.host, args.port, max_batch=args.max_batch, max_queue=args.max_queue,
          prefill_chunk=args.prefill_chunk, threads=args.threads,
          chat_max_tokens=args.chat_max_tokens, speculative=args.spec,
          drain_timeout=args.drain_timeout)


def _bench(args) -> int:
    """`kipp bench ...` is `python -m bench ...` from the source checkout (bench/ is not part of
    the installed package: it needs the repository and the peers' environments)."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    if not (root / "bench" / "__main__.py").is_file():
        raise KippError("kipp bench runs from a source checkout of Kipp (bench/ beside kipp/); "
                        "this installation has no bench/ folder")
    return subprocess.call([sys.executable, "-m", "bench", *args.bench_args], cwd=root)


def _gates(args) -> int:
    """Every gate of kipp.gates for the artifact on the chosen backend; exit 1 if one fails."""
    import tempfile

    from kipp import gates
    from kipp.convert import convert
    from kipp.model import load

    model = _load(args)
    source = args.source
    if source is None:
        from kipp.store import source_folder

        source = source_folder(model.entry.id)
    bf16 = None
    with tempfile.TemporaryDirectory() as scratch:
        if model.artifact.scheme.name != "bf16":  # for the quality report only
            path = convert(model.entry.id, source, "bf16", f"{scratch}/bf16.gguf", progress=False)
            bf16 = load(path, backend="reference", progress=False)
        results = gates.run_gates(model, source, bf16)
    print(f"{model.backend.describe()}; source {source}")
    print(gates.format_table(results))
    return 0 if all(r.passed for r in results if r.gating) else 1


def _add_model_arguments(p) -> None:
    p.add_argument("model", help="a registry id or a .gguf artifact")
    p.add_argument("--backend", default="auto", help="auto, reference, mlx or jax")
    p.add_argument("--scheme", default="bf16", choices=SCHEME_NAMES,
                   help="weight scheme when MODEL is a registry id")
    p.add_argument("--kv-scheme", default="bf16", choices=KV_SCHEME_NAMES,
                   help="KV cache format: bf16, or q8_0 (~1.9x smaller, near-lossless)")


def _add_sampling_arguments(p) -> None:
    p.add_argument("--spec", action="store_true", help="greedy self-speculative decoding "
                   "(prompt-lookup drafts; same output, fewer evals); needs --temperature 0")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kipp", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    p = commands.add_parser("synthesize", help="write a synthetic checkpoint's HF folder")
    p.add_argument("checkpoint", help="a kipp-synthetic/... registry id")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.set_defaults(run=_synthesize)

    p = commands.add_parser("download", help="fetch a checkpoint's pinned revision into the HF cache")
    p.add_argument("checkpoint", help="a registry id, e.g. Qwen/Qwen3-0.6B")
    p.add_argument("--revision", help="must equal the pinned revision if given")
    p.add_argument("--cache-dir", type=Path, help="Hugging Face cache folder")
    p.set_defaults(run=_download)

    p = commands.add_parser("convert", help="convert a BF16 HF folder into a Kipp GGUF artifact")
    p.add_argument("--checkpoint", required=True, help="registry id of the source")
    p.add_argument("--source", required=True, type=Path, help="Hugging Face folder")
    p.add_argument("--scheme", required=True, choices=SCHEME_NAMES)
    p.add_argument("--out", required=True, type=Path, help="output .gguf file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=_convert)

    p = commands.add_parser("prepare", help="make a checkpoint's artifact (download or "
                            "synthesize, then convert) unless it exists; print its summary")
    p.add_argument("checkpoint", help="a registry id")
    p.add_argument("--scheme", default="bf16", choices=SCHEME_NAMES)
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=_prepare)

    p = commands.add_parser("run", help="generate text from a prompt, streaming")
    _add_model_arguments(p)
    p.add_argument("--prompt", required=True)
    _add_sampling_arguments(p)
    p.set_defaults(run=_run)

    p = commands.add_parser("chat", help="interactive chat (instruct checkpoints)")
    _add_model_arguments(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--no-think", action="store_true", help="enable_thinking=False")
    _add_sampling_arguments(p)
    p.set_defaults(run=_chat)

    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server (loopback by default)")
    _add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback only)")
    p.add_argument("--port", type=int, default=8080, help="0 picks a free port (printed)")
    p.add_argument("--max-batch", type=int, default=8, help="sequences decoded together")
    p.add_argument("--max-queue", type=int, default=64,
                   help="waiting requests before new ones get 503")
    p.add_argument("--prefill-chunk", type=int, help="prompt tokens per sequence per step")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-tokens", type=int, help="KV pool size in tokens (default: backend's)")
    pool.add_argument("--kv-mib", type=float, help="KV pool size in MiB (q8_0 KV fits ~1.9x "
                      "the tokens of bf16 in the same MiB)")
    p.add_argument("--threads", type=int, default=96, help="HTTP worker threads")
    p.add_argument("--chat-max-tokens", type=int,
                   help="max_tokens of a chat request that gives none (default 1024, cut to "
                   "the request's share of the KV pool: pool / max-batch)")
    p.add_argument("--drain-timeout", type=float, default=10.0,
                   help="on SIGTERM/SIGINT: seconds until exit; running requests may finish "
                   "until shortly before it (default 10)")
    p.add_argument("--spec", action="store_true", help="speculative decoding for greedy "
                   "requests (prompt-lookup drafts; same tokens, fewer evals)")
    p.set_defaults(run=_serve)

    p = commands.add_parser("bench", help="the benchmark harness (python -m bench; "
                            "see bench/README.md)", add_help=False)
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    p.set_defaults(run=_bench)

    p = commands.add_parser("gates", help="correctness gates of an artifact on a backend "
                            "against transformers, the reference and its source (exit 1 on a "
                            "failure)")
    _add_model_arguments(p)
    p.add_argument("--source", type=Path, help="HF folder of the source checkpoint "
                   "(default: the cached or synthesized source of a registry id)")
    p.set_defaults(run=_gates)

    p = commands.add_parser("inspect", help="validate an artifact and summarise it")
    p.add_argument("artifact", type=Path)
    p.set_defaults(run=_inspect)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # everything after it belongs to the harness's own parser
        args = argparse.Namespace(run=_bench, bench_args=argv[1:])
    else:
        args = _parser().parse_args(argv)
    try:
        return args.run(args) or 0
    except KippError as e:
        print(f"kipp: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
