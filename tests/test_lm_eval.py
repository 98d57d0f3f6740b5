"""lm-evaluation-harness's `local-completions` against a live `kipp serve`, offline, batch size 2:
a generation task and a multiple-choice (loglikelihood) task from local data files.

The harness tokenizes with the checkpoint's own tokenizer files (the synthetic folder's, the
files Kipp ships), sends token-id prompts two at a time, and reads loglikelihoods from `echo` +
`logprobs`. The oracles are Kipp's own: Session.eval rows (log-softmax of the same tokens) for
every loglikelihood, Model.generate (greedy, the same stop strings) for every generation.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from test_server import TINY, Server  # noqa: E402

from kipp.model import load  # noqa: E402
from kipp.text.sampling import logprobs  # noqa: E402

DATA = Path(__file__).parent / "data" / "lm_eval"
MAX_GEN_TOKS = 12

MC_TASK = """task: kipp_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/mc.jsonl
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: choices
doc_to_target: label
metric_list:
  - metric: acc
"""

GEN_TASK = """task: kipp_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}/gen.jsonl
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen}
  do_sample: false
metric_list:
  - metric: exact_match
"""


def run_harness(tmp_path, port, tokenizer_dir) -> dict[str, list[dict]]:
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "kipp_mc.yaml").write_text(MC_TASK.format(data=DATA))
    (tasks / "kipp_gen.yaml").write_text(GEN_TASK.format(data=DATA, max_gen=MAX_GEN_TOKS))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"),
           "OPENAI_API_KEY": "unused"}
    args = ",".join([f"model={TINY}", f"base_url=http://127.0.0.1:{port}/v1/completions",
                     f"tokenizer={tokenizer_dir}", "tokenizer_backend=huggingface",
                     "tokenized_requests=True", "max_retries=1", "timeout=300"])
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "lm_eval", "run", "--model", "local-completions",
         "--model_args", args, "--tasks", "kipp_mc,kipp_gen", "--include_path", str(tasks),
         "--batch_size", "2", "--output_path", str(out), "--log_samples"],
        env=env, capture_output=True, text=True, timeout=1200)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    samples = {}
    for task in ("kipp_mc", "kipp_gen"):
        [path] = out.rglob(f"samples_{task}_*.jsonl")
        samples[task] = [json.loads(line) for line in path.read_text().splitlines()]
    return samples


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The harness's split of a (context, continuation) pair into token ids."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    head = tokenizer.encode(context)
    return head, whole[len(head):]


def kipp_loglikelihood(model, context_ids, continuation_ids) -> float:
    ids = context_ids + continuation_ids
    with model.session(len(ids)) as s:
        rows = s.eval(ids, len(ids))
    return sum(logprobs(rows[len(context_ids) + i - 1], t)[0]
               for i, t in enumerate(continuation_ids))


@pytest.mark.slow
def test_lm_eval_local_completions(tmp_path, artifacts, synthetic_dir):
    artifact = artifacts(TINY)
    server = Server(artifact, "--kv-tokens", "8192", "--max-batch", "8")
    try:
        samples = run_harness(tmp_path, server.port, synthetic_dir(TINY))
    finally:
        server.stop()
    model = load(artifact, backend="reference", kv_tokens=4096, progress=False)
    tokenizer = model.tokenizer
    worst, compared = 0.0, 0
    for sample in samples["kipp_mc"]:
        pairs = [(a["arg_0"], a["arg_1"]) for a in sample["arguments"].values()]
        assert len(pairs) == len(sample["doc"]["choices"])
        for (context, continuation), [[ll, _]] in zip(pairs, sample["resps"]):
            head, tail = encode_pair(tokenizer, context, continuation)
            worst = max(worst, abs(kipp_loglikelihood(model, head, tail) - float(ll)))
            compared += 1
    print(f"\n{compared} loglikelihoods compared; worst |lm-eval - Session.eval| = {worst:.3g}")
    assert compared == sum(len(s["doc"]["choices"]) for s in samples["kipp_mc"]) > 10
    assert worst <= 1e-9
    for sample in samples["kipp_gen"]:
        [arguments] = sample["arguments"].values()
        context, [[got]] = arguments["arg_0"], sample["resps"]
        want = model.generate(tokenizer.encode(context), MAX_GEN_TOKS, temperature=0,
                              stop=["\n\n"])
        assert got == want, (context, got, want)
