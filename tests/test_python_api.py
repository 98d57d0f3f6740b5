"""The Python API as a notebook user meets it: one `kipp.load`, arguments checked before any work,
rich displays, async streaming, and generation that continues a session (a conversation)."""

from __future__ import annotations

import asyncio
import html
import importlib.util
import inspect
import json

import numpy as np
import pytest

import kipp
import kipp.model
from kipp.display import html_view
from kipp.errors import KippError, MissingExtra, QuantError
from kipp.model import GenerationError, load
from kipp.text.chat import render

TINY = "kipp-synthetic/qwen3-tiny"


def test_kipp_load_is_the_one_load():
    assert kipp.load is kipp.model.load  # no wrapper whose signature could drift
    assert {"kv_scheme", "kv_mib", "kv_tokens", "progress"} <= set(
        inspect.signature(kipp.load).parameters)


@pytest.mark.parametrize("kwargs, error, message", [
    ({"scheme": "q4"}, QuantError, "unknown weight scheme 'q4'"),
    ({"backend": "cuda"}, KippError, "unknown backend 'cuda'"),
    ({"kv_scheme": "q4"}, KippError, "unknown kv_scheme"),
    ({"kv_tokens": 8}, KippError, "kv_tokens must be an integer of at least one 32-token"),
    ({"kv_tokens": 64.0}, KippError, "kv_tokens must be an integer"),
    ({"kv_mib": 0}, KippError, "kv_mib must be a positive number"),
    ({"kv_tokens": 64, "kv_mib": 1}, KippError, "not both"),
])
def test_load_rejects_bad_arguments_before_making_anything(kwargs, error, message, tmp_path,
                                                           monkeypatch, capsys):
    monkeypatch.setenv("KIPP_HOME", str(tmp_path))
    with pytest.raises(error, match=message):
        kipp.load(TINY, **kwargs)
    assert list(tmp_path.iterdir()) == []  # nothing synthesized, converted or downloaded
    assert "converting" not in capsys.readouterr().err


def hide_package(monkeypatch, hidden: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *args: None if name == hidden else real(name, *args))


@pytest.mark.parametrize("backend, package, extra", [("jax", "jax", "jax"),
                                                     ("mlx", "mlx", "apple")])
def test_a_backend_without_its_package_names_the_extra(backend, package, extra, tmp_path,
                                                       monkeypatch):
    monkeypatch.setenv("KIPP_HOME", str(tmp_path))
    hide_package(monkeypatch, package)
    with pytest.raises(MissingExtra, match=rf"the {backend} backend needs {package}, which is "
                                           rf"not installed: pip install 'kipp\[{extra}\]'"):
        kipp.load(TINY, backend=backend)
    assert list(tmp_path.iterdir()) == []


def test_load_builds_the_tokenizer_before_placing_the_weights(artifacts, monkeypatch):
    """The tokenizer's tables take ~40 MiB of scratch to build at Qwen3's vocabulary: built
    first, that scratch is gone before the weights are resident (peak RSS), and only once."""
    order = []
    tokenizer, open_backend = kipp.model.Tokenizer, kipp.model.open_backend
    monkeypatch.setattr(kipp.model, "Tokenizer",
                        lambda data: order.append("tokenizer") or tokenizer(data))
    monkeypatch.setattr(kipp.model, "open_backend",
                        lambda *a, **k: order.append("backend") or open_backend(*a, **k))
    model = load(artifacts(TINY, "bf16"), backend="reference", progress=False)
    assert order == ["tokenizer", "backend"]
    assert model.tokenizer.decode(model.tokenizer.encode("Hello world")) == "Hello world"


def test_a_hugging_face_folder_gets_a_hint_to_convert(tiny_dir, tmp_path):
    with pytest.raises(KippError, match="Hugging Face folder, not a Kipp artifact: convert it "
                                        "first \\(kipp convert"):
        kipp.load(tiny_dir)
    with pytest.raises(KippError, match="is a directory, not a .gguf artifact"):
        kipp.load(tmp_path)


@pytest.fixture
def fresh_model(artifacts):
    """A model of its own (the pool counts in its display start at zero)."""
    return load(artifacts(TINY), backend="reference", kv_tokens=256, progress=False)


def test_displays_say_what_a_user_needs(fresh_model):
    model = fresh_model
    shown = repr(model)
    for expected in (TINY, model.entry.revision, "bf16", str(model.artifact.path),
                     model.backend.describe(), f"{model.entry.context_length:,} tokens",
                     "0 of 8 blocks in use"):
        assert expected in shown, (expected, shown)
    with model.session(capacity=64) as s:
        s.eval(model.tokenizer.encode("Hello there, how are you"))
        assert "1 of 8 blocks in use" in repr(model)
        assert "open" in repr(s) and f"{len(s)} of 64 tokens" in repr(s) and "1 block" in repr(s)
    assert "closed" in repr(s)
    assert "0 of 8 blocks in use" in repr(model)

    generation = model.generate("Hello", max_tokens=4, temperature=0, stream=True)
    assert "not started" in repr(generation)
    text = "".join(generation)
    assert generation.text == text and repr(text) in repr(generation)
    assert "finished (length)" in repr(generation)
    assert "4 generated of at most 4" in repr(generation)

    tokenizer = repr(model.tokenizer)
    assert "151,936 ids" in tokenizer and "<|im_end|> (151645)" in tokenizer
    for obj in (model, s, generation, model.tokenizer):  # the HTML says what the text says
        page = obj._repr_html_()
        for label, value in obj._display_rows():
            assert html.escape(label) in page and html.escape(value) in page


def test_html_displays_escape_what_they_show():
    page = html_view("kipp.Generation", [("state", "<running>")], text="<script>x</script>")
    assert "<script>" not in page and "&lt;script&gt;" in page and "&lt;running&gt;" in page


def test_closing_a_stream_early_frees_its_blocks(fresh_model):
    model = fresh_model
    generation = model.generate("Hello there", max_tokens=50, temperature=0, stream=True)
    next(generation)
    assert model.pool.num_in_use > 0
    generation.close()
    assert model.pool.num_in_use == 0 and "stopped" in repr(generation)
    assert list(generation) == []


def test_a_failed_eval_raises_its_error_and_leaves_the_model_usable(fresh_model, monkeypatch):
    """The scheduler fails only the request whose eval raised; generate raises that error, the
    pool is back to idle, and the next call runs."""
    model = fresh_model
    want = model.generate("Hello there", max_tokens=6, temperature=0)
    real, calls = model.backend.eval, []

    def failing(items):
        calls.append(len(items))
        if len(calls) == 3:
            raise RuntimeError("the device went away")
        return real(items)

    monkeypatch.setattr(model.backend, "eval", failing)
    generation = model.generate("Hello there", max_tokens=6, temperature=0, stream=True)
    with pytest.raises(RuntimeError, match="the device went away"):
        list(generation)
    assert "failed" in repr(generation) and list(generation) == []
    assert model.pool.num_in_use == 0 and model.pool.reserved == 0 and model.engine.idle
    assert model.generate("Hello there", max_tokens=6, temperature=0) == want


def test_async_streaming_gives_the_same_pieces_and_lets_the_loop_run(models):
    model = models(TINY)
    prompts = ["Hello", "The Qwen3 family"]
    want = [list(model.generate(p, max_tokens=3, temperature=0, stream=True)) for p in prompts]

    async def main():
        ticks, done = 0, False

        async def ticker():
            nonlocal ticks
            while not done:
                ticks += 1
                await asyncio.sleep(0)

        async def collect(prompt):
            return [piece async for piece in
                    model.generate(prompt, max_tokens=3, temperature=0, stream=True)]

        task = asyncio.create_task(ticker())
        got = await asyncio.gather(*(collect(p) for p in prompts))  # two streams interleaved
        done = True
        await task
        return got, ticks

    got, ticks = asyncio.run(main())
    assert got == want
    assert ticks >= len(want[0])  # the loop ran other tasks between tokens


def assert_kv_matches_a_fresh_session(model, session):
    """The borrowed session's KV equals a fresh evaluation of its tokens (bitwise: the
    reference's rows do not depend on how they were batched or reused)."""
    probe = [9707]
    with model.session() as fresh:
        want = fresh.eval(session.tokens + probe)
    got = session.eval(probe)
    np.testing.assert_array_equal(got, want)
    session.truncate(len(session) - 1)


def test_a_borrowed_session_keeps_the_shared_prefix_and_cuts_the_rest(models):
    model = models(TINY)
    rng = np.random.default_rng(5)
    first = [int(t) for t in rng.integers(0, 151_643, 45)]
    second = first[:20] + [int(t) for t in rng.integers(0, 151_643, 7)]  # differs in block 0
    want_a = model.generate(first, max_tokens=3, temperature=0)  # publishes block 0 of `first`
    want_b = model.generate(second, max_tokens=3, temperature=0)
    with model.session() as s:
        a = model.generate(first, max_tokens=3, temperature=0, session=s, stream=True)
        # adopted from the pool: block 0 and the cached tail of block 1 (kipp.engine.blocks),
        # all but the prompt's last token, which is evaluated for its logits
        assert "".join(a) == want_a and a.stats.reused_tokens == len(first) - 1
        assert s.tokens == first + a.stats.tokens[:-1]  # the last token was never evaluated
        assert s.shared_blocks >= 1
        assert_kv_matches_a_fresh_session(model, s)
        b = model.generate(second, max_tokens=3, temperature=0, session=s, stream=True)
        assert "".join(b) == want_b and b.stats.reused_tokens == 20  # cut inside a shared block
        assert s.tokens == second + b.stats.tokens[:-1] and s.shared_blocks == 0
        assert_kv_matches_a_fresh_session(model, s)
        again = model.generate(second, max_tokens=3, temperature=0, session=s, stream=True)
        assert "".join(again) == want_b and again.stats.reused_tokens == len(second) - 1
    assert model.pool.num_in_use == 0


def test_a_conversation_in_one_session_reuses_earlier_turns(models):
    model = models(TINY)
    messages = [{"role": "user", "content": "Hi"}]
    with model.session() as s:
        for turn, question in enumerate(["And then?", "Why?"]):
            reply = model.chat(messages, max_tokens=3, temperature=0, session=s, stream=True)
            text = "".join(reply)
            assert text == model.chat(messages, max_tokens=3, temperature=0).content
            if turn > 0:  # the session's own KV of the earlier turns (the first turn may adopt
                assert reply.stats.reused_tokens > 0  # blocks earlier calls left in the pool)
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": question}]
        # The template drops an earlier turn's <think> block: the session is cut where the
        # rendered text changed, and only the rest is evaluated again.
        messages[-2]["content"] = "<think>\nplan\n</think>\n\nanswer"
        held = list(s.tokens)
        prompt = model.tokenizer.encode(render(messages))
        shared = next(i for i, (x, y) in enumerate(zip(held, prompt)) if x != y)
        assert shared < len(held)  # the rendered history really differs from the session
        reply = model.chat(messages, max_tokens=3, temperature=0, session=s, stream=True)
        "".join(reply)
        assert reply.stats.reused_tokens == shared and s.tokens == prompt + reply.stats.tokens[:-1]
        assert_kv_matches_a_fresh_session(model, s)


def test_a_session_from_elsewhere_is_rejected_before_any_work(models, fresh_model):
    model = models(TINY)
    with fresh_model.session() as other:
        with pytest.raises(GenerationError, match="another model"):
            model.generate("Hi", max_tokens=2, session=other)
    closed = model.session()
    closed.close()
    with pytest.raises(GenerationError, match="closed"):
        model.generate("Hi", max_tokens=2, session=closed)
    with model.session(capacity=8) as small:
        with pytest.raises(GenerationError, match="exceeds the session's capacity 8"):
            model.generate("Hi", max_tokens=8, session=small)
        assert small.tokens == []


def test_the_first_jax_compile_of_a_shape_shows_progress(artifacts, capsys):
    pytest.importorskip("jax")
    model = load(artifacts(TINY), backend="jax", kv_tokens=64)
    model.generate("Hello", max_tokens=2, temperature=0)
    first = capsys.readouterr().err
    assert "kipp: compiling the jax step" in first and "(first call of this shape)" in first
    model.generate("Hello", max_tokens=2, temperature=0)  # the same shapes: compiled already
    assert "compiling" not in capsys.readouterr().err
    quiet = load(artifacts(TINY), backend="jax", kv_tokens=96, progress=False)
    quiet.generate("Hello there", max_tokens=2, temperature=0)
    assert quiet.backend.compile_log and "compiling" not in capsys.readouterr().err


def test_constrained_replies_continue_a_session(models):
    """A conversation with response_format keeps its KV like a plain one, and each reply is the
    one chat() gives without a session."""
    pytest.importorskip("llguidance")
    model = models(TINY)
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0,
                                                     "maximum": 99}},
              "required": ["n"], "additionalProperties": False}
    messages = [{"role": "user", "content": "A number?"}]
    with model.session() as s:
        for turn in range(2):
            want = model.chat(messages, max_tokens=16, temperature=0,
                              response_format=schema).content
            reply = model.chat(messages, max_tokens=16, temperature=0, response_format=schema,
                               session=s, stream=True)
            text = "".join(reply)
            assert text == want and 0 <= json.loads(text)["n"] <= 99
            if turn == 0:  # `want` left this prompt in the pool: all but its last token
                assert reply.stats.reused_tokens == reply.stats.prompt_tokens - 1
            else:  # the session's own KV of the earlier turns
                assert reply.stats.reused_tokens > 0
            messages += [{"role": "assistant", "content": text},
                         {"role": "user", "content": "Another?"}]
        assert_kv_matches_a_fresh_session(model, s)
    assert model.pool.num_in_use == 0


def test_progress_bars_are_tqdm_auto_widgets_in_jupyter(monkeypatch):
    """Download, synthesis, conversion and the JAX compile bar all use tqdm.auto, which is the
    ipywidgets bar in a notebook kernel and a text bar on stderr elsewhere."""
    import tqdm.auto

    import kipp.formats.convert
    import kipp.formats.download
    import kipp.synthetic.writer
    from kipp.display import step_bar

    assert kipp.synthetic.writer.tqdm is tqdm.auto.tqdm
    assert kipp.formats.convert.tqdm is tqdm.auto.tqdm
    assert issubclass(kipp.formats.download.hf_tqdm, tqdm.auto.tqdm)
    made = []

    class Recording(tqdm.auto.tqdm):
        def __init__(self, *args, **kwargs):
            made.append(kwargs["desc"])
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(tqdm.auto, "tqdm", Recording)
    with step_bar("compiling x (first call of this shape)", enabled=False):
        pass
    assert made == ["compiling x (first call of this shape)"]
