#!/usr/bin/env python
"""lm-evaluation-harness against `pagedcli serve`: small log-likelihood tasks (multiple choice,
as hellaswag, arc and mmlu are scored, and a greedy-continuation one, as lambada) from local JSONL
files, through lm-eval's `local-completions` model, run to the end.

    pip install lm-eval          # heavy (datasets, pandas, scikit-learn...): not in the test extra
    python tools/lm_eval_check.py                 # starts pagedcli serve --model demo itself
    python tools/lm_eval_check.py --url http://127.0.0.1:8000 --model demo --tokenizer pagedcli/data/demo

It writes two tasks (a YAML and a JSONL each, in a temporary folder) from the demo model's held-out
Shakespeare (pagedcli/data/demo/heldout.txt, which it was not trained on):
- pagedcli_word_order (multiple choice, acc): which of four orders of a line's last five words is
  the play's (every choice has the same words: only their order tells them apart);
- pagedcli_greedy (loglikelihood, acc = whether the continuation is the model's greedy one, from
  each token's logprob against its top_logprobs): the start of a line, and the three tokens the
  server itself writes after it at temperature 0 (so acc must be 1);
- pagedcli_generate (generate_until, exact_match): the same contexts, lm-eval's generation of three
  tokens (a batch of prompts a request, with `stop`, `seed`, `max_tokens`) against those tokens.
It runs them twice: prompts as token ids (lm-eval tokenizes with the model's tokenizer, the
huggingface backend, and sends a batch of prompts a request) and prompts as text
(tokenized_requests=False, one a request). Each request is lm-eval's log-likelihood request:
`echo: true`, `max_tokens: 1`, `logprobs: 1`, `temperature: 0`, `seed`. It prints each run's
accuracies and, where transformers is installed, how far the token-id run's log-likelihoods are
from transformers' (float32) for the same tokens, and exits non-zero when lm-eval fails, a run has
no accuracy, that difference passes 1e-3, the token-id run's word-order accuracy is not above
chance (the demo model knows its Shakespeare), or its greedy accuracy or exact match is not 1.

Prompts as text are tokenized by the server, which puts the tokenizer's BOS first (as vLLM does);
lm-eval counts the context's tokens without it, so each log-likelihood there also counts the
context's last token (the same for every choice of a question) and is conditioned on BOS: the
token-id run is the exact one (docs/serve.md)."""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "pagedcli" / "data" / "demo"
TASK = "pagedcli_word_order"
GREEDY = "pagedcli_greedy"
GENERATE = "pagedcli_generate"
CHOICES = 4


def questions(text: str, count: int) -> list[dict]:
    """Which order of a line's last words is the play's: a speech's speaker and the start of one of
    its lines as the context, the line's last five words the answer, three other orders of the same
    words the wrong choices (so every choice has the same words: only their order tells them apart;
    the same questions every run)."""
    lines = []
    for speech in text.split("\n\n"):
        speaker, *rest = speech.strip().split("\n")
        lines += [(speaker, line) for line in rest if speaker.endswith(":") and len(line.split()) >= 8]
    step = max(1, len(lines) // count)
    docs = []
    for i, (speaker, line) in enumerate(lines[::step][:count]):
        words = line.split()
        head, tail = words[:-5], words[-5:]
        orders, shuffle = {tuple(tail)}, random.Random(i).shuffle
        while len(orders) < CHOICES:
            other = tail[:]
            shuffle(other)
            orders.add(tuple(other))
        wrong = sorted(orders - {tuple(tail)})
        choices = [" " + " ".join(o) for o in wrong[:i % CHOICES] + [tuple(tail)] + wrong[i % CHOICES:]]
        docs.append({"context": f"{speaker}\n{' '.join(head)}", "choices": choices, "answer": i % CHOICES})
    return docs


def greedy(url: str, model: str, tokenizer, docs: list[dict]) -> list[dict]:
    """Each question's context (as lm-eval tokenizes it: no BOS) and the three tokens the server
    writes after it at temperature 0; kept where the text of both tokenizes back to those tokens."""
    out = []
    for d in docs:
        ids = tokenizer(d["context"], add_special_tokens=False).input_ids
        body = {"model": model, "prompt": ids, "max_tokens": 3, "temperature": 0}
        request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as r:
            text = json.load(r)["choices"][0]["text"]
        whole = tokenizer(d["context"] + text, add_special_tokens=False).input_ids
        if whole[:len(ids)] == ids and len(whole) == len(ids) + 3:
            out.append({"context": d["context"], "continuation": text})
    return out


def write_tasks(folder: Path, count: int, url: str, model: str, tokenizer_path: str) -> None:
    from transformers import AutoTokenizer

    docs = questions((DEMO / "heldout.txt").read_text(), count)
    continuations = greedy(url, model, AutoTokenizer.from_pretrained(tokenizer_path), docs)
    for task, rows, kind, fields, metric in (
            (TASK, docs, "multiple_choice", 'doc_to_choice: "{{choices}}"\ndoc_to_target: answer', "acc"),
            (GREEDY, continuations, "loglikelihood", 'doc_to_target: "{{continuation}}"', "acc"),
            (GENERATE, continuations, "generate_until", ('doc_to_target: "{{continuation}}"\n'
             'generation_kwargs:\n  until: ["\\n\\n"]\n  max_gen_toks: 3\n  do_sample: false'), "exact_match")):
        data = folder / f"{task}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in rows))
        (folder / f"{task}.yaml").write_text(f"""task: {task}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: {kind}
doc_to_text: "{{{{context}}}}"
{fields}
target_delimiter: ""
metric_list:
  - metric: {metric}
    aggregation: mean
    higher_is_better: true
""")


@contextmanager
def serve(model: str, batch: int):
    """pagedcli serve on a free loopback port, until the block ends: its URL."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "pagedcli", "serve", "--model", model, "--port", str(port),
                               "--batch", str(batch)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        while True:
            if server.poll() is not None:
                raise SystemExit(f"pagedcli serve ended with exit code {server.returncode} before it answered")
            try:
                with urllib.request.urlopen(url + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("pagedcli serve did not answer /health within 180 s")
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()


def evaluate(url: str, model: str, tokenizer: str, folder: Path, tokenized: bool, batch: int) -> tuple[dict, list, int]:
    """One run of the tasks through lm-eval's local-completions: each task's accuracy (exact match
    for the generations), every log-likelihood request as (context, continuation, log-likelihood),
    and the count of generations."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    args = {"model": model, "base_url": url + "/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": tokenizer, "tokenized_requests": tokenized, "max_length": 512, "max_retries": 1}
    # (include_defaults=False: lm-eval's own ~13,000 task files are not read, some 15 s)
    results = lm_eval.simple_evaluate(model="local-completions", model_args=args, tasks=[TASK, GREEDY, GENERATE],
                                      task_manager=TaskManager(include_path=str(folder), include_defaults=False),
                                      batch_size=batch if tokenized else 1, log_samples=True)
    scored = [(*arguments[:2], float(response[0][0])) for task in (TASK, GREEDY) for sample in results["samples"][task]
              for arguments, response in zip(sample["arguments"], sample["resps"])]
    accuracy = {task: results["results"][task].get("acc,none") for task in (TASK, GREEDY)}
    accuracy[GENERATE] = results["results"][GENERATE].get("exact_match,none")
    return accuracy, scored, len(results["samples"][GENERATE])


def reference(tokenizer: str, scored: list) -> float | None:
    """The largest difference between the served log-likelihoods and transformers' (float32, CPU)
    for the same token ids, as lm-eval tokenizes them (no BOS, the context's tokens then the
    continuation's); None without transformers."""
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError:
        return None
    tok = AutoTokenizer.from_pretrained(tokenizer)
    model = AutoModelForCausalLM.from_pretrained(tokenizer, dtype=torch.float32).eval()
    worst = 0.0
    for context, continuation, served in scored:
        whole = tok(context + continuation, add_special_tokens=False).input_ids
        start = len(tok(context, add_special_tokens=False).input_ids)
        with torch.no_grad():
            logprobs = model(torch.tensor([whole])).logits[0].log_softmax(-1)
        expected = sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))
        worst = max(worst, abs(expected - served))
    return worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="a server already running (default: start pagedcli serve)")
    parser.add_argument("--model", default="demo", help="the served model's name (and what serve loads)")
    parser.add_argument("--tokenizer", default=str(DEMO), help="the model's folder, for lm-eval's tokenizer")
    parser.add_argument("--questions", type=int, default=24)
    parser.add_argument("--batch", type=int, default=8, help="prompts a request, when they go as token ids")
    opts = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # (the task's data is a local file)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("OPENAI_API_KEY", "none")
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        with (serve(opts.model, opts.batch) if opts.url is None else _given(opts.url)) as url:
            write_tasks(folder, opts.questions, url, opts.model, opts.tokenizer)
            runs = {}
            for tokenized in (True, False):
                started = time.monotonic()
                try:
                    accuracy, scored, generated = evaluate(url, opts.model, opts.tokenizer, folder, tokenized,
                                                           opts.batch)
                except Exception as e:  # (lm-eval's own failure: a request it could not read, ...)
                    print(f"lm-eval failed ({'token ids' if tokenized else 'text'}): {type(e).__name__}: {e}")
                    return 1
                runs[tokenized] = accuracy, scored
                how = f"token ids, {opts.batch} a request" if tokenized else "text, one a request"
                print(f"prompts as {how}: {TASK} acc {accuracy[TASK]:.4f} ({opts.questions} questions of {CHOICES} "
                      f"choices), {GREEDY} acc {accuracy[GREEDY]:.4f}, {GENERATE} exact_match "
                      f"{accuracy[GENERATE]:.4f} ({len(scored)} log-likelihood requests and "
                      f"{generated} generations in {time.monotonic() - started:.1f} s)",
                      flush=True)
    worst = reference(opts.tokenizer, runs[True][1])
    if worst is not None:
        print(f"prompts as token ids: the served log-likelihoods against transformers' (float32, CPU): "
              f"largest difference {worst:.2e}")
    accuracy = runs[True][0]
    if None in accuracy.values() or None in runs[False][0].values():
        print("a run has no accuracy")
        return 1
    if worst is not None and worst > 1e-3:
        print("the served log-likelihoods are not transformers'")
        return 1
    if accuracy[TASK] <= 1 / CHOICES:
        print(f"{TASK} accuracy {accuracy[TASK]} is not above chance ({1 / CHOICES})")
        return 1
    if accuracy[GREEDY] != 1:
        print(f"{GREEDY} accuracy {accuracy[GREEDY]}: the server's own greedy continuations are not greedy to lm-eval")
        return 1
    if accuracy[GENERATE] != 1:
        print(f"{GENERATE} exact_match {accuracy[GENERATE]}: lm-eval's generations are not the server's own")
        return 1
    print("ok")
    return 0


@contextmanager
def _given(url: str):
    yield url.rstrip("/").removesuffix("/v1")


if __name__ == "__main__":
    sys.exit(main())
