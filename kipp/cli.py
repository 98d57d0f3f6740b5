"""The `kipp` command line: thin wrappers over the same calls the Python API makes.

Generated text (and each command's result) goes to stdout; status, progress and errors go to
stderr, so `kipp run ... > out.txt` holds only the text. Every flag is checked before a model is
loaded, and an error names the flag. Sampling and max-tokens defaults are read from the Python
API, so `kipp run` and `model.generate` behave alike; `--help` shows them.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import os
import signal
import sys
import threading
from pathlib import Path

from kipp.errors import KippError, missing_extra, require
from kipp.model import BACKENDS, KV_SCHEMES, Model
from kipp.text.sampling import SamplingError, SamplingParams

SCHEME_NAMES = ("bf16", "q8_0", "affine4_gs32", "scale4_gs32")
KV_SCHEME_NAMES = KV_SCHEMES
# Optional packages a command needs beyond the base install (checked before loading a model).
COMMAND_NEEDS = {"serve": ("flask", "waitress", "prometheus_client"),
                 "gates": ("torch", "transformers")}
SAMPLING_DEFAULTS = {f.name: f.default for f in dataclasses.fields(SamplingParams)}


def _api_default(method, name: str):
    """A keyword's default in the Python API (the CLI's default is the same by construction)."""
    return inspect.signature(method).parameters[name].default


def _synthesize(args) -> None:
    from kipp.synthetic.writer import synthesize

    folder = synthesize(args.checkpoint, args.out)
    print(folder)


def _download(args) -> None:
    from kipp.formats.download import download

    print(download(args.checkpoint, revision=args.revision, cache_dir=args.cache_dir))


def _convert(args) -> None:
    from kipp.formats.convert import convert

    if args.out.exists() and not args.force:
        raise KippError(f"{args.out} exists; pass --force to overwrite it")
    out = convert(args.checkpoint, args.source, args.scheme, args.out,
                  progress=not args.quiet, merge_lora=args.merge_lora)
    print(out)


def _prepare(args) -> None:
    from kipp.formats.store import ensure_artifact

    _describe(ensure_artifact(args.checkpoint, args.scheme, progress=not args.quiet))


def _inspect(args) -> None:
    from kipp.model import reject_folder

    reject_folder(args.artifact)
    _describe(args.artifact)


def _describe(path) -> None:
    from kipp.formats.artifact import open_artifact

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


def _load(args, group=None):
    """The model of the command's flags; `group` is --distributed's (_group), joined here."""
    from kipp.model import load

    model = load(args.model, backend=args.backend, scheme=args.scheme, distributed=group,
                 parallel=getattr(args, "parallel", "tensor"),
                 kv_tokens=getattr(args, "kv_tokens", None), kv_mib=getattr(args, "kv_mib", None),
                 kv_scheme=getattr(args, "kv_scheme", "bf16"),
                 weight_memory=getattr(args, "weight_memory", "auto"),
                 draft=getattr(args, "draft_model", None),
                 draft_tokens=getattr(args, "draft_tokens", None),
                 draft_vocab=getattr(args, "draft_vocab", None),
                 adapters=_lora_adapters(getattr(args, "lora", None)))
    if hasattr(args, "kv_disk_mib"):
        _attach_disk(model, args)
    return model


def _group(args):
    """--distributed's group: MLX's (rank and hostfile) for --backend mlx, else JAX's."""
    from kipp.chooser import group_runtime

    options = {} if args.join_timeout is None else {"join_timeout_s": args.join_timeout}
    if args.backend == "mlx":
        Group = group_runtime("mlx").Group
        if args.coordinator is not None:
            raise KippError("--coordinator is for --backend jax; MLX ranks find each other "
                            "through --hostfile (or MLX_HOSTFILE)")
        return Group.resolve(args.process_id, args.hostfile, args.num_processes, **options)
    Group = group_runtime("jax").Group

    if args.hostfile is not None:
        raise KippError("--hostfile is for --backend mlx; JAX processes meet at --coordinator")
    return Group.resolve(args.coordinator, args.num_processes, args.process_id, **options)


def _lora_adapters(specs) -> dict | None:
    """--lora NAME=PATH (repeatable) as load(adapters=...)'s dict; a clear error otherwise."""
    if not specs:
        return None
    adapters = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise KippError(f"--lora {spec!r}: give NAME=PATH (an adapter folder)")
        if name in adapters:
            raise KippError(f"--lora {spec!r}: the name {name!r} is given twice")
        adapters[name] = path
    return adapters


def _one_adapter(args) -> str | None:
    """The adapter `run` and `chat` generate under: the one --lora's name."""
    adapters = _lora_adapters(args.lora) or {}
    if len(adapters) > 1:
        raise KippError("run and chat take one --lora (serve takes several)")
    return next(iter(adapters), None)


def _add_lora_argument(p, several: bool) -> None:
    p.add_argument("--lora", action="append", metavar="NAME=PATH",
                   help="a LoRA adapter folder (PEFT or mlx-lm) trained on this checkpoint"
                        + ("; repeat for several: a request's \"model\" names one"
                           if several else ": generate under it"))


def _add_draft_arguments(p) -> None:
    p.add_argument("--draft-model", metavar="MODEL", help="a small model of the same family "
                   "(same tokenizer) drafting for speculative decoding: greedy output is plain "
                   "greedy's, sampled output plain sampling's distribution (implies --spec)")
    p.add_argument("--draft-tokens", type=_at_least(1), metavar="K",
                   help="longest draft (default 15; the adaptive gate picks fewer per step)")
    p.add_argument("--draft-vocab", type=_draft_vocab, metavar="N",
                   help="the draft model scores only the first N token ids (a multiple of 128; "
                        "the common pieces): cheaper drafts, never a rarer token; output "
                        "unchanged")


def _speculative(args, model):
    """What --spec and --draft-model ask for: the draft model's config, or prompt lookup."""
    return model.draft_spec or args.spec


def _kv_folder(args) -> Path:
    from kipp.formats.store import home

    return Path(args.kv_cache_dir) if args.kv_cache_dir else home() / "kv"


def _attach_disk(model, args) -> None:
    """The KV disk tier, on by default where the backend can export blocks (0 MiB: off)."""
    if args.kv_disk_mib == 0:
        return
    if not model.backend.supports_kv_io:
        if args.kv_cache_dir or args.kv_disk_mib:
            raise KippError(f"the {model.backend.name} backend cannot keep KV blocks on disk "
                            f"(--kv-cache-dir, --kv-disk-mib)")
        return
    disk = model.attach_kv_disk(_kv_folder(args), args.kv_disk_mib)
    print(f"kipp: KV disk tier {disk.describe()}", file=sys.stderr)


def _cache_prompt(args) -> None:
    try:
        text = args.file.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise KippError(f"--file {args.file}: {e}") from None
    if not text:
        raise KippError(f"--file {args.file} is empty")
    if args.kv_disk_mib == 0:
        raise KippError("cache-prompt writes to the disk tier: --kv-disk-mib 0 turns it off")
    model = _load(args)
    if model.kv_disk is None:
        raise KippError(f"the {model.backend.name} backend cannot keep KV blocks on disk")
    cached = model.cache_prompt(text)
    stats = model.kv_disk.stats()
    print(f"cached {cached:,} tokens of {len(model.prompt_ids(text)):,} "
          f"({stats['writes']:,} blocks written) in {model.kv_disk.tier.root}")


def _cache(args) -> None:
    from kipp.engine import kv_files

    folder = _kv_folder(args)
    listing = kv_files.listing(folder)
    if args.action == "clear":
        removed, size = kv_files.clear(folder)
        print(f"removed {removed:,} KV block files ({size / 2**20:,.1f} MiB) from {folder}")
        return
    if not listing:
        print(f"{folder}: no KV block files")
        return
    print(f"{folder}:")
    for space, (files, size) in listing.items():
        print(f"  {space}  {files:>8,} blocks  {size / 2**20:>10,.1f} MiB")
    total = sum(size for _, size in listing.values())
    print(f"  total {sum(f for f, _ in listing.values()):,} blocks, {total / 2**20:,.1f} MiB")


def _sampling(args) -> dict:
    return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
            "seed": args.seed}


def _check_sampling(args) -> None:
    """Flag combinations, before the model loads (each flag's own range is argparse's)."""
    if args.draft_tokens is not None and not args.draft_model:
        raise KippError("--draft-tokens needs --draft-model")
    if args.draft_vocab is not None and not args.draft_model:
        raise KippError("--draft-vocab needs --draft-model")
    if args.spec and not args.draft_model and not SamplingParams(**_sampling(args)).is_greedy:
        raise KippError("--spec is greedy only: add --temperature 0 (or --top-k 1), or draft "
                        "with --draft-model")
    from kipp.formats import registry

    entry = registry.REGISTRY.get(args.model)
    if entry is not None and args.max_tokens >= entry.context_length:
        raise KippError(f"--max-tokens {args.max_tokens} leaves no room for a prompt in "
                        f"{entry.id}'s context of {entry.context_length} tokens")


def _run(args) -> None:
    _check_sampling(args)
    model = _load(args)
    generation = model.generate(args.prompt, args.max_tokens, stream=True,
                                speculative=bool(_speculative(args, model)),
                                adapter=_one_adapter(args), **_sampling(args))
    _stream(generation)


def _stream(generation) -> None:
    try:
        with _remembered_interrupt() as interrupted:
            for piece in generation:
                if interrupted:
                    raise KeyboardInterrupt
                print(piece, end="", flush=True)
    finally:
        print(flush=True)  # end the text's line, also when interrupted
    s = generation.stats
    print(f"[{s.prompt_tokens} prompt tokens ({s.reused_tokens} reused), prefill "
          f"{s.prefill_tokens_per_second:.1f} tok/s; {s.completion_tokens} generated, decode "
          f"{s.decode_tokens_per_second:.1f} tok/s; finish: {s.finish_reason}]", file=sys.stderr)
    if s.spec is not None:
        print(f"[spec: {s.spec.accepted}/{s.spec.drafted} draft tokens accepted "
              f"({s.spec.acceptance_rate:.0%}); {s.spec.evals} decode evals for "
              f"{s.decode_tokens} tokens]", file=sys.stderr)


@contextlib.contextmanager
def _remembered_interrupt():
    """Ctrl-C raises KeyboardInterrupt as usual, and is remembered: one raised inside a
    finalizer (where Python prints it and goes on) still ends the loop at its next piece."""
    hits: list[int] = []
    if threading.current_thread() is not threading.main_thread():
        yield hits
        return

    def interrupt(signum, frame):
        hits.append(signum)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, interrupt)
    try:
        yield hits
    finally:
        signal.signal(signal.SIGINT, previous)


def _chat(args) -> None:
    """One session holds the conversation's KV: each turn evaluates only what the re-rendered
    conversation adds (or, where the template rewrites earlier text, from the first change)."""
    _check_sampling(args)
    model = _load(args)
    messages = [{"role": "system", "content": args.system}] if args.system else []
    print("kipp chat: an empty line or Ctrl-D ends the conversation; Ctrl-C stops a reply",
          file=sys.stderr)
    with model.session(adapter=_one_adapter(args)) as session:
        while (line := _read_turn()) is not None:
            messages.append({"role": "user", "content": line})
            generation = model.chat(messages, args.max_tokens, stream=True, session=session,
                                    speculative=bool(_speculative(args, model)),
                                    enable_thinking=not args.no_think,
                                    **_sampling(args))
            try:
                _stream(generation)
            except KeyboardInterrupt:  # the partial reply stays in the conversation
                generation.close()
                print("kipp: reply stopped", file=sys.stderr)
            messages.append({"role": "assistant",
                             "content": model.tokenizer.decode(generation.stats.tokens)})


def _read_turn() -> str | None:
    """The user's next line (the prompt goes to stderr), or None at an empty line or EOF."""
    print("> ", end="", file=sys.stderr, flush=True)
    try:
        line = input()
    except EOFError:
        print(file=sys.stderr)
        return None
    return line if line.strip() else None


def _serve(args) -> None:
    from kipp.http.access import Access

    api_key = args.api_key or (os.environ.get(args.api_key_env) if args.api_key_env else None)
    if args.api_key_env and not api_key:
        raise SystemExit(f"kipp serve: --api-key-env {args.api_key_env}: that environment "
                         f"variable is not set")
    if any(not s for s in args.stop or ()):
        raise SystemExit("kipp serve: --stop needs a non-empty string")
    access = Access(api_key=api_key, protect_info=args.protect_health,
                    cors_origins=tuple(args.cors_origin or ()))
    group = _group(args) if args.distributed else None
    bound = None
    if group is not None and group.leader:  # its port answers 503 until the group is whole
        from kipp.http.forming import Forming

        with Forming(args.host, args.port, access) as forming:
            model = _load(args, group)
        bound = forming.socket
    else:
        model = _load(args, group)
    link = getattr(model.backend, "link", None)
    if link is not None and not link.leader:  # a follower: runs process 0's steps, no HTTP
        from kipp.chooser import group_runtime

        group_runtime(model.backend.name).follow(model.backend)
        return
    try:
        _serve_model(model, args, access, bound)
    finally:
        if link is not None:
            link.stop()  # the followers leave their loop; the group shuts down


def _serve_model(model, args, access, bound=None) -> None:
    from kipp.http import serve

    serve(model, args.host, args.port, max_batch=args.max_batch, max_queue=args.max_queue,
          prefill_chunk=args.prefill_chunk, threads=args.threads,
          served_names=tuple(args.served_model_name or ()),
          chat_max_tokens=args.chat_max_tokens, speculative=_speculative(args, model),
          drain_timeout=args.drain_timeout, reasoning_format=args.reasoning_format,
          max_output_tokens=args.max_output_tokens, stops=tuple(args.stop or ()),
          access=access, runtime_lora=args.lora_runtime, bound=bound)


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
    from kipp.formats.convert import convert
    from kipp.model import load

    model = _load(args)
    source = args.source
    if source is None:
        from kipp.formats.store import source_folder

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


def _doctor(args) -> int:
    from kipp.doctor import main

    return main(args)


class _HelpWithDefaults(argparse.HelpFormatter):
    """--help shows each option's default, where it has one."""

    def _get_help_string(self, action):
        text = action.help or ""
        default = action.default
        if (action.option_strings and "%(default)" not in text and default is not None
                and default is not False and default != argparse.SUPPRESS):
            text += " (default: %(default)s)"
        return text


class _CommandParser(argparse.ArgumentParser):
    """A subcommand's parser: its --help shows defaults."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpWithDefaults)
        super().__init__(*args, **kwargs)


def _at_least(low: int, kind=int):
    """An argparse type: a number >= low (argparse names the flag in its error)."""
    def check(text: str):
        value = kind(text)
        if not value >= low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {text}")
        return value

    check.__name__ = kind.__name__
    return check


def _draft_vocab(text: str) -> int:
    from kipp.model import DRAFT_VOCAB_RANGE, draft_vocab_fits

    value = int(text)
    if not draft_vocab_fits(value):
        raise argparse.ArgumentTypeError(f"must be {DRAFT_VOCAB_RANGE}, got {text}")
    return value


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0..65535, got {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def _sampling_type(name: str, kind):
    """An argparse type that checks the value as SamplingParams would (one range, one place)."""
    def check(text: str):
        value = kind(text)
        try:
            SamplingParams(**{name: value})
        except SamplingError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    check.__name__ = kind.__name__
    return check


def _add_disk_arguments(p) -> None:
    p.add_argument("--kv-cache-dir", type=Path, metavar="DIR",
                   help="KV disk tier folder: published prefixes survive restarts "
                   "(default: $KIPP_HOME/kv)")
    p.add_argument("--kv-disk-mib", type=_at_least(0), metavar="MIB",
                   help="KV disk tier size bound, least recently used blocks go first "
                   "(default: a quarter of the free disk, at most 32 GiB; 0: no disk tier)")


def _add_model_arguments(p) -> None:
    p.add_argument("model", help="a registry id or a .gguf artifact")
    p.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                   help="auto picks the fastest installed: jax on a GPU, mlx on Apple silicon, "
                   "then jax or mlx on the CPU, else reference")
    p.add_argument("--scheme", default="bf16", choices=SCHEME_NAMES,
                   help="weight scheme when MODEL is a registry id")
    p.add_argument("--kv-scheme", default="bf16", choices=KV_SCHEME_NAMES,
                   help="KV cache format: bf16, or q8_0 (~1.9x smaller, near-lossless)")
    p.add_argument("--weight-memory", default="auto", choices=("auto", "stored", "float32"),
                   help="how jax/mlx hold BF16 weights: as stored, or a float32 copy (CPU; "
                   "auto: stored on a GPU and where Kipp's stored CPU matmul runs, else "
                   "float32 when it fits half the available memory)")


def _add_sampling_arguments(p, max_tokens: int) -> None:
    _add_draft_arguments(p)
    p.add_argument("--spec", action="store_true", help="greedy self-speculative decoding "
                   "(prompt-lookup drafts; same output, fewer evals); needs --temperature 0")
    p.add_argument("--max-tokens", type=_at_least(1), default=max_tokens,
                   help="most tokens to generate")
    p.add_argument("--temperature", type=_sampling_type("temperature", float),
                   default=SAMPLING_DEFAULTS["temperature"], help="0 is greedy")
    p.add_argument("--top-p", type=_sampling_type("top_p", float),
                   default=SAMPLING_DEFAULTS["top_p"], help="nucleus sampling mass (0, 1]")
    p.add_argument("--top-k", type=_sampling_type("top_k", int),
                   default=SAMPLING_DEFAULTS["top_k"], help="keep the k likeliest; 0 is off")
    p.add_argument("--seed", type=_sampling_type("seed", int),
                   help="sampling seed (default: fresh randomness)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kipp", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_CommandParser)
    _add_file_commands(commands)
    _add_generation_commands(commands)
    _add_serve_command(commands)
    _add_check_commands(commands)
    return parser


def _add_file_commands(commands) -> None:
    """synthesize, download, convert, prepare: checkpoints and artifacts."""
    p = commands.add_parser("synthesize", help="write a synthetic checkpoint's HF folder")
    p.add_argument("checkpoint", help="a kipp-synthetic/... registry id")
    p.add_argument("--out", required=True, type=Path, help="output folder")
    p.set_defaults(run=_synthesize)

    p = commands.add_parser("download",
                            help="fetch a checkpoint's pinned revision into the HF cache")
    p.add_argument("checkpoint", help="a registry id, e.g. Qwen/Qwen3-0.6B")
    p.add_argument("--revision", help="must equal the pinned revision if given")
    p.add_argument("--cache-dir", type=Path, help="Hugging Face cache folder")
    p.set_defaults(run=_download)

    p = commands.add_parser("convert", help="convert a BF16 HF folder into a Kipp GGUF artifact")
    p.add_argument("--checkpoint", required=True, help="registry id of the source")
    p.add_argument("--source", required=True, type=Path, help="Hugging Face folder")
    p.add_argument("--scheme", required=True, choices=SCHEME_NAMES)
    p.add_argument("--out", required=True, type=Path, help="output .gguf file")
    p.add_argument("--force", action="store_true", help="overwrite --out if it exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.add_argument("--merge-lora", type=Path, metavar="ADAPTER",
                   help="merge this LoRA adapter folder (PEFT or mlx-lm) into the weights; "
                        "recorded in the artifact's kipp.lora.* metadata")
    p.set_defaults(run=_convert)

    p = commands.add_parser("prepare", help="make a checkpoint's artifact (download or "
                            "synthesize, then convert) unless it exists; print its summary")
    p.add_argument("checkpoint", help="a registry id")
    p.add_argument("--scheme", default="bf16", choices=SCHEME_NAMES, help="weight scheme")
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=_prepare)


def _add_generation_commands(commands) -> None:
    p = commands.add_parser("run", help="generate text from a prompt, streaming")
    _add_model_arguments(p)
    p.add_argument("--prompt", required=True, help="the text to continue")
    _add_lora_argument(p, several=False)
    _add_disk_arguments(p)
    _add_sampling_arguments(p, _api_default(Model.generate, "max_tokens"))
    p.set_defaults(run=_run)

    p = commands.add_parser("chat", help="interactive chat (instruct checkpoints)")
    _add_model_arguments(p)
    p.add_argument("--system", help="system prompt")
    p.add_argument("--no-think", action="store_true", help="enable_thinking=False")
    _add_lora_argument(p, several=False)
    _add_disk_arguments(p)
    _add_sampling_arguments(p, _api_default(Model.chat, "max_tokens"))
    p.set_defaults(run=_chat)

    p = commands.add_parser("cache-prompt", help="publish a prompt's KV blocks to the disk "
                            "tier now, so a later request (or process) starting with it skips "
                            "their prefill")
    _add_model_arguments(p)
    p.add_argument("--file", type=Path, required=True, help="the prompt text (a system prompt)")
    _add_disk_arguments(p)
    p.set_defaults(run=_cache_prompt)

    p = commands.add_parser("cache", help="the KV disk tier: ls shows it, clear empties it")
    p.add_argument("action", choices=("ls", "clear"))
    p.add_argument("--kv-cache-dir", type=Path, metavar="DIR",
                   help="the tier's folder (default: $KIPP_HOME/kv)")
    p.set_defaults(run=_cache)


def _add_serve_command(commands) -> None:
    from kipp.engine.scheduler import DEFAULT_PREFILL_CHUNK
    from kipp.text.reasoning import REASONING_FORMATS

    p = commands.add_parser("serve", help="OpenAI-compatible HTTP server (loopback by default)")
    _add_model_arguments(p)
    _add_lora_argument(p, several=True)
    p.add_argument("--lora-runtime", action="store_true",
                   help="allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter (adapter "
                        "folders on this machine, named by the client)")
    _add_disk_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="bind address: loopback only unless "
                   "you choose otherwise")
    p.add_argument("--port", type=_port, default=8080, help="0 picks a free port (printed)")
    p.add_argument("--max-batch", type=_at_least(1), default=8,
                   help="sequences decoded together")
    p.add_argument("--max-queue", type=_at_least(1), default=64,
                   help="waiting requests before new ones get 503")
    p.add_argument("--prefill-chunk", type=_at_least(1), default=DEFAULT_PREFILL_CHUNK,
                   help="prompt tokens per sequence per step")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--kv-tokens", type=_at_least(32),
                      help="KV pool size in tokens (default: backend's)")
    pool.add_argument("--kv-mib", type=_positive_float, help="KV pool size in MiB (q8_0 KV "
                      "fits ~1.9x the tokens of bf16 in the same MiB)")
    p.add_argument("--threads", type=_at_least(1), default=96, help="HTTP worker threads")
    p.add_argument("--chat-max-tokens", type=_at_least(1),
                   help="max_tokens of a chat request that gives none (default 1024, cut to "
                   "the request's share of the KV pool: pool / max-batch; more than chat()'s "
                   "256, as OpenAI clients leave it out and expect a whole answer)")
    p.add_argument("--max-output-tokens", type=_at_least(1), metavar="N",
                   help="the most tokens a chat, Responses or Messages reply may generate: a "
                   "request asking more is cut to N (agents ask for 32,000)")
    p.add_argument("--stop", action="append", metavar="TEXT",
                   help="a stop string every chat, Responses and Messages reply also ends at "
                   "(repeat; for a model that runs on past its turn)")
    p.add_argument("--drain-timeout", type=_positive_float, default=10.0,
                   help="on SIGTERM/SIGINT: seconds until exit; running requests may finish "
                   "until shortly before it")
    p.add_argument("--spec", action="store_true", help="speculative decoding for greedy "
                   "requests (prompt-lookup drafts; same tokens, fewer evals)")
    _add_draft_arguments(p)
    p.add_argument("--served-model-name", action="append", metavar="NAME",
                   help="a model name requests may give (repeat for aliases; the first is the "
                   "one responses report; default: the checkpoint id)")
    p.add_argument("--reasoning-format", choices=REASONING_FORMATS, default="auto",
                   help="auto (default; deepseek is the same): a chat reply's think block goes "
                   "to reasoning_content / reasoning; none: left inline in the content")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", help="require this key (Authorization: Bearer KEY or "
                     "x-api-key: KEY) on every route but /health and /metrics")
    key.add_argument("--api-key-env", metavar="VAR", help="the same, read from this "
                     "environment variable (keeps the key out of the process list)")
    p.add_argument("--protect-health", action="store_true", help="with a key: /health and "
                   "/metrics need it too")
    p.add_argument("--cors-origin", action="append", metavar="ORIGIN",
                   help="allow browser requests from this origin (repeat; '*' for any); "
                   "off by default")
    group = p.add_argument_group("distributed (--backend jax or mlx; docs/distributed.md)")
    group.add_argument("--distributed", action="store_true", help="one of several processes "
                       "holding the model together; process 0 serves HTTP")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address for "
                       "the group (default: JAX_COORDINATOR_ADDRESS, or SLURM's)")
    group.add_argument("--num-processes", type=_at_least(1), help="processes in the group "
                       "(default: JAX_NUM_PROCESSES or SLURM_NTASKS)")
    group.add_argument("--process-id", type=_at_least(0), help="this process's rank "
                       "(default: JAX_PROCESS_ID or SLURM_PROCID; MLX: MLX_RANK)")
    group.add_argument("--hostfile", metavar="FILE", help="--backend mlx: the ring's JSON "
                       "list of each rank's [\"IP:PORT\"] (default: MLX_HOSTFILE, which "
                       "mlx.launch sets)")
    group.add_argument("--parallel", choices=("tensor", "pipeline"), default="tensor",
                       help="tensor: every layer split over every device; pipeline: a range "
                       "of the layers per process (hosts on a slow link)")
    group.add_argument("--join-timeout", type=_at_least(1), metavar="S", help="seconds to wait "
                       "for every process to join (default 60); process 0 answers 503 "
                       "meanwhile")
    p.set_defaults(run=_serve)


def _add_check_commands(commands) -> None:
    """bench, gates, doctor, inspect: measuring and checking."""
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

    p = commands.add_parser("doctor", help="a report to paste into a bug: platform, devices, "
                            "backend choice, kernel probes, gates, a short speed check")
    p.add_argument("model", nargs="?", help="a registry id or .gguf to time (default: the "
                   "tiny synthetic checkpoint)")
    p.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                   help="the backend to check")
    p.add_argument("--json", type=Path, help="also write the report as JSON to this file")
    p.set_defaults(run=_doctor)

    p = commands.add_parser("inspect", help="validate an artifact and summarise it")
    p.add_argument("artifact", type=Path, help="a .gguf file")
    p.set_defaults(run=_inspect)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # everything after it belongs to the harness's own parser
        args = argparse.Namespace(run=_bench, bench_args=argv[1:], command="bench")
    else:
        args = _parser().parse_args(argv)
    try:
        for module in COMMAND_NEEDS.get(args.command, ()):
            require(module, f"kipp {args.command}")
        return args.run(args) or 0
    except KippError as e:
        print(f"kipp: error: {e}", file=sys.stderr)
        return 1
    except ModuleNotFoundError as e:  # an optional package a deeper import needed
        extra = missing_extra(e, f"kipp {args.command}")
        if extra is None:
            raise
        print(f"kipp: error: {extra}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kipp: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
